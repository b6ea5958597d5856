"""The cost gate's decisions agreed across the ranks that route the same rows (imports vLLM only when asked).

Under tensor parallelism (and expert parallelism with one data-parallel rank) every rank of a tensor-parallel group
computes the same router logits for the same rows, and the experts' partial outputs of the ranks are summed: a rank
that remaps a step size while another keeps vLLM's routing there sums two different expert sets. The routing policy is
deterministic, but each rank's cost gate (``LynxConfig.gate="auto"``) gets its decisions itself (a table, the per-user
cache, or a measurement: ``lynx_hf.gate.table``), and two ranks may get different ones (each measured, or one read a
cache entry the other then replaced). So once every layer's plan is made (:func:`lynx_hf.vllm.plans.before_forward`,
and again in ``configure``), :func:`agree` broadcasts rank 0's decisions for every layer (bucket ->
``GateDecision.to_dict``) over vLLM's tensor-parallel group (``get_tp_group().broadcast_object``, on the group's CPU
side) and every rank, rank 0 included, adopts them (``PlanGate.adopt``); the bypass is set from the adopted
decisions afterwards. Data-parallel ranks route their own rows: each tensor-parallel group agrees on its own.

Where the agreement cannot be guaranteed (no tensor-parallel group found, the API missing) under ``gate="auto"`` with
more than one tensor-parallel rank, the engine is refused at start with :class:`~lynx_hf.LynxConfigError` naming why
and the fix, ``gate="always"`` (:func:`check`, :func:`agree`).
"""

from __future__ import annotations

import logging

from ..errors import LynxConfigError
from ..gate import GateDecision
from ..gate import of as gate_of
from ..policies import get as get_policy

logger = logging.getLogger("lynx_hf.vllm")

__all__ = ["needs_agreement", "tp_size_of", "api_missing", "find_group", "refusal", "check", "agree", "payload",
           "adopt"]


def tp_size_of(vllm_config) -> int:
    """The tensor-parallel size of ``vllm_config`` (a ``VllmConfig``; 1 where it says nothing)."""
    parallel = getattr(vllm_config, "parallel_config", None)
    size = getattr(parallel, "tensor_parallel_size", 1)
    return int(size) if isinstance(size, int) and size > 0 else 1


def needs_agreement(cfg, tp_size: int) -> bool:
    """Whether ``cfg`` (a :class:`~lynx_hf.vllm.config.PluginConfig` or ``None``) on ``tp_size`` tensor-parallel ranks
    has decisions to agree on: the cost gate decides (``gate="auto"``) for a policy that remaps, on more than one
    rank."""
    if cfg is None or tp_size <= 1 or cfg.lynx.gate != "auto":
        return False
    return get_policy(cfg.lynx.policy).remaps


def api_missing() -> str | None:
    """Why this vLLM offers no way to agree (``None``: it does): ``vllm.distributed.parallel_state`` with
    ``get_tp_group`` and ``GroupCoordinator.broadcast_object``. Asked where no group exists yet (the driver)."""
    try:
        from vllm.distributed import parallel_state
    except ImportError as exc:
        return f"vllm.distributed.parallel_state cannot be imported ({exc})"
    missing = [name for name in ("get_tp_group", "GroupCoordinator") if not hasattr(parallel_state, name)]
    if not missing and not callable(getattr(parallel_state.GroupCoordinator, "broadcast_object", None)):
        missing = ["GroupCoordinator.broadcast_object"]
    return f"vllm.distributed.parallel_state has no {', '.join(missing)}" if missing else None


def find_group() -> tuple[object | None, str]:
    """``(group, "")``: this process's vLLM tensor-parallel ``GroupCoordinator`` (``get_tp_group()``), or ``(None,
    why)`` where there is none (vLLM's distributed state not initialized, the API missing)."""
    why = api_missing()
    if why is not None:
        return None, why
    from vllm.distributed import parallel_state

    try:
        group = parallel_state.get_tp_group()
    except (AssertionError, RuntimeError, ValueError) as exc:
        return None, f"vLLM's tensor-parallel group is not initialized in this process ({exc or type(exc).__name__})"
    missing = [name for name in ("world_size", "rank_in_group") if not isinstance(getattr(group, name, None), int)]
    if missing:
        return None, f"vLLM's tensor-parallel group ({type(group).__name__}) has no {', '.join(missing)}"
    return group, ""


def refusal(reason: str, tp_size: int) -> LynxConfigError:
    """The error of an engine whose ranks' decisions cannot be agreed (``reason``: why), naming the fix."""
    return LynxConfigError(
        f"lynx_hf.vllm: gate='auto' (the cost gate, the default) on {tp_size} tensor-parallel ranks needs every rank "
        f"to use rank 0's decisions (each rank's partial expert outputs are summed, so all must remap the same step "
        f"sizes), and they cannot be agreed here: {reason}. Start the engine with gate='always' in the lynx "
        "configuration (or LYNX_HF_GATE=always): the policy then runs on every decode step on every rank.")


def check(vllm_config, cfg) -> None:
    """Engine start, before any engine process (the driver's ``EngineArgs.create_engine_config``): refuse a
    configuration ``cfg`` on ``vllm_config`` whose ranks would have to agree (:func:`needs_agreement`) where this vLLM
    offers no way to (:func:`api_missing`). Raises :class:`~lynx_hf.LynxConfigError`."""
    tp_size = tp_size_of(vllm_config)
    if needs_agreement(cfg, tp_size):
        why = api_missing()
        if why is not None:
            raise refusal(why, tp_size)


def payload(entries) -> dict:
    """What rank 0 sends: ``{"layers": [name], "decisions": [{bucket: GateDecision.to_dict()} | None],
    "sources": [str | None]}`` of ``entries`` (``[(layer name, PlanGate | None)]``; ``None``: no gate). Plain data
    (``None`` for a non-finite figure)."""
    return {"layers": [name for name, _ in entries],
            "decisions": [None if gate is None else {int(b): d.to_dict() for b, d in gate.decisions.items()}
                          for _, gate in entries],
            "sources": [None if gate is None else gate.source for _, gate in entries]}


def adopt(entries, received: dict, world_size: int) -> int:
    """Every gate of ``entries`` (``[(layer name, PlanGate | None)]``, this rank's) adopts rank 0's decisions from
    ``received`` (:func:`payload`), source ``"rank 0 of <n> tensor-parallel ranks: <rank 0's source>"``. Returns the
    layers adopted. Raises :class:`~lynx_hf.LynxConfigError` where rank 0 describes other layers, or a layer has a
    gate on one rank and none on the other, or a decision is malformed."""
    names = [name for name, _ in entries]
    if received.get("layers") != names:
        raise refusal(f"rank 0 hooked other MoE layers ({received.get('layers')!r}) than this rank ({names!r})",
                      world_size)
    adopted = 0
    for (name, gate), decisions, source in zip(entries, received["decisions"], received["sources"]):
        if (gate is None) != (decisions is None):
            raise refusal(f"MoE layer {name} has a cost gate on {'rank 0' if gate is None else 'this rank'} only",
                          world_size)
        if gate is None:
            continue
        try:
            parsed = {int(b): GateDecision.from_dict(d) for b, d in decisions.items()}
        except (KeyError, TypeError, ValueError) as exc:
            raise refusal(f"rank 0 sent a malformed decision for {name} ({exc!r})", world_size) from None
        gate.adopt(parsed, f"rank 0 of {world_size} tensor-parallel ranks: {source}")
        adopted += 1
    return adopted


def agree(entries, cfg, tp_size: int, group=None) -> int:
    """Make the cost gates of ``entries`` (``[(layer name, plan)]``, every MoE layer of this process in order; a plan
    without a gate counts as ``None``) agree across this process's tensor-parallel group: rank 0's decisions, adopted
    by every rank (:func:`adopt`). Nothing to do (returns 0) where ``cfg`` on ``tp_size`` ranks needs no agreement
    (:func:`needs_agreement`) or the group has one rank. ``group``: a vLLM ``GroupCoordinator`` (or anything with
    ``world_size``, ``rank_in_group`` and ``broadcast_object(obj, src=0)``); ``None``: :func:`find_group`. A
    collective: every rank of the group must call it at the same point (before the first forward, in ``configure``).
    Returns the layers adopted. Raises :class:`~lynx_hf.LynxConfigError` where no group is found (the reason and the
    fix, ``gate="always"``), or where :func:`adopt` does."""
    if not needs_agreement(cfg, tp_size):
        return 0
    if group is None:
        group, why = find_group()
        if group is None:
            raise refusal(why, tp_size)
    world = int(group.world_size)
    if world <= 1:
        return 0
    gates = []
    for name, plan in entries:  # a captured engine's gates hold replay-timed decisions too: agreed alike
        gate = gate_of(plan)
        gates.append((name, gate))
        if gate is not None and gate.replayed is not None:
            gates.append((f"{name} (replayed)", gate.replayed))
    mine = payload(gates) if group.rank_in_group == 0 else None
    try:
        received = group.broadcast_object(mine, src=0)
    except Exception as exc:  # noqa: BLE001 - any failure of the collective stops the start with the fix named
        raise refusal(f"the broadcast over vLLM's tensor-parallel group failed ({type(exc).__name__}: {exc})",
                      world) from exc
    if not isinstance(received, dict):
        raise refusal(f"the broadcast over vLLM's tensor-parallel group returned {type(received).__name__}", world)
    adopted = adopt(gates, received, world)
    logger.info("lynx_hf.vllm: cost-gate decisions of %d MoE layers agreed: rank 0's, on %d tensor-parallel ranks",
                adopted, world)
    return adopted
