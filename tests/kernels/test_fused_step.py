"""The fused device decode step (kernels/fused_step.py: one Triton launch per MoE layer-step, interpreted here) returns
what the step-by-step torch path returns: ``core.remap`` (selection scores of the family, the policy's critical set,
remap, weight rule, merge) followed by ``core.record_step`` (the telemetry row), run inside ``strict_sync_free()``
(the accelerator code path, torch ops only). Same ids exactly, same telemetry counts exactly, weights and routing mass
within fp32 rounding; for every policy (the default, the paper rule, OEA, XShare, keep), every selection rule the
families use (logits, DeepSeek-V2 group-limited, selection bias with and without groups, scores computed outside),
masks (decode / live rows, padding rows with id -1, a seed), ties and forbidden experts, non-finite rows, the counting
mode and verify steps. Outputs are written whole (``torch.empty`` poisoned)."""

import math
import threading

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from helpers.strategies import fuzz, planted_ties, routing_scores, tied_topk
from lynx_hf import core
from lynx_hf.config import LynxConfig
from lynx_hf.kernels import fused_step as fs
from lynx_hf.kernels import routing_torch as rt
from lynx_hf.kernels.step_spec import FusedPolicy, FusedSelection
from lynx_hf.selection import BiasedSelection
from lynx_hf.telemetry import BlockTelemetry
from lynx_hf.vllm.rows import without_padding

POLICIES = [("lynx", {}), ("lynx", {"mass_price": None}), ("oea", {}), ("xshare", {"xshare_warmup": 1}),
            ("lynx", {"price_unit": "sqrt"}), ("none", {})]


def plan_for(policy, kw, n, k):
    """The CPU torch plan of the policy (the reference's parameters) and its fused step (what make_plan gives the
    Triton backend: ``Policy.device_policy``, ``"keep"`` for a plan that keeps the routing)."""
    plan = core.make_plan(LynxConfig(policy=policy, **kw), core.MoELayer(n, k, "cpu"))
    keeps = plan.kernel is core.keep_routing
    described = FusedPolicy("keep") if keeps else plan.policy.device_policy(plan.params)
    return plan, fs.FusedStep(described, n, k), keeps


def reference(plan, keeps, rule, step, scores, logits, weights, idx, seed, pad, mode):
    """core.remap + core.record_step on the accelerator path; vLLM's padding rows as the plugin's stage treats them."""
    rstep, ridx = (step, idx) if pad is None else without_padding(step, idx, pad)
    tel = BlockTelemetry(mode)
    with rt.strict_sync_free():
        if keeps:
            new_w, new_i, finite = weights, ridx, None
        else:
            new_w, new_i, finite = core.remap(plan, rule, rstep, scores, logits, weights, ridx, host=False, seed=seed)
        core.record_step(tel, scores.shape[1], rstep, ridx, weights, new_i, finite, host=False, masks=False)
    if pad is not None:
        new_i = torch.where(pad[:, None], idx, new_i.to(idx.dtype))
        new_w = torch.where(pad[:, None], weights, new_w)
    return new_w, new_i, tel.acc


def group_limited_scores(logits, n_group, topk_group):
    """DeepSeek-V2 ``group_limited_greedy`` selection scores, as the HF router computes its groups."""
    n = logits.shape[1]
    probs = logits.float().softmax(dim=-1)
    group_scores = probs.view(-1, n_group, n // n_group).max(dim=-1).values
    chosen = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, chosen, True)
    return logits.float().masked_fill(~mask.repeat_interleave(n // n_group, dim=-1), float("-inf"))


def draw_case(seed):
    """One drawn layer-step: shape, selection rule, weight rule, router logits, the model's own top-k by the
    selection, masks, seed, padding, telemetry mode."""
    g = torch.Generator().manual_seed(seed)
    n_group = (1, 2, 4, 8)[seed % 4]
    per_group = int(torch.randint(2, 9, (1,), generator=g))
    n = n_group * per_group
    topk_group = int(torch.randint(1, n_group + 1, (1,), generator=g))
    k = int(torch.randint(1, min(8, topk_group * per_group - 1, n - 1) + 1, (1,), generator=g))
    t = int(torch.randint(1, 40, (1,), generator=g))
    logits = (torch.randn(t, n, generator=g) * 2).to((torch.float32, torch.bfloat16)[seed % 2])
    kind = ("group", "sigmoid", "softmax", "logits", "plain")[seed % 5 if n_group > 1 else 3 + seed % 2]
    bias = torch.randn(n, generator=g) * 0.1
    if kind == "plain":
        selection, scores, b = fs.LOGITS, logits.float(), None
        rule = core.WeightRule("softmax_all", renormalize=bool(seed % 3))
    elif kind == "group":
        selection = FusedSelection("group_softmax_max", n_group=n_group, topk_group=topk_group)
        scores, b = group_limited_scores(logits, n_group, topk_group), None
        rule = core.WeightRule("softmax_all", scale=2.5)
    else:
        group_score = "top2_sum" if seed % 3 else "max"
        biased = BiasedSelection(kind, "router", "bias", n_group, topk_group, group_score)
        scores, b = biased.selection_scores(logits, bias), bias
        selection = biased.fused()
        rule = core.WeightRule("sigmoid", renormalize=True, scale=1.5) if kind == "sigmoid" else \
            core.WeightRule("softmax_chosen")
    idx = scores.topk(k, dim=-1).indices
    if seed % 5 == 0:
        idx = idx.to(torch.int32)
    weights = torch.softmax(logits.float(), -1).gather(1, idx.long()).to(logits.dtype)
    live = torch.rand(t, generator=g) > 0.2 if seed % 2 else None
    decode = torch.rand(t, generator=g) > 0.25 if seed % 3 == 0 else None
    verify = seed % 8 == 3
    kind_of = core.VERIFY if verify else core.MIXED if decode is not None else core.DECODE
    step = core.Step(kind_of, decode=decode, live=live)
    pad = None
    if seed % 7 == 0 and t > 2:
        pad = torch.zeros(t, dtype=torch.bool)
        pad[-1] = True
    seed_mask = torch.rand(n, generator=g) > 0.8 if seed % 4 == 1 else None
    mode = "counts" if seed % 6 == 5 else "full"
    return dict(n=n, k=k, logits=logits, scores=scores, selection=selection, bias=b, rule=rule, idx=idx,
                weights=weights, step=step, pad=pad, seed=seed_mask, mode=mode)


def run_fused(step_fn, c, scores=None):
    idx = c["idx"] if c["pad"] is None else c["idx"].masked_fill(c["pad"][:, None], -1)
    acc = torch.zeros(13, dtype=torch.float64)
    rule, step = c["rule"], c["step"]
    kw = dict(selection=c["selection"], bias=c["bias"]) if scores is None else dict(scores=scores)
    w, i = step_fn(c["logits"], c["weights"], idx, rule.kind, rule.renormalize, rule.scale, rule.renorm_eps,
                   decode=step.decode, live=step.live, seed=c["seed"], acc=acc, counts_only=c["mode"] == "counts",
                   verify=step.kind == core.VERIFY, **kw)
    if c["pad"] is not None:
        assert (i[c["pad"]] == -1).all()  # padding rows come back as they came
        i = torch.where(c["pad"][:, None], c["idx"], i)
    return w, i, acc


def assert_same(out, ref, keeps=False):
    (w, i, acc), (rw, ri, racc) = out, ref
    assert i.dtype == ri.dtype and torch.equal(i, ri)
    assert w.dtype == rw.dtype
    torch.testing.assert_close(w.float(), rw.float(), rtol=1e-2 if w.dtype == torch.bfloat16 else 1e-5, atol=1e-6)
    if w.dtype == torch.bfloat16 and w.numel() >= 20:  # rounded to nearest even as torch's cast (not truncated):
        assert (w == rw).float().mean() >= 0.95  # only an fp32 ulp apart at a bf16 rounding boundary may differ
    counts = [s for s in range(13) if s != 5]  # every slot but the routing mass is a count: exact
    assert torch.equal(acc[counts], racc[counts]), (acc.tolist(), racc.tolist())
    torch.testing.assert_close(acc[5], racc[5], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", range(36))
def test_fused_step_equals_the_step_by_step_path(seed, poisoned_empty):
    c = draw_case(seed)
    for policy, kw in POLICIES:
        plan, step_fn, keeps = plan_for(policy, kw, c["n"], c["k"])
        ref = reference(plan, keeps, c["rule"], c["step"], c["scores"], c["logits"], c["weights"], c["idx"],
                        c["seed"], c["pad"], c["mode"])
        assert_same(run_fused(step_fn, c), ref)


def test_the_drawn_cases_remap():
    """The cases above are no identity: the default policy changes the routing in most of them."""
    changed = 0
    for seed in range(36):
        c = draw_case(seed)
        _, step_fn, _ = plan_for("lynx", {}, c["n"], c["k"])
        changed += int(not torch.equal(run_fused(step_fn, c)[1].long(), c["idx"].long()))
    assert changed >= 18, changed


@pytest.mark.parametrize("seed", [1, 2, 6])
def test_scores_computed_outside_the_kernel(seed):
    """A selection rule the kernel does not know: the caller's scores (``FusedSelection("scores")``)."""
    c = draw_case(seed)
    plan, step_fn, keeps = plan_for("lynx", {}, c["n"], c["k"])
    ref = reference(plan, keeps, c["rule"], c["step"], c["scores"], c["logits"], c["weights"], c["idx"], c["seed"],
                    c["pad"], c["mode"])
    assert_same(run_fused(step_fn, c, scores=c["scores"].contiguous()), ref)


@fuzz(0.5)
@given(routing_scores(tokens=(1, 12), experts=(3, 24), max_k=5, k_below_n=True), st.sampled_from(range(5)),
       st.sampled_from(["softmax_all", "softmax_chosen", "sigmoid"]), st.data())
def test_ties_and_forbidden_experts(drawn, which, rule_kind, data):
    """Grid values (exact ties, C12), ``-inf`` experts the model forbids, any k, the model's own top-k taking tied
    experts lower id first or in a drawn order (as ``torch.topk`` may): the same integers."""
    scores, idx, k = drawn
    n = scores.shape[1]
    if data.draw(st.booleans(), label="own ties in a drawn order"):
        idx = tied_topk(scores, k, torch.tensor(data.draw(st.permutations(range(n)), label="tie order")))
    policy, kw = POLICIES[which]
    plan, step_fn, keeps = plan_for(policy, kw, n, k)
    logits = torch.where(torch.isfinite(scores), scores, torch.full_like(scores, -40.0))
    weights = torch.softmax(logits, -1).gather(1, idx)
    rule = core.WeightRule(rule_kind)
    c = dict(logits=logits, weights=weights, idx=idx, rule=rule, step=core.Step(core.DECODE), seed=None, pad=None,
             mode="full", selection=fs.LOGITS, bias=None)
    ref = reference(plan, keeps, rule, c["step"], scores, logits, weights, idx, None, None, "full")
    # the forbidden experts as the family's selection marks them (-inf scores), not as logits
    assert_same(run_fused(step_fn, c, scores=scores), ref)
    out_idx = run_fused(step_fn, c, scores=scores)[1]
    assert (out_idx.sort(-1).values.diff(dim=-1) > 0).all()  # k distinct experts per row
    assert torch.isfinite(scores.gather(1, out_idx)).all()  # never a forbidden one


@pytest.mark.parametrize("case", ["zeros", "planted ties"])
@pytest.mark.parametrize("t,n,k", [(3, 8, 2), (6, 12, 3)])
def test_ties_keep_the_tokens_own_experts(case, t, n, k):
    """Exact ties (all-zero router logits, the new-user finding of docs/guarantees.md; ties planted across each row's
    top-k boundary, some experts forbidden by the selection) with the model's own top-k from ``torch.topk`` (tied
    experts in its own order, not lower id first): in the one-launch step OEA with ``oea_k0 = k`` and XShare with a
    budget of N (warm-up 0, 1, k) give each token its own set exactly (OEA's top-k0, XShare's warm-up and the remap
    take ties -> the token's own experts, then lower id), LYNX (default, paper rule) and OEA ``oea_k0 = 1`` k distinct
    allowed experts; every policy the step-by-step path's ids and counts."""
    scores = torch.zeros(t, n) if case == "zeros" else planted_ties(t, n, k, seed=n * 100 + t)
    own = torch.topk(scores, k).indices
    lower_first = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
    assert not torch.equal(own.sort(1).values, lower_first.sort(1).values)  # the subject: not lower id first
    logits = torch.where(torch.isfinite(scores), scores, torch.full_like(scores, -40.0))
    weights = torch.softmax(logits, -1).gather(1, own)
    rule = core.WeightRule("softmax_all")
    c = dict(logits=logits, weights=weights, idx=own, rule=rule, step=core.Step(core.DECODE), seed=None, pad=None,
             mode="full", selection=fs.LOGITS, bias=None)
    identity = [("oea", {"oea_k0": k})] + [("xshare", {"xshare_budget": n, "xshare_warmup": w}) for w in (0, 1, k)]
    others = [("lynx", {}), ("lynx", {"mass_price": None}), ("oea", {"oea_k0": 1})]
    for policy, kw in identity + others:
        plan, step_fn, keeps = plan_for(policy, kw, n, k)
        ref = reference(plan, keeps, rule, c["step"], scores, logits, weights, own, None, None, "full")
        out = run_fused(step_fn, c, scores=scores)
        assert_same(out, ref)
        new = out[1]
        assert (new.sort(-1).values.diff(dim=-1) > 0).all() and torch.isfinite(scores.gather(1, new)).all()
        if (policy, kw) in identity:
            assert [set(r) for r in new.tolist()] == [set(r) for r in own.tolist()], (policy, kw)
            assert out[2][3] == 0  # telemetry: no assignment remapped


def test_shift_invariance():
    """C13: every logit negative, or all shifted by -1000: the same ids and counts."""
    c = draw_case(4)
    plan, step_fn, _ = plan_for("lynx", {}, c["n"], c["k"])
    base = run_fused(step_fn, c)
    shifted = dict(c, logits=c["logits"].float() - 1000.0, weights=c["weights"].float())
    out = run_fused(step_fn, shifted)
    assert torch.equal(out[1], base[1])
    assert torch.equal(out[2][[0, 1, 2, 6]], base[2][[0, 1, 2, 6]])


def test_non_finite_rows_keep_their_routing_and_count_as_fallbacks():
    c = draw_case(8)
    logits = c["logits"].float().clone()
    logits[0, 0] = math.inf
    logits[2, 1] = math.nan
    c = dict(c, logits=logits, weights=c["weights"].float(), scores=logits)
    plan, step_fn, keeps = plan_for("lynx", {}, c["n"], c["k"])
    ref = reference(plan, keeps, c["rule"], c["step"], logits, logits, c["weights"], c["idx"], c["seed"], c["pad"],
                    c["mode"])
    out = run_fused(step_fn, c)
    assert_same(out, ref)
    assert torch.equal(out[1][[0, 2]], c["idx"][[0, 2]])
    assert out[2][7] == 1.0  # the fallback slot


def test_no_live_row_votes_nothing_and_counts_nothing():
    c = draw_case(9)
    t = c["idx"].shape[0]
    c = dict(c, step=core.Step(core.DECODE, live=torch.zeros(t, dtype=torch.bool)), pad=None, seed=None)
    plan, step_fn, keeps = plan_for("lynx", {}, c["n"], c["k"])
    ref = reference(plan, keeps, c["rule"], c["step"], c["scores"], c["logits"], c["weights"], c["idx"], None, None,
                    c["mode"])
    out = run_fused(step_fn, c)
    assert_same(out, ref)
    assert out[2][0] == 0 and out[2][10] == t  # no decode step counted; every row a finished one


def test_buffers_are_reused_per_size_and_thread():
    """No allocation after a step size's first step on a thread; another thread gets its own buffers (C18)."""
    c = draw_case(10)
    _, step_fn, _ = plan_for("lynx", {}, c["n"], c["k"])
    first = run_fused(step_fn, c)
    second = run_fused(step_fn, c)
    assert second[1].data_ptr() == first[1].data_ptr() and torch.equal(second[1], first[1])
    other = {}
    thread = threading.Thread(target=lambda: other.setdefault("out", run_fused(step_fn, c)))
    thread.start()
    thread.join()
    assert other["out"][1].data_ptr() != first[1].data_ptr() and torch.equal(other["out"][1], first[1])
    for size in range(1, fs.MAX_SIZES + 3):  # a bounded number of step sizes is kept
        cut = dict(c, logits=c["logits"][:size], weights=c["weights"][:size], idx=c["idx"][:size],
                   step=core.Step(core.DECODE), pad=None)
        if cut["idx"].shape[0] == size:
            run_fused(step_fn, cut)
    assert len(step_fn._local.cache) <= fs.MAX_SIZES


def test_keep_returns_the_models_tensors_and_records():
    c = draw_case(11)
    _, step_fn, keeps = plan_for("none", {}, c["n"], c["k"])
    assert keeps
    acc = torch.zeros(13, dtype=torch.float64)
    w, i = step_fn(c["logits"], c["weights"], c["idx"], decode=c["step"].decode, live=c["step"].live, acc=acc)
    assert w is c["weights"] and i is c["idx"]
    assert acc[0] == 1.0 and acc[1] == acc[2] > 0
    assert step_fn(c["logits"], c["weights"], c["idx"])[1] is c["idx"]  # no telemetry: no launch at all


def test_bad_arguments_are_value_errors():
    with pytest.raises(ValueError, match="top_k"):
        fs.FusedStep(FusedPolicy("lynx_mass", 1.0, 2), 8, 8)
    with pytest.raises(ValueError, match="kind"):
        FusedPolicy("greedy")
    with pytest.raises(ValueError, match="topk_group"):
        FusedSelection("biased", n_group=2, topk_group=3)
    step_fn = fs.FusedStep(FusedPolicy("oea", k0=1), 8, 2)
    logits = torch.randn(3, 8)
    w, i = torch.softmax(logits, -1).topk(2)
    with pytest.raises(ValueError, match="weight rule"):
        step_fn(logits, w, i, "softmax_everything")


def test_the_launch_torch_compile_traces_equals_the_eager_one(monkeypatch):
    """While ``torch.compile`` traces (transformers' compiled static-cache generate on a GPU) the step launches the
    kernel through its one-config autotuner (its launch options as a config, as the routing kernels do) into fresh
    outputs: the same routing and telemetry as the eager launch."""
    c = draw_case(13)
    _, step_fn, _ = plan_for("lynx", {}, c["n"], c["k"])
    eager = [x.clone() for x in run_fused(step_fn, c)]
    launches = []
    real = fs._FUSED_TRACED.run
    monkeypatch.setattr(fs._FUSED_TRACED, "run", lambda *a, **k: launches.append(k) or real(*a, **k))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    traced = run_fused(step_fn, c)
    assert launches and "num_warps" not in launches[0]
    assert traced[1].data_ptr() != eager[1].data_ptr()  # fresh outputs: the graph owns its memory
    assert_same(traced, eager)


def test_a_launch_captured_into_a_cuda_graph_keeps_its_buffers(monkeypatch):
    """A size captured into a CUDA graph (a vLLM engine's captured sizes) is never evicted: the graph replays into its
    buffers, which must stay allocated whatever other sizes run later."""
    c = draw_case(10)
    _, step_fn, _ = plan_for("lynx", {}, c["n"], c["k"])
    monkeypatch.setattr(fs, "_capturing", lambda t: True)
    captured = run_fused(step_fn, c)[1]
    monkeypatch.setattr(fs, "_capturing", lambda t: False)
    for size in range(1, fs.MAX_SIZES + 3):  # more eager sizes than the cache keeps
        if size != c["idx"].shape[0]:
            run_fused(step_fn, dict(c, logits=c["logits"][:size], weights=c["weights"][:size],
                                    idx=c["idx"][:size], step=core.Step(core.DECODE), pad=None))
    assert len(step_fn.pinned) == 1
    again = run_fused(step_fn, c)[1]
    assert again.data_ptr() == captured.data_ptr()  # the captured size's buffers, still the same memory


def test_C18_two_threads_launching_at_once():
    """Two threads stepping one layer at once (C18): each gets its own buffers and the routing single-threaded calls
    give; the interpreter's launches take turns (it patches ``triton.language`` per launch: two at once failed with
    "Did you forget to add @triton.jit?" in about one run of three)."""
    c = draw_case(12)
    _, step_fn, _ = plan_for("lynx", {}, c["n"], c["k"])
    want = run_fused(step_fn, c)[1].clone()
    errors, results = [], []

    def work():
        try:
            for _ in range(20):
                results.append(run_fused(step_fn, c)[1].clone())
        except Exception as exc:  # noqa: BLE001 - collected, asserted below
            errors.append(repr(exc))

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert len(results) == 40 and all(torch.equal(r, want) for r in results)


def test_n8_a_warm_up_keeps_every_captured_sizes_buffers_for_the_captures(monkeypatch):
    """Issue 54 N8: the vLLM plugin's warm-up before the first CUDA-graph capture launches the step once at every
    captured size (a vLLM engine captures tens of sizes, more than :data:`MAX_SIZES`) inside ``fused_step.pinning()``:
    each size's launch is kept, so the captures that follow (largest first) find their buffers made and make none."""
    c = draw_case(10)
    _, step_fn, _ = plan_for("lynx", {}, c["n"], c["k"])
    sizes = list(range(fs.MAX_SIZES + 4, 0, -1))
    made = []
    real = fs._Buffers
    monkeypatch.setattr(fs, "_Buffers", lambda *a, **k: made.append(a[0]) or real(*a, **k))

    def run(size):
        step = core.Step(core.MIXED, decode=c["step"].decode[:size] if c["step"].decode is not None else None,
                         live=c["step"].live[:size] if c["step"].live is not None else None)
        return run_fused(step_fn, dict(c, logits=c["logits"][:size], weights=c["weights"][:size], idx=c["idx"][:size],
                                       step=step, pad=None))[1]

    sizes = [t for t in sizes if t <= c["idx"].shape[0]]
    assert len(sizes) > fs.MAX_SIZES
    # without it (eager launches, least recently used dropped past MAX_SIZES) the first captures make buffers anew
    for t in sizes:
        run(t)
    monkeypatch.setattr(fs, "_capturing", lambda t: True)
    made.clear()
    run(sizes[0])
    assert made == [sizes[0]]
    monkeypatch.setattr(fs, "_capturing", lambda t: False)
    _, step_fn, _ = plan_for("lynx", {}, c["n"], c["k"])
    made.clear()
    with fs.pinning():
        warmed = {t: run(t).data_ptr() for t in sizes}
    assert sorted(made) == sorted(sizes) and len(step_fn.pinned) == len(sizes)
    made.clear()
    monkeypatch.setattr(fs, "_capturing", lambda t: True)  # the captures, largest first
    captured = {t: run(t).data_ptr() for t in sizes}
    assert made == [] and captured == warmed


@pytest.mark.parametrize("policy,kw", [("lynx", {}), ("oea", {}), ("xshare", {"xshare_warmup": 1})],
                         ids=["lynx", "oea", "xshare"])
def test_n5_a_replayed_mixed_or_prefill_only_step_runs_the_policy_on_its_decode_rows_tiles_only(policy, kw,
                                                                                              monkeypatch):
    """Issue 54 N5 (cases C68): a CUDA graph captured at T tokens replays mixed and prefill-only steps of that size too
    (vLLM's piecewise graphs), with the rows' kinds read from the step mask on the device. The fused step computes the
    selection scores and the remap only in the tiles of rows that hold a decode row (vLLM puts the decode requests
    first); a prefill-only step computes none and returns the model's routing, counting no step. Counted by the calls
    of the kernel's selection-score helper (interpreted here), the results equal the step-by-step reference."""
    n, k, t = 8, 2, 160
    plan, step_fn, keeps = plan_for(policy, kw, n, k)
    g = torch.Generator().manual_seed(54)
    logits = torch.randn(t, n, generator=g) * 2
    idx = logits.topk(k, dim=-1).indices
    weights = torch.softmax(logits, -1).gather(1, idx)
    block_t = max(1, min(64, fs.TILE.get("lynx_mass", 1024) // 8))
    calls = []
    real = fs._selection_scores
    monkeypatch.setattr(fs, "_selection_scores", lambda *args: calls.append(1) or real(*args))
    rule = core.WeightRule("softmax_all", renormalize=True)
    for decode_rows in (20, 0, t):
        decode = torch.arange(t) < decode_rows
        step = core.Step(core.MIXED, decode=decode)
        c = dict(logits=logits, weights=weights, idx=idx, selection=fs.LOGITS, bias=None, rule=rule, step=step,
                 pad=None, seed=None, mode="full")
        calls.clear()
        out = run_fused(step_fn, c)
        tiles = -(-t // block_t)
        assert len(calls) == -(-decode_rows // block_t) < tiles or decode_rows == t and len(calls) == tiles
        assert_same(out, reference(plan, keeps, rule, step, logits.float(), logits, weights, idx, None, None, "full"))
        if decode_rows == 0:
            assert torch.equal(out[1], idx) and torch.equal(out[0], weights) and out[2][0] == 0  # no step counted
