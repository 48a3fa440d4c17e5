"""The context-parallel lse merge (doc_packed.cp.lse_merge) on one GPU: the Triton kernel
against the torch ops it replaced (the anchor), per merged row count.

Each case merges ``n`` rows of ``[n, Hq, D]`` outputs and ``[Hq, n]`` lse, the second side into
the first in place, the first a slice of a larger result buffer as in a rank's forward. Prints
ms per merge (CUDA events, median of --iters), the bytes a one-pass merge must move, and the
ratio anchor / Triton.

Usage: ``python bench/bench_lse_merge.py [--rows 500,2000,8766,16384] [--heads 32] [--head-dim 128]``
"""

from __future__ import annotations

import argparse
import statistics

import torch

from doc_packed.cp import lse_merge


def _time(fn, reset, iters: int) -> float:
    times = []
    for _ in range(iters):
        reset()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="500,2000,8766,16384")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=50)
    args = p.parse_args()
    if lse_merge._triton_merge() is None:
        raise SystemExit("Triton is not importable here")
    H, D, dt = args.heads, args.head_dim, torch.bfloat16
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  {dt} Hq={H} D={D}")
    print("| rows | torch ops ms (anchor) | Triton ms | anchor / Triton | MB a one-pass merge moves | Triton GB/s |")
    print("|---|---|---|---|---|---|")
    for n in (int(x) for x in args.rows.split(",")):
        N = 2 * n + 128  # the result buffer: the merged rows are a slice of it
        out0, lse0 = torch.randn(N, H, D, device="cuda", dtype=dt), torch.randn(H, N, device="cuda") * 3
        ob, lb = torch.randn(n, H, D, device="cuda", dtype=dt), torch.randn(H, n, device="cuda") * 3
        out, lse = out0.clone(), lse0.clone()
        sl = slice(64, 64 + n)

        def reset():
            out.copy_(out0)
            lse.copy_(lse0)

        ms = {}
        for name, fn in (("torch", lse_merge._torch_merge), ("triton", lse_merge.merge_)):
            run = lambda fn=fn: fn(out[sl], lse[:, sl], ob, lb)  # noqa: E731
            run()  # compile / warm up
            ms[name] = _time(run, reset, args.iters)
        mb = n * H * D * 2 * 3 / 2**20 + n * H * 4 * 3 / 2**20
        print(
            f"| {n} | {ms['torch']:.3f} | {ms['triton']:.3f} | {ms['torch'] / ms['triton']:.2f}x | {mb:.1f} "
            f"| {mb * 2**20 / 1e9 / (ms['triton'] / 1e3):.0f} |"
        )


if __name__ == "__main__":
    main()
