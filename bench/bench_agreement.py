"""The per-call agreement of context parallelism, timed on one process group of ``--world`` ranks
(default 1: one GPU, a single-rank group) and checked for host syncs.

Context-parallel calls start with one small all-gather (3 int64 words per rank, on CPU: on the
group itself when it has a CPU backend, else on a gloo companion group; docs/contract.md). This
prints, per process-group backend: microseconds per agreement alone, and a cached CP forward +
backward with and without it (the difference is the agreement's cost in a step), and runs the
cached path under ``torch.cuda.set_sync_debug_mode("error")`` (raises on a host sync).

Usage (one GPU): ``python -m bench.bench_agreement --device cuda --backends nccl cpu:gloo,cuda:nccl``;
CPU: ``python -m bench.bench_agreement --device cpu --backends gloo --world 2``.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from bench._harness import add_dry_run, init_process_group, spawn_ranks, timed_ms


def _time(fn, n: int) -> float:
    """Median microseconds per call over ``n`` calls (after 5 warm-up calls)."""
    return timed_ms(fn, warmup=5, iters=n, clock="wall") * 1e3


def _rank(rank, world, port, args, backend):
    torch.set_num_threads(1)
    dev = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    if args.device == "cuda":
        torch.cuda.set_device(dev)
    init_process_group(rank, world, port, backend)
    import doc_packed as dp
    from doc_packed.cp import comm

    group = dist.group.WORLD
    S, Hq, Hkv, D = args.seq, 16, 4, 128 if args.device == "cuda" else 32
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    L = S // world
    g = torch.Generator(device=dev).manual_seed(rank)
    q = torch.randn(1, L, Hq, D, device=dev, dtype=dtype, generator=g, requires_grad=True)
    k = torch.randn(1, L, Hkv, D, device=dev, dtype=dtype, generator=g, requires_grad=True)
    v = torch.randn(1, L, Hkv, D, device=dev, dtype=dtype, generator=g, requires_grad=True)
    cu = dp.cu_seqlens_from_lengths([[S // 4, S // 2, S - S // 4 - S // 2]], S).to(dev)

    def step():
        out = dp.doc_packed_attn(q, k, v, cu, cp_group=group, seq_len=S, causal=True)
        out.float().sum().backward()
        if args.device == "cuda":
            torch.cuda.synchronize()

    fields = {"pass": "forward", "seq_len": S, "head dim": D, "dtype": dtype}
    agree_us = _time(lambda: comm.check_agreement(group.group_name, "a timing call", fields), args.calls)
    step_us = _time(step, args.steps)
    real = comm.check_agreement
    comm.check_agreement = lambda *a, **k: None
    try:
        bare_us = _time(step, args.steps)
    finally:
        comm.check_agreement = real
    sync_ok = "n/a (cpu)"
    if args.device == "cuda":
        step()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(3):
                out = dp.doc_packed_attn(q, k, v, cu, cp_group=group, seq_len=S, causal=True)
                out.float().sum().backward()
            sync_ok = "no sync"
        except RuntimeError as e:
            sync_ok = f"SYNC: {str(e).splitlines()[0][:80]}"
        finally:
            torch.cuda.set_sync_debug_mode(0)
    companion = comm._channels[group.group_name][1].backend is not None
    dist.barrier()
    dist.destroy_process_group()
    return dict(rank=rank, agree=agree_us, step=step_us, bare=bare_us, sync=sync_ok, companion=companion)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--backends", nargs="+", default=["nccl", "cpu:gloo,cuda:nccl"])
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--calls", type=int, default=2000, help="agreement calls timed")
    ap.add_argument("--steps", type=int, default=50, help="CP forward+backward steps timed")
    add_dry_run(ap, "2 gloo ranks on CPU, 1024 tokens, a few calls: checks the script runs")
    args = ap.parse_args(argv)
    if args.dry_run:
        args.device, args.backends, args.world, args.seq, args.calls, args.steps = "cpu", ["gloo"], 2, 1024, 5, 2
    print(f"bench_agreement: {args.world} rank(s), {args.device}, S={args.seq}, torch {torch.__version__}")
    print("| process group | agreement on | agreement us/call | CP fwd+bwd us | without agreement us | difference | cached path |")
    print("|---|---|---|---|---|---|---|")
    for backend in args.backends:
        res = spawn_ranks(_rank, args.world, args, backend)
        r = max(res, key=lambda r: r["agree"])  # the slowest rank
        where = "gloo companion" if r["companion"] else "the group itself"
        print(
            f"| {backend} | {where} | {r['agree']:.0f} | {r['step']:.0f} | {r['bare']:.0f} | "
            f"{r['step'] - r['bare']:+.0f} ({(r['step'] - r['bare']) / r['step']:+.1%}) | {r['sync']} |"
        )


if __name__ == "__main__":
    main()
