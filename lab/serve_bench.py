"""vLLM serving benchmark on CPU: decode TPOT and throughput, unpatched vLLM vs the lynx_hf plugin
with LYNX default and OEA k0=1, at several numbers of concurrent requests. Runs in the vLLM environment
(.venv-vllm, built by .ci/vllm_env.sh).

    .venv-vllm/bin/python -m lab.serve_bench          # full run (writes eval/results/serve_bench.{md,json})
    .venv-vllm/bin/python -m lab.serve_bench --tiny   # dry run: 1/16-scaled shapes, 4 requests, 8 tokens

Models
- ``fixture-a``: the committed trained fixture eval/fixtures/qwen2moe-tiny (N 32, k 4), real text prompts
  (held-out documents), so the routing is a trained router's.
- ``qwen2-57b-2l``: the Qwen2-57B-A14B configuration (H 3584, N 64, k 8, moe I 2560, shared I 20480, 28/4
  heads) cut to 2 decoder layers with a 4096-token vocabulary (fixture A's tokenizer), random bf16 weights
  written to a temporary directory (never the hub), so the expert weights dominate a decode step as in the
  real model. Router weights are scaled as in lynx_hf.eval.bench's ``build_tpot_model``: unit-RMS normed inputs and
  router weights U(-a, a) with a chosen so that the logits' spread gives a mean top-1 router probability of
  0.42 (``calibrate_temperature``: the trained fixtures' routers have mean top-1 p 0.34-0.50). Prompts are
  random token ids.

Protocol: one engine per (model, variant), each in its own process (in-process engine core, stepped by
hand); variants are alternated, rotating the order each round. Per concurrency C: a warm-up batch, then C
requests of ``--prompt-tokens`` tokens added at once, greedy, ``ignore_eos``, ``--max-tokens`` new tokens
each. Per request TPOT = (time of its last token - time of its first token) / (tokens - 1), as vLLM's own
benchmarks define it; reported: the median over requests, the decode throughput C * (tokens - 1) / (decode
span) and the whole-batch throughput (prefill included); ratios to unpatched are per round (paired), median
over rounds. The plugin's telemetry gives the unique experts per MoE layer per decode step before/after.
``--interleave`` (for a drifting host): one persistent engine per variant (``--serve`` workers, all alive at once,
idle while another steps), and per concurrency every round, the variants alternated cell by cell
(:func:`interleaved_schedule`), so the two cells a ratio pairs run seconds apart instead of a whole curve apart; its
rounds repeat cells within the same engines (they sample the host's drift, not engine start-up). Memory: every
variant's engine at once. One fp32 engine of the 1-layer real shape holds 10.0 GB after start and peaks at 15.7 GB
while it loads (vLLM's CPU MoE backend repacks the experts; the same from an fp32 checkpoint), so two do not fit in
this machine's 24 GB (the second engine was OOM-killed while loading): ``--interleave`` at that shape needs ~28 GB.
``--same-engine`` (implies ``--interleave``) fits one: a single engine, started with the plugin at the LYNX
variant's configuration and switched before every cell (``lynx_hf.vllm.configure``); its ``unpatched`` side is
:data:`SAME_ENGINE_BASELINE` (LYNX at price 0: nothing to save, so the default cost gate bypasses every layer: vLLM's
own routing and experts; the plugin's hook frames stay: issue 54 item 7 measured that path against vLLM without the
plugin), and each cell's telemetry says how many layers were bypassed.
Timings on a shared machine are noisy: read the ratios, and run nothing else meanwhile.

Routing-mass price: the default's price depends on the model's MoE depth (7/64 x 4 / L above 4 MoE layers), and the
plugin prices a 2-layer cut as a 2-layer model. ``--full-layers`` (``lynx_hf.eval.depth``; default ``real``: Qwen2-57B-A14B's
28 MoE layers, price 1/64) gives the real-shape model's LYNX engines the full model's price: the configuration passed
to each vLLM worker (``additional_config={"lynx": ...}``) carries ``mass_price`` scaled and ``price_ref_layers: None``
(``lynx_hf.at_depth``); ``cut``: the price as given (every run before issue 52). Fixture A runs whole, at its own 4 MoE
layers (7/64). Each row records the price it ran (``mass_price``, ``full_layers``) and the table says it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lynx_hf.eval.depth import add_full_layers, full_depth, options_at_depth, price_of
from lynx_hf.eval.slo import VARIANTS as SLO_VARIANTS
from lynx_hf.eval.slo import point_price
from lynx_hf.eval.slo import variants as slo_variants

from . import DATA_DIR, ROOT, command
from . import DEFAULT_FIXTURE as FIXTURE_A
from . import RESULTS_DIR as RESULTS

VARIANTS = {
    "unpatched": None,  # the plugin is installed (entry point) but off: vLLM's own code path
    "lynx": {"policy": "lynx"},  # LynxConfig() defaults
    "oea": {"policy": "oea", "oea_k0": 1},
    "xshare": SLO_VARIANTS["xshare"],  # budget matched to the default's experts at 16 requests (--xshare-budget)
    "none": {"policy": "none"},  # optional: the plugin's own cost (hook, telemetry) without a remap
}
DEFAULT_VARIANTS = ("unpatched", "lynx", "oea")

# Qwen2-57B-A14B (config.json of the public checkpoint), cut to 2 layers, small vocabulary
QWEN2_57B = dict(hidden_size=3584, moe_intermediate_size=2560, num_experts=64, num_experts_per_tok=8,
                 shared_expert_intermediate_size=20480, intermediate_size=18944, num_attention_heads=28,
                 num_key_value_heads=4, norm_topk_prob=False)
SCALED_KEYS = ("hidden_size", "moe_intermediate_size", "shared_expert_intermediate_size", "intermediate_size")


# ------------------------------------------------------------------------------------------ model
def moe_layers_of(config: dict) -> int:
    """MoE layers of a Qwen2-MoE ``config.json`` (every ``decoder_sparse_step``-th layer not in ``mlp_only_layers``)."""
    step, dense = config.get("decoder_sparse_step", 1), set(config.get("mlp_only_layers") or [])
    return sum(1 for i in range(config["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0)


def engine_lynx(variant: str, model: str, full_layers, cut_layers: int,
                xshare_budget: int | None = None) -> tuple[dict | None, dict]:
    """The plugin configuration a worker of ``variant`` on ``model`` gets (``additional_config={"lynx": ...}``;
    ``None``: unpatched) and what the rows record of its price: ``{"mass_price", "full_layers", "cut_layers"}``.
    The real-shape model (a cut of ``cut_layers`` layers) at the depth ``--full-layers`` gives; fixture A whole.
    XShare's budget: ``xshare_budget``, else the one matched to LYNX at that price (:func:`lynx_hf.eval.slo.variants`)."""
    table = {**VARIANTS, "xshare": slo_variants(xshare_budget, full_layers)["xshare"]}
    if model == "fixture-a":
        own = moe_layers_of(json.loads((FIXTURE_A / "config.json").read_text()))
        options = table[variant]
        return options, {"mass_price": price_of(options, own), "full_layers": own, "cut_layers": own}
    depth = full_depth(full_layers, "qwen2-57b-a14b")
    options = options_at_depth(table[variant], depth)
    return options, {"mass_price": price_of(options, cut_layers), "full_layers": depth or "cut", "cut_layers": cut_layers}


def real_shape_config(layers: int, vocab: int, scale: int) -> dict:
    kw = dict(QWEN2_57B)
    for key in SCALED_KEYS:
        kw[key] = max(64, kw[key] // scale)
    if scale > 1:  # dry runs: head_dim 32 (a size vLLM's CPU attention supports), GQA ratio 7 as 28 / 4
        kw["num_attention_heads"] = max(1, kw["hidden_size"] // 32)
        kw["num_key_value_heads"] = max(1, kw["num_attention_heads"] // 7)
    return {
        "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", **kw,
        "num_hidden_layers": layers, "vocab_size": vocab, "max_position_embeddings": 4096,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "qkv_bias": True, "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}, "tie_word_embeddings": False, "use_sliding_window": False,
        "sliding_window": None, "max_window_layers": layers, "bos_token_id": 0, "eos_token_id": 0,
        "pad_token_id": 0, "torch_dtype": "bfloat16", "dtype": "bfloat16", "router_aux_loss_coef": 0.001,
        "output_router_logits": False, "initializer_range": 0.02, "use_cache": True, "attention_dropout": 0.0,
    }


def router_bound(num_experts: int, top_k: int, hidden: int) -> tuple[float, dict]:
    """Router weights U(-a, a) on unit-RMS inputs give logits of std a * sqrt(H / 3); a is chosen so that this
    std is lynx_hf.eval.bench's calibrated temperature (mean top-1 router probability 0.42)."""
    from lynx_hf.eval.bench import calibrate_temperature  # same calibration as the HF TPOT benchmark

    scale, stats = calibrate_temperature(num_experts, top_k)
    return scale * math.sqrt(3.0 / hidden), stats


def write_real_shape_model(path: Path, layers: int = 2, vocab: int = 4096, scale: int = 1, seed: int = 3) -> dict:
    """Write a random-weight Qwen2-MoE checkpoint at real layer shapes to ``path`` (one safetensors shard per
    decoder layer, HF's per-expert tensor names, bf16) plus fixture A's tokenizer. Returns the config."""
    import torch
    from safetensors.torch import save_file

    cfg = real_shape_config(layers, vocab, scale)
    h, n = cfg["hidden_size"], cfg["num_experts"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = h // heads
    bound, calib = router_bound(n, cfg["num_experts_per_tok"], h)
    gen = torch.Generator().manual_seed(seed)

    def uniform(*shape, a=0.02):
        return torch.empty(*shape, dtype=torch.float32).uniform_(-a, a, generator=gen).to(torch.bfloat16)

    def ones(*shape):
        return torch.ones(*shape, dtype=torch.bfloat16)

    path.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    shards = []

    def flush(tensors: dict, name: str):
        save_file(tensors, str(path / name), metadata={"format": "pt"})
        weight_map.update({key: name for key in tensors})
        shards.append(name)

    total = layers + 1
    flush({"model.embed_tokens.weight": torch.empty(vocab, h).normal_(0, 1, generator=gen).to(torch.bfloat16),
           "model.norm.weight": ones(h), "lm_head.weight": uniform(vocab, h)},
          f"model-00001-of-{total:05d}.safetensors")
    for layer in range(layers):
        p = f"model.layers.{layer}."
        t = {p + "input_layernorm.weight": ones(h), p + "post_attention_layernorm.weight": ones(h),
             p + "self_attn.q_proj.weight": uniform(heads * head_dim, h), p + "self_attn.q_proj.bias": uniform(heads * head_dim),
             p + "self_attn.k_proj.weight": uniform(kv * head_dim, h), p + "self_attn.k_proj.bias": uniform(kv * head_dim),
             p + "self_attn.v_proj.weight": uniform(kv * head_dim, h), p + "self_attn.v_proj.bias": uniform(kv * head_dim),
             p + "self_attn.o_proj.weight": uniform(h, heads * head_dim),
             p + "mlp.gate.weight": uniform(n, h, a=bound),
             p + "mlp.shared_expert_gate.weight": uniform(1, h)}
        si, mi = cfg["shared_expert_intermediate_size"], cfg["moe_intermediate_size"]
        for proj, shape in (("gate_proj", (si, h)), ("up_proj", (si, h)), ("down_proj", (h, si))):
            t[p + f"mlp.shared_expert.{proj}.weight"] = uniform(*shape)
        for e in range(n):
            for proj, shape in (("gate_proj", (mi, h)), ("up_proj", (mi, h)), ("down_proj", (h, mi))):
                t[p + f"mlp.experts.{e}.{proj}.weight"] = uniform(*shape)
        flush(t, f"model-{layer + 2:05d}-of-{total:05d}.safetensors")
        del t
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(FIXTURE_A / name, path / name)
    (path / "lynx_bench_model.json").write_text(json.dumps({"layers": layers, "vocab": vocab, "scale": scale,
                                                            "seed": seed, "router_bound": bound, "calibration": calib}))
    return cfg


def real_shape_model(args) -> Path:
    """The cached random-weight checkpoint for ``args`` (built once per (layers, vocab, scale))."""
    base = Path(args.model_dir) if args.model_dir else Path(tempfile.gettempdir())
    path = base / f"lynx_serve_bench_qwen2-57b_{args.layers}l_v{args.vocab}_s{args.scale}"
    marker = path / "lynx_bench_model.json"
    if not marker.exists():
        if path.exists():
            shutil.rmtree(path)
        t = time.perf_counter()
        print(f"writing the random-weight model to {path} ...", flush=True)
        write_real_shape_model(path, args.layers, args.vocab, args.scale)
        print(f"  written in {time.perf_counter() - t:.0f} s", flush=True)
    return path


# ------------------------------------------------------------------------------------------ prompts
def make_prompts(model: str, tokenizer_dir: Path, count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """``count`` prompts of exactly ``length`` token ids: held-out documents (fixture) or random ids."""
    if model == "fixture-a":
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
        docs = [json.loads(line)["text"] for line in (DATA_DIR / "valid_docs.jsonl").read_text().splitlines()]
        docs += [json.loads(line)["text"] for line in (DATA_DIR / "valid_code.jsonl").read_text().splitlines()]
        encoded = [tok.encode(doc).ids for doc in docs]
        out, seen = [], set()
        for w in range(64):  # window w of every document in turn (documents differ more than windows)
            for d in range(len(encoded)):
                ids = encoded[(seed + d) % len(encoded)]
                window = tuple(ids[w * length:(w + 1) * length])
                if len(window) == length and window not in seen:  # distinct prompts (files share headers)
                    seen.add(window)
                    out.append(list(window))
                    if len(out) == count:
                        return out
        raise RuntimeError(f"not enough held-out text for {count} prompts of {length} tokens")
    import random

    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(length)] for _ in range(count)]


# ------------------------------------------------------------------------------------------ worker
def timed_batch(llm, prompts: list[list[int]], max_tokens: int) -> dict:
    """Add every prompt at once, step the engine until all finish; per-request first/last token times."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    first, last, count = {}, {}, {}
    t0 = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", TokensPrompt(prompt_token_ids=ids), params)
    steps = 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        steps += 1
        for out in outs:
            n = len(out.outputs[0].token_ids)
            if n and out.request_id not in first:
                first[out.request_id] = now
            if n:
                last[out.request_id] = now
                count[out.request_id] = n
    t1 = time.perf_counter()
    tpots = [(last[r] - first[r]) / (count[r] - 1) for r in first if count[r] > 1]
    span = max(last.values()) - min(first.values())
    decode_tokens = sum(count[r] - 1 for r in first)
    return {"steps": steps, "wall_s": t1 - t0, "tpot_ms": statistics.median(tpots) * 1e3,
            "decode_tok_s": decode_tokens / span if span > 0 else None,
            "total_tok_s": sum(count.values()) / (t1 - t0), "tokens": sum(count.values())}


def make_llm(spec: dict):
    """The engine a worker's ``spec`` describes (``model_path``, ``dtype``, ``eager``, ``concurrency`` list,
    ``prompt_tokens``, ``max_tokens``, ``lynx``: the plugin's configuration or ``None``), sized for its largest
    concurrency: a ``vllm.LLM``."""
    from vllm import LLM

    kwargs = {}
    if spec["lynx"] is not None:
        kwargs["additional_config"] = {"lynx": spec["lynx"]}
    top = max(spec["concurrency"])
    return LLM(model=spec["model_path"], dtype=spec.get("dtype", "bfloat16"), enforce_eager=spec["eager"], seed=0,
               max_model_len=spec["prompt_tokens"] + spec["max_tokens"] + 16, max_num_seqs=top,
               max_num_batched_tokens=max(2048, top * spec["prompt_tokens"]),
               enable_prefix_caching=False,  # the warm-up batch must not make the timed prefill a cache hit
               **kwargs)


def measure_cell(llm, spec: dict, c: int) -> dict:
    """One cell: ``c`` requests (:func:`make_prompts`, seed ``c``) after a warm-up batch of the same prompts (4 new
    tokens: also the compiled graph), the plugin's telemetry reset between: :func:`timed_batch`'s figures plus
    ``unique_before`` / ``unique_after`` / ``decode_steps_seen`` / ``gate_bypassed_layers`` (``None`` unpatched)."""
    import lynx_hf.vllm as lynx_vllm

    prompts = make_prompts(spec["model"], Path(spec["model_path"]), c, spec["prompt_tokens"], spec["vocab"], seed=c)
    timed_batch(llm, prompts, min(4, spec["max_tokens"]))  # warm-up (also the compiled graph)
    lynx_vllm.reset_stats(llm)
    cell = timed_batch(llm, prompts, spec["max_tokens"])
    stats = lynx_vllm.stats(llm)[0]
    cell["unique_before"] = stats["summary"]["unique_experts_before"] if stats["layers"] else None
    cell["unique_after"] = stats["summary"]["unique_experts_after"] if stats["layers"] else None
    cell["decode_steps_seen"] = stats["summary"]["decode_steps"] if stats["layers"] else None
    cell["gate_bypassed_layers"] = stats["summary"].get("gate_bypassed_layers") if stats["layers"] else None
    return cell


def _cell_line(spec: dict, c: int, cell: dict) -> str:
    return (f"  {spec['model']} {spec['variant']:9s} C={c:3d}: TPOT {cell['tpot_ms']:8.1f} ms  decode "
            f"{cell['decode_tok_s']:8.1f} tok/s  T {cell['unique_before']} -> {cell['unique_after']}")


def worker(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    t0 = time.perf_counter()
    llm = make_llm(spec)
    start_s = time.perf_counter() - t0
    result = {"variant": spec["variant"], "engine_start_s": start_s, "cells": {}}
    for c in spec["concurrency"]:
        cell = measure_cell(llm, spec, c)
        result["cells"][str(c)] = cell
        print(_cell_line(spec, c, cell), flush=True)
    Path(out_path).write_text(json.dumps(result))


#: the prefix of a persistent worker's answer lines on its stdout (vLLM's own output passes through unmarked)
ANSWER = "@@serve_bench "


def serve(spec_path: str) -> None:
    """A persistent worker (``--interleave``): the engine of ``spec`` started once, then one cell per request line
    on stdin (``{"c": C}``; ``{"quit": true}`` or end of input stops it), each answered by one line ``ANSWER + JSON``
    on stdout (``{"ready": true, "engine_start_s": s}`` first). A request with ``"configure": options`` first switches
    the running engine's policy (``lynx_hf.vllm.configure``; ``--same-engine``)."""
    spec = json.loads(Path(spec_path).read_text())
    t0 = time.perf_counter()
    llm = make_llm(spec)
    print(ANSWER + json.dumps({"ready": True, "engine_start_s": time.perf_counter() - t0}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("quit"):
            break
        if "configure" in req:
            import lynx_hf.vllm as lynx_vllm

            lynx_vllm.configure(llm, req["configure"])
        cell = measure_cell(llm, spec, int(req["c"]))
        print(ANSWER + json.dumps(cell), flush=True)


class Engine:
    """The driver's side of one persistent worker (:func:`serve`): ``Engine(spec, work, env)`` starts it and waits
    until its engine is up; ``cell(c)`` -> the cell dict; ``close()``. vLLM's log lines go to ``work/<name>.log``.
    Raises ``RuntimeError`` (with the log's tail) if the worker dies or answers nothing."""

    def __init__(self, spec: dict, work: Path, env: dict, worker=("lab.serve_bench", "--serve")):
        self.name = f"{spec['model']}_{spec['variant']}"
        spec_path = work / f"{self.name}.spec.json"
        spec_path.write_text(json.dumps(spec))
        self.log_path = work / f"{self.name}.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", *worker, str(spec_path)], cwd=ROOT, env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log)
        self.engine_start_s = self._answer()["engine_start_s"]

    def _answer(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(ANSWER):
                return json.loads(line[len(ANSWER):])
            self.log.write(line)
        self.log.flush()
        raise RuntimeError(f"engine {self.name} stopped without answering (exit {self.proc.wait()}):\n"
                           f"{self.log_path.read_text()[-6000:]}")

    def cell(self, c: int, configure: dict | None = None) -> dict:
        req = {"c": c} if configure is None else {"c": c, "configure": configure}
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def close(self) -> None:
        try:
            self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=120)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
        self.log.close()


def rotated(items, rnd: int) -> list:
    """``items`` as a list rotated left by ``rnd`` (round ``rnd``'s order: neither side always runs first)."""
    items = list(items)
    return items[rnd % len(items):] + items[:rnd % len(items)]


def interleaved_schedule(concurrency: list[int], rounds: int, variants: list[str]) -> list[tuple[int, int, str]]:
    """``[(C, round, variant)]`` in run order for ``--interleave``: per concurrency every round, per round every
    variant once, the variants' order rotated by the round (:func:`rotated`), so the cells a ratio pairs are seconds
    apart and neither side always runs first."""
    return [(c, rnd, v) for c in concurrency for rnd in range(rounds) for v in rotated(variants, rnd)]


#: ``--same-engine``'s baseline: LYNX at routing-mass price 0, under which every expert of the batch's union joins
#: the critical set (no token is remapped), so the default cost gate, expecting no saving, bypasses every layer:
#: vLLM's own routing and experts, the plugin's hook frames only (issue 54 item 7's "gate off" path, measured against
#: vLLM without the plugin: ~15 us of host time per step). Policy "none" would not do: it runs the plugin's op.
SAME_ENGINE_BASELINE = {"policy": "lynx", "mass_price": 0.0}


def run_interleaved(specs: dict[str, dict], concurrency: list[int], rounds: int, work: Path, env: dict,
                    engine=Engine, same_engine: bool = False) -> list[dict]:
    """``--interleave``: one persistent engine per variant (``specs``: variant -> worker spec), all alive at once,
    driven cell by cell in :func:`interleaved_schedule`'s order. ``same_engine`` (``--same-engine``): one engine
    only, started with the first patched variant's spec, switched before each cell to the variant's configuration
    (``lynx_hf.vllm.configure``; ``unpatched`` -> :data:`SAME_ENGINE_BASELINE`: every layer bypassed): one engine's memory, the same
    process and weights on both sides. Returns the same per-(variant, round) results as the one-engine-per-round
    protocol (``{"variant", "round", "engine_start_s", "cells": {str(C): cell}}``), so :func:`aggregate` pairs them
    per round the same way."""
    engines = {}
    try:
        if same_engine:
            patched = [v for v, spec in specs.items() if spec["lynx"] is not None]
            if not patched:
                raise ValueError("--same-engine needs a patched variant to start the engine with")
            shared = engine(specs[patched[0]], work, env)
            engines = {v: shared for v in specs}
        else:
            for v, spec in specs.items():
                engines[v] = engine(spec, work, env)
        out = {(v, r): {"variant": v, "round": r, "engine_start_s": engines[v].engine_start_s, "cells": {}}
               for v in specs for r in range(rounds)}
        for c, rnd, v in interleaved_schedule(concurrency, rounds, list(specs)):
            if same_engine:
                cell = engines[v].cell(c, configure=specs[v]["lynx"] or SAME_ENGINE_BASELINE)
            else:
                cell = engines[v].cell(c)
            out[(v, rnd)]["cells"][str(c)] = cell
            print(_cell_line(specs[v], c, cell) + f"  (round {rnd})", flush=True)
        return list(out.values())
    finally:
        for e in {id(e): e for e in engines.values()}.values():
            e.close()


# ------------------------------------------------------------------------------------------ driver
def run_engine(spec: dict, work: Path, env: dict, timeout: int, worker=("lab.serve_bench", "--worker")) -> dict:
    """Run one engine in its own process: ``python -m <module> <flag> SPEC OUT`` (``worker``, by default this
    module's :func:`worker`) on ``spec`` written to ``work``; returns the JSON it wrote, with ``process_s``. Raises
    ``RuntimeError`` with the process's output tails if it fails."""
    name = f"{spec['model']}_{spec['variant']}_r{spec['round']}"
    spec_path, out_path = work / f"{name}.spec.json", work / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", *worker, str(spec_path), str(out_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"engine {name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}")
    print(proc.stdout.strip(), flush=True)
    out = json.loads(out_path.read_text())
    out["process_s"] = time.perf_counter() - t
    return out


def aggregate(results: list[dict], variants: list[str]) -> list[dict]:
    """Rows per (model, concurrency, variant): medians over rounds, ratios to unpatched paired per round."""
    rows = []
    keys = sorted({(r["model"], c) for r in results for c in r["cells"]}, key=lambda k: (k[0], int(k[1])))
    for model, c in keys:
        by_round = {}
        for r in results:
            if r["model"] == model and c in r["cells"]:
                by_round.setdefault(r["round"], {})[r["variant"]] = r["cells"][c]
        for v in variants:
            cells = [rnd[v] for rnd in by_round.values() if v in rnd]
            if not cells:
                continue
            paired = [rnd for rnd in by_round.values() if v in rnd and "unpatched" in rnd]
            med = lambda key, cs=cells: statistics.median(x[key] for x in cs if x[key] is not None)  # noqa: E731
            row = {"model": model, "concurrency": int(c), "variant": v, "rounds": len(cells),
                   "tpot_ms": med("tpot_ms"), "decode_tok_s": med("decode_tok_s"), "total_tok_s": med("total_tok_s"),
                   "tpot_ms_rounds": [round(x["tpot_ms"], 2) for x in cells]}
            if paired:
                row["tpot_ratio"] = statistics.median(p[v]["tpot_ms"] / p["unpatched"]["tpot_ms"] for p in paired)
                row["decode_speedup"] = statistics.median(p[v]["decode_tok_s"] / p["unpatched"]["decode_tok_s"]
                                                          for p in paired)
            before = [x["unique_before"] for x in cells if x["unique_before"] is not None]
            after = [x["unique_after"] for x in cells if x["unique_after"] is not None]
            row["unique_before"] = statistics.median(before) if before else None
            row["unique_after"] = statistics.median(after) if after else None
            # no decode step went through the policy (the cost gate kept vLLM's routing): "gate off", not "0 -> 0"
            seen = [x.get("decode_steps_seen") for x in cells if x.get("decode_steps_seen") is not None]
            row["gate_off"] = bool(before) and bool(seen) and max(seen) == 0
            bypassed = [x["gate_bypassed_layers"] for x in cells if x.get("gate_bypassed_layers") is not None]
            row["gate_bypassed_layers"] = max(bypassed) if bypassed else None
            priced = [r for r in results if r["model"] == model and r["variant"] == v and "full_layers" in r]
            if priced:  # the price its engines ran (one per model and variant)
                row.update({key: priced[0][key] for key in ("mass_price", "full_layers", "cut_layers")})
            rows.append(row)
    return rows


def markdown(rows: list[dict], header: str) -> str:
    def f(x, fmt):
        return "—" if x is None else format(x, fmt)

    out = [header, "", "| model | C | variant | TPOT (ms) | TPOT ratio to unpatched | decode tok/s | decode speed-up | "
           "batch tok/s (with prefill) | unique experts before → after | TPOT per round (ms) | routing-mass price |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        t = "—" if r["unique_before"] is None else f"{r['unique_before']:.2f} → {r['unique_after']:.2f}"
        if r.get("gate_off"):
            bypassed = r.get("gate_bypassed_layers")
            t = "gate off: vLLM's routing" + (f" ({bypassed} layers bypassed)" if bypassed else "")
        out.append(f"| {r['model']} | {r['concurrency']} | {r['variant']} | {f(r['tpot_ms'], '.1f')} | "
                   f"{f(r.get('tpot_ratio'), '.3f')} | {f(r['decode_tok_s'], '.1f')} | {f(r.get('decode_speedup'), '.3f')} | "
                   f"{f(r['total_tok_s'], '.1f')} | {t} | {r['tpot_ms_rounds']} | {point_price(r)} |")
    return "\n".join(out) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["fixture-a", "qwen2-57b-2l"], choices=["fixture-a", "qwen2-57b-2l"])
    p.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), choices=list(VARIANTS))
    p.add_argument("--concurrency", nargs="+", type=int, default=[16, 64])
    p.add_argument("--rounds", type=int, default=2, help="engines per (model, variant), alternated")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--eager", action="store_true", help="enforce_eager (default: vLLM's compiled mode)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="the engine's dtype (the checkpoint is bf16; float32: CPUs without native bf16 (AVX2 only), "
                        "where vLLM's bf16 GEMMs fall back to slow paths)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers of the real-shape model")
    p.add_argument("--vocab", type=int, default=4096, help="vocabulary of the real-shape model (fixture A's tokenizer)")
    p.add_argument("--scale", type=int, default=1, help="divide the real-shape model's sizes by this (dry runs)")
    p.add_argument("--model-dir", default=None, help="where the random-weight model is written (default: temp dir)")
    p.add_argument("--kv-cache-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--timeout", type=int, default=3600, help="seconds per engine process")
    add_full_layers(p, "Qwen2-57B-A14B (the real-shape model; fixture A runs whole)")
    p.add_argument("--xshare-budget", type=int, default=None,
                   help="XShare's budget, experts per layer-step (default: matched to LYNX at 16 requests at the price "
                        "--full-layers gives: 41 at the full model's, 15 with --full-layers cut)")
    p.add_argument("--tiny", action="store_true", help="dry run: --scale 16, C 4, 8 tokens, 1 round, eager")
    p.add_argument("--out", type=Path, default=None, help="output stem (default: eval/results/serve_bench[_tiny])")
    p.add_argument("--interleave", action="store_true",
                   help="one persistent engine per variant, all alive; per concurrency every round, the variants "
                        "alternated cell by cell (the cells a ratio pairs run seconds apart: for drifting hosts)")
    p.add_argument("--same-engine", action="store_true",
                   help="with --interleave: one engine for every variant, its policy switched per cell "
                        "(lynx_hf.vllm.configure; unpatched = the plugin at price 0, every layer bypassed): "
                        "one engine's memory")
    p.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    p.add_argument("--serve", metavar="SPEC", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.tiny:
        args.scale, args.concurrency, args.max_tokens, args.prompt_tokens, args.rounds = 16, [4], 8, 8, 1
        args.eager = True
    if args.same_engine:
        args.interleave = True
    if args.out is None:
        args.out = RESULTS / ("serve_bench_tiny" if args.tiny else "serve_bench")
    if "unpatched" not in args.variants:
        args.variants = ["unpatched", *args.variants]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(*args.worker)
        return 0
    if args.serve:
        serve(args.serve)
        return 0
    try:
        import vllm  # noqa: F401
    except ImportError:
        print("serve_bench needs vLLM: build .venv-vllm with .ci/vllm_env.sh and run it with .venv-vllm/bin/python",
              file=sys.stderr)
        return 2
    t_start = time.perf_counter()
    cmd = command("serve_bench", argv)
    env = {k: v for k, v in os.environ.items() if k not in ("LYNX_VLLM_CONFIG", "TRITON_INTERPRET")}
    env.update({"VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    paths = {}
    for model in args.models:
        paths[model] = FIXTURE_A if model == "fixture-a" else real_shape_model(args)
    results = []
    with tempfile.TemporaryDirectory(prefix="lynx_serve_bench_") as tmp:
        work = Path(tmp)
        env.setdefault("VLLM_CACHE_ROOT", str(work / "vllm_cache"))
        for model in args.models:
            specs, prices = {}, {}   # per variant: the worker's spec (round 0) and the price its row records
            for variant in args.variants:
                lynx, prices[variant] = engine_lynx(variant, model, args.full_layers, args.layers, args.xshare_budget)
                specs[variant] = {"model": model, "model_path": str(paths[model]), "variant": variant, "round": 0,
                                  "lynx": lynx, "eager": args.eager, "concurrency": args.concurrency,
                                  "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
                                  "vocab": args.vocab, "dtype": args.dtype}
            if args.interleave:
                outs = run_interleaved(specs, args.concurrency, args.rounds, work, env, same_engine=args.same_engine)
            else:   # one engine per variant and round, the variants rotated each round
                outs = [dict(run_engine(dict(specs[v], round=rnd), work, env, args.timeout), round=rnd)
                        for rnd in range(args.rounds) for v in rotated(args.variants, rnd)]
            label = model if model == "fixture-a" else f"qwen2-57b-{args.layers}l"
            for out in outs:
                out.update(model=label + ("" if args.dtype == "bfloat16" else f" {args.dtype}"),
                           **prices[out["variant"]])
                results.append(out)
    rows = aggregate(results, args.variants)
    import torch
    import vllm

    header = (f"# vLLM serving benchmark (CPU)\n\ncommand: `{cmd.strip()}`; vLLM {vllm.__version__}, torch "
              f"{torch.__version__}, {os.cpu_count()} CPUs, {args.dtype}, {'eager' if args.eager else 'compiled'}; "
              f"{args.rounds} round(s)"
              + (" interleaved per concurrency in ONE engine, switched per cell (--same-engine; 'unpatched' is the "
                 "plugin at price 0: every layer bypassed by the cost gate, vLLM's routing)" if args.same_engine
                 else " interleaved per concurrency (one engine per variant, all alive; --interleave)" if args.interleave
                 else " (one engine per variant and round)")
              + f", prompt {args.prompt_tokens} tokens, {args.max_tokens} new tokens, greedy; "
              f"LYNX's routing-mass price at --full-layers {args.full_layers} (the last column); "
              f"total {time.perf_counter() - t_start:.0f} s")
    write_results(args.out, markdown(rows, header), {"command": cmd, "rows": rows, "engines": results})
    return 0


def write_results(out: Path, md: str, payload: dict) -> None:
    """``<out>.md`` (the table ``md``) and ``<out>.json`` (``payload``), the folder made if needed; ``md`` printed."""
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.md").write_text(md)
    Path(f"{out}.json").write_text(json.dumps(payload, indent=1))
    print("\n" + md, flush=True)


if __name__ == "__main__":
    sys.exit(main())
