"""Worst errors of each CUDA backend against the float64 dense oracle, per dtype.

Runs the grid of tests/test_gpu.py through the same code (``doc_packed_testing.gpu_parity``:
causal, full and two windows; GQA 1, 4 and 8; one document, random layouts with zero-length and
1-token documents, two rows) and prints, per backend and dtype, the largest relative Frobenius
error of out, dq, dk, dv and the largest lse abs error: the numbers behind the tolerances the
tests assert. Usage: ``python -m bench.accuracy [--backends fa4,flash]`` (default: every CUDA
backend; fa4 only where FA4 is usable). ``--dry-run``: the math backend on CPU, one mask, S=64.
"""

from __future__ import annotations

import argparse
import random

import torch

from bench._harness import add_dry_run, device_name
from doc_packed_testing.gpu_parity import HEAD_DIM, HEADS, MASKS, layouts, parity_errors

KEYS = ("out", "lse", "dq", "dk", "dv")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default="fa4,flash,flex,math", help="comma-separated")
    add_dry_run(ap)
    args = ap.parse_args(argv)
    from doc_packed.kernels import fa4

    S, device, masks, heads_grid = 384, "cuda", MASKS, HEADS
    runs = [("fa4", torch.bfloat16), ("fa4", torch.float16),
            ("flash", torch.bfloat16), ("flash", torch.float16), ("flex", torch.bfloat16),
            ("flex", torch.float16), ("flex", torch.float32), ("math", torch.float32)]
    runs = [r for r in runs if r[0] in args.backends.split(",")]
    if args.dry_run:
        S, device, masks, heads_grid, runs = 64, "cpu", MASKS[:1], HEADS[:1], [("math", torch.float32)]
    grid = layouts(random.Random(7), S)
    if any(r[0] == "fa4" for r in runs):
        why = fa4.unsupported_reason(torch.empty(0, 8, HEAD_DIM, device=device, dtype=torch.bfloat16), 2)
        if why is not None:
            print(f"fa4 skipped: {why}")
            runs = [r for r in runs if r[0] != "fa4"]
    print(f"device: {device_name(device)}  torch {torch.__version__}  S={S} D={HEAD_DIM} B=2\n")
    print("| backend | dtype | out | lse (abs) | dq | dk | dv |\n|---|---|---|---|---|---|---|")
    for backend, dtype in runs:
        worst = dict.fromkeys(KEYS, 0.0)
        for causal, window in masks:
            for heads in heads_grid:
                for lengths in grid:
                    errs = parity_errors(lengths, S, heads, causal, window, dtype, backend, seed=1, device=device)
                    worst = {key: max(worst[key], errs[key]) for key in KEYS}
        cells = " | ".join(f"{worst[key]:.1e}" for key in KEYS)
        print(f"| {backend} | {str(dtype).removeprefix('torch.')} | {cells} |")


if __name__ == "__main__":
    main()
