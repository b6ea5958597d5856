"""The vLLM plugin's cost-gate plumbing that needs no vLLM (issue 56): the agreement of each tensor-parallel group on its
own rank 0's decisions (``lynx_hf.vllm.ranks.agree``), the bypassed layers' count of the steps they skip
(``lynx_hf.vllm.bypass.skip_bypassed`` / ``flush_skips``) and the depth a layer's plan scales its price with (the
target's MoE layers, not the drafter's). ``lynx_hf.vllm.ranks``, ``plans`` and ``state`` import no vLLM, so these run
on the newest leg (``tests/vllm_plugin`` runs only where vLLM is installed); the group is a stand-in with the
semantics of vLLM's ``GroupCoordinator.broadcast_object`` (``vllm/distributed/parallel_state.py``: ``src`` is the
rank *in the group*, ``src < world_size`` asserted, the rank whose ``rank_in_group == src`` sends)."""

import dataclasses
import types

import pytest
import torch

import lynx_hf
import lynx_hf.gate.stage as gs
from lynx_hf import gate
from lynx_hf.core import MoELayer, WeightRule, make_plan
from lynx_hf.vllm import bypass, plans, ranks, state
from lynx_hf.vllm import config as plugin_config

MARGIN = gate.TUNING.margin
RULE = WeightRule("softmax_all", renormalize=True)


def _decisions(on_from: int) -> dict:
    """On at the buckets >= ``on_from`` (a saving of 4 x 1 ms against 1 ms), off below (nothing saved)."""
    return {b: gate.decide(1.0, 4.0 if b >= on_from else 0.0, 1.0, margin=MARGIN) for b in gate.BUCKETS}


class StandInGroup:
    """vLLM's tensor-parallel ``GroupCoordinator`` as ``ranks.agree`` uses it: ``ranks`` (the global ranks of the
    group), ``rank`` (this process's global rank), ``rank_in_group``, ``world_size`` (the group's size) and
    ``broadcast_object(obj, src=0)`` with vLLM's semantics; the ranks of one group share ``channel``."""

    def __init__(self, channel: dict, members: tuple, rank: int) -> None:
        self.channel, self.ranks, self.rank = channel, list(members), rank
        self.world_size, self.rank_in_group = len(members), members.index(rank)

    def broadcast_object(self, obj=None, src: int = 0):
        assert src < self.world_size, f"Invalid src rank ({src})"  # vLLM's own check: src is a rank in the group
        if self.rank_in_group == src:
            self.channel[tuple(self.ranks)] = obj
            return obj
        return self.channel[tuple(self.ranks)]


def _rank_entries(on_from: int):
    """One rank's MoE layers: two plans, each holding a cost gate with its own (this rank's) decisions."""
    entries = []
    for name in ("layers.0.mlp", "layers.1.mlp"):
        plan = make_plan(lynx_hf.LynxConfig(policy="lynx", gate="always"), MoELayer(8, 2, "cpu"))
        g = gate.PlanGate(gate.LayerShape(8, 2, 16, 8), plan=plan, decisions=_decisions(on_from),
                          source=f"measured on_from={on_from}")
        entries.append((name, dataclasses.replace(plan, stages=(g,))))
    return entries


@pytest.mark.parametrize("groups", [((0, 1), (2, 3)), ((0, 1, 2, 3), (4, 5, 6, 7))],
                         ids=["dp2_tp2", "pp2_tp4"])
def test_each_tensor_parallel_group_agrees_on_its_own_rank_0_not_the_worlds(groups):
    """DP x TP (and PP x TP) engines: every tensor-parallel group but the first has no global rank 0. Each group's
    rank in group 0 sends its decisions and every rank of that group adopts them. Here each global rank measured
    differently (global rank r is on from bucket 2^r): after the agreement every rank of a group holds its first
    member's decisions. Were the sender chosen by the global rank, the second group would send nothing (its engine
    refused) or take another group's decisions."""
    cfg = plugin_config.parse({"policy": "lynx", "gate": "auto"})
    channel, held = {}, {}
    for members in groups:
        for rank in members:  # the sender first: the stand-in's broadcast does not block
            entries = _rank_entries(on_from=2 ** rank)
            group = StandInGroup(channel, members, rank)
            assert ranks.agree(entries, cfg, len(members), group=group) == 2
            held[rank] = [gate.of(plan) for _, plan in entries]
    for members in groups:
        first = members[0]
        for rank in members:
            for g in held[rank]:
                want = {b: d.to_dict() for b, d in _decisions(2 ** first).items()}  # nan-free: None
                assert {b: d.to_dict() for b, d in g.decisions.items()} == want, (members, rank)
                assert g.source == f"rank 0 of {len(members)} tensor-parallel ranks: measured on_from={2 ** first}"
                # the decisions route: on exactly from the sender's first bucket
                assert [g.on(b) for b in gate.BUCKETS] == [b >= 2 ** first for b in gate.BUCKETS]


def _runner():
    """What ``plans.before_forward`` reads of a model runner: an eager CPU runner of fp32."""
    return types.SimpleNamespace(device="cpu", model_config=types.SimpleNamespace(dtype=torch.float32,
                                                                                  enforce_eager=True))


def _layer(index: int, drafter: bool = False) -> state.Layer:
    return state.Layer(index=index, name=f"{'drafter' if drafter else 'model'}.layers.{index}.mlp", top_k=2,
                       num_experts=8, rule=RULE, drafter=drafter, gate_shape=gate.LayerShape(8, 2, 16, 8))


def test_bypassed_layers_count_every_step_they_skip(monkeypatch, fresh_gate_store):
    """A layer the gate keeps off at every step size is bypassed (vLLM's routing without the op); its gate counts the
    steps it skipped, kept once per step (``STATE.pending_skips``) and counted into the gate when read. Hand count:
    3 steps of 8 tokens, 2 of 16 (4 decode rows), read, then 2 more of 8: 5 at 8, 2 at 16, 7 in all."""
    monkeypatch.setattr(gs, "measure_layer", lambda planned, expert_times, tuning=gate.TUNING: _decisions(10 ** 6))
    with state.isolated({"policy": "lynx", "gate": "auto"}, capacity=64) as st:
        st.layers.extend([_layer(0), _layer(1)])
        plans.before_forward(_runner())
        assert all(layer.bypass for layer in st.layers) and st.all_bypassed
        for _ in range(3):
            bypass.skip_bypassed(8, 8)
        for _ in range(2):
            bypass.skip_bypassed(16, 4)
        first = bypass.gate_summary(st.layers[0])
        assert first["steps_skipped"] == 5 and first["by_tokens"][8]["steps_skipped"] == 3
        assert first["by_tokens"][16]["steps_skipped"] == 2 and first["bypassed"] is True
        for _ in range(2):
            bypass.skip_bypassed(8, 8)
        for layer in st.layers:  # every bypassed layer counts every step, the first read's included once
            s = bypass.gate_summary(layer)
            assert s["steps_skipped"] == 7 and s["by_tokens"][8]["steps_skipped"] == 5
            assert s["by_tokens"][16]["steps_skipped"] == 2
            assert gate.of(layer.plan).seen == {8: 5, 16: 2}


def test_a_drafters_moe_layers_do_not_deepen_the_targets_plans():
    """The routing-mass price scales with the model's depth (``LynxConfig.price_ref_layers`` = 4: mass_price x 4 / L);
    L is the target's MoE layers in this process, not the drafter's (an MTP / EAGLE head runs after the step with
    vLLM's routing and gets no plan). 6 target layers beside 2 drafter layers: 0.109375 x 4 / 6 (not / 8)."""
    with state.isolated({"policy": "lynx", "gate": "always"}, capacity=64) as st:
        st.layers.extend([_layer(i) for i in range(6)] + [_layer(6 + i, drafter=True) for i in range(2)])
        plans.before_forward(_runner())
        targets = [layer for layer in st.layers if not layer.drafter]
        assert all(layer.plan is None for layer in st.layers if layer.drafter)
        for layer in targets:
            assert layer.plan.params.mass_price == pytest.approx(0.109375 * 4 / 6)
