"""A stand-in for ``python -m lab.serve_bench --serve SPEC`` (no vLLM): the same line protocol (``lab.serve_bench.ANSWER``
answers, vLLM-like log lines unmarked on stdout and stderr); a cell's TPOT is ``VARIANT_MS[policy] + C`` (the policy
it was started with, or the last ``configure`` request's), and it counts the requests this worker has served so far. A request for C = -1 makes it exit with status 3 (a dying engine)."""

import json
import sys

from lab.serve_bench import ANSWER

VARIANT_MS = {"unpatched": 100.0, "lynx": 60.0, "oea": 80.0}


def main(spec_path: str) -> None:
    spec = json.load(open(spec_path))
    print("INFO vllm-like log line before the engine is up", flush=True)
    print("WARNING a log line on stderr", file=sys.stderr, flush=True)
    print(ANSWER + json.dumps({"ready": True, "engine_start_s": 1.5}), flush=True)
    config = spec["lynx"] or {}
    served, policy = 0, config.get("policy", "unpatched")
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("quit"):
            break
        if "configure" in req:   # lab.serve_bench --same-engine: the running engine switched
            config = req["configure"]
            policy = "unpatched" if config.get("mass_price") == 0 else config["policy"]   # price 0: all bypassed
        c = int(req["c"])
        if c == -1:
            print("Traceback: the engine died", file=sys.stderr, flush=True)
            sys.exit(3)
        served += c
        print(f"INFO stepping {c} requests", flush=True)
        on = policy != "unpatched"
        tpot = VARIANT_MS[policy if on else "unpatched"] + c
        print(ANSWER + json.dumps({"tpot_ms": tpot, "decode_tok_s": 1000.0 * c / tpot, "total_tok_s": 1.0,
                                   "unique_before": 20.0 if on else None, "unique_after": 10.0 if on else None,
                                   "served_so_far": served, "price": config.get("mass_price")}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
