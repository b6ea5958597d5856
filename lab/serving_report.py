"""Serving report: LYNX in the generation modes a server runs, none vs LYNX (default) vs OEA k0=1.

    python -m lab.serving_report              # fixture A, writes eval/results/serving.md / .json
    python -m lab.serving_report --quick      # fewer tokens (a smoke run, not for the README)

1. Continuous batching (``model.generate_batch``, transformers' paged-cache engine): 16 held-out prompts of
   mixed lengths (8..68 tokens), greedy, EOS on; once with the default token budget (all prompts prefilled
   together, then pure decode steps) and once with ``max_batch_tokens=64`` (prompts are chunked and their
   chunks share forwards with other requests' decode tokens: mixed steps). Reported: decode steps and tokens,
   prefill tokens seen in mixed steps, unique experts per layer per step among decode tokens before/after,
   token agreement with the unpatched run.
2. Prompt-lookup decoding (``prompt_lookup_num_tokens``) and assisted decoding with a draft model (fixture B,
   same tokenizer), greedy, on held-out code prompts. transformers 5.24 refuses batch > 1 for both
   ("assisted generate is only supported for batch_size = 1"; the script checks and records the message), so
   each prompt is its own generate call (B = 1) and a verify forward holds 1 + c tokens of one row.
   Reported: unique experts per MoE layer per verify forward with the model's own routing ("before") and
   with the policy ("after"), from router outputs captured per forward; the acceptance rate (accepted /
   proposed candidates, from the cache length at each forward); new tokens per target forward.

All numbers are means over MoE layers and steps; fp32 on CPU; greedy, so runs are deterministic.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from transformers import GenerationConfig

import lynx_hf
from lynx_hf.eval import evaluation as ev
from lynx_hf.state import find_state

POLICIES = {"none": dict(policy="none"), "lynx": dict(policy="lynx"), "oea k0=1": dict(policy="oea", oea_k0=1)}


class Capture:
    """Backbone forwards (query length, cache length) and every router's top-k ids per forward, with the
    forward's decode mask as lynx_hf classified it (``None`` while unpatched). Hooks added before ``patch`` see
    the model's own routing; hooks added after see the policy's."""

    def __init__(self, model, backbone) -> None:
        self.model = model
        self.forwards, self.handles = [], [backbone.register_forward_pre_hook(self._pre, with_kwargs=True)]
        self.routing: dict[str, list] = {}
        for name, module in model.named_modules():
            if type(module).__name__.endswith(("TopKRouter", "Router")) and hasattr(module, "top_k"):
                self.routing[name] = []
                self.handles.append(module.register_forward_hook(self._router(name)))

    def _pre(self, module, args, kwargs):
        x = kwargs.get("input_ids", args[0] if args else None)
        cache = kwargs.get("cache")
        held = cache.get_seq_length() if cache is not None and hasattr(cache, "get_seq_length") else None
        self.forwards.append({"q": int(x.shape[1]), "held": None if isinstance(held, torch.Tensor) else held})

    def _router(self, name):
        def hook(module, args, output):
            state = find_state(self.model)
            step = None if state is None else state.tracker.step
            idx = output[2].detach().clone()
            decode = None
            if step is not None and step.kind != "prefill":
                decode = torch.ones(idx.shape[0], dtype=torch.bool) if step.decode is None else step.decode.clone()
                if step.live is not None:
                    decode &= step.live
            self.routing[name].append((idx, decode))
        return hook

    def close(self):
        for h in self.handles:
            h.remove()


def step_unions(before: Capture, after: Capture) -> tuple[float, float, int]:
    """Mean over layers and decode-carrying forwards of the experts the *whole* forward loads (prefill tokens
    included), with the model's own routing and with the policy's; and the number of such forwards per layer."""
    b, a, steps = [], [], 0
    for name, calls in after.routing.items():
        for (idx_raw, _), (idx, decode) in zip(before.routing[name], calls):
            if decode is None or not bool(decode.any()):
                continue
            b.append(int(idx_raw.unique().numel()))
            a.append(int(idx.unique().numel()))
        steps = len(b) // max(len(after.routing), 1)
    return sum(b) / max(len(b), 1), sum(a) / max(len(a), 1), steps


def heldout_prompts(tok, count: int, lengths, files) -> list[list[int]]:
    texts = [t for f in files for t in ev.read_texts(f)]
    ids = [tok(t, verbose=False).input_ids for t in texts]
    ids = [t for t in ids if len(t) >= max(lengths)]
    return [ids[i % len(ids)][: lengths[i % len(lengths)]] for i in range(count)]


# -- continuous batching ---------------------------------------------------------------------------------------
def continuous_batching(model, prompts, new_tokens, eos, budget) -> dict:
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gen = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=0)
    rows, reference = {}, None
    for label, cfg in {"unpatched": None, **POLICIES}.items():
        # explicit sizes: transformers otherwise sizes the paged cache and its static buffers from free memory,
        # and zeroing those takes ~30 s per run on this CPU
        cb = ContinuousBatchingConfig(num_blocks=128, max_batch_tokens=budget)
        before = after = None
        if cfg is not None:
            before = Capture(model, model.model)
            lynx_hf.patch(model, **cfg)
            after = Capture(model, model.model)
        t0 = time.perf_counter()
        out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb, progress_bar=False)
        seconds = time.perf_counter() - t0
        if before is not None:
            before.close()
            after.close()
        tokens = {k: v.generated_tokens for k, v in out.items()}
        if cfg is None:
            reference = tokens
            rows[label] = {"seconds": round(seconds, 2)}
            continue
        s = lynx_hf.stats(model).summary()
        lynx_hf.unpatch(model)
        agree = [sum(a == b for a, b in zip(tokens[k], reference[k])) / max(len(reference[k]), 1) for k in reference]
        rows[label] = {key: s[key] for key in ("decode_steps", "decode_tokens", "prefill_tokens_in_mixed_steps",
                                               "finished_row_tokens", "unique_experts_before", "unique_experts_after",
                                               "ratio", "routing_mass_kept")}
        loaded_before, loaded_after, _ = step_unions(before, after)
        rows[label].update(step_experts_before=loaded_before, step_experts_after=loaded_after)
        rows[label].update(token_agreement=sum(agree) / len(agree), identical=tokens == reference,
                           new_tokens=sum(len(t) for t in tokens.values()), seconds=round(seconds, 2))
    return rows


# -- verification ------------------------------------------------------------------------------------------------
def _verify_metrics(before: Capture, after: Capture, prompt_len: int, new_tokens: int) -> dict:
    qs = [f["q"] for f in before.forwards]
    held = [f["held"] for f in before.forwards]
    verify = [i for i in range(1, len(qs)) if qs[i] > 1]
    uniq = {"before": [], "after": []}
    for which, cap in (("before", before), ("after", after)):
        for calls in cap.routing.values():
            uniq[which] += [int(calls[i][0].unique().numel()) for i in verify]
    proposed = [qs[0] - prompt_len] + [q - 1 for q in qs[1:]]
    accepted = []
    for i in range(len(qs) - 1):
        fed = prompt_len if i == 0 else 1
        accepted.append(held[i + 1] - held[i] - fed)
    accepted.append(max(0, min(proposed[-1], new_tokens - sum(a + 1 for a in accepted) - 1)))
    return {"forwards": len(qs), "verify_forwards": len(verify), "verify_tokens": sum(qs[i] for i in verify),
            "proposed": sum(proposed), "accepted": sum(accepted), "uniq_before": uniq["before"],
            "uniq_after": uniq["after"]}


def verification(model, prompts, new_tokens, mode: dict, label: str) -> dict:
    rows, reference = {}, None
    try:  # record what generate says about batches
        batch = torch.tensor([prompts[0], prompts[0]])
        model.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=2, do_sample=False,
                       pad_token_id=0, **mode)
        refusal = None
    except ValueError as exc:
        refusal = str(exc)
    for name, cfg in POLICIES.items():
        totals = {"forwards": 0, "verify_forwards": 0, "verify_tokens": 0, "proposed": 0, "accepted": 0,
                  "uniq_before": [], "uniq_after": [], "new_tokens": 0, "agree": 0, "seconds": 0.0}
        sequences = []
        for prompt in prompts:
            ids = torch.tensor([prompt])
            backbone = model.model
            before = Capture(model, backbone)
            lynx_hf.patch(model, **cfg)
            after = Capture(model, backbone)
            t0 = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 do_sample=False, eos_token_id=None, pad_token_id=0, **mode)
            totals["seconds"] += time.perf_counter() - t0
            before.close()
            after.close()
            lynx_hf.unpatch(model)
            new = out[0, ids.shape[1]:].tolist()
            sequences.append(new)
            m = _verify_metrics(before, after, ids.shape[1], len(new))
            for key in ("forwards", "verify_forwards", "verify_tokens", "proposed", "accepted"):
                totals[key] += m[key]
            totals["uniq_before"] += m["uniq_before"]
            totals["uniq_after"] += m["uniq_after"]
            totals["new_tokens"] += len(new)
        if reference is None:
            reference = sequences
        agree = [sum(a == b for a, b in zip(s, r)) / max(len(r), 1) for s, r in zip(sequences, reference)]
        ub, ua = totals.pop("uniq_before"), totals.pop("uniq_after")
        totals.update(unique_experts_per_verify_step_before=sum(ub) / max(len(ub), 1),
                      unique_experts_per_verify_step_after=sum(ua) / max(len(ua), 1),
                      acceptance_rate=totals["accepted"] / max(totals["proposed"], 1),
                      tokens_per_target_forward=totals["new_tokens"] / max(totals["forwards"], 1),
                      mean_verify_tokens=totals["verify_tokens"] / max(totals["verify_forwards"], 1),
                      token_agreement_with_none=sum(agree) / len(agree), seconds=round(totals["seconds"], 2))
        rows[name] = totals
    return {"mode": label, "batch_refused": refusal, "rows": rows}


def markdown(report: dict) -> str:
    a = report["args"]
    out = ["# Serving report", "",
           f"Fixture `{report['model']}`, fp32, CPU ({a['threads']} threads), greedy. Command: `{report['command']}` "
           f"({report['seconds']} s). Unique experts: mean per MoE layer per step, among the step's decode tokens "
           "(continuous batching) or over all tokens of a verify forward; 'before' = the model's own routing of the "
           "same tokens.", ""]
    for key, title in (("cb_default", "Continuous batching, max_batch_tokens=1024 (every prompt prefilled in "
                                      "the first forward, then pure decode steps)"),
                       ("cb_chunked", f"Continuous batching, max_batch_tokens={a['budget']} (chunked prompts, "
                                      "mixed steps)")):
        r = report[key]
        out += [f"## {title}", "",
                f"{a['cb_requests']} requests, prompt lengths {a['cb_lengths']}, {a['cb_new_tokens']} new tokens max, "
                "EOS on.", "",
                "| policy | decode steps | decode tokens (per step) | prefill tokens in mixed steps | unique experts "
                "of decode tokens before -> after | ratio | experts the whole step loads before -> after | mass kept "
                "| token agreement | identical |", "|---|---|---|---|---|---|---|---|---|---|"]
        for name in POLICIES:
            x = r[name]
            out.append(f"| {name} | {x['decode_steps']} | {x['decode_tokens']} ({x['decode_tokens'] / max(x['decode_steps'], 1):.1f}) "
                       f"| {x['prefill_tokens_in_mixed_steps']} "
                       f"| {x['unique_experts_before']:.2f} -> {x['unique_experts_after']:.2f} | {x['ratio']:.3f} | "
                       f"{x['step_experts_before']:.2f} -> {x['step_experts_after']:.2f} | "
                       f"{x['routing_mass_kept']:.3f} | {x['token_agreement']:.3f} | {x['identical']} |")
        out.append("")
    for key in ("prompt_lookup", "assisted"):
        r = report[key]
        out += [f"## {r['mode']}", "",
                f"{a['verify_prompts']} held-out code prompts of {a['verify_prompt_length']} tokens, "
                f"{a['verify_new_tokens']} new tokens each, B = 1 (batch 2 refused by transformers: "
                f"\"{r['batch_refused']}\").", "",
                "| policy | verify forwards | tokens per verify forward | unique experts per verify step before "
                "-> after | acceptance rate | new tokens per target forward | agreement with none |",
                "|---|---|---|---|---|---|---|"]
        for name in POLICIES:
            x = r["rows"][name]
            out.append(f"| {name} | {x['verify_forwards']} | {x['mean_verify_tokens']:.2f} | "
                       f"{x['unique_experts_per_verify_step_before']:.2f} -> "
                       f"{x['unique_experts_per_verify_step_after']:.2f} | {x['acceptance_rate']:.3f} | "
                       f"{x['tokens_per_target_forward']:.2f} | {x['token_agreement_with_none']:.3f} |")
        out.append("")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(ev.FIXTURES_DIR / "qwen2moe-tiny"))
    p.add_argument("--draft", default=str(ev.FIXTURES_DIR / "mixtral-tiny"),
                   help="draft model for assisted decoding (same tokenizer)")
    p.add_argument("--cb-new-tokens", type=int, default=32)
    p.add_argument("--budget", type=int, default=64, help="max_batch_tokens of the chunked continuous-batching run")
    p.add_argument("--verify-new-tokens", type=int, default=48)
    p.add_argument("--lookup", type=int, default=10, help="prompt_lookup_num_tokens")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="8 new tokens, 4 prompts (smoke run)")
    p.add_argument("--out", default=str(ev.RESULTS_DIR), help="results folder (default: eval/results)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    model, tok = ev.load_model(args.model)
    lengths = [8 + 4 * i for i in range(16)]
    files = [ev.DATA_DIR / "valid_docs.jsonl", ev.DATA_DIR / "valid_code.jsonl"]
    cb_prompts = heldout_prompts(tok, 16, lengths, files)
    verify_count, verify_len = (4, 48) if args.quick else (8, 96)
    verify_prompts = heldout_prompts(tok, verify_count, [verify_len], [ev.DATA_DIR / "valid_code.jsonl"])
    cb_new = 8 if args.quick else args.cb_new_tokens
    v_new = 8 if args.quick else args.verify_new_tokens
    eos = model.generation_config.eos_token_id
    report = {"model": Path(args.model).name,
              "command": "python -m lab.serving_report" + (" --quick" if args.quick else ""),
              "args": {"threads": args.threads, "budget": args.budget, "cb_requests": len(cb_prompts),
                       "cb_lengths": f"{min(lengths)}..{max(lengths)}", "cb_new_tokens": cb_new,
                       "verify_prompts": verify_count, "verify_prompt_length": verify_len,
                       "verify_new_tokens": v_new, "lookup": args.lookup}}
    report["cb_default"] = continuous_batching(model, cb_prompts, cb_new, eos, 1024)
    report["cb_chunked"] = continuous_batching(model, cb_prompts, cb_new, eos, args.budget)
    report["prompt_lookup"] = verification(model, verify_prompts, v_new, {"prompt_lookup_num_tokens": args.lookup},
                                           f"Prompt-lookup decoding (prompt_lookup_num_tokens={args.lookup})")
    draft, _ = ev.load_model(args.draft)
    report["assisted"] = verification(model, verify_prompts, v_new, {"assistant_model": draft},
                                      f"Assisted decoding, draft model `{Path(args.draft).name}`")
    report["seconds"] = round(time.perf_counter() - t0, 1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "serving.json").write_text(json.dumps(report, indent=1))
    text = markdown(report)
    (out / "serving.md").write_text(text)
    print(text)
    print(f"wrote {out / 'serving.md'} and .json ({report['seconds']} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
