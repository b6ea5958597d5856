"""The sweep on your own checkpoint: ``lynx-hf sweep --model PATH`` (``python -m lynx_hf.eval.sweep --model PATH``).

    lynx-hf sweep --model /ckpt/Qwen1.5-MoE-A2.7B                       # held-out text shipped with lynx_hf
    lynx-hf sweep --model /ckpt/m --data my_corpus/ --batch-sizes 8,16,32 --max-minutes 60 --budget 0.01

The same teacher-forced harness as the fixture sweep (:mod:`lynx_hf.eval.sweep`,
:func:`lynx_hf.eval.evaluation.teacher_forced`): ``--sequences`` windows of ``--prefill + --decode + 1`` tokens
of your data, decoded one token per step through the KV cache in position-aligned batches of B, unpatched first
(the reference of each B), then every configuration of the same catalog (the paper's LYNX rule, the routing-mass
greedy in token / batch / sqrt(B) price units, OEA, XShare) at every requested B. x = unique experts per MoE
layer per decode step, y = dCE = CE / CE(unpatched) - 1 (relative).

Order and trimming: points run tier by tier over every B (tier 0: none and the library default; then OEA k0 = 1
and the paper rule at tau = 1; then the rest of the sqrt-price series (nearest the default first), OEA, XShare
warm-up 1; then the paper rule's tau grid, the token and batch price series; last the paper rule at alpha 0.5x and
2x, XShare warm-up 0). With ``--max-minutes`` the windows are first sized to the budget (:func:`size_to_budget`:
one batch of the smallest B is timed, and the windows cut, in multiples of every B, so that each B's reference,
none and the default take at most :data:`FIRST_POINTS_SHARE` of the time left; the run refuses at once, exit
status 2, naming the minutes it needs, when even the fewest windows would not fit); then each point's time is
estimated from the points measured so far at its B (a B's unpatched reference counts as one more point); the run
stops before a point that would not fit, and says how much of the grid it trimmed. The precision of what was
measured is stated: each dCE with its standard error over the windows, and how many windows the budget allowed.

Resumable: every measured point (and each B's reference) is appended to ``<name>.points.jsonl`` in the output
folder as it finishes; a rerun with the same model, data windows, prefill/decode, dtype and device skips them
(other runs' lines in the file are ignored, and said so). A B with points left recomputes its reference first.

Writes to ``--out`` (default ``<results>/sweep_<model folder name>``): ``<name>.json`` (every point, each B's
Pareto frontier, the frontier comparisons, the choice), ``<name>.md``, ``<name>_pareto.png`` (matplotlib, the
``eval`` extra; without it the run says so and writes no PNG) and ``lynx_config.json``
(:meth:`lynx_hf.LynxConfig.to_file`): among the configurations measured at every requested B (policy none
excluded), the one whose dCE is within ``--budget`` at every B with the fewest unique experts (mean over B of
unique experts / the model's own); if none is within budget everywhere, the one with the smallest worst-case
dCE, flagged (``"within_budget": false`` under the file's ``"_about"`` key, and in the report). Use it with
``lynx_hf.patch(model, "lynx_config.json")``, ``lynx-hf generate --config``, lm-eval
``model_args=pretrained=...,lynx_config=...`` or the vLLM plugin's ``config_file``.

Bad inputs (a missing model folder, an unsupported family, empty or too little data, a budget <= 0, bad batch
sizes) are one line on stderr and exit status 2.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import sys
import time
from pathlib import Path

import torch

from lynx_hf import LynxConfig, LynxError, patcher

from . import RESULTS_DIR, command, pareto
from . import evaluation as ev

#: the library's default configuration, by its catalog name
#: the library's default configuration (``LynxConfig()``: its price scaled with the model's depth,
#: ``LynxConfig.price_ref_layers``), an entry of its own beside the price grid's points (each at its price as given)
DEFAULT_NAME = "default"
DEFAULT_BATCH_SIZES = (8, 16, 32, 64)
SERIES = ("paper", "token", "batch", "sqrt", "oea", "xshare")
#: tie-break between configurations with equal experts and dCE (price twins at one B are identical)
_SERIES_PREFERENCE = {"sqrt": 0, "token": 1, "batch": 2, "paper": 3, "oea": 4, "xshare": 5}
def _clock() -> float:
    """The clock ``--max-minutes`` is kept with (seconds; read through this module's ``time``, which tests replace)."""
    return time.perf_counter()

#: with ``--max-minutes``, the share of the time left that the windows are sized to for the first points: each B's
#: unpatched reference, policy none and the library default (the rest of the budget goes to further points)
FIRST_POINTS_SHARE = 0.5


class SweepInputError(Exception):
    """A bad input of the model sweep, reported as one line (exit status 2)."""


# -- the plan --------------------------------------------------------------------------------------------
def priority_tiers(cat: dict, series: set[str]) -> list[list[str]]:
    """The catalog's names in run order, as tiers (see the module docstring); only ``series`` (plus policy
    none, always first). Within a price series, nearest the default's threshold (in token-price terms) first;
    the paper rule's taus nearest tau = 1 first."""
    default = LynxConfig()
    centre = default.mass_price * pareto.UNIT_SCALE[default.price_unit]

    def of(s, pred=lambda cfg: True):
        return [n for n, (ser, cfg) in cat.items() if ser == s and pred(cfg)]

    def by_price(names):
        return sorted(names, key=lambda n: abs(math.log(cat[n][1].mass_price * pareto.UNIT_SCALE[cat[n][1].price_unit]
                                                         / centre)))

    def by_tau(names):
        return sorted(names, key=lambda n: abs(math.log(cat[n][1].tau)) if cat[n][1].tau > 0 else math.inf)

    paper_1x = [n for n in of("paper") if n.endswith(" a=1x")]
    tiers = [
        ["none", DEFAULT_NAME],  # at every B first: a time budget always gets the answer lynx_config.json needs
        ["oea k0=1", pareto.paper_name(1.0, 1.0)],
        by_price(of("sqrt")) + of("oea") + of("xshare", lambda c: c.xshare_warmup == 1),
        by_tau(paper_1x) + by_price(of("token")) + by_price(of("batch")),
        by_tau([n for n in of("paper") if n not in paper_1x]) + of("xshare", lambda c: c.xshare_warmup == 0),
    ]
    seen: set[str] = set()
    out = []
    for tier in tiers:
        keep = []
        for n in tier:
            if n in cat and n not in seen and (n == "none" or cat[n][0] in series):
                seen.add(n)
                keep.append(n)
        out.append(keep)
    return out


def choose_config(runs: list[dict], budget: float) -> dict | None:
    """The configuration for ``lynx_config.json``: among the names measured at every run's B (policy none and
    the reference excluded), those with dCE <= ``budget`` at every B; of them the fewest unique experts (mean
    over B of ``unique_ratio_vs_none``), ties -> smaller worst dCE, then sqrt, token, batch, paper, OEA, XShare.
    If none is within budget everywhere: the smallest worst-case dCE (``within_budget`` False). ``None`` when
    no configuration was measured at every B. Returns ``{"name", "within_budget", "worst_delta_ce_rel",
    "mean_unique_ratio", "cells": [{batch_size, unique_experts_before (none's), unique_experts_after,
    unique_ratio_vs_none, delta_ce_rel, delta_ce_rel_se}]}``."""
    if not runs:
        return None
    per_b = [{r["name"]: r for r in run["results"] if r.get("policy") not in (None, "none")} for run in runs]
    names = set.intersection(*(set(d) for d in per_b))
    cands = []
    for name in sorted(names):
        rows = [d[name] for d in per_b]
        worst = max(r["delta_ce_rel"] for r in rows)
        mean_ratio = sum(r["unique_ratio_vs_none"] for r in rows) / len(rows)
        cands.append((name, rows, worst, mean_ratio))
    if not cands:
        return None
    within = [c for c in cands if c[2] <= budget]
    pref = lambda name: _SERIES_PREFERENCE.get(pareto.series_of(per_b[0][name]), 9)  # noqa: E731
    if within:
        name, rows, worst, mean_ratio = min(within, key=lambda c: (round(c[3], 9), round(c[2], 12), pref(c[0]), c[0]))
    else:
        name, rows, worst, mean_ratio = min(cands, key=lambda c: (round(c[2], 12), round(c[3], 9), pref(c[0]), c[0]))
    cells = []
    for run, r in zip(runs, rows):
        none = next(x for x in run["results"] if x.get("policy") == "none")
        cells.append({"batch_size": run["batch_size"], "unique_experts_before": none["unique_experts_before"],
                      **{k: r[k] for k in ("unique_experts_after", "unique_ratio_vs_none", "delta_ce_rel",
                                           "delta_ce_rel_se")}})
    return {"name": name, "series": pareto.series_of(rows[0]), "within_budget": bool(within),
            "worst_delta_ce_rel": worst, "mean_unique_ratio": mean_ratio, "cells": cells}


def best_per_batch_size(run: dict, budget: float) -> dict | None:
    """At one B alone: the fewest unique experts with dCE <= budget over every series (the fixture sweep's
    rule, :func:`lynx_hf.eval.pareto.choose_default`); ``None`` when no point is within budget."""
    return pareto.choose_default(run["results"], budget, lambda r: r.get("policy") not in (None, "none"))


# -- inputs ----------------------------------------------------------------------------------------------
def _fail(message: str):
    raise SweepInputError(message)


def _batch_sizes(text: str | None) -> list[int]:
    if text is None:
        return list(DEFAULT_BATCH_SIZES)
    try:
        sizes = [int(b) for b in text.split(",") if b.strip()]
    except ValueError:
        _fail(f"--batch-sizes must be comma-separated positive ints, got {text!r}")
    if not sizes or min(sizes) < 1:
        _fail(f"--batch-sizes must be comma-separated positive ints, got {text!r}")
    return list(dict.fromkeys(sizes))


def _device(text: str | None) -> str:
    if text is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if text == "auto":
        return text
    try:
        dev = torch.device(text)
    except RuntimeError:
        _fail(f"--device {text!r} is not a torch device (cpu, cuda, cuda:N or auto)")
    if dev.type == "cuda" and not torch.cuda.is_available():
        _fail(f"--device {text}: CUDA is not available here")
    return text


def _validate(args) -> dict:
    """Every input check that needs no model (one-line errors)."""
    if not math.isfinite(args.ce_budget) or args.ce_budget <= 0:
        _fail(f"--budget must be > 0 (a relative dCE: 0.01 = 1 %), got {args.ce_budget:g}")
    if args.max_minutes is not None and not args.max_minutes > 0:
        _fail(f"--max-minutes must be > 0, got {args.max_minutes:g}")
    for name in ("sequences", "prefill", "decode"):
        if getattr(args, name) < 1:
            _fail(f"--{name} must be >= 1, got {getattr(args, name)}")
    series = set(SERIES) if args.series is None else {s.strip() for s in args.series.split(",") if s.strip()}
    if not series or series - set(SERIES):
        _fail(f"--series must name some of {', '.join(SERIES)}, got {args.series!r}")
    try:
        grids = pareto.parse_grids(args)
    except ValueError as exc:
        _fail(f"a grid option is not a list of numbers: {exc}")
    try:
        files = ev.data_files(args.data) if args.data is not None else list(ev.HELDOUT_FILES)
        documents = sum(len(ev.read_texts(f, args.text_field)) for f in files)
    except (OSError, ValueError) as exc:
        _fail(str(exc))
    if documents == 0:
        _fail(f"no text in {args.data} (empty files)")
    model = Path(args.model)
    if not (model / "config.json").is_file():
        _fail(f"no local checkpoint at {model} (a folder with config.json is expected)")
    return {"sizes": _batch_sizes(args.batch_sizes), "device": _device(args.device), "series": series,
            "grids": grids, "files": files, "model": model}


def _load(model_path: Path, dtype_name: str, device: str):
    """The model and tokenizer, checked to be of a supported family; ``(model, tokenizer, N, k)``."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    dtype = getattr(torch, dtype_name) if dtype_name != "auto" else (torch.float32 if device == "cpu" else torch.bfloat16)
    try:
        model, tok = ev.load_model(model_path, dtype=dtype, device=device)
    except Exception as exc:  # a folder transformers cannot load: unknown model type, missing weights, ...
        _fail(f"cannot load {model_path}: {type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}")
    try:
        with patcher.patched(model, LynxConfig(policy="none")):
            num_experts, top_k = ev.moe_shape(model)
    except LynxError as exc:
        _fail(f"{model_path}: {exc}")
    return model, tok, num_experts, top_k, dtype


def _windows(tok, args, files, sizes, log) -> torch.Tensor:
    length = args.prefill + args.decode + 1
    everything = ev.heldout_windows(tok, length, None, files, field=args.text_field)
    step = math.lcm(*sizes)
    n = min(args.sequences, len(everything)) // step * step
    where = args.data if args.data is not None else "the shipped held-out data"
    if n == 0:
        _fail(f"{where} holds {len(everything)} windows of {length} tokens; the batch sizes {sizes} need at least "
              f"{step} (add text, or lower --batch-sizes, --prefill or --decode)")
    if n < args.sequences:
        log(f"using {n} windows of {length} tokens ({len(everything)} in {where}; a multiple of every batch size)")
    return everything[:n]


def size_to_budget(model, windows: torch.Tensor, sizes: list[int], args, left_s: float, log) -> torch.Tensor:
    """The windows a ``--max-minutes`` budget allows (``left_s``: seconds left of it). One batch of the smallest B is
    decoded unpatched and timed (``_clock``): seconds per window (the smallest B is the slowest per window, so the
    estimate errs long). The first points -- each B's reference, policy none and the library default, 3 passes over
    the windows per B -- get at most :data:`FIRST_POINTS_SHARE` of the time left: the windows are cut to the largest
    multiple of every B that fits (at least one multiple). Raises :class:`SweepInputError` (exit status 2, before
    anything else is measured) naming the minutes needed when even the fewest windows do not fit in the time left."""
    step = math.lcm(*sizes)
    smallest = min(sizes)
    start = _clock()
    ev.reference_run(model, windows[:smallest], smallest, args.prefill)
    per_window = max(_clock() - start, 1e-9) / smallest
    left = left_s - (_clock() - start)
    passes = 3 * len(sizes)
    need = passes * step * per_window
    if need > left:
        spent = 60.0 * args.max_minutes - left
        raise SweepInputError(
            f"--max-minutes {args.max_minutes:g} is too short on this machine: policy none and the default at every "
            f"B ({', '.join(map(str, sizes))}) on the fewest windows ({step}, a multiple of every B) need about "
            f"{need / 60:.2f} min (measured {per_window:.2f} s per window of {args.decode} decode steps at B = "
            f"{smallest}), and {max(left, 0.0) / 60:.2f} min are left after loading; give --max-minutes "
            f"{math.ceil((spent + need / FIRST_POINTS_SHARE) / 60 * 10) / 10:g} or more, or fewer batch sizes, or a "
            f"smaller --decode")
    fit = int(FIRST_POINTS_SHARE * left / (passes * per_window)) // step * step
    n = max(step, min(int(windows.shape[0]), fit))
    if n < windows.shape[0]:
        log(f"--max-minutes {args.max_minutes:g}: {n} of {windows.shape[0]} windows, sized to the budget "
            f"({per_window:.2f} s per window at B = {smallest}; none and the default at every B first); each dCE is "
            f"then a mean over {n} windows x {args.decode} decode steps, its standard error in the report "
            f"(rerun with more time for a tighter one)")
    return windows[:n]


# -- the run ---------------------------------------------------------------------------------------------
def _read_points(path: Path, key: dict, log) -> dict:
    done: dict = {}
    other = 0
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by an interrupted run
                continue
            if item.get("key") != key:
                other += 1
                continue
            done[(item["batch_size"], item["result"]["name"])] = item["result"]
    if done:
        log(f"resuming: {len(done)} points already in {path}")
    if other:
        log(f"{other} lines of {path} belong to other settings (model, data windows, dtype or device) and are ignored")
    return done


def _append(path: Path, key: dict, batch_size: int, row: dict) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps({"key": key, "batch_size": batch_size, "result": row}) + "\n")


def config_for_file(cfg: LynxConfig) -> LynxConfig:
    """The chosen configuration as ``lynx_config.json`` stores it: a mass-price config (``mass_price`` set) runs no
    consensus step, so its ``tau`` is unused (``LynxConfig.tau``); the catalogue's price series carry tau = 1e6 (its
    "no consensus" marker), the file the documented default, so a user who later sets ``mass_price=None`` (the
    paper's rule) gets the paper's tau, not 1e6. Same routing either way."""
    if cfg.policy == "lynx" and cfg.mass_price is not None:
        return dataclasses.replace(cfg, tau=LynxConfig().tau)
    return cfg


def main(args, argv, prog: str) -> int:
    """``lynx-hf sweep --model ...`` (``args``: the parsed options of :func:`lynx_hf.eval.sweep.main`). Returns
    the exit status: 0, or 2 after printing a one-line error for a bad input."""
    try:
        return _run(args, argv)
    except SweepInputError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2


def _run(args, argv) -> int:
    from tqdm.auto import tqdm

    t_start = _clock()
    log = lambda line: tqdm.write(line, file=sys.stderr)  # noqa: E731
    v = _validate(args)
    sizes, device, model_path = v["sizes"], v["device"], v["model"]
    budget = args.ce_budget
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok, num_experts, top_k, dtype = _load(model_path, args.dtype, device)
    windows = _windows(tok, args, v["files"], sizes, log)
    deadline = None if args.max_minutes is None else 60.0 * args.max_minutes
    requested_windows = int(windows.shape[0])
    if deadline is not None:
        windows = size_to_budget(model, windows, sizes, args, deadline - (_clock() - t_start), log)
    model_name = model_path.resolve().name
    out = Path(args.out) if args.out else RESULTS_DIR / f"sweep_{model_name}"
    out.mkdir(parents=True, exist_ok=True)
    key = {"model": str(model_path.resolve()), "windows_sha256": hashlib.sha256(windows.numpy().tobytes()).hexdigest()[:16],
           "windows": int(windows.shape[0]), "prefill": args.prefill, "decode": args.decode, "dtype": str(dtype),
           "device": "cpu" if device == "cpu" else "cuda"}
    points_file = out / f"{args.name}.points.jsonl"
    done = _read_points(points_file, key, log)

    taus, mults, tprices, fractions = v["grids"]
    cat = pareto.catalog(num_experts, top_k, taus, mults, tprices, fractions, pareto.XSHARE_WARMUPS)
    cat[DEFAULT_NAME] = (LynxConfig().price_unit, LynxConfig())
    tiers = priority_tiers(cat, v["series"])
    plan = [(b, name) for tier in tiers for b in sizes for name in tier]
    todo = [p for p in plan if p not in done]
    log(f"== {model_name} (N = {num_experts}, k = {top_k}, {dtype}, {device}): {len(plan)} points at B = "
        f"{', '.join(map(str, sizes))}, {windows.shape[0]} windows x {args.decode} decode steps; {len(todo)} to run"
        + (f"; --max-minutes {args.max_minutes:g}" if deadline else ""))

    refs: dict = {}
    times: dict = {b: [] for b in sizes}

    def estimate(b):  # median seconds per point at b (else over every B): robust to the first points' warm-up
        measured = sorted(times[b] or [t for ts in times.values() for t in ts])
        return measured[len(measured) // 2] if measured else None

    def cost(b):  # the point, plus the B's reference when it is not computed yet in this run
        one = estimate(b)
        return None if one is None else one * (1 if b in refs else 2)

    trimmed: list = []
    announced = False
    bar = tqdm(total=len(todo), desc=f"sweep {model_name}", unit="point", file=sys.stderr)
    for i, (b, name) in enumerate(todo):
        elapsed = _clock() - t_start
        c = cost(b)
        if deadline is not None and c is not None and elapsed + c > deadline:
            trimmed = todo[i:]
            break
        if b not in refs:
            refs[b] = ev.reference_run(model, windows, b, args.prefill)
            times[b].append(refs[b].row["seconds"])
            stored = done.get((b, "unpatched"))
            if stored is None:
                _append(points_file, key, b, refs[b].row)
                done[(b, "unpatched")] = refs[b].row
            elif abs(stored["ce"] - refs[b].ce) > 1e-6 * abs(stored["ce"]):
                log(f"B={b}: the unpatched CE {refs[b].ce:.6f} differs from the stored run's {stored['ce']:.6f} "
                    "(nondeterministic kernels?); stored points keep their own reference")
        row = ev.score_policy(model, refs[b], name, cat[name][1])
        _append(points_file, key, b, row)
        done[(b, name)] = row
        times[b].append(row["seconds"])
        bar.update(1)
        bar.set_postfix_str(f"B={b} {name}: dCE {100 * row['delta_ce_rel']:+.2f} %, experts "
                            f"{row['unique_experts_after']:.2f}")
        if deadline is not None and not announced and (i + 1 >= 8 or i + 1 == len(todo)):
            announced = True  # one projection, once a few points are measured
            rest = todo[i + 1:]
            need = sum(estimate(bb) for bb, _ in rest) + sum(estimate(bb) for bb in {bb for bb, _ in rest} - set(refs))
            left = deadline - (_clock() - t_start)
            if need > left:
                per = ", ".join(f"B={bb} {estimate(bb):.2f} s" for bb in sizes if times[bb])
                log(f"--max-minutes {args.max_minutes:g}: the remaining {len(rest)} points need about {need / 60:.1f} "
                    f"min at the median time per point so far ({per}); {left / 60:.1f} min are left, so the grid "
                    "will be trimmed to fit (lowest-priority points last)")
    bar.close()
    if trimmed:
        per = ", ".join(f"B={bb} {estimate(bb):.2f} s" for bb in sizes if times[bb])
        log(f"the grid is trimmed to fit --max-minutes {args.max_minutes:g}: {len(trimmed)} of {len(plan)} points not "
            f"run (median time per point: {per}); rerun with a larger --max-minutes to add them (the "
            f"{len(plan) - len(trimmed)} measured are kept in {points_file.name})")

    # -- the report
    runs = []
    for b in sizes:
        rows = [done[(b, n)] for tier in tiers for n in tier if (b, n) in done]
        ref_row = done.get((b, "unpatched"))
        if ref_row is None or not any(r.get("policy") == "none" for r in rows):
            continue
        results = [ref_row] + sorted(rows, key=pareto.sort_key)
        ev.add_unique_ratios(results)
        none = next(r for r in results if r.get("policy") == "none")
        anchor_front = pareto.frontier([(r["unique_experts_after"], r["delta_ce_rel"]) for r in results[1:]])
        front = [{k: r.get(k) for k in ("name", "unique_experts_after", "delta_ce_rel", "delta_ce_rel_se")}
                 | {"series": pareto.series_of(r)} for r in results[1:]
                 if (r["unique_experts_after"], r["delta_ce_rel"]) in anchor_front]
        runs.append({"model": model_name, "batch_size": b, "num_experts": num_experts, "top_k": top_k,
                     "scored_tokens": int(windows.shape[0] * args.decode), "threads": torch.get_num_threads(),
                     "seconds": sum(r.get("seconds", 0.0) for r in results), "results": results,
                     "unique_experts_none": none["unique_experts_before"],
                     "frontier": sorted(front, key=lambda r: r["unique_experts_after"])})
    choice = choose_config(runs, budget)
    settings = {"mode": "model", "model": str(model_path), "data": [str(f) for f in v["files"]],
                "text_field": args.text_field, "sequences": int(windows.shape[0]), "prefill": args.prefill,
                "decode": args.decode, "batch_sizes": [r["batch_size"] for r in runs] or sizes,
                "requested_batch_sizes": sizes, "ce_budget": budget, "device": device, "dtype": str(dtype),
                "series": sorted(v["series"]), "taus": taus, "alpha_mults": mults, "token_prices": tprices,
                "xshare_fractions": fractions, "max_minutes": args.max_minutes, "requested_sequences": requested_windows,
                "torch": torch.__version__,
                "threads": torch.get_num_threads()}
    rule = (f"lynx_config.json: among the configurations measured at every B ({', '.join(map(str, sizes))}), those "
            f"with dCE <= {100 * budget:g} % at every B; of them the fewest unique experts (mean over B of unique "
            "experts / the model's own); ties: smaller worst dCE. If none qualifies: the smallest worst-case dCE, "
            "flagged.")
    report = {"settings": settings, "rule": rule, "runs": runs, "choice": choice,
              "best_per_batch_size": {str(run["batch_size"]): (lambda r: None if r is None else
                                                               {k: r[k] for k in ("name", "unique_experts_after",
                                                                                  "delta_ce_rel")})(
                  best_per_batch_size(run, budget)) for run in runs},
              "points": {"planned": len(plan), "measured": sum(1 for p in plan if p in done),
                         "trimmed": len(trimmed), "trimmed_names": sorted({n for _, n in trimmed})},
              "seconds": _clock() - t_start, "command": command("sweep", argv)}
    pareto.compare_runs(report, "sqrt" if "sqrt" in v["series"] else None)
    missing = [b for b in sizes if b not in settings["batch_sizes"]] if runs else sizes
    (out / f"{args.name}.json").write_text(json.dumps(report, indent=1))
    (out / f"{args.name}.md").write_text(markdown(report, missing))
    png = out / f"{args.name}_pareto.png"
    written = [f"{args.name}.json", f"{args.name}.md"]
    if runs:
        try:
            pareto.plot(report, png)
            written.append(png.name)
        except ImportError:
            log("matplotlib is not installed (pip install 'lynx-hf[eval]'): no PNG written")
    if choice is not None:
        cfg = config_for_file(cat[choice["name"]][1])
        about = {"made_by": "lynx-hf sweep --model", "command": report["command"], "model": str(model_path),
                 "choice": choice["name"], "within_budget": choice["within_budget"], "budget": budget,
                 "per_batch_size": choice["cells"], "rule": rule}
        cfg.to_file(out / "lynx_config.json", about=about)
        written.append("lynx_config.json")
    print(summary(report, missing))
    log(f"wrote {', '.join(written)} to {out} in {report['seconds']:.0f} s")
    return 0


# -- output ----------------------------------------------------------------------------------------------
def summary(report: dict, missing: list[int]) -> str:
    """A few lines: the chosen configuration and its numbers at every B."""
    c = report["choice"]
    budget = report["settings"]["ce_budget"]
    if c is None:
        return ("no configuration was measured at every batch size (raise --max-minutes); no lynx_config.json "
                "written")
    flag = "" if c["within_budget"] else (f"  ** NOT within the {100 * budget:g} % budget at every B: the closest "
                                          "(smallest worst-case dCE) **")
    lines = [f"lynx_config.json: `{c['name']}`{flag}"]
    for cell in c["cells"]:
        lines.append(f"  B = {cell['batch_size']}: unique experts {cell['unique_experts_before']:.2f} -> "
                     f"{cell['unique_experts_after']:.2f} ({100 * (1 - cell['unique_ratio_vs_none']):.1f} % fewer), "
                     f"dCE {100 * cell['delta_ce_rel']:+.2f} % +- {100 * cell['delta_ce_rel_se']:.2f}")
    if missing:
        lines.append(f"  not measured at B = {', '.join(map(str, missing))} (trimmed)")
    settings = report["settings"]
    if settings.get("requested_sequences", settings["sequences"]) > settings["sequences"]:
        lines.append(f"  {settings['sequences']} of {settings['requested_sequences']} windows (sized to --max-minutes "
                     f"{settings['max_minutes']:g}): the +- is each dCE's standard error over them")
    return "\n".join(lines)


def markdown(report: dict, missing: list[int]) -> str:
    s = report["settings"]
    c = report["choice"]
    pts = report["points"]
    trim_note = ""
    if pts["trimmed"]:
        names = ", ".join(f"`{n}`" for n in pts["trimmed_names"][:20]) + (", ..." if len(pts["trimmed_names"]) > 20 else "")
        trim_note = (f"; **{pts['trimmed']} trimmed to fit --max-minutes {s['max_minutes']:g}** (configurations not "
                     f"run at every B: {names})")
    lines = [f"# Sweep on {Path(s['model']).name}: LYNX vs OEA and XShare (teacher-forced decode)", "",
             f"Model `{s['model']}` ({s['dtype']}, {s['device']}); data: {', '.join(f'`{d}`' for d in s['data'])}; "
             f"{s['sequences']} windows x ({s['prefill']} prefill + {s['decode']} decode steps) per batch size. dCE = "
             "CE / CE(unpatched) - 1; +- se = standard error over sequences of the paired difference. Unique experts = "
             "mean over MoE layers and decode steps of the experts the batch touches.", "",
             f"Points: {pts['measured']} of {pts['planned']} measured{trim_note}.", "",
             f"Command: `{report['command']}`", "", f"Rule: {report['rule']}", ""]
    if c is not None:
        lines += [f"## lynx_config.json: `{c['name']}`"
                  + ("" if c["within_budget"] else f" (**not within {100 * s['ce_budget']:g} % at every B: closest**)"),
                  "", "| B | unique experts none -> chosen | fewer | dCE % | +- se | within budget |",
                  "|---|---|---|---|---|---|"]
        for cell in c["cells"]:
            lines.append(f"| {cell['batch_size']} | {cell['unique_experts_before']:.2f} -> {cell['unique_experts_after']:.2f}"
                         f" | {100 * (1 - cell['unique_ratio_vs_none']):.1f} % | {100 * cell['delta_ce_rel']:+.2f} | "
                         f"{100 * cell['delta_ce_rel_se']:.2f} | {'yes' if cell['delta_ce_rel'] <= s['ce_budget'] else '**no**'} |")
        lines.append("")
    else:
        lines += ["No configuration was measured at every batch size: no lynx_config.json.", ""]
    if missing:
        lines += [f"Not measured at B = {', '.join(map(str, missing))} (trimmed).", ""]
    lines += ["Best point at each B alone (fewest unique experts within the budget, any series): "
              + "; ".join(f"B = {b}: " + ("none within budget" if r is None else
                                           f"`{r['name']}` ({r['unique_experts_after']:.2f} experts, "
                                           f"{100 * r['delta_ce_rel']:+.2f} %)")
                          for b, r in report["best_per_batch_size"].items()), ""]
    for run in report["runs"]:
        lines += [f"### Pareto frontier at B = {run['batch_size']} (every series; policy none = "
                  f"{run['unique_experts_none']:.2f} experts)", "",
                  ev.markdown_table([{**r, "pct": 100 * r["delta_ce_rel"], "se": 100 * r["delta_ce_rel_se"]}
                                     for r in run["frontier"]],
                                    [("point", "name", ""), ("series", "series", ""),
                                     ("unique experts", "unique_experts_after", ".2f"), ("dCE %", "pct", "+.2f"),
                                     ("+- se", "se", ".2f")]), ""]
    if report.get("comparison_summary"):
        lines += ["## Frontier comparisons (counts over every B)", "",
                  "| comparison | ours wins | tie | peer wins | no overlap |", "|---|---|---|---|---|"]
        for per_model in report["comparison_summary"].values():
            for cs in per_model.values():
                lines.append(f"| {cs['title']} | {cs['counts'][cs['names'][0]]} | {cs['counts']['tie']} | "
                             f"{cs['counts'][cs['names'][1]]} | {cs['counts']['out of range']} |")
        lines += ["", "(\"the default's series\" = the sqrt(B)-price routing-mass greedy, the library default's.)", ""]
    return "\n".join(lines + pareto.run_sections(report)) + "\n"
