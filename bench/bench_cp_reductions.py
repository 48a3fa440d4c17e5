"""The context-parallel runtime's two reductions on one GPU, each Triton kernel against the
torch ops it replaced (the anchor, measured in the same run):

- the lse merge (``doc_packed.cp.lse_merge``): ``n`` rows of ``[n, Hq, D]`` outputs and
  ``[Hq, n]`` lse, the second side folded into the first in place, the first a slice of a larger
  result buffer as in a rank's forward;
- the partial dK/dV sums (``doc_packed.cp.partials``): an interval of ``n`` key rows that ``k``
  peers' queries saw, its ``[k, n, 2, Hkv, D]`` partials summed and added to ``dk``/``dv``.

Prints ms per call (CUDA events, median of --iters), the bytes a one-pass kernel must move, and
the ratio anchor / Triton.

Usage: ``python bench/bench_cp_reductions.py [--rows 500,2000,8766,16384] [--heads 32 8] [--head-dim 128]``
"""

from __future__ import annotations

import argparse
import statistics

import torch

from doc_packed.cp import lse_merge, partials


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
    p.add_argument("--heads", type=int, nargs=2, default=[32, 8], metavar=("HQ", "HKV"))
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=50)
    args = p.parse_args()
    if lse_merge._triton_merge() is None or partials._triton_partials() is None:
        raise SystemExit("Triton is not importable here")
    (H, Hkv), D, dt = args.heads, args.head_dim, torch.bfloat16
    rows = [int(x) for x in args.rows.split(",")]
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  {dt} Hq={H} Hkv={Hkv} D={D}")
    print("\nlse merge")
    print("| rows | torch ops ms (anchor) | Triton ms | anchor / Triton | MB a one-pass merge moves | Triton GB/s |")
    print("|---|---|---|---|---|---|")
    for n in rows:
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

    print("\npartial dK/dV sums")
    print("| rows | peers k | torch ops ms (anchor) | Triton ms | anchor / Triton | MB a one-pass sum moves | Triton GB/s |")
    print("|---|---|---|---|---|---|---|")
    for n in rows:
        for k in (1, 2, 6):
            dk0, dv0 = (torch.randn(2 * n, Hkv, D, device="cuda", dtype=dt) for _ in range(2))
            back = torch.randn(k * n, 2, Hkv, D, device="cuda", dtype=dt)
            dk, dv = dk0.clone(), dv0.clone()
            sums = [(0, k, n // 2, n)]

            def reset():
                dk.copy_(dk0)
                dv.copy_(dv0)

            ms = {}
            for name, cuda in (("torch", False), ("triton", True)):
                fn = partials.add_partials_ if cuda else partials._torch_partials
                run = lambda fn=fn: fn(dk, dv, back, sums)  # noqa: E731
                run()
                ms[name] = _time(run, reset, args.iters)
            mb = (k * n * 2 + 2 * 2 * n) * Hkv * D * 2 / 2**20
            print(
                f"| {n} | {k} | {ms['torch']:.3f} | {ms['triton']:.3f} | {ms['torch'] / ms['triton']:.2f}x | {mb:.1f} "
                f"| {mb * 2**20 / 1e9 / (ms['triton'] / 1e3):.0f} |"
            )


if __name__ == "__main__":
    main()
