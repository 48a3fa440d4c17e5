"""Soak: many context-parallel steps over random layouts on gloo ranks (CPU), layouts changing
every step. Reports, per rank, host memory (RSS) over the run, how often the schedule came from
the cache, step-time percentiles and the share of the per-call agreement; prints one table.

Each step: a new random layout (documents of random lengths in ``--rows`` rows of ``--seq``
tokens, a random mask), drawn from a pool of ``--pool`` layouts when given (repeats then hit the
cache; 0: a fresh layout every step), and one forward and backward with lse in the loss. Every
rank draws the same layouts (one seed). Memory must stay flat: the layout cache and each
layout's memo are bounded LRUs.

Usage: ``python -m bench.soak_cp [--steps 10000] [--world 4] [--seq 256] [--pool 0]``.
"""

from __future__ import annotations

import argparse
import os
import random
import time

import torch
import torch.distributed as dist

from bench._harness import add_dry_run, init_process_group, spawn_ranks


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _layout(rng: random.Random, rows: int, S: int) -> list[list[int]]:
    out = []
    for _ in range(rows):
        lengths, left = [], S
        while left:
            n = min(left, max(1, int(rng.lognormvariate(3.5, 1.0))))
            lengths.append(n)
            left -= n
        out.append(lengths)
    return out


def _rank(rank, world, port, args):
    torch.set_num_threads(1)
    init_process_group(rank, world, port, "gloo", timeout_s=300)
    import doc_packed as dp
    from doc_packed.cp import attention, comm

    calls = {"schedule": 0, "built": 0, "agree_s": 0.0}
    real_get, real_build, real_agree = attention.get_schedule, attention.build_schedule, comm.check_agreement

    def get(*a, **k):
        calls["schedule"] += 1
        return real_get(*a, **k)

    def build(*a, **k):
        calls["built"] += 1
        return real_build(*a, **k)

    def agree(*a, **k):
        t0 = time.perf_counter()
        try:
            return real_agree(*a, **k)
        finally:
            calls["agree_s"] += time.perf_counter() - t0

    attention.get_schedule, attention.build_schedule, comm.check_agreement = get, build, agree
    rng = random.Random(args.seed)
    pool = [_layout(rng, args.rows, args.seq) for _ in range(args.pool)]
    S, H, Hkv, D = args.seq, 4, 2, 16
    L = -(-S // world)
    group = dist.group.WORLD
    times, rss = [], []
    g = torch.Generator().manual_seed(rank)
    profiler = None
    if args.profile and rank == 0:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    for step in range(args.steps):
        lengths = rng.choice(pool) if pool else _layout(rng, args.rows, S)
        causal = rng.random() < 0.7
        window = (rng.choice([-1, 16, 64]), -1 if causal else rng.choice([-1, 8]))
        if causal:
            window = (window[0], 0)
        local = min(L, max(0, S - rank * L))
        q = torch.randn(args.rows, local, H, D, generator=g, requires_grad=True)
        k = torch.randn(args.rows, local, Hkv, D, generator=g, requires_grad=True)
        v = torch.randn(args.rows, local, Hkv, D, generator=g, requires_grad=True)
        cu = dp.cu_seqlens_from_lengths(lengths, S)
        t0 = time.perf_counter()
        out, lse = dp.doc_packed_attn(
            q, k, v, cu, causal=causal, window_size=window, return_lse=True, cp_group=group, seq_len=S
        )
        (out.sum() + lse.sum()).backward()
        times.append(time.perf_counter() - t0)
        if step % max(1, args.steps // 20) == 0 or step == args.steps - 1:
            rss.append((step, _rss_mib()))
    if profiler is not None:
        import pstats

        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(args.profile)
    times.sort()
    n = len(times)
    stats = dict(
        rank=rank,
        p50=times[n // 2] * 1e3,
        p90=times[int(n * 0.9)] * 1e3,
        p99=times[min(n - 1, int(n * 0.99))] * 1e3,
        max=times[-1] * 1e3,
        hit=1 - calls["built"] / max(1, calls["schedule"]),
        agree_us=calls["agree_s"] / max(1, 2 * args.steps) * 1e6,
        agree_share=calls["agree_s"] / sum(times),
        rss=rss,
    )
    dist.barrier()
    dist.destroy_process_group()
    return stats


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256, help="tokens per row")
    ap.add_argument("--rows", type=int, default=2, help="rows per step")
    ap.add_argument("--pool", type=int, default=0, help="draw layouts from this many (0: new every step)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", type=int, default=0, help="print rank 0's N most expensive functions")
    add_dry_run(ap, "20 steps on 2 ranks: checks the script runs")
    args = ap.parse_args(argv)
    if args.dry_run:
        args.steps, args.world = 20, 2
    t0 = time.time()
    stats = spawn_ranks(_rank, args.world, args)
    wall = time.time() - t0
    print(
        f"soak_cp: {args.steps} steps, {args.world} gloo ranks, {args.rows} x {args.seq} tokens, "
        f"pool {args.pool or 'none (new layout every step)'}, torch {torch.__version__}, {wall:.0f} s wall"
    )
    print("| rank | step p50 ms | p90 | p99 | max | schedule cache hits | agreement us/call | share of step | RSS MiB at 5% -> 50% -> end |")
    print("|---|---|---|---|---|---|---|---|---|")
    for s in stats:
        rss = s["rss"]
        marks = [rss[min(1, len(rss) - 1)], rss[len(rss) // 2], rss[-1]]
        print(
            f"| {s['rank']} | {s['p50']:.2f} | {s['p90']:.2f} | {s['p99']:.2f} | {s['max']:.1f} | {s['hit']:.1%} | "
            f"{s['agree_us']:.0f} | {s['agree_share']:.1%} | {' -> '.join(f'{m:.1f}' for _, m in marks)} |"
        )
    growth = max(s["rss"][-1][1] - s["rss"][len(s["rss"]) // 2][1] for s in stats)
    print(f"largest RSS growth over the second half of the run: {growth:+.1f} MiB")


if __name__ == "__main__":
    main()
