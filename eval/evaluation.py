"""Accuracy harness for patched MoE models (docs/design.md "Evaluation").

Everything here runs offline on local checkpoints and the committed held-out data
(``eval/data/valid_docs.jsonl``, ``valid_code.jsonl``, ``prompts.txt``):

- :func:`heldout_windows`: position-aligned token windows (no padding) from the held-out text;
- :func:`router_statistics`: what the routers do on held-out text (logit gaps by rank, routing
  weight by rank, load skew, unique experts per position-aligned decode batch of B tokens);
- :func:`teacher_forced`: B sequences fed through a ``DynamicCache`` -- a prefill of P tokens, then
  one token per step, so every scored position is a true decode step and the patch acts -- for a list
  of policies against the *unpatched* model run the same way (next-token cross-entropy, accuracy,
  top-1 agreement and KL to unpatched, ``lynx_hf.stats`` telemetry, bit-identity to unpatched);
- :func:`generation_agreement`: greedy continuations of left-padded prompts vs unpatched;
- :func:`run_lm_eval`: lm-eval ``simple_evaluate`` through ``HFLM`` over the (patched) model object
  with the local task YAMLs in ``eval/tasks`` and a fixed batch size.

The functions leave the model as they found it: unpatched models are patched per policy with
:func:`lynx_hf.patched` and unpatched again; a model that arrives patched is refused (the
reference run must be the model's own code).
"""

from __future__ import annotations

import inspect
import json
import math
import os
import time
from pathlib import Path
from typing import Iterable, Sequence

import torch
from tqdm.auto import tqdm

from lynx_hf import LynxConfig, patcher
from lynx_hf.policies.lynx import layer_price

from . import DATA_DIR, FIXTURES_DIR, RESULTS_DIR, TASKS_DIR  # noqa: F401  (re-exported for the scripts and tests)

HELDOUT_FILES = (DATA_DIR / "valid_docs.jsonl", DATA_DIR / "valid_code.jsonl")

#: a policy to evaluate: (name, config); config ``None`` = the unpatched model.
Policy = tuple[str, "LynxConfig | None"]
#: every accuracy run here (teacher forcing, generation agreement, lm-eval; ``lynx-hf eval`` / ``sweep``) patches with
#: the cost gate forced on (``LynxConfig.gate``): accuracy must not depend on this machine's timing
ACCURACY_GATE = "always"


# ----------------------------------------------------------------------------------------------
# loading
# ----------------------------------------------------------------------------------------------
def add_run_args(parser) -> None:
    """The options every checkpoint script shares: ``--threads`` (torch intra-op threads) and ``--out`` (results
    folder: eval/results in the source checkout, else ./lynx_hf_results)."""
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(RESULTS_DIR),
                        help="results folder (default: eval/results in the source checkout, else ./lynx_hf_results)")


def start_run(args):
    """Set the threads and load ``args.model``: ``(checkpoint name, model, tokenizer, start time in s)``."""
    import time

    from . import results_folder

    results_folder(args.out)  # a file name is refused before anything loads
    torch.set_num_threads(args.threads)
    name = Path(args.model).resolve().name
    t0 = time.perf_counter()
    model, tok = load_model(args.model)
    return name, model, tok, t0


def load_model(path: str | os.PathLike, dtype: torch.dtype = torch.float32, device: str | torch.device | None = None):
    """``(model, tokenizer)`` from a local checkpoint folder (never the hub); tokenizer left-padding.

    ``device``: where the weights are loaded (``None`` / ``"cpu"``: CPU; else passed as ``device_map``, e.g.
    ``"cuda"``, ``"cuda:1"`` or ``"auto"``). Raises ``FileNotFoundError`` when ``path`` has no ``config.json``.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no local checkpoint at {path} (a folder with config.json is expected)")
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    on_cpu = device is None or str(device) == "cpu"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **({} if on_cpu else {"device_map": device}))
    return model.eval(), tokenizer


def moe_shape(model) -> tuple[int, int]:
    """``(N, k)`` of the model's routed experts: from its (text) config where it names them
    (``num_experts`` / ``num_local_experts`` / ``n_routed_experts``, ``num_experts_per_tok``), else from the
    blocks :func:`lynx_hf.patch` finds (the largest N and k over the MoE layers). Raises
    :class:`lynx_hf.UnsupportedModelError` when neither names them."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    n = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None) or getattr(cfg, "n_routed_experts", None)
    k = getattr(cfg, "num_experts_per_tok", None)
    if isinstance(n, int) and isinstance(k, int):
        return int(n), int(k)
    if patcher.is_patched(model):
        layers = patcher.stats(model).layers
    else:
        with patcher.patched(model, LynxConfig(policy="none")):
            layers = patcher.stats(model).layers
    return max(layer["num_experts"] for layer in layers), max(layer["top_k"] for layer in layers)


#: suffixes :func:`data_files` reads: JSON lines with a text field, plain text (one document per file)
DATA_SUFFIXES = (".jsonl", ".txt")


def data_files(path: str | os.PathLike) -> list[Path]:
    """The text files behind a ``--data`` argument: a ``.jsonl`` file (one JSON object per line with a text
    field), a ``.txt`` file (its whole text is one document), or a folder (every such file under it, sorted by
    path). Raises ``FileNotFoundError`` when ``path`` does not exist and ``ValueError`` when it is a file of
    another kind or a folder without such files."""
    path = Path(path)
    if path.is_dir():
        files = sorted(f for f in path.rglob("*") if f.is_file() and f.suffix in DATA_SUFFIXES)
        if not files:
            raise ValueError(f"no {' or '.join(DATA_SUFFIXES)} files under {path}")
        return files
    if not path.exists():
        raise FileNotFoundError(f"no data at {path}")
    if path.suffix not in DATA_SUFFIXES:
        raise ValueError(f"{path}: data must be a .jsonl file (a text field per line), a .txt file or a folder of them")
    return [path]


def read_texts(path: str | os.PathLike, field: str = "text") -> list[str]:
    """The documents of one data file, in file order: the ``field`` of every line of a ``.jsonl`` file, or the
    whole text of a ``.txt`` file (one document; none when it is blank). Raises ``ValueError`` naming the line
    for a line that is not a JSON object with a string ``field``."""
    path = Path(path)
    if path.suffix == ".txt":
        text = path.read_text(encoding="utf-8")
        return [text] if text.strip() else []
    out = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)[field]
            except (json.JSONDecodeError, KeyError, TypeError, IndexError):
                value = None
            if not isinstance(value, str):
                raise ValueError(f"{path}:{number}: expected a JSON object with a string {field!r} field")
            out.append(value)
    return out


def heldout_windows(tokenizer, length: int, count: int | None, files: Sequence[str | os.PathLike] = HELDOUT_FILES,
                    seed: int = 0, field: str = "text") -> torch.Tensor:
    """``[count, length]`` int64 token windows of held-out text, position-aligned, no padding.

    Each file's documents (:func:`read_texts`; ``field`` of a ``.jsonl`` file) are tokenized and concatenated
    (EOS between documents) and cut into non-overlapping windows; each file's windows are shuffled with
    ``seed``; files are interleaved round-robin, so a batch of B consecutive windows mixes the domains (docs,
    code, docs, ...). ``count=None``: every window, in the same order (so the first ``c`` rows are the
    windows of ``count=c``). Raises ``ValueError`` when the files hold fewer than ``count`` windows.
    """
    eos = tokenizer.eos_token_id
    pools = []
    for i, path in enumerate(files):
        stream: list[int] = []
        for text in read_texts(path, field):
            stream.extend(tokenizer(text, verbose=False)["input_ids"])
            stream.append(eos)
        n = len(stream) // length
        windows = torch.tensor(stream[: n * length], dtype=torch.long).view(n, length)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + i))
        pools.append(windows[perm])
    out = []
    j = 0
    while count is None or len(out) < count:
        pool, item = pools[j % len(pools)], j // len(pools)
        if item >= max((len(p) for p in pools), default=0):
            if count is None:
                break
            raise ValueError(f"held-out files hold fewer than {count} windows of {length} tokens")
        if item < len(pool):
            out.append(pool[item])
        j += 1
    return torch.stack(out) if out else torch.zeros(0, length, dtype=torch.long)


def prompts_from_file(path: str | os.PathLike = DATA_DIR / "prompts.txt", count: int | None = None) -> list[str]:
    lines = [line.rstrip("\n") for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    return lines if count is None else lines[:count]


def _check_unpatched(model) -> None:
    if patcher.is_patched(model):
        raise ValueError("the harness needs an unpatched model (the reference is the model's own code); "
                         "call lynx_hf.unpatch(model) first")


# ----------------------------------------------------------------------------------------------
# router report
# ----------------------------------------------------------------------------------------------
@torch.inference_mode()
def router_logits_per_layer(model, windows: torch.Tensor, chunk: int = 16) -> list[torch.Tensor]:
    """Router logits ``[n, L, N]`` fp32 per MoE layer for full-sequence forwards over ``windows [n, L]``."""
    layers: list[list[torch.Tensor]] = []
    n, length = windows.shape
    for start in range(0, n, chunk):
        ids = windows[start:start + chunk]
        out = model(input_ids=ids, output_router_logits=True, use_cache=False)
        logits = [r.float().view(ids.shape[0], length, -1) for r in out.router_logits if r is not None]
        if not layers:
            layers = [[] for _ in logits]
        for acc, r in zip(layers, logits):
            acc.append(r)
    return [torch.cat(parts) for parts in layers]


QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9)


def moe_block_names(model) -> list[str]:
    """Module names of the model's MoE blocks (the ones ``lynx_hf.patch`` would patch), in order."""
    from lynx_hf.patches import find_spec

    return [name for name, module in model.named_modules() if find_spec(module) is not None]


def router_statistics(model, windows: torch.Tensor, batch_sizes: Iterable[int] = (1, 8, 16, 32, 64),
                      skip: int = 8) -> dict:
    """What the routers do on held-out windows ``[n, L]`` (full-sequence forwards, unpatched).

    Per MoE layer: quantiles of the logit gap ``s_0 - s_r`` between rank 0 and each rank
    ``r = 1..k-1`` (nats; for a softmax router ``exp(-gap) = p_r / p_0``); the mean router
    probability by rank (softmax over all N) and the share of the top-k weight by rank; the share of
    assignments whose gap exceeds ``ln(N/k)`` (LYNX's default voting cut-off: the expert would not
    vote); expert load over all top-k assignments (max/mean, normalized entropy); and the unique
    experts touched by a position-aligned decode batch of B tokens (the B windows' tokens at one
    position, positions ``>= skip``), with ``N (1 - (1 - k/N)^B)`` (independent uniform routing)
    for reference.
    """
    num_experts, top_k = moe_shape(model)
    per_layer = router_logits_per_layer(model, windows)
    n, length = windows.shape
    blocks = moe_block_names(model)
    if len(blocks) != len(per_layer):  # names are labels only
        blocks = [str(i) for i in range(len(per_layer))]
    layers = []
    for index, logits in enumerate(per_layer):
        flat = logits[:, skip:].reshape(-1, num_experts)
        sorted_logits, order = torch.sort(flat, dim=-1, descending=True, stable=True)
        probs = torch.softmax(flat, dim=-1)
        sorted_probs = torch.gather(probs, 1, order)
        gaps = {}
        for r in range(1, top_k):
            g = sorted_logits[:, 0] - sorted_logits[:, r]
            gaps[str(r)] = {f"q{int(q * 100)}": float(torch.quantile(g, q)) for q in QUANTILES} | {
                "mean": float(g.mean())}
        topk_probs = sorted_probs[:, :top_k]
        cut = math.log(num_experts / top_k)
        low = (sorted_logits[:, 0:1] - sorted_logits[:, :top_k]) > cut
        load = torch.bincount(order[:, :top_k].reshape(-1), minlength=num_experts).double()
        share = load / load.sum()
        entropy = float(-(share[share > 0] * share[share > 0].log()).sum() / math.log(num_experts))
        unique = {}
        topk_idx = torch.topk(logits, top_k, dim=-1).indices  # [n, L, k]
        for b in batch_sizes:
            groups = n // b
            if groups == 0:
                continue
            sets = torch.zeros(groups, length - skip, num_experts, dtype=torch.bool)
            idx = topk_idx[: groups * b, skip:].reshape(groups, b, length - skip, top_k)
            for member in range(b):
                sets.scatter_(2, idx[:, member], True)
            counts = sets.sum(-1).double()
            unique[str(b)] = {"mean": float(counts.mean()), "q10": float(torch.quantile(counts.flatten(), 0.1)),
                              "q90": float(torch.quantile(counts.flatten(), 0.9)),
                              "independent_uniform": num_experts * (1 - (1 - top_k / num_experts) ** b),
                              "batches": int(groups * (length - skip))}
        layers.append({
            "layer": index,
            "block": blocks[index],
            "gap_rank0_to_rank": gaps,
            "prob_by_rank": [float(v) for v in topk_probs.mean(0)],
            "topk_mass": float(topk_probs.sum(-1).mean()),
            "topk_share_by_rank": [float(v) for v in (topk_probs / topk_probs.sum(-1, keepdim=True)).mean(0)],
            "below_vote_cutoff_by_rank": [float(v) for v in low.double().mean(0)],
            "load_max_over_mean": float(load.max() / load.mean()),
            "load_min_over_mean": float(load.min() / load.mean()),
            "load_entropy_norm": entropy,
            "unique_experts_per_batch": unique,
        })
    return {"num_experts": num_experts, "top_k": top_k, "windows": n, "window_length": length,
            "skip_positions": skip, "tokens": n * (length - skip), "vote_cutoff_gap": math.log(num_experts / top_k),
            "layers": layers}


# ----------------------------------------------------------------------------------------------
# teacher-forced decode
# ----------------------------------------------------------------------------------------------
@torch.inference_mode()
def decode_logits(model, ids: torch.Tensor, prefill: int) -> torch.Tensor:
    """Logits ``[b, L - prefill - 1, V]`` fp32, on the CPU, of the decode steps over ``ids [b, L]`` (moved to
    ``model.device`` first).

    A prefill forward of ``ids[:, :prefill]`` creates the ``DynamicCache``; then each token
    ``ids[:, t]``, ``t = prefill .. L-2``, is fed alone with the cache (a true decode step:
    a patched model remaps), and its logits predict ``ids[:, t + 1]``.
    """
    if not 1 <= prefill <= ids.shape[1] - 2:
        raise ValueError(f"prefill must be in 1..L-2 (L={ids.shape[1]}), got {prefill}")
    device = getattr(model, "device", None)
    ids = ids.to(device) if isinstance(device, torch.device) else ids
    # transformers >= 5.24 names the cache argument ``cache`` (``past_key_values`` warns); older ones do not
    name = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
    out = model(input_ids=ids[:, :prefill], use_cache=True)
    cache = out.past_key_values
    steps = []
    for t in range(prefill, ids.shape[1] - 1):
        out = model(input_ids=ids[:, t:t + 1], use_cache=True, **{name: cache})
        cache = out.past_key_values
        steps.append(out.logits[:, -1].float())
    return torch.stack(steps, dim=1).cpu()


def _alpha_mult(cfg: LynxConfig, num_experts: int, top_k: int) -> float | None:
    if cfg.policy != "lynx":
        return None
    from lynx_hf.kernels.routing_torch import default_lynx_bins

    default_alpha, _ = default_lynx_bins(num_experts, top_k)
    return 1.0 if cfg.alpha is None else cfg.alpha / default_alpha


def _xshare_budget(cfg: LynxConfig, num_experts: int) -> int:
    """XShare's experts per step for this config (``xshare_budget``, or ``ceil(xshare_fraction * N)``)."""
    budget = cfg.xshare_budget if cfg.xshare_budget is not None else math.ceil(cfg.xshare_fraction * num_experts)
    return min(max(int(budget), 1), num_experts)


class Reference:
    """The unpatched model's teacher-forced decode of ``windows [n, L]`` in batches of ``batch_size``
    (:func:`reference_run`): what every policy is scored against. Fields: ``batches`` (``[B, L]`` each),
    ``targets`` (``[B, L - prefill - 1]``), ``logits`` (fp32 CPU ``[B, L - prefill - 1, V]`` per batch),
    ``nll`` (``[n, L - prefill - 1]``, nats), ``pred`` (argmax per batch), ``row`` (the ``"unpatched"`` result
    row), ``num_experts``, ``top_k``, ``batch_size``, ``prefill``, ``length``. Memory: ``n (L - prefill - 1) V``
    fp32 values."""

    def __init__(self, **fields):
        self.__dict__.update(fields)

    @property
    def ce(self) -> float:
        return self.row["ce"]

    def summary(self) -> dict:
        """The run's shape as :func:`teacher_forced` reports it (no results)."""
        n = self.nll.shape[0]
        return {"num_experts": self.num_experts, "top_k": self.top_k, "batch_size": self.batch_size,
                "prefill": self.prefill, "window_length": self.length, "sequences": n,
                "scored_tokens": int(self.nll.numel()),
                "decode_steps_per_policy": len(self.batches) * (self.length - self.prefill - 1)}


@torch.inference_mode()
def reference_run(model, windows: torch.Tensor, batch_size: int, prefill: int) -> Reference:
    """Teacher-forced decode of ``windows [n, L]`` by the unpatched model (see :func:`teacher_forced`).
    Raises ``ValueError`` when ``n`` is not a multiple of ``batch_size`` or the model is patched."""
    _check_unpatched(model)
    n, length = windows.shape
    if n % batch_size:
        raise ValueError(f"{n} windows is not a multiple of batch_size={batch_size}")
    num_experts, top_k = moe_shape(model)
    batches = [windows[i:i + batch_size] for i in range(0, n, batch_size)]
    targets = [b[:, prefill + 1:] for b in batches]
    t0 = time.perf_counter()
    ref_logits = [decode_logits(model, b, prefill) for b in batches]
    ref_nll = torch.cat([-torch.log_softmax(x, dim=-1).gather(-1, y[..., None])[..., 0]
                         for x, y in zip(ref_logits, targets)])
    ref_pred = [x.argmax(-1) for x in ref_logits]
    ref_correct = torch.cat([p == y for p, y in zip(ref_pred, targets)])
    ref_ce = float(ref_nll.mean())
    row = {"name": "unpatched", "policy": None, "ce": ref_ce, "acc": float(ref_correct.float().mean()),
           "delta_ce_rel": 0.0, "delta_ce_rel_se": 0.0, "top1_agreement": 1.0, "kl": 0.0, "bit_identical": True,
           "seconds": time.perf_counter() - t0}
    return Reference(batches=batches, targets=targets, logits=ref_logits, nll=ref_nll, pred=ref_pred, row=row,
                     num_experts=num_experts, top_k=top_k, batch_size=batch_size, prefill=prefill, length=length)


@torch.inference_mode()
def score_policy(model, ref: Reference, name: str, cfg: LynxConfig) -> dict:
    """One policy's result row against ``ref`` (the same batches, decoded with ``model`` patched by ``cfg``
    through :func:`lynx_hf.patched`; see :func:`teacher_forced` for the keys). ``unique_ratio_vs_none`` is
    not set here (it needs policy none's row)."""
    t0 = time.perf_counter()
    nll, correct, agree, kl, identical = [], [], [], [], True
    with patcher.patched(model, cfg, gate=ACCURACY_GATE):
        patcher.reset_stats(model)
        for b, y, rl, rp in zip(ref.batches, ref.targets, ref.logits, ref.pred):
            logits = decode_logits(model, b, ref.prefill)
            identical = identical and torch.equal(logits, rl)
            rlp = torch.log_softmax(rl, dim=-1)
            logp = torch.log_softmax(logits, dim=-1)
            nll.append(-logp.gather(-1, y[..., None])[..., 0])
            pred = logits.argmax(-1)
            correct.append(pred == y)
            agree.append(pred == rp)
            kl.append((rlp.exp() * (rlp - logp)).sum(-1))
        summary = patcher.stats(model).summary()
    nll_t = torch.cat(nll)
    ce = float(nll_t.mean())
    diff = (nll_t - ref.nll).mean(dim=1) / ref.ce  # per sequence, relative
    num_experts, top_k = ref.num_experts, ref.top_k
    entry = {
        "name": name, "policy": cfg.policy, "tau": cfg.tau if cfg.policy == "lynx" else None,
        "alpha": cfg.alpha, "alpha_mult": _alpha_mult(cfg, num_experts, top_k),
        "beta": cfg.beta,
        "mass_price": cfg.mass_price if cfg.policy == "lynx" else None,
        "price_unit": cfg.price_unit if cfg.policy == "lynx" and cfg.mass_price is not None else None,
        # the price a layer of this model used (LynxConfig.price_ref_layers applied; = mass_price up to that depth)
        "layer_price": (layer_price(cfg, max(1, len(summary.get("per_layer", []))))
                        if cfg.policy == "lynx" and cfg.mass_price is not None else None),
        "k0": cfg.oea_k0 if cfg.policy == "oea" else None,
        "xshare_fraction": cfg.xshare_fraction if cfg.policy == "xshare" and cfg.xshare_budget is None else None,
        "xshare_budget": _xshare_budget(cfg, num_experts) if cfg.policy == "xshare" else None,
        "xshare_warmup": cfg.xshare_warmup if cfg.policy == "xshare" else None,
        "ce": ce, "acc": float(torch.cat(correct).float().mean()),
        "delta_ce_rel": ce / ref.ce - 1.0,
        "delta_ce_rel_se": float(diff.std(unbiased=True) / math.sqrt(len(diff))) if len(diff) > 1 else 0.0,
        "top1_agreement": float(torch.cat(agree).float().mean()),
        "kl": float(torch.cat(kl).mean()),
        "bit_identical": bool(identical),
        "seconds": time.perf_counter() - t0,
    }
    for key in ("decode_steps", "unique_experts_before", "unique_experts_after", "ratio", "routing_mass_kept",
                "remapped_fraction", "fallbacks"):
        entry[key] = summary[key]
    entry["per_layer"] = [{k: layer[k] for k in ("layer", "unique_experts_before", "unique_experts_after",
                                                 "routing_mass_kept")} for layer in summary["per_layer"]]
    return entry


def add_unique_ratios(results: list[dict]) -> None:
    """Set ``unique_ratio_vs_none`` (unique experts after / policy none's before: the model's own routing per
    decode step) on every row with telemetry, when policy none is among ``results``."""
    base = next((r for r in results if r.get("policy") == "none"), None)
    if base is not None:
        for r in results:
            if "unique_experts_after" in r:
                r["unique_ratio_vs_none"] = r["unique_experts_after"] / base["unique_experts_before"]


def teacher_forced(model, windows: torch.Tensor, batch_size: int, prefill: int, policies: Sequence[Policy],
                   progress=None) -> dict:
    """Teacher-forced decode of ``windows [n, L]`` in batches of ``batch_size`` for each policy.

    The unpatched model is run first (the reference: the model's own code, same cache, same steps,
    :func:`reference_run`); then each ``(name, LynxConfig)`` via :func:`lynx_hf.patched`
    (:func:`score_policy`). Scored tokens: ``n * (L - prefill - 1)``, all produced by decode steps. Per
    policy: ``ce`` (mean next-token cross-entropy, nats), ``acc``, ``delta_ce_rel`` (``ce / ce_unpatched -
    1``) with ``delta_ce_rel_se`` (standard error over sequences of the paired per-sequence difference,
    relative), ``top1_agreement`` and ``kl`` (mean KL(unpatched || policy), nats) against the unpatched
    predictions, ``bit_identical`` (every logit equal to unpatched), and the ``lynx_hf.stats`` summary
    (means over MoE layers of unique experts per decode step before/after, routing mass kept, remapped
    fraction; ``per_layer``). ``n`` must be a multiple of ``batch_size``. ``progress`` (optional) is called
    with a line per policy.
    """
    ref = reference_run(model, windows, batch_size, prefill)
    results = [ref.row]
    if progress:
        progress(f"unpatched: ce {ref.ce:.4f} ({ref.row['seconds']:.1f}s)")
    for name, cfg in tqdm(policies, desc=f"teacher-forced B={batch_size}", unit="policy", disable=progress is None,
                          leave=False):
        if cfg is None:
            continue
        entry = score_policy(model, ref, name, cfg)
        results.append(entry)
        if progress:
            progress(f"{name}: ce {entry['ce']:.4f} ({entry['delta_ce_rel'] * 100:+.2f}%), experts "
                     f"{entry['unique_experts_before']:.2f} -> {entry['unique_experts_after']:.2f} "
                     f"({entry['seconds']:.1f}s)")
    add_unique_ratios(results)
    return {**ref.summary(), "results": results}


# ----------------------------------------------------------------------------------------------
# generation agreement
# ----------------------------------------------------------------------------------------------
@torch.inference_mode()
def generation_agreement(model, tokenizer, prompts: Sequence[str], policies: Sequence[Policy],
                         max_new_tokens: int = 32) -> dict:
    """Greedy continuations of the left-padded ``prompts`` (one batch) vs the unpatched model.

    Per policy: ``token_agreement`` (share of the ``len(prompts) * max_new_tokens`` positions with
    the same token; finished rows are padded), ``exact_match`` (share of identical continuations),
    ``mean_agree_prefix`` (mean number of leading tokens equal to unpatched) and the stats summary.
    """
    _check_unpatched(model)
    tokenizer.padding_side = "left"
    batch = tokenizer(list(prompts), return_tensors="pt", padding=True)
    pad = tokenizer.pad_token_id
    gen = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)

    def new_tokens(out):
        new = out[:, batch["input_ids"].shape[1]:]
        if new.shape[1] < max_new_tokens:
            new = torch.cat([new, new.new_full((new.shape[0], max_new_tokens - new.shape[1]), pad)], dim=1)
        return new

    t0 = time.perf_counter()
    ref = new_tokens(model.generate(**batch, **gen))
    results = [{"name": "unpatched", "policy": None, "token_agreement": 1.0, "exact_match": 1.0,
                "mean_agree_prefix": float(max_new_tokens), "seconds": time.perf_counter() - t0}]
    texts = {"unpatched": [tokenizer.decode(r, skip_special_tokens=True) for r in ref]}
    for name, cfg in policies:
        if cfg is None:
            continue
        t0 = time.perf_counter()
        with patcher.patched(model, cfg, gate=ACCURACY_GATE):
            patcher.reset_stats(model)
            out = new_tokens(model.generate(**batch, **gen))
            summary = patcher.stats(model).summary()
        same = out == ref
        prefix = torch.where(same.all(1), torch.full((len(same),), max_new_tokens),
                             (~same).float().argmax(1))
        results.append({
            "name": name, "policy": cfg.policy, "token_agreement": float(same.float().mean()),
            "exact_match": float(same.all(1).float().mean()), "mean_agree_prefix": float(prefix.float().mean()),
            "unique_experts_before": summary["unique_experts_before"],
            "unique_experts_after": summary["unique_experts_after"],
            "routing_mass_kept": summary["routing_mass_kept"], "seconds": time.perf_counter() - t0,
        })
        texts[name] = [tokenizer.decode(r, skip_special_tokens=True) for r in out]
    return {"prompts": len(prompts), "max_new_tokens": max_new_tokens, "results": results, "texts": texts}


# ----------------------------------------------------------------------------------------------
# lm-eval
# ----------------------------------------------------------------------------------------------
def run_lm_eval(model, tokenizer, tasks: Sequence[str], batch_size: int = 16, config: LynxConfig | None = None,
                include_path: str | os.PathLike = TASKS_DIR, limit: int | float | None = None) -> dict:
    """``lm_eval.simple_evaluate`` over ``HFLM(pretrained=model, tokenizer=..., batch_size=N)``.

    ``config``: patch the model with it for the run (``None``: run the model as it is). The batch
    size must be an int (never "auto": results must not depend on free memory). Offline: the local
    tasks in ``include_path`` load their data from files next to them. Returns
    ``{"results": {task: metrics}, "samples": {task: [per-doc dicts]}, "stats": summary or None}``.
    """
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int (never 'auto'), got {batch_size!r}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import logging

    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    for name in ("lm_eval", "lm-eval"):
        logging.getLogger(name).setLevel(logging.WARNING)
    tokenizer.padding_side = "left"
    stats = None
    ctx = patcher.patched(model, config, gate=ACCURACY_GATE) if config is not None else _null()
    with ctx:
        if config is not None:
            patcher.reset_stats(model)
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
        out = simple_evaluate(model=lm, tasks=list(tasks),
                              task_manager=TaskManager(include_path=str(include_path), include_defaults=False),
                              limit=limit, log_samples=True, bootstrap_iters=0, random_seed=0, numpy_random_seed=0,
                              torch_random_seed=0, fewshot_random_seed=0)
        if config is not None:
            stats = patcher.stats(model).summary()
    results = {task: {k: v for k, v in metrics.items() if k != "alias"} for task, metrics in out["results"].items()}
    return {"results": results, "samples": out.get("samples", {}), "stats": stats}


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def sample_responses(samples: list[dict]) -> list:
    """The raw per-request model responses of lm-eval samples, in doc order (for exact comparisons)."""
    return [s["resps"] for s in sorted(samples, key=lambda s: s["doc_id"])]


# ----------------------------------------------------------------------------------------------
# policies and tables
# ----------------------------------------------------------------------------------------------
def lynx_config(num_experts: int, top_k: int, tau: float, alpha_mult: float = 1.0, **kw) -> LynxConfig:
    """A LYNX config whose alpha is ``alpha_mult`` times the k/N-derived default (beta stays default);
    the paper's rule (``mass_price=None``) unless ``mass_price`` is passed."""
    from lynx_hf.kernels.routing_torch import default_lynx_bins

    alpha = None if alpha_mult == 1.0 else alpha_mult * default_lynx_bins(num_experts, top_k)[0]
    kw.setdefault("mass_price", None)  # the paper's rule unless a mass price is asked for
    return LynxConfig(policy="lynx", tau=float(tau), alpha=alpha, **kw)


def markdown_table(rows: Sequence[dict], columns: Sequence[tuple[str, str, str]]) -> str:
    """``columns``: ``(header, key, format)``; missing values print as ``-``."""
    head = "| " + " | ".join(h for h, _, _ in columns) + " |"
    sep = "|" + "|".join("---" for _ in columns) + "|"
    lines = [head, sep]
    for row in rows:
        cells = []
        for _, key, fmt in columns:
            value = row.get(key)
            cells.append("-" if value is None else format(value, fmt) if fmt else str(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
