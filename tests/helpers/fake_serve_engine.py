"""A stand-in for ``python -m lab.serve_bench --serve SPEC`` (no vLLM): the same line protocol (``lab.serve_bench.ANSWER``
answers, vLLM-like log lines unmarked on stdout and stderr); a cell's TPOT is ``variant_ms[variant] + C``, its telemetry
counts the requests this worker has served so far. A request for C = -1 makes it exit with status 3 (a dying engine)."""

import json
import sys

from lab.serve_bench import ANSWER

VARIANT_MS = {"unpatched": 100.0, "lynx": 60.0, "oea": 80.0}


def main(spec_path: str) -> None:
    spec = json.load(open(spec_path))
    print("INFO vllm-like log line before the engine is up", flush=True)
    print("WARNING a log line on stderr", file=sys.stderr, flush=True)
    print(ANSWER + json.dumps({"ready": True, "engine_start_s": 1.5}), flush=True)
    served = 0
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("quit"):
            break
        c = int(req["c"])
        if c == -1:
            print("Traceback: the engine died", file=sys.stderr, flush=True)
            sys.exit(3)
        served += c
        print(f"INFO stepping {c} requests", flush=True)
        tpot = VARIANT_MS[spec["variant"]] + c
        print(ANSWER + json.dumps({"tpot_ms": tpot, "decode_tok_s": 1000.0 * c / tpot, "total_tok_s": 1.0,
                                   "unique_before": None if spec["lynx"] is None else 20.0,
                                   "unique_after": None if spec["lynx"] is None else 10.0,
                                   "served_so_far": served}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
