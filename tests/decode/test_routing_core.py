"""The decode post-process core (lynx_hf/core.py ``remap`` / ``BlockRouting.route``) on hand-worked
steps with per-token masks: finished rows do not vote, prefill rows seed the critical set, telemetry
counts only live decode tokens (each test here kills a named mutant of lab/mutants.py)."""

import contextlib
import types

import pytest
import torch

import lynx_hf
from helpers import families as fam
from lynx_hf import LynxConfig
from lynx_hf.core import DECODE, MIXED, MoELayer, StageBase, Step, StepInputs, make_plan, remap

SOFTMAX_ALL = types.SimpleNamespace(kind="softmax_all", renormalize=False, scale=1.0, renorm_eps=0.0)


def _own_topk(s, k):
    return torch.sort(s, dim=-1, descending=True, stable=True).indices[:, :k]


def _remap(cfg, step, s, k):
    idx = _own_topk(s, k)
    weights = torch.softmax(s, -1).gather(1, idx)
    plan = make_plan(cfg, MoELayer(s.shape[1], k, torch.device("cpu")))
    return remap(plan, SOFTMAX_ALL, step, s, s, weights, idx)


def test_finished_rows_are_remapped_into_the_set_but_do_not_vote():
    """OEA k0=1, k=1, N=4. Live rows' top-1: e0, e1, so S = {e0, e1}. The finished row (top-1 e3) does
    not vote: it is remapped to its best expert inside S, e1 (score 1 > 0). Were it voting, S would hold
    e3 and it would keep e3."""
    s = torch.tensor([[3.0, 1.0, 0.0, 2.0],
                      [1.0, 3.0, 0.0, 2.0],
                      [0.0, 1.0, 2.0, 3.0]])
    step = Step(DECODE, live=torch.tensor([True, True, False]))
    w, idx, finite = _remap(LynxConfig(policy="oea", oea_k0=1), step, s, 1)
    assert idx.tolist() == [[0], [1], [1]]
    assert bool(finite.all())
    # the weight of the finished row is the rule on its new expert: softmax(all N) at e1
    assert w[2, 0].item() == pytest.approx(torch.softmax(s[2], -1)[1].item(), rel=1e-6)


def test_prefill_rows_keep_their_routing_and_seed_the_critical_set():
    """A mixed step (continuous batching): row 0 decodes, row 1 is a prefill token using {e2, e3}. OEA
    k0=1, k=2, N=4: S = seed {e2, e3} + row 0's top-1 {e0}. Row 0 takes its top-2 inside S: e0 (3) then
    e2 (1), not its own e1 (2) outside S; row 1 keeps exactly its own routing. Without the seed S = {e0}
    and row 0 would keep [e0, e1]."""
    s = torch.tensor([[3.0, 2.0, 1.0, 0.0],
                      [0.0, 1.0, 3.0, 2.0]])
    step = Step(MIXED, decode=torch.tensor([True, False]))
    idx0 = _own_topk(s, 2)
    w, idx, _ = _remap(LynxConfig(policy="oea", oea_k0=1), step, s, 2)
    assert idx.tolist() == [[0, 2], [2, 3]]
    assert torch.equal(idx[1], idx0[1])
    assert torch.equal(w[1], torch.softmax(s[1], -1)[[2, 3]])  # the model's own weights, untouched


def test_telemetry_counts_only_live_decode_tokens():
    """Telemetry of one MoE block: a prefill forward records nothing; a mixed step with 2 decode tokens,
    1 prefill token and 1 finished decode token counts exactly those (hand-counted)."""
    model = fam.build("qwen2_moe")
    ids, mask = fam.prompts(4, 6)
    with lynx_hf.patched(model, policy="lynx", gate="always"):  # every decode step counted
        model(input_ids=ids, attention_mask=mask)  # plain forward: prefill
        model(input_ids=ids, attention_mask=mask, use_cache=True)  # prefill with a cache
        summary = lynx_hf.stats(model).summary()
        assert summary["decode_steps"] == 0 and summary["decode_tokens"] == 0
        assert all(layer["decode_tokens"] == 0 for layer in summary["per_layer"])
        block = model.__dict__["_lynx_state"].blocks[0]
        g = torch.Generator().manual_seed(0)
        logits = torch.randn(4, block.num_experts, generator=g) * 3
        idx = _own_topk(logits, block.top_k)
        weights = torch.softmax(logits, -1).gather(1, idx)
        step = Step(MIXED, decode=torch.tensor([True, False, True, True]),
                    live=torch.tensor([True, True, True, False]))
        block.route(step, logits, weights, idx)
        layer = lynx_hf.stats(model).summary()["per_layer"][0]
    assert layer["decode_steps"] == 1
    assert layer["decode_tokens"] == 2  # rows 0 and 2
    assert layer["prefill_tokens_in_mixed_steps"] == 1  # row 1
    assert layer["finished_row_tokens"] == 1  # row 3
    # unique experts before: the union of rows 0 and 2's own top-k (hand count from the indices)
    assert layer["unique_experts_before"] == len(set(idx[0].tolist()) | set(idx[2].tolist()))


@pytest.mark.parametrize("sync_free", [False, True])
def test_telemetry_counts_mode_counts_what_full_mode_counts(sync_free):
    """``LynxConfig.telemetry="counts"``: the same routing and the same decode steps, unique experts and tokens as
    the full mode (eager: the one-call CPU path; sync-free: the masked path compiled / accelerator code runs), with
    ``remapped_fraction`` / ``routing_mass_kept`` not measured (None); unique experts checked against a count made
    outside from the routing the block returned."""
    from lynx_hf.kernels.routing_torch import strict_sync_free

    model = fam.build("qwen2_moe")
    g = torch.Generator().manual_seed(1)
    out = {}
    for mode in (True, "counts"):
        with lynx_hf.patched(model, policy="lynx", gate="always", telemetry=mode):
            block = model.__dict__["_lynx_state"].blocks[0]
            seen_before, seen_after, routes = 0, 0, []
            for seed in range(3):
                g.manual_seed(seed)
                logits = torch.randn(8, block.num_experts, generator=g) * 3
                idx = _own_topk(logits, block.top_k)
                weights = torch.softmax(logits, -1).gather(1, idx)
                with strict_sync_free() if sync_free else contextlib.nullcontext():
                    new_weights, new_idx = block.route(Step(DECODE), logits, weights, idx)
                routes.append((new_weights, new_idx))
                seen_before += len(set(idx.flatten().tolist()))
                seen_after += len(set(new_idx.flatten().tolist()))
            out[mode] = (lynx_hf.stats(model).summary()["per_layer"][0], routes)
        layer = out[mode][0]
        assert layer["decode_steps"] == 3 and layer["decode_tokens"] == 24
        assert layer["unique_experts_before"] == seen_before / 3
        assert layer["unique_experts_after"] == seen_after / 3
    full, counts = out[True][0], out["counts"][0]
    assert counts["remapped_fraction"] is None and counts["routing_mass_kept"] is None
    assert full["remapped_fraction"] is not None and 0 < full["routing_mass_kept"] <= 1
    for (w1, i1), (w2, i2) in zip(out[True][1], out["counts"][1]):  # the mode never changes the routing
        assert torch.equal(i1, i2) and torch.equal(w1, w2)


def test_summary_names_the_telemetry_mode():
    """``stats().summary()["telemetry"]`` says which mode recorded the figures; with telemetry off a decode step
    still routes with the policy but nothing is recorded: the summary says "off" beside its placeholders."""
    model = fam.build("qwen2_moe")
    logits = torch.randn(8, 8, generator=torch.Generator().manual_seed(0)) * 3
    for mode, want, steps in ((True, "full", 1), ("counts", "counts", 1), (False, "off", 0)):
        with lynx_hf.patched(model, policy="lynx", gate="always", telemetry=mode):
            block = model.__dict__["_lynx_state"].blocks[0]
            lg = logits[:, :block.num_experts]
            idx = _own_topk(lg, block.top_k)
            block.route(Step(DECODE), lg, torch.softmax(lg, -1).gather(1, idx), idx)
            summary = lynx_hf.stats(model).summary()
        assert summary["telemetry"] == want and summary["decode_steps"] == steps


def test_config_telemetry_values():
    assert LynxConfig(telemetry="counts").telemetry == "counts"
    assert LynxConfig.from_options({"telemetry": "counts"}).telemetry == "counts"
    assert LynxConfig.from_options({"telemetry": "false"}).telemetry is False
    with pytest.raises(lynx_hf.LynxConfigError, match="telemetry"):
        LynxConfig(telemetry="fast")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("step_name", ["fused_step", "remap_step"])
def test_plain_scores_reuse_the_cast_with_the_same_result(dtype, step_name):
    """``StepInputs.scores=None`` (the scores are the fp32 logits) lets the step reuse the fp32 scores as the weight
    rule's logits: bit-identical to the same step given an equivalent selection function (which casts twice), bf16 and
    fp32 router logits."""
    from lynx_hf import core

    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(16, 32, generator=g) * 2).to(dtype)
    idx = _own_topk(logits.float(), 4)
    weights = torch.softmax(logits.float(), -1).gather(1, idx).to(dtype)
    plan = make_plan(LynxConfig(gate="always"), MoELayer(32, 4, torch.device("cpu")))
    fn = getattr(core, step_name)
    for host in (True, False):
        a = fn(plan, StepInputs(Step(DECODE), logits, weights, idx, SOFTMAX_ALL, host))
        b = fn(plan, StepInputs(Step(DECODE), logits, weights, idx, SOFTMAX_ALL, host, lambda x: x.float()))
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        assert a[0].dtype == dtype and a[1].dtype == idx.dtype


class _Recorder(StageBase):
    """A stage that counts the steps it wraps and reports them (``summary``), or reports nothing (``quiet``)."""

    def __init__(self, name, remaps_only=True, quiet=False):
        self.name, self.remaps_only, self.quiet, self.steps, self.bound = name, remaps_only, quiet, 0, 0

    def bind(self, plan, inner):
        self.bound += 1

        def run(plan, inputs):
            self.steps += 1
            return inner(plan, inputs)

        return run

    def summary(self):
        return None if self.quiet else {"steps": self.steps}

    def reset(self):
        self.steps = 0


@pytest.mark.parametrize("policy", ["none", "lynx"])
def test_the_stage_contract_binds_report_and_reset_in_one_place(policy):
    """``make_plan`` binds no ``remaps_only`` stage to a plan that keeps the routing (policy none), and binds one with
    ``remaps_only`` False to every plan; :func:`stage_report` reports each stage whose summary is not ``None`` by its
    name, :func:`reset_stages` zeroes them; the base's ``summary`` / ``reset`` / ``note`` are no-ops. The counts are
    the steps run (the oracle: two steps)."""
    from lynx_hf.core import keep_routing, reset_stages, stage_report

    around, always, quiet = _Recorder("around"), _Recorder("always", remaps_only=False), _Recorder("quiet", quiet=True)
    plan = make_plan(LynxConfig(policy=policy, routing_backend="torch"), MoELayer(8, 2, "cpu"),
                     stages=[around, always, quiet])
    keeps = policy == "none"
    assert (plan.kernel is keep_routing) == keeps and plan.keeps(4) == keeps
    assert [s.name for s in plan.stages] == (["always"] if keeps else ["around", "always", "quiet"])
    assert (around.bound, always.bound, quiet.bound) == ((0, 1, 0) if keeps else (1, 1, 1))
    logits = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    weights, idx = torch.softmax(logits, -1).topk(2, dim=-1)
    for _ in range(2):
        plan.run(StepInputs(Step(DECODE), logits, weights, idx, SOFTMAX_ALL, True))
    want = {"always": {"steps": 2}} if keeps else {"around": {"steps": 2}, "always": {"steps": 2}}
    assert stage_report(plan) == want and stage_report(None) == {}
    reset_stages(plan)
    reset_stages(None)
    assert all(v == {"steps": 0} for v in stage_report(plan).values())
    base = StageBase()
    assert base.summary() is None and base.reset() is None and base.note(4, 2, steps=3) is None
    with pytest.raises(NotImplementedError):
        base.bind(plan, None)
