"""Train a small MoE fixture (Qwen2-MoE, Mixtral or DeepSeek-V2) on CPU, save it as a HF checkpoint in bf16.

Prerequisite: ``python -m lab.build_corpus`` (writes eval/work/train_tokens.npy and eval/work/tokenizer).

    python -m lab.train_fixture --family qwen2_moe   --epochs 1 --out eval/fixtures/qwen2moe-tiny
    python -m lab.train_fixture --family mixtral     --steps 2000 --out eval/fixtures/mixtral-tiny
    python -m lab.train_fixture --family deepseek_v2 --epochs 1 --out eval/fixtures/deepseekv2-tiny
    python -m lab.train_fixture --family qwen2_moe_deep --steps 2700 --out eval/fixtures/qwen2moe-deep
    python -m lab.train_fixture --eval-only --out eval/fixtures/qwen2moe-tiny   # metrics of a saved checkpoint

Training: random ``--seq``-token windows of the train split, fp32, AdamW, linear warmup + cosine decay over
``--steps`` (or ``--epochs E``: ceil(E * train tokens / (batch * seq)) steps), router aux (load-balancing)
loss on with coefficient 0.01 (Qwen2-MoE / Mixtral compute it in the model; DeepseekV2ForCausalLM returns
router logits but no aux loss, so this script adds the same Switch-style loss for it). CARD.md records the
command, steps, tokens, epochs and wall time (summed over resumed runs); ``--note`` adds a free-text note. Every
``--ckpt-every`` steps the model, optimizer, batch sampler and log go to ``eval/work/train_ckpt_<out name>.pt``; a rerun
with the same settings resumes there (the same batches as an uninterrupted run). Not bit-reproducible across CPUs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

from . import DATA_DIR as DATA
from . import WORK_DIR as WORK


def make_config(family: str, vocab: int, eos: int):
    common = dict(
        vocab_size=vocab,
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        output_router_logits=True,
        router_aux_loss_coef=0.01,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
        use_cache=True,
    )
    if family in ("qwen2_moe", "qwen2_moe_deep"):
        from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

        if family == "qwen2_moe":  # fixture A
            sizes = dict(num_experts=32, num_experts_per_tok=4, moe_intermediate_size=64,
                         shared_expert_intermediate_size=256)
        else:
            # Fixture E: 16 MoE layers, fine-grained router (N 64, top-8, as Qwen3-30B-A3B / OLMoE), a small shared
            # expert; hidden 192 so the bf16 checkpoint stays near 25 MB and training fits ~95 min on 2 cores.
            common = {**common, "hidden_size": 192, "num_hidden_layers": 16}
            sizes = dict(num_experts=64, num_experts_per_tok=8, moe_intermediate_size=16,
                         shared_expert_intermediate_size=64)
        cfg = Qwen2MoeConfig(
            **common,
            **sizes,
            intermediate_size=common["hidden_size"],  # dense MLP size, unused (all layers sparse)
            norm_topk_prob=False,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
        return cfg, Qwen2MoeForCausalLM
    if family == "mixtral":
        from transformers import MixtralConfig, MixtralForCausalLM

        # I=256: 8 experts x 3 x 256 x 256 = 1.57M params per layer, the same as Qwen's 32 x 3 x 256 x 64,
        # and the active (top-2) expert params per token equal Qwen's top-4 + shared expert.
        cfg = MixtralConfig(**common, intermediate_size=256, num_local_experts=8, num_experts_per_tok=2)
        return cfg, MixtralForCausalLM
    if family == "deepseek_v2":
        from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

        # 64 x 3 x 256 x 32 = 1.57M routed-expert params per MoE layer, as in the other fixtures; 2 shared
        # experts (one MLP of 2 x 32); layer 0 dense (I 512). MLA attention scaled from DeepSeek-V2-Lite
        # (kv_lora_rank H/4, nope:rope 2:1, no q LoRA); MLA expands K/V per head, so KV heads == heads.
        # DeepseekV2Config has no router_aux_loss_coef field: it is stored as an extra attribute.
        cfg = DeepseekV2Config(
            **{**common, "num_key_value_heads": common["num_attention_heads"]},
            intermediate_size=512,  # the dense first layer
            first_k_dense_replace=1,
            n_routed_experts=64,
            num_experts_per_tok=6,
            moe_intermediate_size=32,
            n_shared_experts=2,
            topk_method="greedy",
            norm_topk_prob=False,
            routed_scaling_factor=1.0,
            q_lora_rank=None,
            kv_lora_rank=64,
            qk_nope_head_dim=32,
            qk_rope_head_dim=16,
            v_head_dim=32,
        )
        return cfg, DeepseekV2ForCausalLM
    raise SystemExit(f"unknown family {family}")


def load_valid(tok, domain: str) -> torch.Tensor:
    ids: list[int] = []
    with open(DATA / f"valid_{domain}.jsonl", encoding="utf-8") as f:
        for line in f:
            ids.extend(tok(json.loads(line)["text"], add_special_tokens=False)["input_ids"])
            ids.append(tok.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


@torch.no_grad()
def evaluate(model, tok, seq: int = 256, batch: int = 16) -> dict:
    """CE / next-token accuracy over non-overlapping `seq` windows of the committed validation set,
    plus mean router probabilities (softmax over all experts) of the top-1..top-k experts per layer."""
    model.eval()
    k = model.config.num_experts_per_tok
    res = {}
    router = None
    for dom in ("docs", "code"):
        ids = load_valid(tok, dom)
        n = ids.numel() // seq
        windows = ids[: n * seq].view(n, seq)
        nll, correct, count = 0.0, 0, 0
        for i in range(0, n, batch):
            x = windows[i : i + batch]
            out = model(input_ids=x, output_router_logits=True, use_cache=False)
            logits = out.logits[:, :-1].float()
            tgt = x[:, 1:]
            nll += torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), tgt.reshape(-1), reduction="sum").item()
            correct += (logits.argmax(-1) == tgt).sum().item()
            count += tgt.numel()
            rl = out.router_logits
            probs = [torch.softmax(r.float().reshape(-1, r.size(-1)), -1).topk(k, -1).values.sum(0) for r in rl]
            cur = torch.stack(probs)  # [layers, k]
            router = (cur, x.numel()) if router is None else (router[0] + cur, router[1] + x.numel())
        res[dom] = {"ce": nll / count, "acc": correct / count, "tokens": count}
    res["router_topk_mean_p"] = (router[0] / router[1]).tolist()
    res["router_layers"] = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")]
    return res


def aux_loss(model, out) -> torch.Tensor | None:
    """The model's load-balancing loss, or (DeepseekV2ForCausalLM, which returns router logits but no aux loss)
    the same Switch-style loss transformers uses for Qwen2-MoE / Mixtral, over all MoE layers' router logits."""
    if out.aux_loss is not None:
        return out.aux_loss
    if not out.router_logits:
        return None
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    cfg = model.config
    return load_balancing_loss_func(tuple(out.router_logits), cfg.num_experts, cfg.num_experts_per_tok)


def lr_at(step: int, progress: float, peak: float, warmup: int, floor: float = 0.1) -> float:
    """Linear warmup over `warmup` steps, then cosine from peak to floor*peak as progress goes 0 -> 1."""
    cos = peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))
    return min(cos, peak * (step + 1) / warmup)


def portable_tokenizer_class(folder: Path) -> None:
    """transformers 5 writes "TokenizersBackend"; "PreTrainedTokenizerFast" (an alias in v5) also loads in v4."""
    p = Path(folder) / "tokenizer_config.json"
    cfg = json.loads(p.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    for key in ("is_local", "local_files_only"):  # load-time flags transformers 5 writes back
        cfg.pop(key, None)
    p.write_text(json.dumps(cfg, indent=2) + "\n")


def save(model, tok, out: Path, family: str) -> None:
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    model = model.to(torch.bfloat16)
    model.config.output_router_logits = False  # inference default; aux coef stays recorded
    model.config.use_cache = True
    eos = tok.eos_token_id
    model.generation_config = GenerationConfig(bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    portable_tokenizer_class(out)
    model.to(torch.float32)
    model.config.output_router_logits = True


def write_card(out: Path, info: dict) -> None:
    a = info["args"]
    ev = info["eval"]
    name = Path(a["out"]).name
    cfg = json.loads((Path(out) / "config.json").read_text())
    if info["family"] in ("qwen2_moe", "qwen2_moe_deep"):
        arch = (f"Qwen2MoeForCausalLM: {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, "
                f"{cfg['num_attention_heads']} heads ({cfg['num_key_value_heads']} KV), N {cfg['num_experts']} experts, "
                f"top-{cfg['num_experts_per_tok']}, moe_intermediate_size {cfg['moe_intermediate_size']}, "
                f"shared expert {cfg['shared_expert_intermediate_size']} (sigmoid-gated), norm_topk_prob {cfg['norm_topk_prob']}")
    elif info["family"] == "deepseek_v2":
        nd = cfg["first_k_dense_replace"]
        arch = (f"DeepseekV2ForCausalLM: {cfg['num_hidden_layers']} layers (first {nd} dense, MLP intermediate_size "
                f"{cfg['intermediate_size']}; the rest MoE), hidden {cfg['hidden_size']}, {cfg['num_attention_heads']} heads, "
                f"MLA attention (q_lora_rank {cfg['q_lora_rank']}, kv_lora_rank {cfg['kv_lora_rank']}, qk_nope_head_dim "
                f"{cfg['qk_nope_head_dim']}, qk_rope_head_dim {cfg['qk_rope_head_dim']}, v_head_dim {cfg['v_head_dim']}), "
                f"N {cfg['n_routed_experts']} routed experts, top-{cfg['num_experts_per_tok']} (`topk_method` "
                f"{cfg['topk_method']}, softmax scores), moe_intermediate_size {cfg['moe_intermediate_size']}, "
                f"{cfg['n_shared_experts']} shared experts (one ungated MLP of {cfg['n_shared_experts']} x "
                f"{cfg['moe_intermediate_size']}), norm_topk_prob {cfg['norm_topk_prob']}, routed_scaling_factor "
                f"{cfg['routed_scaling_factor']}")
    else:
        arch = (f"MixtralForCausalLM: {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, "
                f"{cfg['num_attention_heads']} heads ({cfg['num_key_value_heads']} KV), N {cfg['num_local_experts']} experts, "
                f"top-{cfg['num_experts_per_tok']}, intermediate_size {cfg['intermediate_size']}")
    size = sum(f.stat().st_size for f in Path(out).iterdir() if f.is_file()) / 2**20
    layers = ev.get("router_layers") or range(len(ev["router_topk_mean_p"]))
    rows = "\n".join(
        f"| {i} | " + " | ".join(f"{p:.3f}" for p in layer) + " |" for i, layer in zip(layers, ev["router_topk_mean_p"])
    )
    k = len(ev["router_topk_mean_p"][0])
    sched = f"LR schedule over {info['steps']} steps" + (
        f" (`--epochs {a['epochs']}`: ceil({a['epochs']} x {info['train_tokens']:,} / ({a['batch']} x {a['seq']})))."
        if a.get("epochs") else ".")
    if info["family"] == "deepseek_v2":
        aux_src = ("DeepseekV2ForCausalLM returns router logits but no aux loss, so `train_fixture.py` adds "
                   "transformers' Switch-style `load_balancing_loss_func` over the MoE layers' router logits, "
                   f"coefficient {cfg['router_aux_loss_coef']}")
    else:
        aux_src = f"`output_router_logits=True`, `router_aux_loss_coef={cfg['router_aux_loss_coef']}`"
    load = info.get("loadavg")
    load = f" (1-min load average {load[0]:.2f} at start, {load[1]:.2f} at end)" if load else ""
    text = f"""# {name}

Small MoE test fixture for lynx_hf, trained from scratch on CPU by `python -m lab.train_fixture`.
It is a *fixture*, not a useful language model: it exists so tests, evaluation and the demo
can load a real trained MoE with `from_pretrained` offline.

## Model
- {arch}
- vocab {cfg['vocab_size']} (byte-level BPE, `<|endoftext|>` = id 0 = bos/eos/pad), tied embeddings,
  {info['params'] / 1e6:.2f}M parameters, stored in bfloat16 (`model.safetensors`), {size:.1f} MiB folder.
- Saved with `output_router_logits: false`; trained with the router load-balancing loss on
  ({aux_src}).
- Tokenizer: left padding (`padding_side: left`), pad = eos; identical in all fixtures.

## Data (PSF licence)
- docs: reST sources of the Python 3.11 documentation (Debian bookworm `python3.11-doc` 3.11.2-6+deb12u9,
  `/usr/share/doc/python3.11-doc/html/_sources/**/*.txt`).
- code: CPython 3.11 standard library (Debian `libpython3.11-stdlib` / `-minimal` 3.11.2-6+deb12u9, `/usr/lib/python3.11/**/*.py`,
  without `test/`, `tests/`, `idle_test/`, site/dist-packages).
- File-level split: `sha1("<docs|code>/<relative path>") % 20 == 0` -> validation. Tokenizer and
  training use the train split only ({info['train_tokens']:,} tokens). The committed held-out set is
  `eval/data/valid_docs.jsonl` / `valid_code.jsonl` (validation files, each truncated to 12,000 chars).
  Built by `python -m lab.build_corpus`.

## Training
- Command: `{info['command']}` (after `python -m lab.build_corpus`)
- {sched}
- {info['steps']} steps x batch {a['batch']} x {a['seq']} tokens = {info['tokens_seen']:,} tokens seen
  ({info['epochs']:.2f} epochs), {info['wall_minutes']:.1f} min wall ({info['wall_minutes'] * 60 / max(info['steps'], 1):.2f} s/step)
  on {a['threads']} CPU threads{load}, fp32, AdamW (betas 0.9/0.95, wd {a['weight_decay']}), peak lr {a['lr']},
  {a['warmup']} warmup steps, cosine to 10 %, grad clip 1.0, seed {a['seed']},
  experts implementation `{a['experts_impl']}`; torch {info['torch']}, transformers {info['transformers']}.
- Final training LM loss (last logged batch): {info['log'][-1]['lm_loss'] if info['log'] else 'n/a'}, aux loss {info['log'][-1]['aux'] if info['log'] else 'n/a'}.
- Not bit-reproducible across CPUs / thread counts: the committed weights are the reference.

## Held-out metrics (committed checkpoint, {info['eval_dtype']}, non-overlapping 256-token windows)
| split | tokens | cross-entropy (nats) | next-token accuracy |
|---|---|---|---|
| docs | {ev['docs']['tokens']:,} | {ev['docs']['ce']:.3f} | {ev['docs']['acc']:.3f} |
| code | {ev['code']['tokens']:,} | {ev['code']['ce']:.3f} | {ev['code']['acc']:.3f} |

Reproduce: `python -m lab.train_fixture --eval-only --out eval/fixtures/{name}`.

## Router confidence (same windows, docs + code)
Mean softmax probability (over all experts) of the rank-1..rank-{k} expert, per layer:

| layer | """ + " | ".join(f"rank {r + 1}" for r in range(k)) + """ |
|---|""" + "---|" * k + f"""
{rows}
"""
    note = info.get("note") or a.get("note")
    if note:
        text += f"\n## Notes\n{note}\n"
    (Path(out) / "CARD.md").write_text(text)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", choices=["qwen2_moe", "qwen2_moe_deep", "mixtral", "deepseek_v2"], default="qwen2_moe")
    length = ap.add_mutually_exclusive_group()
    length.add_argument("--steps", type=int, default=2000, help="optimizer steps (the LR schedule length)")
    length.add_argument("--epochs", type=float, help="derive --steps: ceil(E * train tokens / (batch * seq))")
    ap.add_argument("--note", default="", help="free text for the card's Notes section (e.g. machine load)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--tokens", type=Path, default=WORK / "train_tokens.npy")
    ap.add_argument("--tokenizer", type=Path, default=WORK / "tokenizer")
    ap.add_argument("--experts-impl", default="grouped_mm")
    ap.add_argument("--ckpt-every", type=int, default=100,
                    help="steps between resumable checkpoints (eval/work/train_ckpt_<out name>.pt; a rerun with the same "
                         "settings resumes from it; 0: none)")
    ap.add_argument("--eval-only", action="store_true")
    ap.add_argument("--card-only", action="store_true", help="rewrite CARD.md from eval/work/train_log_<name>.json (and --note)")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    torch.manual_seed(args.seed)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.card_only:
        info = json.loads((WORK / f"train_log_{args.out.name}.json").read_text())
        info["note"] = args.note or info.get("note") or info["args"].get("note")
        write_card(args.out, info)
        return
    if args.eval_only:
        tok = AutoTokenizer.from_pretrained(args.out)
        model = AutoModelForCausalLM.from_pretrained(args.out)
        if args.experts_impl and hasattr(model, "set_experts_implementation"):
            model.set_experts_implementation(args.experts_impl)
        t0 = time.time()
        print(json.dumps(evaluate(model, tok, args.seq), indent=1), f"({time.time() - t0:.0f}s, dtype {model.dtype})")
        return

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    data = torch.from_numpy(np.load(args.tokens).astype(np.int64))
    cfg, cls = make_config(args.family, len(tok), tok.eos_token_id)
    model = cls(cfg).float()
    if args.experts_impl and hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(args.experts_impl)
    nparams = sum(p.numel() for p in model.parameters())
    if args.epochs:
        args.steps = math.ceil(args.epochs * data.numel() / (args.batch * args.seq))
    print(f"{args.family}: {nparams / 1e6:.2f}M params, {data.numel()} train tokens, {args.steps} steps", flush=True)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
    )
    gen = torch.Generator().manual_seed(args.seed)
    coef = cfg.router_aux_loss_coef
    model.train()
    load0 = os.getloadavg()[0]
    log = []
    tokens_seen = 0
    first, spent = 0, 0.0
    ckpt = WORK / f"train_ckpt_{args.out.name}.pt"
    ckpt_key = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in ("note", "ckpt_every", "out")}
    if args.ckpt_every and ckpt.is_file():
        state = torch.load(ckpt, weights_only=False)
        if state["key"] == ckpt_key:
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            gen.set_state(state["gen"])
            first, spent, log, tokens_seen, load0 = state["step"], state["seconds"], state["log"], state["tokens"], state["load0"]
            print(f"resumed from {ckpt} at step {first} ({spent / 60:.1f} min spent)", flush=True)
        else:
            print(f"{ckpt} was written with other settings: starting afresh", flush=True)
    t0 = time.time() - spent
    for step in range(first, args.steps):
        lr = lr_at(step, step / args.steps, args.lr, args.warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, data.numel() - args.seq, (args.batch,), generator=gen)
        x = torch.stack([data[s : s + args.seq] for s in starts.tolist()])
        out = model(input_ids=x, labels=x, use_cache=False)
        aux = aux_loss(model, out)
        # Qwen2-MoE / Mixtral already add coef * aux_loss to out.loss; DeepSeek-V2 does not
        loss = out.loss if out.aux_loss is not None or aux is None else out.loss + coef * aux
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        tokens_seen += x.numel()
        if (step + 1) % 25 == 0 or step + 1 == args.steps:
            a = aux.item() if aux is not None else 0.0
            el = time.time() - t0
            rec = {"step": step + 1, "lm_loss": round(loss.item() - coef * a, 4), "aux": round(a, 4), "lr": round(lr, 6),
                   "gnorm": round(gn.item(), 3), "min": round(el / 60, 2)}
            log.append(rec)
            print(json.dumps(rec), flush=True)
        if args.ckpt_every and (step + 1) % args.ckpt_every == 0 and step + 1 < args.steps:
            WORK.mkdir(parents=True, exist_ok=True)
            state = {"key": ckpt_key, "model": model.state_dict(), "opt": opt.state_dict(), "gen": gen.get_state(),
                     "step": step + 1, "seconds": time.time() - t0, "log": log, "tokens": tokens_seen, "load0": load0}
            torch.save(state, ckpt.with_suffix(".tmp"))
            os.replace(ckpt.with_suffix(".tmp"), ckpt)
    wall = time.time() - t0
    loadavg = [load0, os.getloadavg()[0]]
    ckpt.unlink(missing_ok=True)

    save(model, tok, args.out, args.family)
    # metrics of the committed (bf16) checkpoint, as users load it
    m = AutoModelForCausalLM.from_pretrained(args.out)
    if args.experts_impl and hasattr(m, "set_experts_implementation"):
        m.set_experts_implementation(args.experts_impl)
    ev = evaluate(m, tok, args.seq)
    print(json.dumps(ev, indent=1), flush=True)
    info = {
        "family": args.family,
        "command": "python -m lab.train_fixture " + " ".join(sys.argv[1:]),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "params": nparams,
        "steps": args.steps,
        "tokens_seen": tokens_seen,
        "train_tokens": data.numel(),
        "epochs": tokens_seen / data.numel(),
        "wall_minutes": wall / 60,
        "loadavg": loadavg,
        "eval_dtype": str(m.dtype),
        "eval": ev,
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "cpu": platform.processor() or platform.machine(),
        "log": log,
    }
    WORK.mkdir(parents=True, exist_ok=True)
    (WORK / f"train_log_{args.out.name}.json").write_text(json.dumps(info, indent=1))
    write_card(args.out, info)
    print(f"saved {args.out} ({sum(f.stat().st_size for f in args.out.iterdir()) / 2**20:.1f} MiB), {wall / 60:.1f} min", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
