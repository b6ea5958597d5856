"""Loaders and metrics of the local lm-eval tasks (referenced from the YAMLs with ``!function``).

The data files live next to this module (``data/*.jsonl``, built by ``build_tasks.py``), so the
tasks load offline and from any working directory.
"""

from __future__ import annotations

import json
from pathlib import Path

import datasets

DATA = Path(__file__).resolve().parent / "data"


def _load(name: str) -> datasets.DatasetDict:
    with open(DATA / name, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def load_code_line_completion(**kwargs) -> datasets.DatasetDict:
    return _load("code_line_completion.jsonl")


def load_code_next_line_mc(**kwargs) -> datasets.DatasetDict:
    return _load("code_next_line_mc.jsonl")


def process_line_completion(doc: dict, results: list) -> dict:
    """``exact_match``: generated text (rstripped) equals the rest of the line; ``prefix_match``:
    share of the target's characters matched before the first difference."""
    pred = results[0].split("\n")[0].rstrip()
    target = doc["target"].rstrip()
    n = 0
    for a, b in zip(pred, target):
        if a != b:
            break
        n += 1
    return {"exact_match": float(pred == target), "prefix_match": n / max(len(target), 1)}
