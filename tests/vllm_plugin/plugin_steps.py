"""Shared by the plugin's unit tests: describe one engine step to the plugin without a model runner."""

from lynx_hf.vllm import steps
from lynx_hf.vllm.state import PADDING


def set_kinds(kinds):
    """What the hooked input preparation does for a step whose tokens have these kinds (``DECODE`` / ``PREFILL``;
    trailing ``PADDING`` rows are rows a padded forward adds after the step's tokens: not written)."""
    live = list(kinds)
    while live and live[-1] == PADDING:
        live.pop()
    assert PADDING not in live, "padding rows come after the step's tokens"
    steps.write_kinds(live, "cpu")


def moe_config(**fields):
    """What the plugin reads of a vLLM ``MoERunner.moe_config`` (``FusedMoEConfig``: ``lynx_hf.vllm.rows.inspect_rows``,
    ``layers.attach``), for runner stand-ins: no pipeline / context / sequence parallelism, no H / I; ``fields``
    override."""
    import types

    parallel = types.SimpleNamespace(use_all2all_kernels=False)
    base = dict(num_logical_experts=None, pcp_size=1, is_sequence_parallel=False, moe_parallel_config=parallel,
                hidden_dim=None, intermediate_size_per_partition=None, in_dtype=None)
    return types.SimpleNamespace(**{**base, **fields})
