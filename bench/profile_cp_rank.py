"""Where one context-parallel rank's host time goes, on one GPU (cProfile of forward + backward).

Emulates every rank of a CP group as ``bench.bench_cp_emulate`` does (collectives replaced
by copies of the same bytes), picks the slowest rank, and runs its forward and backward
directly (``doc_packed.cp.attention.forward`` / ``backward``, in this thread, without autograd,
so cProfile sees both passes). Prints the rank's ms per forward+backward with the host running
ahead (one sync per loop), the same with a sync per call, and cProfile's top functions.
Usage: ``python -m bench.profile_cp_rank --seq 131072 --cp 8 --layout "lognormal 2k"``.
``--dry-run``: 512 tokens at CP 2 on CPU (float32, small heads), two calls per rank.

``--autograd`` also times the same rank through autograd (fresh leaves, ``attn_fwd`` with its
autograd or the eager path's ``autograd.Function``, then ``torch.autograd.backward``) beside the
direct calls, and prints torch.profiler's CPU and CUDA self time per op for both, so that what
autograd adds (bench_cp_emulate's timing goes through it) shows op by op, and each pass's host
time apart (forward, then backward on autograd's device thread and on the calling thread).
``--heads Hq,Hkv``: the rank's heads (cp_tp's rank at tp 2 of 16/4: ``8,2``).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from bench import bench_cp_emulate as emu
from bench._harness import add_dry_run, device_name, sync
from bench.emulated_layouts import emulated_lengths
from doc_packed.cp import attention as cp_attention
from doc_packed_examples.model import random_attention_problem
from doc_packed.ops import Call


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=131072)
    ap.add_argument("--cp", type=int, default=8)
    ap.add_argument("--layout", default="lognormal 2k")
    ap.add_argument("--packing", default="greedy", choices=["greedy", "cp"])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--heads", default="32,8", help="query,key/value heads of the rank (cp_tp at tp 2: 8,2)")
    ap.add_argument("--autograd", action="store_true", help="compare with the same rank through autograd")
    ap.add_argument(
        "--autograd-threads",
        choices=["on", "off"],
        default="on",
        help="with --autograd, also time the autograd modes with the engine's device thread off "
        "(torch.autograd.set_multithreading_enabled(False): backwards on the calling thread)",
    )
    add_dry_run(ap)
    args = ap.parse_args(argv)
    emu.ARGS = emu._parser().parse_args(["--packing", args.packing])
    S, c, D = args.seq, args.cp, 128
    Hq, Hkv = (int(h) for h in args.heads.split(","))
    if args.dry_run:
        emu.DEVICE, emu.DTYPE = "cpu", torch.float32
        S, c, Hq, Hkv, D, args.layout, args.iters, args.top = 512, 2, 4, 2, 16, "lognormal 512", 2, 5
    dev = emu.DEVICE
    q, k, v, dout, cu = random_attention_problem(
        emulated_lengths(args.layout, S, c, args.packing), S, (Hq, Hkv), D, emu.DTYPE, emu.DEVICE, 0
    )
    scale = D**-0.5
    runs = {}
    for r in range(c):
        emu._install(emu._CopyComm(r, c))
        lq, lk, lv, ld = (t.chunk(c, dim=1)[r].contiguous() for t in (q, k, v, dout))

        def step(lq=lq, lk=lk, lv=lv, ld=ld):
            call = Call(cu, S, True, -1, 0, scale, "auto", emu.GROUP)
            out, lse = cp_attention.forward(lq, lk, lv, call)
            cp_attention.backward(ld, lq, lk, lv, out, lse, call)

        for _ in range(3):
            step()
        sync(dev)
        t0 = time.perf_counter()
        for _ in range(args.iters):
            step()
        sync(dev)
        runs[r] = ((time.perf_counter() - t0) / args.iters * 1e3, step)
    slow = max(runs, key=lambda r: runs[r][0])
    emu._install(emu._CopyComm(slow, c))
    step = runs[slow][1]
    synced = []
    for _ in range(args.iters):
        sync(dev)
        t0 = time.perf_counter()
        step()
        sync(dev)
        synced.append((time.perf_counter() - t0) * 1e3)
    host = []
    for _ in range(args.iters):  # host time alone: the call returns before the GPU finishes
        sync(dev)
        t0 = time.perf_counter()
        step()
        host.append((time.perf_counter() - t0) * 1e3)
        sync(dev)
    print(f"\n{device_name(dev)}  torch {torch.__version__}  S={S} {args.layout} ({args.packing}) CP={c}")
    print("| rank | ms per fwd+bwd (host runs ahead) |\n|---|---|")
    for r, (ms, _) in runs.items():
        print(f"| {r} | {ms:.2f} |")
    print(
        f"\nslowest rank {slow}: {sorted(synced)[len(synced) // 2]:.2f} ms synced per call, "
        f"host time until the call returns {sorted(host)[len(host) // 2]:.2f} ms"
    )
    if args.autograd:
        _compare_autograd(step, q, k, v, dout, cu, S, c, slow, scale, args)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.iters):
        step()
    sync(dev)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)
    pstats.Stats(prof).sort_stats("cumtime").print_stats(args.top)


def _split_passes(lq, lk, lv, ld, call, iters: int) -> None:
    """Host microseconds until each pass returns (device drained before and after), forward and
    backward apart: the runtime called directly, the eager path's ``autograd.Function`` and the
    op's autograd, each backward on autograd's device thread and on the calling thread."""
    from doc_packed import _eager

    dev = emu.DEVICE

    def leaves():
        return tuple(t.detach().requires_grad_() for t in (lq, lk, lv))

    def fwd(entry, qq, kk, vv):
        if entry == "direct":
            return cp_attention.forward(qq, kk, vv, call)
        if entry == "eager":
            return _eager.attention(qq, kk, vv, call)
        return torch.ops.doc_packed.attn_fwd(qq, kk, vv, *call)

    def bwd(entry, threads, qq, kk, vv, out, lse):
        if entry == "direct":
            return cp_attention.backward(ld, qq, kk, vv, out, lse, call)
        with torch.autograd.set_multithreading_enabled(threads):
            torch.autograd.backward(out, ld)

    def host_us(fn) -> float:
        sync(dev)
        t0 = time.perf_counter()
        fn()
        t = time.perf_counter() - t0
        sync(dev)
        return t * 1e6

    print(f"\nhost us until each pass returns, median of {iters} (device drained around each)")
    print("| entry | backward thread | forward | backward |\n|---|---|---|---|")
    for entry, threads in (("direct", True), ("eager", True), ("eager", False), ("op", True), ("op", False)):
        f_us, b_us = [], []
        for i in range(iters + 3):
            qq, kk, vv = leaves() if entry != "direct" else (lq, lk, lv)
            got: list = []
            tf = host_us(lambda: got.extend(fwd(entry, qq, kk, vv)))
            tb = host_us(lambda: bwd(entry, threads, qq, kk, vv, *got))
            if i >= 3:
                f_us.append(tf)
                b_us.append(tb)
        med = lambda x: sorted(x)[len(x) // 2]  # noqa: E731
        where = "-" if entry == "direct" else ("device thread" if threads else "calling thread")
        print(f"| {entry} | {where} | {med(f_us):.0f} | {med(b_us):.0f} |")


def _compare_autograd(direct, q, k, v, dout, cu, S, c, rank, scale, args):
    from torch.profiler import ProfilerActivity, profile

    from doc_packed import _eager

    dev = emu.DEVICE
    lq, lk, lv, ld = (t.chunk(c, dim=1)[rank].contiguous() for t in (q, k, v, dout))
    call = Call(cu, S, True, -1, 0, scale, "auto", emu.GROUP)

    def through(entry):
        def run():
            qq, kk, vv = (t.detach().requires_grad_() for t in (lq, lk, lv))
            if entry == "eager":
                out, _ = _eager.attention(qq, kk, vv, call)
            else:
                out, _ = torch.ops.doc_packed.attn_fwd(qq, kk, vv, *call)
            torch.autograd.backward(out, ld)

        return run

    modes = {"direct": direct, "autograd (op)": through("op"), "autograd (eager)": through("eager")}
    _split_passes(lq, lk, lv, ld, call, args.iters)
    if args.autograd_threads == "off":  # the same, each backward on this thread instead of the device's

        def calling_thread(fn):
            def run():
                with torch.autograd.set_multithreading_enabled(False):
                    fn()

            return run

        modes["autograd (op), engine threads off"] = calling_thread(modes["autograd (op)"])
    print(f"\nrank {rank}: ms per forward+backward, median of {args.iters}")
    print("| mode | synced (wall) | CUDA events | host until return |\n|---|---|---|---|")
    for name, fn in modes.items():
        for _ in range(3):
            fn()
        wall, ev, host = [], [], []
        cuda = torch.device(dev).type == "cuda"
        a, b = (torch.cuda.Event(enable_timing=True) for _ in range(2)) if cuda else (None, None)
        for _ in range(args.iters):
            sync(dev)
            t0 = time.perf_counter()
            if a is not None:
                a.record()
            fn()
            t1 = time.perf_counter()
            if b is not None:
                b.record()
            sync(dev)
            wall.append((time.perf_counter() - t0) * 1e3)
            host.append((t1 - t0) * 1e3)
            ev.append(a.elapsed_time(b) if a is not None else float("nan"))
        med = lambda x: sorted(x)[len(x) // 2]  # noqa: E731
        print(f"| {name} | {med(wall):.2f} | {med(ev):.2f} | {med(host):.2f} |")
    for name, fn in modes.items():
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fn()
            sync(dev)
        print(f"\n### {name}: torch.profiler, 5 calls, top ops by self CPU time")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
        print(f"\n### {name}: top ops by self CUDA time")
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12))


if __name__ == "__main__":
    main()
