"""Count every Python call an engine's decode steps make, and what its compiled forward was traced from (a script the
tests start in a subprocess, not a test; issue 54 item 7).

    python tests/vllm_plugin/step_calls_run.py SPEC.json OUT.json

SPEC: ``{"model": dir, "eager": bool, "lynx": {...} | null (additional_config["lynx"]; null: the plugin installed, not
configured), "gate_off": bool, "requests": R, "steps": K}``. ``gate_off``: the cost gate's decisions are "off at every
step size" (no table or cache read, no measurement), so the plugin bypasses every layer. The engine (in-process engine
core, so one ``step()`` is one scheduler step in this thread) gets R prompts of 16 token ids (greedy, ``ignore_eos``),
steps until every request decodes, then K decode steps are counted with ``sys.setprofile``: every Python function
entered (``"call"``, keyed ``file:function:first line``, the file relative to ``site-packages`` or the checkout) and
every builtin called (``"c_call"``, keyed ``caller file>builtin``), summed over the K steps; a key is prefixed
``plugin|`` where the function or builtin is ``lynx_hf``'s or called by ``lynx_hf`` code (or by a function it
called). A compiled engine also
records the call targets of the FX graph Dynamo traced and every file it inlined into it.

OUT: ``{"calls": {key: count}, "steps": K, "ops": [target, ...], "traced_files": [file, ...], "stats": rank 0's
lynx_hf.vllm.stats}``.
"""

import json
import os
import re
import sys
import tempfile
from collections import Counter
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

ROOT = str(Path(__file__).resolve().parents[2])


CACHE = os.environ.get("VLLM_CACHE_ROOT") or "\0"


def where(filename: str) -> str:
    """``filename`` relative to ``site-packages`` or the checkout, ``<vllm cache>`` for code vLLM / Inductor generated
    under this engine's ``VLLM_CACHE_ROOT`` (each engine has its own), so two processes' keys compare."""
    if filename.startswith(CACHE):
        return "<vllm cache>"
    if "site-packages/" in filename:
        return filename.split("site-packages/", 1)[1]
    return os.path.relpath(filename, ROOT) if filename.startswith(ROOT) else filename


def gate_off() -> None:
    """Every cost-gate decision "off" (an expected saving of 0 against a cost of 1 ms), from no table or cache."""
    from lynx_hf import gate
    from lynx_hf.gate import stage, table

    off = gate.decide(1.0, 0.0, 1.0, margin=gate.TUNING.margin)
    stage.measure_layer = lambda planned, expert_times, tuning=gate.TUNING: {b: off for b in tuning.buckets}
    table.DecisionStore.lookup = lambda self, key, user_table=None: None
    os.environ[gate.CACHE_ENV] = tempfile.mkdtemp(prefix="lynx_gate_off_")


def record_compile(ops: list, files: set) -> None:
    """Record the FX graph Dynamo hands the compiler (``call_function`` targets; ``OutputGraph.call_user_compiler``,
    whatever backend vLLM picks) and the files Dynamo inlines (as vLLM's compiled mode collects them for its cache
    key: ``InliningInstructionTranslator.inline_call_``)."""
    from torch._dynamo.output_graph import OutputGraph
    from torch._dynamo.symbolic_convert import InliningInstructionTranslator

    real_compile, inline_call = OutputGraph.call_user_compiler, InliningInstructionTranslator.inline_call_

    def compiling(self, gm, example_inputs):
        # without addresses (``<built-in method x of type object at 0x...>``: another address in each process)
        ops.extend(re.sub(r" at 0x[0-9a-f]+", "", str(node.target)) for node in gm.graph.nodes
                   if node.op == "call_function")
        return real_compile(self, gm, example_inputs)

    def inlining(self_):
        files.add(where(self_.f_code.co_filename))
        return inline_call(self_)

    OutputGraph.call_user_compiler = compiling
    InliningInstructionTranslator.inline_call_ = inlining


def main(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    if spec.get("gate_off"):
        gate_off()
    ops, files = [], set()
    if not spec["eager"]:
        record_compile(ops, files)
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import lynx_hf.vllm as lynx_vllm

    kwargs = {} if spec.get("lynx") is None else {"additional_config": {"lynx": spec["lynx"]}}
    requests, steps = int(spec["requests"]), int(spec["steps"])
    llm = LLM(model=spec["model"], dtype="bfloat16", enforce_eager=spec["eager"], seed=0, max_model_len=16 + steps + 32,
              max_num_seqs=requests, enable_prefix_caching=False, **kwargs)
    engine = llm.llm_engine
    generator = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 16, ignore_eos=True, detokenize=False)
    for i in range(requests):
        ids = torch.randint(1, 1000, (16,), generator=generator).tolist()
        engine.add_request(f"r{i}", TokensPrompt(prompt_token_ids=ids), params)
    for _ in range(4):  # the prompts' prefill, then decode steps
        engine.step()
    calls = Counter()

    def plugin(frame) -> bool:
        return frame is not None and where(frame.f_code.co_filename).startswith("lynx_hf/")

    def profile(frame, event, arg):
        if event == "call":
            code = frame.f_code
            key = f"{where(code.co_filename)}:{code.co_name}:{code.co_firstlineno}"
        elif event == "c_call":
            key = f"{where(frame.f_code.co_filename)}>{getattr(arg, '__qualname__', None) or repr(arg)}"
        else:
            return
        # the plugin's work: its own functions, the functions it calls (a vLLM property it reads, numpy's) and the
        # builtins either calls (the hooks call vLLM's originals too: the same in both engines)
        calls[f"plugin|{key}" if plugin(frame) or plugin(frame.f_back) else key] += 1

    sys.setprofile(profile)
    try:
        for _ in range(steps):
            engine.step()
    finally:
        sys.setprofile(None)
    out = {"calls": dict(calls), "steps": steps, "ops": ops, "traced_files": sorted(files),
           "stats": lynx_vllm.stats(llm)[0]}
    Path(out_path).write_text(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
