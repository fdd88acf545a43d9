"""`python -m retrain.machine [--dtype float32] [--threads N]`: measure this machine's
matmul and memory peaks now, cache them, print them (the numbers `retrain explain` offers
for the roofline hints)."""

from __future__ import annotations

import argparse

from retrain.machine.peaks import cache_path, measure_peaks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: every core)")
    args = ap.parse_args()
    from retrain.machine.cpu import auto_threads

    p = measure_peaks(args.dtype, args.threads or auto_threads())
    print(f"{p.gflops:.1f} GFLOP/s {p.dtype} matmul, {p.bw_gb_s:.1f} GB/s memory copy, "
          f"{p.threads} threads (cached in {cache_path()})")
    print(f"[backpressure]\npeak_gflops = {p.gflops:.0f}\npeak_bw_gb_s = {p.bw_gb_s:.0f}")


if __name__ == "__main__":
    main()
