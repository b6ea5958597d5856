"""engine_run.py with a routing probe outside the plugin (a script the tests start in a subprocess, not a test).

    python tests/vllm_plugin/family_run.py SPEC.json OUT.json

Runs ``engine_run.main`` (same SPEC and OUT). With ``"probe": true`` in SPEC (eager engines only: the probe is
plain Python around each router, which ``torch.compile`` would trace once), every MoE router's routing is
checked after the plugin, on every call, against vLLM's own routing of the same logits (the router's original
``_compute_routing``): calls, rows, rows whose ids differ from vLLM's, calls whose ids and weights are vLLM's
bit for bit, and violations: expert ids outside the token's allowed groups, computed by vLLM's own CPU grouped
top-k (``cpu_router._grouped_topk`` asked for every allowed expert). The counts of each run are its entry's
``"probe"`` in OUT. The plugin is registered first so the probe wraps the plugin's routing, not vLLM's.
"""

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

sys.path.insert(0, str(Path(__file__).parent))

PROBE = {"calls": 0, "rows": 0, "changed_rows": 0, "identical_calls": 0, "violations": 0, "grouped_layers": 0,
         "layers": 0}
PER_RUN = ("calls", "rows", "changed_rows", "identical_calls", "violations")


def _allowed_mask(router, logits):
    """``[T, N]`` bool: the experts of each token's allowed groups, from vLLM's own grouped top-k."""
    import torch
    from vllm.model_executor.layers.fused_moe.router.cpu_router import _grouped_topk

    num_experts = logits.shape[-1]
    groups, topk_group = router.num_expert_group, router.topk_group
    allowed = topk_group * (num_experts // groups)
    _, ids = _grouped_topk(logits, allowed, False, groups, topk_group, router.scoring_func, 1.0,
                           router.e_score_correction_bias)
    return torch.zeros(logits.shape, dtype=torch.bool).scatter_(1, ids.long(), True)


def install_probe() -> None:
    import torch
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    import lynx_hf.vllm
    from lynx_hf.vllm.layers import original_routing

    lynx_hf.vllm.register()  # the plugin's MoERunner hook first: the probe then wraps the remapped routing
    init = MoERunner.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        router = self.router
        remapped = router._compute_routing
        original = original_routing(router)  # vLLM's own routing (the plugin's hook wraps it when configured)
        grouped = bool(getattr(router, "use_grouped_topk", False)) and (router.num_expert_group or 1) > 1
        PROBE["layers"] += 1
        PROBE["grouped_layers"] += int(grouped)

        def _compute_routing(hidden_states, router_logits, indices_type, *, input_ids=None):
            weights, ids = remapped(hidden_states, router_logits, indices_type, input_ids=input_ids)
            with torch.no_grad():
                own_weights, own = original(hidden_states, router_logits, indices_type, input_ids=input_ids)
                PROBE["calls"] += 1
                PROBE["rows"] += int(ids.shape[0])
                PROBE["changed_rows"] += int((ids.sort(dim=-1).values != own.sort(dim=-1).values).any(-1).sum())
                PROBE["identical_calls"] += int(torch.equal(ids, own) and torch.equal(weights, own_weights))
                if grouped:
                    inside = _allowed_mask(router, router_logits).gather(1, ids.long())
                    PROBE["violations"] += int((~inside).sum())
            return weights, ids

        router._compute_routing = _compute_routing

    MoERunner.__init__ = __init__


if __name__ == "__main__":
    import engine_run

    def per_run(name, entry):
        entry["probe"] = dict(PROBE)
        PROBE.update({key: 0 for key in PER_RUN})

    spec = json.loads(Path(sys.argv[1]).read_text())
    if spec.get("probe"):
        install_probe()
    engine_run.main(sys.argv[1], sys.argv[2], on_run=per_run if spec.get("probe") else None)
