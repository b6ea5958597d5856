"""The dependency policy, kept by CI (docs/setup.md#dependency-policy): every range in pyproject.toml is tested at its
floor and at its newest release that resolves.

    python .ci/deps.py floors [EXTRA ...]    print a pip constraints file: each requirement of the project and of the
                                            named extras pinned to its lower bound (``>=X`` / ``==X`` -> ``==X``)
    python .ci/deps.py check-floor [EXTRA ...]   fail unless every one of them is installed at its lower bound
    python .ci/deps.py check-newest [--skip NAME] [EXTRA ...]   fail where pip would install a newer release of one
                                            of them in range (``pip install --dry-run --upgrade --upgrade-strategy
                                            eager``: the newest that resolves with the rest); ``--skip torch`` where
                                            torch is held at the CPU wheel on purpose (its newest has its own leg)
    python .ci/deps.py caps [--skip NAME] [EXTRA ...]   every upper bound (``<``, ``<=``, ``==``, ``~=``) of them: the
                                            releases above it that would resolve were it lifted (one ``pip install
                                            --dry-run`` with every cap lifted at once), printed by CI so an expired
                                            reason shows on the next run; fails where a ``<`` / ``<=`` / ``~=`` cap
                                            does not name the failing test (``tests/...``) in its comment

Runs on the standard library and pip alone (``packaging`` from pip's vendored copy), before or after the install.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(extras: list[str]) -> dict[str, str]:
    """``{name: lower bound}`` of the project's dependencies and the named extras (a requirement without a lower bound
    raises: the policy needs one)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = list(project["dependencies"])
    optional = project.get("optional-dependencies", {})
    for extra in extras:
        if extra not in optional:
            raise SystemExit(f"deps.py: no extra {extra!r} in pyproject.toml (have {sorted(optional)})")
        lines += optional[extra]
    floors = {}
    for line in lines:
        spec = line.split(";")[0]
        name = NAME.match(spec).group(1)
        low = re.search(r"(?:>=|==)\s*([0-9][^,\s]*)", spec[len(name):])
        if low is None:
            raise SystemExit(f"deps.py: {line!r} has no lower bound (the dependency policy needs one)")
        floors[_canon(name)] = low.group(1)
    return floors


def _same(installed: str, floor: str) -> bool:
    """``2.13.0+cpu`` is ``2.13.0``; ``1.10`` is ``1.10.0``."""
    def parts(v):
        v = v.split("+")[0]
        nums = [int(x) if x.isdigit() else x for x in v.split(".")]
        while len(nums) > 1 and nums[-1] == 0:
            nums.pop()
        return nums

    return parts(installed) == parts(floor)


def check_floor(extras: list[str]) -> int:
    bad = []
    for name, floor in requirements(extras).items():
        installed = md.version(name)
        status = "ok" if _same(installed, floor) else "NOT AT FLOOR"
        print(f"  {name:16s} floor {floor:10s} installed {installed:14s} {status}")
        if status != "ok":
            bad.append(name)
    if bad:
        print(f"deps.py: not at their floor: {', '.join(bad)}")
        return 1
    print(f"deps.py: {len(requirements(extras))} requirements at their floor")
    return 0


def check_newest(extras: list[str], skip: set[str]) -> int:
    target = f".[{','.join(extras)}]" if extras else "."
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as held:  # a skipped package stays as installed
        held.write("".join(f"{name}=={md.version(name)}\n" for name in skip))
        held.flush()
        report = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--upgrade", "--upgrade-strategy",
                                 "eager", "--quiet", "--report", "-", "-c", held.name, "-e", target],
                                cwd=ROOT, capture_output=True, text=True)
    if report.returncode != 0:
        print(report.stderr[-3000:])
        return report.returncode
    would = {_canon(item["metadata"]["name"]): item["metadata"]["version"]
             for item in json.loads(report.stdout).get("install", [])}
    bad = []
    for name in requirements(extras):
        installed = md.version(name)
        newer = would.get(name)
        status = f"newer resolves: {newer}" if newer and not _same(newer, installed) else "newest"
        if name in skip:
            status = f"not checked here ({status})"
        print(f"  {name:16s} installed {installed:14s} {status}")
        if status.startswith("newer"):
            bad.append(name)
    if bad:
        print(f"deps.py: a newer release in range resolves for: {', '.join(bad)}")
        return 1
    print(f"deps.py: {len(requirements(extras))} requirements at their newest resolvable release")
    return 0


_CAP = re.compile(r"(<=?|==|~=)\s*([0-9][^,\s;]*)")


def capped(extras: list[str]) -> list[tuple[str, str, str, str]]:
    """``[(name, requirement, cap operator, comment)]`` of every requirement of the project and the named extras with an
    upper bound; ``comment`` is the comment on its line and the comment lines directly above it in pyproject.toml (the
    reason beside the pin)."""
    lines = (ROOT / "pyproject.toml").read_text().splitlines()
    wanted = set(requirements(extras))
    out = []
    for i, line in enumerate(lines):
        for req in re.findall(r'"([A-Za-z0-9][A-Za-z0-9._-]*\s*[<>=!~][^"]*)"', line):
            name = _canon(NAME.match(req).group(1))
            cap = _CAP.search(req[len(NAME.match(req).group(1)):].split(";")[0])
            if name not in wanted or cap is None:
                continue
            notes = [line.split("#", 1)[1].strip()] if "#" in line else []
            j = i - 1
            while j >= 0 and lines[j].strip().startswith("#"):
                notes.insert(0, lines[j].strip().lstrip("#").strip())
                j -= 1
            out.append((name, req.split(";")[0].strip(), cap.group(1), " ".join(notes)))
    return out


def check_caps(extras: list[str], skip: set[str]) -> int:
    """Print, for every capped requirement, what would resolve with every cap lifted; fail where a ``<`` / ``<=`` / ``~=``
    cap's comment names no test (the policy: a cap only where a newer release fails a test, named beside the pin)."""
    caps = capped(extras)
    if not caps:
        print("deps.py: no requirement has an upper bound")
        return 0
    floors = requirements(extras)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = list(project["dependencies"]) + [r for e in extras for r in project["optional-dependencies"][e]]
    lifted = {name for name, *_ in caps}
    with tempfile.TemporaryDirectory() as tmp:
        reqs, held = Path(tmp, "lifted.txt"), Path(tmp, "held.txt")
        reqs.write_text("".join(f"{_canon(NAME.match(r).group(1))}>={floors[_canon(NAME.match(r).group(1))]}\n"
                                if _canon(NAME.match(r).group(1)) in lifted else r + "\n" for r in lines))
        held.write_text("".join(f"{name}=={md.version(name)}\n" for name in skip))
        report = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                                 "--report", "-", "-c", str(held), "-r", str(reqs)],
                                cwd=ROOT, capture_output=True, text=True)
    if report.returncode != 0:
        print(report.stderr[-3000:])
        print("deps.py: the requirements with every cap lifted do not resolve (printed above)")
        return report.returncode
    would = {_canon(item["metadata"]["name"]): item["metadata"]["version"]
             for item in json.loads(report.stdout).get("install", [])}
    bad = []
    for name, req, op, comment in caps:
        newer = would.get(name)
        above = newer is not None and not _satisfies(newer, req[len(NAME.match(req).group(1)):])
        status = f"ABOVE THE CAP, resolves: {newer}" if above else f"nothing above it resolves ({newer})"
        print(f"  {req:28s} {status}")
        if op != "==" and "tests/" not in comment:
            print(f"    the cap names no failing test beside it (comment: {comment!r})")
            bad.append(name)
    if bad:
        print(f"deps.py: caps without a failing test named beside the pin: {', '.join(bad)}")
        return 1
    print(f"deps.py: {len(caps)} capped requirements; a release named ABOVE THE CAP means its reason may have expired")
    return 0


def _satisfies(version: str, spec: str) -> bool:
    from pip._vendor.packaging.specifiers import SpecifierSet

    return SpecifierSet(spec.strip()).contains(version, prereleases=True)


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("floors", "check-floor", "check-newest", "caps"):
        print(__doc__)
        return 2
    command, extras, skip = argv[0], [], set()
    rest = iter(argv[1:])
    for arg in rest:
        if arg == "--skip":
            skip.add(_canon(next(rest)))
        else:
            extras.append(arg)
    if command == "floors":
        for name, floor in requirements(extras).items():
            print(f"{name}=={floor}")
        return 0
    if command == "caps":
        return check_caps(extras, skip)
    return check_floor(extras) if command == "check-floor" else check_newest(extras, skip)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
