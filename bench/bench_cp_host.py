"""Host time per new layout of a context-parallel call, several ranks per host, by thread setting.

What the first context-parallel call of a step does on the host when its layout is new (read
the layout, plan, build this rank's schedule and queue its device indices, the agreement's
tag), timed in ``--ranks`` processes at once (as ranks share a host in training), alternating
layout by layout between the intra-op thread pool the launcher leaves (``torch.multiprocessing``:
as wide as the host) and one thread, and a third way: the plan made beforehand (as a DataLoader
worker would, with ``plan_context_parallel`` on plain lists) and handed over pickled, so the rank
only checks it and builds its schedule. Every layout is new. The anchor is the one-thread figure of
the same run: the ratio says how much the thread pool costs. ``--device cuda`` queues the
indices on the rank's GPU as the runtime does.
Usage: ``python -m bench.bench_cp_host [--ranks 4] [--layouts 20] [--device cpu|cuda]``.
"""

from __future__ import annotations

import argparse
import os
import pickle
import random
import statistics
import time

import torch
import torch.multiprocessing as mp

import doc_packed as dp
from bench._harness import add_dry_run, spawn_ranks
from doc_packed._doc_layout import get_layout
from doc_packed.cp import attention

try:  # trees before prepare(plan=...) have no handed plan to time
    from doc_packed.cp.plan import query_cost_of
    from doc_packed.cp.prepared import _check_plan
except ImportError:
    _check_plan = None

CASES = ((4, 32768), (1, 131072))  # (rows, S): the 4 x 32k and 1 x 128k, CP over --ranks
HQ, HKV = 16, 4


def _schedule(layout, world, rank, device):
    """This rank's schedule (the runtime's entry point; older trees: their private one)."""
    if hasattr(attention, "schedule_for"):
        return attention.schedule_for(layout, (world, rank, True, -1, 0, HQ / HKV, device))
    return attention._schedule(layout, (world, rank, True, -1, 0, HQ, HKV, device))  # before prepare()


def _handed(layout, plan_bytes, world, rank, device):
    """What ``prepare(..., plan=...)`` leaves to the rank when a DataLoader worker made the plan
    (``plan_context_parallel`` on lists) and sent it pickled: unpickle, check it against the
    layout, build this rank's schedule from it (its indices queued), the agreement's tag."""
    plan = pickle.loads(plan_bytes)
    qc = query_cost_of((HQ, HKV), None)
    _check_plan(plan, layout, world, True, (-1, 0), qc)
    attention.install_schedule(layout, attention.ScheduleKey(world, rank, True, -1, 0, qc, device), plan)


def rank_main(rank, world, port, args, barrier):
    device = torch.device("cuda", rank % torch.cuda.device_count()) if args.device == "cuda" else torch.device("cpu")
    launched = torch.get_num_threads()
    # (threads, plan made by the rank or handed): launched, one thread, and a worker's plan handed over
    variants = ((launched, False), (1, False)) + (((launched, True),) if _check_plan is not None else ())
    rows = []
    for B, S in (CASES[:1] if args.dry_run else CASES):
        times: list[list[float]] = [[] for _ in variants]
        cpu: list[list[float]] = [[] for _ in variants]  # process CPU time: all threads, robust to a loaded host
        n = len(variants)
        for i in range(n * args.layouts + n):
            which = i % n
            threads, handed = variants[which]
            torch.set_num_threads(threads)
            rng = random.Random(hash((B, S, i)) & 0xFFFFFFF)
            S = 4096 if args.dry_run else S
            cu = dp.cu_seqlens_from_lengths([dp.data.lognormal_lengths(S, 2048, rng) for _ in range(B)], S, max_docs=S // 8)
            plan_bytes = pickle.dumps(dp.plan_context_parallel(cu.tolist(), world, num_heads=(HQ, HKV))) if handed else b""
            barrier.wait()
            t0, c0 = time.perf_counter(), time.process_time()
            layout = get_layout(cu, S)
            if handed:
                _handed(layout, plan_bytes, world, rank, device)
            else:
                _schedule(layout, world, rank, device)
            tag = getattr(attention, "layout_tag", None) or (lambda lay: attention._layout_tag(lay))
            tag(layout)
            if i >= n:
                times[which].append((time.perf_counter() - t0) * 1e3)
                cpu[which].append((time.process_time() - c0) * 1e3)
        stats = [(statistics.median(t), max(t), statistics.median(c)) for t, c in zip(times, cpu)]
        rows.append((rank, B, S, launched, stats))
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--layouts", type=int, default=20)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    add_dry_run(ap, "2 ranks, 2 layouts of 4 x 4096 tokens: checks the script runs")
    args = ap.parse_args(argv)
    if args.dry_run:
        args.ranks, args.layouts, args.device = 2, 2, "cpu"
    barrier = mp.get_context("spawn").Barrier(args.ranks)  # spawn_ranks' processes are spawned
    rows = sorted(row for rank_rows in spawn_ranks(rank_main, args.ranks, args, barrier) for row in rank_rows)
    print(f"host: {os.cpu_count()} CPUs, {args.ranks} ranks at once, torch {torch.__version__}, doc_packed from "
          f"{os.path.dirname(dp.__file__)}, device {args.device}, lognormal mean 2k, Hq/Hkv {HQ}/{HKV}")
    print("ms per new layout, wall (median / max) and the process's CPU time (median, all its threads)")
    print("| B x S | CP | rank | threads as launched | as launched: wall | CPU | one thread: wall | CPU "
          "| launched / one (wall) | plan handed (a worker's), as launched: wall | CPU |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for rank, B, S, launched, stats in sorted(rows, key=lambda r: (r[1], r[0])):
        (m0, x0, c0), (m1, x1, c1) = stats[:2]
        handed = f"{stats[2][0]:.2f} / {stats[2][1]:.2f} | {stats[2][2]:.2f}" if len(stats) > 2 else "- | -"
        print(f"| {B} x {S // 1024}k | {args.ranks} | {rank} | {launched} | {m0:.2f} / {x0:.2f} | {c0:.2f} "
              f"| {m1:.2f} / {x1:.2f} | {c1:.2f} | {m0 / m1:.2f} | {handed} |")

if __name__ == "__main__":
    main()
