"""What the tinker backend's per-call slot lease costs: sequential sample calls through
TinkerBackend with a real file semaphore (2 slots), against `retrain serve`'s app in this
process over the bigram double; prints the mean time per call.

    RETRAIN_CACHE=/tmp/cache python -m bench.slot_lease [--calls 200]

Run it on two checkouts (before and after a change to backends/tinker/backend.py) to compare.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    os.environ.setdefault("TINKER_API_KEY", "tml-bench-not-a-real-key")
    os.environ["TINKER_TELEMETRY"] = "0"
    from retrain.backends.base import SamplingParams
    from retrain.backends.models import TINY, resolve_model
    from retrain.backends.tinker.backend import TinkerBackend
    from retrain.slots.file_slots import CountingSemaphore
    from tests.serve_doubles import BigramEngine, Served

    tmp = Path(tempfile.mkdtemp())
    engine = BigramEngine(vocab=260, eos=2, tokenizer_id=resolve_model(TINY))
    with Served(engine, tmp, hold_s=2.0, api_key=os.environ["TINKER_API_KEY"]) as served:
        backend = TinkerBackend(base_model="bigram-test", lora_rank=2, seed=0,
                                base_url=served.url, request_timeout_s=60,
                                slots=CountingSemaphore(tmp / "slots", 2))
        params = SamplingParams(max_tokens=4, seed=1)
        for _ in range(10):  # warm-up: sessions, sampler, connections
            backend.sample([[1, 70]], 2, params)
        start = time.perf_counter()
        for _ in range(args.calls):
            backend.sample([[1, 70]], 2, params)
        per_call = (time.perf_counter() - start) / args.calls
        backend.close()
    print(f"{per_call * 1000:.2f} ms per sample call ({args.calls} calls)")


if __name__ == "__main__":
    main()
