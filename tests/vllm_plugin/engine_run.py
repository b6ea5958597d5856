"""Run one vLLM engine on a model and write tokens, prompt logprobs, telemetry and timings as JSON
(a script the tests start in a subprocess, not a test).

    python tests/vllm_plugin/engine_run.py SPEC.json OUT.json

SPEC: ``{"model": dir, "eager": bool, "lynx": {...} | null (additional_config["lynx"]; null: plugin off),
"engine": {extra LLM kwargs}, "runs": [RUN, ...]}``, each RUN one of

- ``{"name", "kind": "batch", "prompts": [str], "max_tokens": int}``: ``LLM.generate``, greedy;
- ``{"name", "kind": "staggered", "waves": [[str], [str]], "steps_before_wave": int, "max_tokens": int}``:
  the engine is stepped by hand (in-process engine core, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so one
  ``step()`` is one scheduler step and the schedule is the same in every engine): wave 0 is added,
  ``steps_before_wave`` steps run (its requests are decoding by then), wave 1 is added and its prompt
  is prefilled in steps that also decode wave 0 (mixed steps); greedy, ``ignore_eos``, prompt logprobs;

- ``{"name", "kind": "unhooked", "prompts": [str], "max_tokens": int}``: the plugin's step hooks are switched
  off in every worker (``collective_rpc``), then ``LLM.generate``: records the error the liveness rule raises
  (``{"error_type", "error"}``; an in-process engine core raises it as is). The engine is unusable afterwards: last run;

and optionally ``"configure": {...}`` (``lynx_hf.vllm.configure`` before the run). Telemetry is read
and reset after each run. One engine per process: vLLM spawns workers (main guard) and one engine per
process keeps tests independent.
"""

import json
import os
import sys
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def _prompt_logprobs(output) -> list[float]:
    """Log-probability of each prompt token (after the first) under the model, from ``prompt_logprobs``."""
    out = []
    for token, entry in zip(output.prompt_token_ids[1:], (output.prompt_logprobs or [])[1:]):
        out.append(float(entry[token].logprob))
    return out


def _staggered(llm, run, SamplingParams) -> dict:
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=run["max_tokens"], ignore_eos=True, prompt_logprobs=0)
    finished = {}
    steps = 0

    def step():
        nonlocal steps
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        steps += 1

    waves = run["waves"]
    for w, prompts in enumerate(waves):
        for i, prompt in enumerate(prompts):
            engine.add_request(f"w{w}-{i}", prompt, params)
        if w + 1 < len(waves):
            for _ in range(run["steps_before_wave"]):
                step()
    while engine.has_unfinished_requests():
        step()
    ids = [f"w{w}-{i}" for w, prompts in enumerate(waves) for i in range(len(prompts))]
    return {"ids": ids, "steps": steps,
            "tokens": [list(finished[r].outputs[0].token_ids) for r in ids],
            "prompt_logprobs": [_prompt_logprobs(finished[r]) for r in ids]}


def _disable_step_hooks(worker) -> int:
    """Run in each worker: every hooked model runner's input preparation is vLLM's own again (the wrapper's
    ``__wrapped__``), so no step mask is written: what a runner the plugin did not reach looks like."""
    from lynx_hf.vllm.runners import HOOKED_RUNNERS

    for cls, name in HOOKED_RUNNERS.items():
        setattr(cls, name, getattr(cls, name).__wrapped__)
    return len(HOOKED_RUNNERS)


def _unhooked(llm, run, SamplingParams) -> dict:
    llm.collective_rpc(_disable_step_hooks)
    try:
        llm.generate(run["prompts"], SamplingParams(temperature=0.0, max_tokens=run["max_tokens"]))
    except Exception as exc:  # noqa: BLE001 - recorded for the test
        return {"error_type": type(exc).__name__, "error": str(exc)}
    return {"error_type": None, "error": None}


def main(spec_path: str, out_path: str, on_run=None) -> None:
    """Run SPEC, write OUT. ``on_run(name, entry)``: called after each batch / staggered run (it may add to the
    entry)."""
    with open(spec_path) as fh:
        spec = json.load(fh)
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams

    import lynx_hf.vllm as lynx_vllm

    kwargs = dict(spec.get("engine") or {})
    if spec.get("lynx") is not None:
        kwargs["additional_config"] = {"lynx": spec["lynx"]}
    t1 = time.perf_counter()
    llm = LLM(model=spec["model"], dtype="bfloat16", max_model_len=kwargs.pop("max_model_len", 512),
              enforce_eager=spec["eager"], seed=0, **kwargs)
    t2 = time.perf_counter()
    result = {"timing": {"import_s": t1 - t0, "engine_start_s": t2 - t1}, "runs": {}}
    for run in spec["runs"]:
        if run.get("configure") is not None:
            lynx_vllm.configure(llm, run["configure"])
        lynx_vllm.reset_stats(llm)
        t = time.perf_counter()
        if run["kind"] == "unhooked":
            result["runs"][run["name"]] = _unhooked(llm, run, SamplingParams)
            continue
        if run["kind"] == "batch":
            outs = llm.generate(run["prompts"], SamplingParams(temperature=0.0, max_tokens=run["max_tokens"]))
            entry = {"tokens": [list(o.outputs[0].token_ids) for o in outs]}
        else:
            entry = _staggered(llm, run, SamplingParams)
        entry["seconds"] = time.perf_counter() - t
        entry["stats"] = lynx_vllm.stats(llm)
        if on_run is not None:
            on_run(run["name"], entry)
        result["runs"][run["name"]] = entry
    with open(out_path, "w") as fh:
        json.dump(result, fh)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
