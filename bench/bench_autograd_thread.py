"""Host cost of a tensor op on the autograd engine's device thread vs the calling thread (one GPU).

A context-parallel rank at CP 8 is host-bound, and through the op's autograd its host time per
forward+backward read 3.50 ms against 1.85 ms calling the passes directly (1 x H200, 2026-11-24;
docs/context_parallel.md, "Tried and not kept"), with every launch and allocation ~1.7x slower
in the profile. This times N small in-place ops (``x.add_(1)``, launched and not waited for)
three ways: in the calling thread (the anchor), inside a backward that autograd runs on its CUDA
device thread (the default), and inside the same backward with
``torch.autograd.set_multithreading_enabled(False)`` (the backward runs on the calling thread).
Prints microseconds per op and the ratio to the anchor.
Usage: ``python -m bench.bench_autograd_thread [--ops 400] [--repeats 30]``.
"""

from __future__ import annotations

import argparse

import torch

from bench._harness import add_dry_run, device_name, timed_ms


class _Ops(torch.autograd.Function):
    """Identity forward; its backward launches ``n`` small ops (on the engine's thread)."""

    @staticmethod
    def forward(ctx, x, n):
        ctx.n = n
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        y = torch.zeros(64, device=g.device)
        for _ in range(ctx.n):
            y.add_(1)
        return g, None


def _host_us(fn, n: int, repeats: int, device: str = "cuda") -> float:
    """Median host microseconds per op of ``fn`` (synchronised before each start)."""
    return timed_ms(fn, warmup=0, iters=repeats, clock="host", device=device) / n * 1e3


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=30)
    add_dry_run(ap, "on CPU, 20 ops, 3 repeats: checks the script runs")
    args = ap.parse_args(argv)
    dev = "cpu" if args.dry_run else "cuda"
    if args.dry_run:
        args.ops, args.repeats = 20, 3
    n = args.ops
    y = torch.zeros(64, device=dev)
    x = torch.zeros(64, device=dev, requires_grad=True)

    def main_thread():
        for _ in range(n):
            y.add_(1)

    def in_backward():
        _Ops.apply(x, n).sum().backward()

    rows = []
    for _ in range(2):  # alternated, twice: this host drifts between runs
        rows.append(("calling thread (anchor)", _host_us(main_thread, n, args.repeats, dev)))
        torch.autograd.set_multithreading_enabled(True)
        rows.append(("backward, autograd device thread (default)", _host_us(in_backward, n, args.repeats, dev)))
        torch.autograd.set_multithreading_enabled(False)
        rows.append(("backward, multithreading disabled", _host_us(in_backward, n, args.repeats, dev)))
        torch.autograd.set_multithreading_enabled(True)
    print(f"device {device_name(dev)}  torch {torch.__version__}  {n} ops of x.add_(1) per call")
    print("| where the ops launch | us per op | / anchor |\n|---|---|---|")
    for i, (name, us) in enumerate(rows):
        anchor = rows[i - i % 3][1]
        print(f"| {name} | {us:.2f} | {us / anchor:.2f}x |")


if __name__ == "__main__":
    main()
