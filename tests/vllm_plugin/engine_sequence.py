"""vLLM engines one after another in one process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as notebooks and sweeps run
them), each with its own ``additional_config`` (a script the tests start in a subprocess, not a test):

    python tests/vllm_plugin/engine_sequence.py MODEL CONFIGS_JSON OUT.json

``CONFIGS_JSON``: a list, one ``additional_config["lynx"]`` per engine (``null``: plugin off). Each engine generates
(8 greedy requests x 12 tokens, eager), then is deleted (``del llm``; ``gc.collect()``) before the next starts. OUT
holds one entry per engine: ``lynx_hf.vllm.stats(llm)``, or the error its start raised (``{"error_type", "error"}``).
"""

import gc
import json
import os
import sys
import traceback

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def main(model, configs, out_path):
    from vllm import LLM, SamplingParams

    import lynx_hf.vllm as lynx_vllm

    prompts = ["def main(", "class Queue(", "import os\n", "for i in range("] * 2
    params = SamplingParams(temperature=0.0, max_tokens=12)
    result = []
    for lynx in configs:
        kwargs = {} if lynx is None else {"additional_config": {"lynx": lynx}}
        try:
            llm = LLM(model=model, dtype="bfloat16", max_model_len=256, enforce_eager=True, seed=0,
                      max_num_batched_tokens=128, max_num_seqs=8, enable_prefix_caching=False, **kwargs)
        except Exception as exc:  # noqa: BLE001 - recorded for the test
            traceback.print_exc()
            result.append({"error_type": type(exc).__name__, "error": str(exc)})
            continue
        llm.generate(prompts, params)
        result.append({"stats": lynx_vllm.stats(llm)})
        del llm
        gc.collect()
    with open(out_path, "w") as fh:
        json.dump(result, fh)


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]), sys.argv[3])
