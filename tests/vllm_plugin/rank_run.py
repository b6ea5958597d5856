"""One rank of the two-rank agreement test (``test_rank_agreement.py``; a script the test starts twice, not a test).

    python tests/vllm_plugin/rank_run.py RANK PORT OUT.json ON_BUCKETS

Joins vLLM's distributed state as rank RANK of 2 (gloo on ``127.0.0.1:PORT``, tensor parallel 2: vLLM's own
``GroupCoordinator``, ``get_tp_group()``), hooks two vLLM ``CPURouter`` layers (k 2 of 8) with ``layers.attach`` in a
fresh plugin state (policy LYNX, the cost gate on ``gate="auto"``), and replaces this rank's measurement by fixed
decisions: on at the buckets of ON_BUCKETS (comma-separated; empty: off everywhere), so the two ranks' own decisions
disagree. Then, as an engine's worker does:

1. ``start``: the plans are made before the first forward (``plans.before_forward``, eager), then one decode step of
   8 rows, the same seeded logits on both ranks, goes through each hooked router;
2. ``configured``: ``layers.configure`` to OEA (k0 1, ``gate="auto"``: measured again, agreed again), the same step.

OUT: ``{"rank", "measured_on": {phase: [buckets]}, phase: {"layers": [{"ids", "vllm_ids", "bypass", "gate",
"decisions"}]}}`` (``measured_on``: the buckets this rank's own measurement was on at; ``decisions``: bucket -> on of
the decisions the gate holds after the agreement; ``gate``: its summary).
"""

import json
import os
import sys
import types


class _MoERunner:
    """What ``layers.attach`` reads of a vLLM ``MoERunner`` (held weakly by the layer)."""

    do_naive_dispatch_combine = False
    moe_config = types.SimpleNamespace(num_logical_experts=None, pcp_size=1, is_sequence_parallel=False,
                                       hidden_dim=None, intermediate_size_per_partition=None, in_dtype=None)

    def __init__(self, router, name):
        self.router, self.layer_name = router, name


def _vllm_config():
    """A ``VllmConfig`` to join vLLM's distributed state under (it reads the parallel configuration). vLLM 0.34 refuses
    to configure a CPU engine on x86 without triton-cpu (the ``vllm_code`` leg's GPU wheel here): the distributed
    state needs no engine, so the config is built without the platform's engine check there."""
    from vllm.config import VllmConfig

    try:
        return VllmConfig()
    except RuntimeError as exc:
        if "Triton" not in str(exc):
            raise
        from vllm.platforms import current_platform

        type(current_platform).check_and_update_config = classmethod(lambda cls, vllm_config: None)
        return VllmConfig()


def _decision(on: bool):
    from lynx_hf import gate

    return gate.decide(1.0, 4.0 if on else 0.0, 1.0, margin=gate.TUNING.margin)


def main(rank: int, port: int, out_path: str, on_buckets: str) -> None:
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state
    from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter

    from lynx_hf import gate
    from lynx_hf.gate import stage as gate_stage
    from lynx_hf.vllm import bypass, layers, plans, state, steps
    from lynx_hf.vllm.state import DECODE

    on = {int(b) for b in on_buckets.split(",") if b.strip()}
    measured = []

    def measure_layer(planned, expert_times, tuning=gate.TUNING):
        measured.append(sorted(b for b in tuning.buckets if b in on))
        return {b: _decision(b in on) for b in tuning.buckets}

    gate_stage.measure_layer = measure_layer  # this rank's own decisions
    result = {"rank": rank, "measured_on": {}}
    os.environ["VLLM_DIST_IDENT"] = str(port)  # what vLLM's CPU worker sets before joining (its SHM communicator)
    with set_current_vllm_config(_vllm_config()):
        parallel_state.init_distributed_environment(world_size=2, rank=rank, local_rank=rank, backend="gloo",
                                                    distributed_init_method=f"tcp://127.0.0.1:{port}")
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
        try:
            runners = []
            with state.isolated({"policy": "lynx", "gate": "auto", "mass_price": None, "tau": 1000}, capacity=16) as st:
                st.tp_size = 2
                for i in range(2):
                    router = CPURouter(top_k=2, global_num_experts=8, renormalize=True)
                    runners.append(_MoERunner(router, f"layers.{i}.experts"))
                    layers.attach(runners[-1])  # the layer keeps a weak reference: the runner is held here
                    st.layers[-1].gate_shape = gate.LayerShape(8, 2, 32, 16)  # a size the gate decides at
                runner = types.SimpleNamespace(device=torch.device("cpu"),
                                               model_config=types.SimpleNamespace(dtype=torch.float32,
                                                                                  enforce_eager=True))
                logits = [torch.randn(8, 8, generator=torch.Generator().manual_seed(10 + i)) * 2 for i in range(2)]
                for phase in ("start", "configured"):
                    if phase == "start":
                        plans.before_forward(runner)
                    else:
                        layers.configure({"policy": "oea", "oea_k0": 1, "gate": "auto"})
                    result["measured_on"][phase] = measured[-1]
                    steps.write_kinds([DECODE] * 8, "cpu")
                    entries = []
                    for one, run, x in zip(st.layers, runners, logits):
                        _, ids = run.router._compute_routing(None, x, None)
                        _, vllm_ids = layers.original_routing(run.router)(None, x, None)
                        planned = gate.of(one.plan)
                        entries.append({"ids": ids.tolist(), "vllm_ids": vllm_ids.tolist(), "bypass": one.bypass,
                                        "gate": bypass.gate_summary(one),
                                        "decisions": {b: d.on for b, d in sorted(planned.decisions.items())}})
                    steps.end_step()
                    result[phase] = {"layers": entries}
        finally:
            parallel_state.destroy_model_parallel()
            parallel_state.destroy_distributed_environment()
    with open(out_path, "w") as fh:
        json.dump(result, fh)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
