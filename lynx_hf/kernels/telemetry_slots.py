"""The telemetry row of one decode step of one MoE layer: its slots, in order, defined once.

A row is fp64 ``[NUM_SLOTS]``; ``lynx_hf.telemetry.BlockTelemetry`` sums rows over steps, and the numba twin
:func:`.routing_cpu.decode_step_counts` (and the default policy's one-call CPU step) writes rows in this order.

- ``STEPS``: 1 if the step has a counted (live decode) token, else 0;
- ``BEFORE`` / ``AFTER``: distinct experts the counted tokens use, with the model's routing / the policy's;
- ``REMAPPED``: counted token->expert assignments changed; ``ASSIGNMENTS``: counted tokens x k;
- ``MASS``: sum over counted tokens of the share of their original top-k weight still used;
- ``TOKENS``: counted tokens; ``FALLBACKS``: 1 if a counted token kept its routing (non-finite logits);
- ``VERIFY_TOKENS``: counted tokens of a verification forward; ``PREFILL_TOKENS``: prefill tokens of a step that
  also decodes; ``FINISHED_TOKENS``: tokens of finished rows;
- ``LOADED_BEFORE`` / ``LOADED_AFTER``: in a step with a counted token, distinct experts the counted tokens and the
  step's prefill tokens use together, with the model's routing / the policy's: what the experts kernel loads in a
  continuous-batching step (equal to ``BEFORE`` / ``AFTER`` where the step has no prefill rows); else 0.
"""

(STEPS, BEFORE, AFTER, REMAPPED, ASSIGNMENTS, MASS, TOKENS, FALLBACKS, VERIFY_TOKENS, PREFILL_TOKENS,
 FINISHED_TOKENS, LOADED_BEFORE, LOADED_AFTER) = range(13)
NUM_SLOTS = 13
