"""The context-parallel runtime's two reductions on one GPU, each Triton kernel against the
torch ops it replaced (the anchor, measured in the same run):

- the lse merge (``doc_packed.cp.lse_merge``): ``n`` rows of ``[n, Hq, D]`` outputs and
  ``[Hq, n]`` lse, the second side folded into the first in place, the first a slice of a larger
  result buffer as in a rank's forward;
- the partial dK/dV sums (``doc_packed.cp.partials``): an interval of ``n`` key rows that ``k``
  peers' queries saw, its ``[k, n, 2, Hkv, D]`` partials summed and added to ``dk``/``dv``.

Prints ms per call (CUDA events, median of --iters), the bytes a one-pass kernel must move, and
the ratio anchor / Triton.

Usage: ``python -m bench.bench_cp_reductions [--rows 500,2000,8766,16384] [--heads 32 8] [--head-dim 128]``
"""

from __future__ import annotations

import argparse

import torch

from bench._harness import add_dry_run, device_name, timed_ms
from doc_packed.cp import lse_merge, partials


def _time(fn, reset, iters: int, device: str = "cuda") -> float:
    return timed_ms(fn, warmup=0, iters=iters, setup=reset, device=device)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="500,2000,8766,16384")
    p.add_argument("--heads", type=int, nargs=2, default=[32, 8], metavar=("HQ", "HKV"))
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=50)
    add_dry_run(p, "on CPU, 64 rows, small heads: the torch ops against themselves (no Triton there)")
    args = p.parse_args(argv)
    dev = "cpu" if args.dry_run else "cuda"
    if args.dry_run:
        args.rows, args.heads, args.head_dim, args.iters = "64", [4, 2], 16, 2
    elif lse_merge._triton_merge() is None or partials._triton_partials() is None:
        raise SystemExit("Triton is not importable here")
    (H, Hkv), D, dt = args.heads, args.head_dim, torch.bfloat16
    rows = [int(x) for x in args.rows.split(",")]
    print(f"device: {device_name(dev)}  torch {torch.__version__}  {dt} Hq={H} Hkv={Hkv} D={D}")
    print("\nlse merge")
    print("| rows | torch ops ms (anchor) | Triton ms | anchor / Triton | MB a one-pass merge moves | Triton GB/s |")
    print("|---|---|---|---|---|---|")
    for n in rows:
        N = 2 * n + 128  # the result buffer: the merged rows are a slice of it
        out0, lse0 = torch.randn(N, H, D, device=dev, dtype=dt), torch.randn(H, N, device=dev) * 3
        ob, lb = torch.randn(n, H, D, device=dev, dtype=dt), torch.randn(H, n, device=dev) * 3
        out, lse = out0.clone(), lse0.clone()
        sl = slice(64, 64 + n)

        def reset():
            out.copy_(out0)
            lse.copy_(lse0)

        ms = {}
        for name, fn in (("torch", lse_merge._torch_merge), ("triton", lse_merge._torch_merge if args.dry_run else lse_merge.merge_)):
            run = lambda fn=fn: fn(out[sl], lse[:, sl], ob, lb)  # noqa: E731
            run()  # compile / warm up
            ms[name] = _time(run, reset, args.iters, dev)
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
            dk0, dv0 = (torch.randn(2 * n, Hkv, D, device=dev, dtype=dt) for _ in range(2))
            back = torch.randn(k * n, 2, Hkv, D, device=dev, dtype=dt)
            dk, dv = dk0.clone(), dv0.clone()
            sums = [(0, k, n // 2, n)]

            def reset():
                dk.copy_(dk0)
                dv.copy_(dv0)

            ms = {}
            for name, cuda in (("torch", False), ("triton", True)):
                fn = partials.add_partials_ if cuda and not args.dry_run else partials._torch_partials
                run = lambda fn=fn: fn(dk, dv, back, sums)  # noqa: E731
                run()
                ms[name] = _time(run, reset, args.iters, dev)
            mb = (k * n * 2 + 2 * 2 * n) * Hkv * D * 2 / 2**20
            print(
                f"| {n} | {k} | {ms['torch']:.3f} | {ms['triton']:.3f} | {ms['torch'] / ms['triton']:.2f}x | {mb:.1f} "
                f"| {mb * 2**20 / 1e9 / (ms['triton'] / 1e3):.0f} |"
            )


if __name__ == "__main__":
    main()
