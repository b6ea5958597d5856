"""The router-flatness probe and its warning (lynx_hf.flatness; issue 45 item 3): the two figures worked by hand,
the probe against telemetry and a torch reference, and the default configuration on a flat vs a peaked router of a
deep tiny Qwen2-MoE (8 MoE layers, 12 experts, top-3).

The end-to-end tests run the default policy with ``gate="always"``: at these tiny shapes the cost gate keeps the
model's own routing on a CPU (nothing is moved, so nothing is warned), and the warning is about what the policy does
where it runs. The default gate itself (``test_default_gate_warns_exactly_when_the_mass_moved_is_over_the_threshold``)
is forced on and off by decision tables, so both sides of the threshold are taken on any machine (issue 56)."""

import math
import warnings

import pytest
import torch

import lynx_hf
from lynx_hf import flatness, gate
from tests.helpers import families as fam


def test_top1_excess_share_by_hand():
    # k = 2: top-2 weights 3:1 -> w1 = 3/4 -> (3/4 - 1/2) / (1 - 1/2) = 1/2; equal top-2 -> 0
    # k = 3: weights 8:1:1 -> w1 = 0.8 -> (0.8 - 1/3) / (2/3) = 0.7
    s2 = torch.tensor([[math.log(3.0), 0.0, -5.0, -6.0], [1.0, 1.0, 0.0, -1.0]])
    idx2 = torch.tensor([[0, 1], [1, 0]])
    torch.testing.assert_close(flatness.top1_excess_share(s2, idx2), torch.tensor([0.5, 0.0]))
    s3 = torch.tensor([[math.log(8.0), 0.0, 0.0, -3.0]])
    torch.testing.assert_close(flatness.top1_excess_share(s3, torch.tensor([[0, 1, 2]])), torch.tensor([0.7]))
    assert flatness.top1_excess_share(s3, torch.tensor([[3]])).tolist() == [1.0]   # k = 1: nothing to be flat


def test_mass_moved_by_hand():
    # top-3 weights 8:1:1 (w = 0.8, 0.1, 0.1): keep {0, 1} + expert 3 (not its own) -> kept 0.9, moved 0.1;
    # keep {1, 2, 3} -> moved 0.8; its own three in another order -> 0
    s = torch.tensor([[math.log(8.0), 0.0, 0.0, -3.0]] * 3)
    idx = torch.tensor([[0, 1, 2]] * 3)
    new = torch.tensor([[0, 1, 3], [3, 2, 1], [2, 0, 1]])
    torch.testing.assert_close(flatness.mass_moved(s, idx, new), torch.tensor([0.1, 0.8, 0.0]))


def _deep(router_scale):
    """8 MoE layers (every layer sparse), 12 experts, top-3; routers scaled by ``router_scale`` (as ``fam.build``)."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2MoeConfig(**fam.COMMON, intermediate_size=48, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                         num_hidden_layers=8, num_experts=12, num_experts_per_tok=3, decoder_sparse_step=1,
                         mlp_only_layers=[])
    model = Qwen2MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.mul_(router_scale)
    return model


def _run(model, config, batch=8, new_tokens=flatness.STEPS + 1):
    ids, mask = fam.prompts(batch, 6, left_pad=False)
    lynx_hf.patch(model) if config is None else lynx_hf.patch(model, config)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=False)
    summary = lynx_hf.stats(model).summary()
    acc = [w for w in got if issubclass(w.category, lynx_hf.LynxAccuracyWarning)]
    lynx_hf.unpatch(model)
    return summary["per_layer"], acc


ALWAYS = lynx_hf.LynxConfig(gate="always")   # the default policy and parameters (module docstring: why the gate)


def test_flat_router_warns_once_with_both_figures_and_the_sweep_command():
    layers, acc = _run(_deep(0.5), ALWAYS)   # near-uniform routers: the default moves much mass in every layer
    moved = [lay["router_flatness"]["routing_mass_moved"] for lay in layers]
    assert len(moved) == 8 and sum(moved) > flatness.MOVED_THRESHOLD, moved
    assert len(acc) == 1, [str(w.message) for w in acc]
    msg = str(acc[0].message)
    assert f"moved {sum(moved):.2f} tokens' worth" in msg and "8 MoE layers" in msg and "lynx-hf sweep --model" in msg


def test_peaked_router_is_silent_and_the_figures_match_telemetry_and_a_torch_reference():
    model = _deep(20.0)
    seen = {}   # layer -> the router inputs of its decode steps ([B, H]: one token per row)

    def keep(i):
        return lambda mod, args: seen.setdefault(i, []).append(args[0].reshape(-1, args[0].shape[-1]).clone())

    hooks = [layer.mlp.gate.register_forward_pre_hook(keep(i)) for i, layer in enumerate(model.model.layers)]
    layers, acc = _run(model, ALWAYS)   # exactly STEPS decode steps: telemetry counts the probe's tokens
    for h in hooks:
        h.remove()
    assert acc == []
    k = model.config.num_experts_per_tok
    for i, lay in enumerate(layers):
        fig = lay["router_flatness"]
        assert fig["steps"] == flatness.STEPS
        # routing mass moved = 1 - telemetry's routing_mass_kept over the same decode tokens
        assert fig["routing_mass_moved"] == pytest.approx(1.0 - lay["routing_mass_kept"], abs=1e-5)
        # top-1 excess share: softmax over the router logits, the top-1's share of the top-k mass
        x = torch.cat([t for t in seen[i] if t.shape[0] == 8][: flatness.STEPS])
        p = (x @ model.model.layers[i].mlp.gate.weight.detach().T).float().softmax(-1).topk(k, dim=-1).values
        w1 = p[:, 0] / p.sum(-1)
        assert fig["top1_excess_share"] == pytest.approx(float(((w1 - 1 / k) / (1 - 1 / k)).mean()), rel=1e-5)
    assert sum(lay["router_flatness"]["routing_mass_moved"] for lay in layers) < flatness.MOVED_THRESHOLD


def test_nothing_moved_nothing_warned():
    # a single-row batch keeps each token's own top-k: its steps are not counted, nothing is warned
    layers, acc = _run(_deep(0.5), ALWAYS, batch=1)
    assert acc == [] and all(lay["router_flatness"]["steps"] == 0 for lay in layers)


def _table(model, path, on: bool) -> str:
    """A decision table holding the keys of ``model``'s gates under the default configuration, on (a saving of 4 x
    1 ms against 1 ms) or off (nothing saved) at every step size: the default's gate forced either way on any
    machine (``gate_table`` is not a policy field: the configuration stays the default the probe watches)."""
    lynx_hf.patch(model)
    table = gate.DecisionTable()
    for block in lynx_hf.patcher._state(model).blocks:
        d = gate.decide(1.0, 4.0 if on else 0.0, 1.0, margin=gate.TUNING.margin)
        table.put(gate.of(block.plan).key, {b: d for b in gate.BUCKETS}, "test table")
    lynx_hf.unpatch(model)
    return str(table.save(path))


@pytest.mark.parametrize("decisions", ["measured", "table_on", "table_off"])
def test_default_gate_warns_exactly_when_the_mass_moved_is_over_the_threshold(decisions, tmp_path):
    # the default configuration, gate "auto" included: a step the gate keeps the model's routing on moves nothing, and
    # the warning follows the figure. "measured": whatever this machine decided (on a CPU at this tiny shape: off, so
    # both sides read 0 and False); the tables force each side on any machine: on, the flat routers move more than
    # the threshold and it warns; off, the probe still counts every step (it sits above the gate) and reads 0
    model = _deep(0.5)
    table = None if decisions == "measured" else _table(model, tmp_path / "table.json", decisions == "table_on")
    layers, acc = _run(model, None if table is None else lynx_hf.LynxConfig(gate_table=table))
    moved = sum(lay["router_flatness"]["routing_mass_moved"] for lay in layers)
    assert all(lay["router_flatness"]["steps"] == flatness.STEPS for lay in layers)
    assert (len(acc) == 1) == (moved > flatness.MOVED_THRESHOLD), (moved, acc)
    if decisions == "table_on":
        assert moved > flatness.MOVED_THRESHOLD and len(acc) == 1
        assert all(lay["gate"]["source"] == f"table {table}" for lay in layers)
    elif decisions == "table_off":
        assert moved == pytest.approx(0.0, abs=1e-5) and acc == []   # 1 - a sum of fp32 weights: ~1e-8 per layer


def test_a_configuration_the_user_chose_is_not_probed():
    for config in (lynx_hf.LynxConfig(gate="always", mass_price=0.25),
                   lynx_hf.LynxConfig(gate="always", policy="oea", oea_k0=2)):
        layers, acc = _run(_deep(0.5), config)
        assert acc == [] and not any("router_flatness" in lay for lay in layers)


def test_the_warning_fires_once_per_patch():
    """Once per patch: not again on a second generate, nor after ``patched(model, policy="none")`` and back (what
    ``lynx-hf generate`` does for its reference): the way back makes each layer's probe stage anew, and their figures
    reach the model's probe again (every layer measured its steps again), which has warned already; a new patch
    warns again."""
    model = _deep(0.5)
    ids, mask = fam.prompts(8, 6, left_pad=False)

    def generate():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=flatness.STEPS + 2,
                       min_new_tokens=flatness.STEPS + 2, do_sample=False)

    def warned(got):
        return sum(issubclass(w.category, lynx_hf.LynxAccuracyWarning) for w in got)

    lynx_hf.patch(model, ALWAYS)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        for _ in range(2):
            generate()
        with lynx_hf.patched(model, policy="none"):
            generate()
        generate()
        steps = [lay["router_flatness"]["steps"] for lay in lynx_hf.stats(model).summary()["per_layer"]]
    assert warned(got) == 1
    assert steps == [flatness.STEPS] * 8   # the stages made on the way back measured (and reached the guard)
    lynx_hf.unpatch(model)
    lynx_hf.patch(model, ALWAYS)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        generate()
    lynx_hf.unpatch(model)
    assert warned(got) == 1


def test_a_layer_that_never_runs_does_not_keep_the_warning_off():
    """Issue 53: four registered layers, three of which run (each step: 2 live decode tokens, top-3 weights 8:1:1, the
    policy keeping experts {3, 2, 1}: moved 1 - (0.1 + 0.1) = 0.8 per token, top-1 excess share (0.8 - 1/3) / (2/3)
    = 0.7), the fourth never (vision experts on text). After DECIDE_AFTER decode steps the figures are taken over the
    three that ran: moved 3 x 0.8 = 2.4 > MOVED_THRESHOLD, so the warning fires, once, naming "3 of its 4". Before:
    the probe waited for the fourth layer's steps forever, no figure, no warning."""
    from types import SimpleNamespace

    from lynx_hf.core import DECODE, Routed, Step, StepInputs, WeightRule

    probe = flatness.ModelFlatness("the test model")
    plan = SimpleNamespace(kernel=object())   # a plan that remaps (not keep_routing)
    scores = torch.tensor([[math.log(8.0), 0.0, 0.0, -3.0]] * 2)
    own, kept = torch.tensor([[0, 1, 2]] * 2), torch.tensor([[3, 2, 1]] * 2)
    inputs = StepInputs(Step(DECODE), scores, torch.full((2, 3), 1 / 3), own, WeightRule("softmax_all"), True)
    runs = [flatness.FlatnessStage(probe, f"layer{i}").bind(plan, lambda p, x: Routed(x.weights, kept))
            for i in range(3)]
    flatness.FlatnessStage(probe, "vision").bind(plan, lambda p, x: Routed(x.weights, kept))   # never runs
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        for step in range(flatness.DECIDE_AFTER):
            assert probe.figures is None, step
            for run in runs:
                run(plan, inputs)
        for run in runs:  # later steps: nothing more
            run(plan, inputs)
    assert probe.figures is not None
    assert probe.figures["layers"] == 3 and probe.figures["registered"] == 4
    assert probe.figures["moved"] == pytest.approx(2.4) and probe.figures["share"] == pytest.approx(0.7)
    acc = [w for w in got if issubclass(w.category, lynx_hf.LynxAccuracyWarning)]
    assert len(acc) == 1 and "moved 2.40 tokens' worth" in str(acc[0].message) and "3 of its 4" in str(acc[0].message)
