"""Build the local lm-eval task data from the committed held-out code (eval/data/valid_code.jsonl).

    python -m lab.build_tasks   # rewrites eval/tasks/data/*.jsonl (deterministic)

- ``lynx_code_line_completion`` (generate_until, 200 items): prompt = up to 8 preceding lines of a
  held-out stdlib file plus the start of the next line (cut before a space, so the prompt ends on a
  natural token boundary); target = the rest of that line. Metrics: exact match (rstripped) and the
  matched-prefix share of the target's characters.
- ``lynx_code_next_line_mc`` (multiple_choice, loglikelihood, 200 items): context = up to 8 lines;
  choices = the real next line and 3 lines of the same indentation and similar length drawn from
  other held-out files. Metric: acc / acc_norm. Prefill only: bit-identical under lynx_hf (C17).

The items are drawn from the validation split only (the fixtures never trained on these files).
"""

from __future__ import annotations

import json
import random

from . import DATA_DIR, TASKS_DIR

SOURCE = DATA_DIR / "valid_code.jsonl"
OUT = TASKS_DIR / "data"
CONTEXT_LINES = 8
MAX_CONTEXT_CHARS = 600
ITEMS = 200
MAX_PER_FILE = 10


def _ok_line(line: str) -> bool:
    content = line.strip()
    return (12 <= len(content) <= 70 and not content.startswith(("#", '"""', "'''", "r\"\"\"")) and " " in content
            and content.isascii())


def _candidates(docs):
    for doc_id, doc in enumerate(docs):
        lines = doc["text"].split("\n")
        for i in range(4, len(lines)):
            if not _ok_line(lines[i]):
                continue
            context = lines[max(0, i - CONTEXT_LINES):i]
            if sum(1 for c in context if c.strip()) < 3:
                continue
            text = "\n".join(context) + "\n"
            while len(text) > MAX_CONTEXT_CHARS and "\n" in text[:-1]:
                text = text.split("\n", 1)[1]
            if len(text) > MAX_CONTEXT_CHARS or not text.strip():
                continue
            yield doc_id, doc["path"], i, text, lines[i]


def _pick(cands, rng, items):
    rng.shuffle(cands)
    per_file, out = {}, []
    for c in cands:
        if per_file.get(c[0], 0) >= MAX_PER_FILE:
            continue
        per_file[c[0]] = per_file.get(c[0], 0) + 1
        out.append(c)
        if len(out) == items:
            break
    return sorted(out, key=lambda c: (c[1], c[2]))


def _word_boundary(line: str, start: int) -> int:
    """First index >= start of a space that follows a non-space and precedes text (-1 if none)."""
    for i in range(max(start, 1), len(line)):
        if line[i] == " " and line[i - 1] != " " and line[i:].strip():
            return i
    return -1


def build_generation(docs, items=ITEMS, seed=0):
    rng = random.Random(seed)
    out = []
    for doc_id, path, i, context, line in _pick(list(_candidates(docs)), rng, items):
        indent = len(line) - len(line.lstrip())
        content = line.rstrip()
        start = indent + max(4, (len(content) - indent) // 3)
        cut = _word_boundary(content, start)
        if cut < 0:
            cut = _word_boundary(content, indent + 1)
        if cut < 0:
            continue
        out.append({"id": f"{path}:{i + 1}", "prompt": context + content[:cut], "target": content[cut:]})
    return out


def build_multiple_choice(docs, items=ITEMS, seed=1):
    rng = random.Random(seed)
    cands = list(_candidates(docs))
    pool = [(doc_id, line.rstrip()) for doc_id, doc in enumerate(docs) for line in doc["text"].split("\n")
            if _ok_line(line)]
    out = []
    for doc_id, path, i, context, line in _pick(cands, rng, items):
        line = line.rstrip()
        indent = len(line) - len(line.lstrip())
        similar = [c for d, c in pool if d != doc_id and len(c) - len(c.lstrip()) == indent
                   and 0.6 * len(line) <= len(c) <= 1.5 * len(line) and c != line]
        similar = sorted(set(similar))
        if len(similar) < 3:
            continue
        choices = rng.sample(similar, 3) + [line]
        rng.shuffle(choices)
        out.append({"id": f"{path}:{i + 1}", "context": context, "choices": choices, "label": choices.index(line)})
    return out


def main() -> None:
    docs = [json.loads(line) for line in SOURCE.read_text(encoding="utf-8").splitlines() if line.strip()]
    OUT.mkdir(exist_ok=True)
    for name, rows in (("code_line_completion.jsonl", build_generation(docs)),
                       ("code_next_line_mc.jsonl", build_multiple_choice(docs))):
        with open(OUT / name, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        print(f"{OUT / name}: {len(rows)} items")


if __name__ == "__main__":
    main()
