"""Build the offline training corpus, the byte-level BPE tokenizer and the committed validation set.

Sources (both from Debian bookworm packages, PSF licence):
  * docs: reST sources of the Python 3.11 documentation, package ``python3.11-doc``
    (/usr/share/doc/python3.11-doc/html/_sources/**/*.txt)  -> English prose
  * code: CPython 3.11 standard library, package ``libpython3.11-stdlib`` / ``-minimal``
    (/usr/lib/python3.11/**/*.py, without test suites and site/dist-packages)  -> Python code

Split: file level, deterministic: sha1("<domain>/<relative path>") % 20 == 0 -> validation.

Outputs:
  eval/work/tokenizer/            tokenizer (PreTrainedTokenizerFast: tokenizer.json + tokenizer_config.json)
  eval/work/train_tokens.npy      uint16 token ids of the train split, documents joined by <|endoftext|>
  eval/work/corpus_stats.json     file/char/token counts
  eval/data/valid_docs.jsonl      committed held-out docs  ({"path", "text"} per line, truncated documents)
  eval/data/valid_code.jsonl      committed held-out code
  eval/data/prompts.txt           16 short held-out prompts, one per line

Usage:  apt-get install -y python3.11-doc && python -m lab.build_corpus

The committed tokenizer (eval/fixtures/*/tokenizer.json) was built from the Debian 3.11.2-6+deb12u9 packages
(python3.11-doc, libpython3.11-stdlib, libpython3.11-minimal); other package versions change a few files and
give a different tokenizer (a warning is printed). Packages extracted elsewhere (``dpkg-deb -x``) can be
used with ``--docs-root`` / ``--code-root``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from pathlib import Path

import numpy as np

from . import DATA_DIR as DATA
from . import DEFAULT_FIXTURE
from . import WORK_DIR as WORK

EOS = "<|endoftext|>"
DOCS_ROOT = Path("/usr/share/doc/python3.11-doc/html/_sources")
CODE_ROOT = Path("/usr/lib/python3.11")
CODE_EXCLUDE_PARTS = {"test", "tests", "site-packages", "dist-packages", "__pycache__", "idle_test"}


def is_valid(key: str) -> bool:
    return int(hashlib.sha1(key.encode()).hexdigest(), 16) % 20 == 0


def collect(docs_root: Path = DOCS_ROOT, code_root: Path = CODE_ROOT) -> list[tuple[str, str, str]]:
    """Return sorted (domain, key, text) for all documents."""
    out = []
    if not docs_root.is_dir():
        raise SystemExit(f"{docs_root} missing: apt-get install -y python3.11-doc")
    for p in sorted(docs_root.rglob("*.txt")):
        rel = p.relative_to(docs_root).as_posix()
        out.append(("docs", f"docs/{rel}", p.read_text(encoding="utf-8", errors="replace")))
    for p in sorted(code_root.rglob("*.py")):
        rel = p.relative_to(code_root)
        if CODE_EXCLUDE_PARTS & set(rel.parts[:-1]):
            continue
        out.append(("code", f"code/{rel.as_posix()}", p.read_text(encoding="utf-8", errors="replace")))
    return out


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS,
        eos_token=EOS,
        unk_token=EOS,
        pad_token=EOS,
        padding_side="left",
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )
    return fast


def truncate_lines(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    cut = text.rfind("\n", 0, limit)
    return text[: cut + 1 if cut > 0 else limit]


def first_prompt(domain: str, text: str) -> str | None:
    """A short prompt: a code line that starts a def/class, or a doc prose sentence start."""
    for line in text.splitlines():
        s = line.strip()
        if domain == "code":
            if (s.startswith("def ") or s.startswith("class ")) and 12 <= len(s) <= 70 and line == s:
                return s.split("(")[0] + "("
        else:
            if (
                len(s) > 60
                and s[0].isupper()
                and not any(c in s for c in "`*:|=_<>[]")
                and line == s
            ):
                words = s.split()[:6]
                return " ".join(words)
    return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--valid-chars-per-domain", type=int, default=160_000)
    ap.add_argument("--valid-chars-per-doc", type=int, default=12_000)
    ap.add_argument("--docs-root", type=Path, default=DOCS_ROOT)
    ap.add_argument("--code-root", type=Path, default=CODE_ROOT)
    args = ap.parse_args()

    WORK.mkdir(parents=True, exist_ok=True)
    DATA.mkdir(parents=True, exist_ok=True)
    docs = collect(args.docs_root, args.code_root)
    train = [d for d in docs if not is_valid(d[1])]
    valid = [d for d in docs if is_valid(d[1])]
    print(f"{len(docs)} files: {len(train)} train, {len(valid)} valid")

    tok = train_tokenizer([t for _, _, t in train], args.vocab)
    tok.save_pretrained(WORK / "tokenizer")
    cfg_path = WORK / "tokenizer" / "tokenizer_config.json"  # v5 writes "TokenizersBackend"; this alias also loads in v4
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    eos_id = tok.convert_tokens_to_ids(EOS)
    assert eos_id == 0, eos_id
    committed = DEFAULT_FIXTURE / "tokenizer.json"
    if committed.is_file() and committed.read_bytes() != (WORK / "tokenizer" / "tokenizer.json").read_bytes():
        print(f"WARNING: the rebuilt tokenizer differs from {committed}: the fixtures need the "
              "committed one (sources differ: see the docstring on Debian package versions)")

    ids: list[int] = []
    stats = {"train": {"docs": [0, 0, 0], "code": [0, 0, 0]}, "valid": {"docs": [0, 0, 0], "code": [0, 0, 0]}}
    enc = tok.backend_tokenizer.encode_batch([t for _, _, t in train], add_special_tokens=False)
    for (dom, _, t), e in zip(train, enc):
        ids.extend(e.ids)
        ids.append(eos_id)
        s = stats["train"][dom]
        s[0], s[1], s[2] = s[0] + 1, s[1] + len(t), s[2] + len(e.ids) + 1
    arr = np.asarray(ids, dtype=np.uint16)
    np.save(WORK / "train_tokens.npy", arr)
    for dom, _, t in valid:
        s = stats["valid"][dom]
        s[0], s[1], s[2] = s[0] + 1, s[1] + len(t), s[2] + len(tok(t)["input_ids"]) + 1

    # Committed validation subset: valid files in hash order, each truncated at a line boundary.
    prompts: dict[str, list[str]] = {"docs": [], "code": []}
    for dom in ("docs", "code"):
        rows = sorted((d for d in valid if d[0] == dom), key=lambda d: hashlib.sha1(d[1].encode()).hexdigest())
        total = 0
        with open(DATA / f"valid_{dom}.jsonl", "w", encoding="utf-8") as f:
            for _, key, text in rows:
                if total >= args.valid_chars_per_domain:
                    break
                t = truncate_lines(text, args.valid_chars_per_doc)
                if len(t.strip()) < 200:
                    continue
                f.write(json.dumps({"path": key, "text": t}, ensure_ascii=False) + "\n")
                total += len(t)
                p = first_prompt(dom, t)
                if p and p not in prompts[dom]:
                    prompts[dom].append(p)
        stats[f"committed_valid_{dom}_chars"] = total
    sel = prompts["code"][:8] + prompts["docs"][:8]
    assert len(sel) == 16, (len(prompts["code"]), len(prompts["docs"]))
    # interleave code/docs so any prefix of the list has both
    inter = [x for pair in zip(prompts["code"][:8], prompts["docs"][:8]) for x in pair]
    (DATA / "prompts.txt").write_text("\n".join(inter) + "\n", encoding="utf-8")

    stats["train_tokens"] = int(arr.size)
    stats["sources"] = {"docs": str(args.docs_root), "code": str(args.code_root)}
    (WORK / "corpus_stats.json").write_text(json.dumps(stats, indent=1))
    print(json.dumps(stats, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    main()
