"""Two vLLM engines one after another in one process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as notebooks and sweeps
run them), each with its own ``additional_config`` (a script the tests start in a subprocess, not a test):

    python tests/vllm_plugin/two_engines.py MODEL FIRST_LYNX_JSON SECOND_LYNX_JSON OUT.json

``FIRST_LYNX_JSON`` / ``SECOND_LYNX_JSON``: ``additional_config["lynx"]`` of each engine (``null``: plugin off). The
first engine generates, is deleted (``del llm``; ``gc.collect()``), then the second starts and generates. OUT holds,
per engine, ``lynx_hf.vllm.stats(llm)`` (or the error the second engine's start raised: ``{"error_type", "error"}``).
"""

import gc
import json
import os
import sys

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def _engine(model, lynx, LLM):
    kwargs = {} if lynx is None else {"additional_config": {"lynx": lynx}}
    return LLM(model=model, dtype="bfloat16", max_model_len=256, enforce_eager=True, seed=0,
               max_num_batched_tokens=128, max_num_seqs=8, enable_prefix_caching=False, **kwargs)


def main(model, first, second, out_path):
    from vllm import LLM, SamplingParams

    import lynx_hf.vllm as lynx_vllm

    prompts = ["def main(", "class Queue(", "import os\n", "for i in range("] * 2
    params = SamplingParams(temperature=0.0, max_tokens=12)
    result = {}
    llm = _engine(model, first, LLM)
    llm.generate(prompts, params)
    result["first"] = lynx_vllm.stats(llm)
    del llm
    gc.collect()
    try:
        llm = _engine(model, second, LLM)
    except Exception as exc:  # noqa: BLE001 - recorded for the test
        result["second"] = {"error_type": type(exc).__name__, "error": str(exc)}
    else:
        llm.generate(prompts, params)
        result["second"] = lynx_vllm.stats(llm)
    with open(out_path, "w") as fh:
        json.dump(result, fh)


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4])
