"""Greedy vs CP-aware packing, measured with the real context-parallel planner (CPU only).

For each document-length distribution of bench/cp_model.py, row length S, rows per batch B and
CP size c: draw B rows of documents exactly as the simulation does (``cp_model.make_layout``,
so "greedy" is first-fit in drawn order, every row full), repack the same documents with
``doc_packed.data.pack_order(lengths, S, cp_size=c)`` ("cp"), and plan both with
``doc_packed.cp.plan.build_plan`` (causal, ``query_cost = Hq/Hkv = 4``, tolerance 0.01, as the
runtime). Reported per packing: queries moved (max over ranks), K/V tokens received (max over
ranks) and as a share of all-gather's ``B*S*(c-1)/c``, the owner-first imbalance (before the
planner moves anything) and the plan's, the padding fraction; and the lower bound on K/V that
any packing moving no query (imbalance <= 1.01) must pay (:func:`forced_kv`: every piece of a
document, next to the least fill of the rest of its rank's tokens, must stay under the cap;
"queries must move" where no placement of some document does; :func:`exact_two_kv`, the exact
optimum, for one row of at most 16 documents over 2 ranks).

Goal cells: a shard holds at least 8 mean documents. There the goal is zero queries moved,
K/V <= 1% of all-gather, imbalance <= 1.02, padding <= 0.5%.

Usage:
    python -m bench.bench_packing                     # the grid, tables in Markdown
    python -m bench.bench_packing --quick             # a few points
    python -m bench.bench_packing --stream            # streaming look-ahead trade-off only
    python -m bench.bench_packing --timing            # packing time of 1M tokens only
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import statistics
import sys
import time

import numpy as np
import torch

from bench._harness import add_dry_run
from bench.cp_model import DISTS, HKV, HQ, make_layout, row_lengths, token_label
from bench.simulate_cp import markdown_table
from doc_packed._doc_layout import DocLayout
from doc_packed._mask import prefix_pairs
from doc_packed.cp.plan import build_plan, chunk_len
from doc_packed.data import PAD, pack_order, pack_stream
from doc_packed.data._work import column_loads

SEED = 2026
MEANS = {"lognormal-512": 512, "lognormal-2k": 2048, "lognormal-8k": 8192, "powerlaw": 384}
GRID = [  # (S, rows per batch)
    (1 << 17, 1),
    (1 << 17, 8),
    (1 << 20, 1),
]
CPS = [2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
MIN_TOKENS_PER_RANK = 64


def _layout(lens: list[list[int]], S: int) -> DocLayout:
    return DocLayout([[0] + list(itertools.accumulate(r)) for r in lens], S)


def _measure(lens: list[list[int]], S: int, c: int) -> dict:
    layout = _layout(lens, S)
    loads = column_loads(lens, S, c, True, -1, 0)
    mean = sum(loads) / c
    plan = build_plan(layout, c, True, -1, 0, query_cost=HQ / HKV, tolerance=0.01)
    B = len(lens)
    ag = B * S * (c - 1) // c
    return {
        "rows": B,
        "q": max(plan.q_moved_tokens),
        "kv": max(plan.kv_recv_tokens),
        "kv_ag": max(plan.kv_recv_tokens) / ag,
        "imb0": max(loads) / mean if mean else 1.0,
        "imb": plan.imbalance,
    }


def _least_fill(lengths: list[int], rows: int, pad: int):
    """x -> the fewest pairs that x tokens of one rank's column can carry besides a given
    document, relaxed: whole documents taken fractionally at their density (n + 1) / 2, the
    head of any document (its first t tokens: t (t + 1) / 2 pairs; at most one per row, at a
    cell's end) and padding for free. A lower bound on what really fills them."""
    n = np.asarray(lengths, dtype=np.float64)
    top = int(n.max()) if n.size else 0
    j = np.arange(1, (top + 1) // 2 + 2, dtype=np.float64)  # head tokens: the j-th costs j pairs
    slope = np.concatenate([[0.0], (n + 1) / 2, j])
    count = np.concatenate([[pad], n, np.full(j.size, rows, dtype=np.float64)])
    o = np.argsort(slope, kind="stable")
    toks = np.concatenate([[0.0], np.cumsum(count[o])])
    work = np.concatenate([[0.0], np.cumsum(count[o] * slope[o])])
    return lambda x: np.interp(x, toks, work)


def forced_kv(lengths: list[int], S: int, c: int, rows: int = 1, slack: float = 0.01) -> float:
    """K/V tokens some rank receives in ANY packing of these documents into ``rows`` rows that
    moves no query (every rank within ``1 + slack`` of the mean pairs, the planner's tolerance);
    ``inf`` if no such packing exists. A document that ends ``y`` tokens into a shard is cut into
    its tail (y tokens: that rank receives the other ``n - y`` as keys, none when the document
    is whole there), whole shards before it and a head, all in one row; each piece shares its rank's ``rows``
    cells with at least :func:`_least_fill` of the remaining tokens, and must stay under the
    cap. The largest y that keeps every piece under it gives the document's bound, the largest
    over documents the packing's. Without the fill this is "too long or too heavy for one
    shard"; the fill makes it see a document that fits a rank's share of pairs but not next to
    a shard's worth of others, and one whose two pieces cannot both fit."""
    cs = chunk_len(S, c)
    total = sum(prefix_pairs(n, n, True, -1, 0) for n in lengths)
    cap = (1 + slack) * total / c
    fill = _least_fill(lengths, rows, rows * S - sum(lengths))
    X = rows * cs

    def pairs(k: np.ndarray) -> np.ndarray:  # the first k queries of a document (causal)
        return k * (k + 1) // 2

    out: float = 0
    for n in sorted(set(lengths), reverse=True):
        if n <= out:
            break
        y = np.arange(1, min(n, cs) + 1, dtype=np.int64)
        rest = n - y
        head = rest % cs
        ok = pairs(np.int64(n)) - pairs(rest) + fill(X - y) <= cap  # the tail
        ok &= (rest < cs) | (pairs(rest) - pairs(rest - cs) + fill(X - cs) <= cap)  # the heaviest whole shard
        ok &= (head == 0) | (pairs(head) + fill(X - head) <= cap)  # the head
        ok &= 1 + rest // cs + (head > 0) <= c  # ... all on the c shards of one row
        if ok[-1] and y[-1] == n:
            continue  # whole on one shard: no keys forced
        out = max(out, n - int(y[ok].max()) if ok.any() else math.inf)
    return out


def exact_two_kv(lengths: list[int], S: int, slack: float = 0.01) -> int | None:
    """The least K/V of one full row over 2 ranks that moves no query, by trying every split
    (a subset of the documents on rank 0, plus the head of one more that straddles): the exact
    optimum, for rows of at most 16 documents; None where it does not apply."""
    m = len(lengths)
    if m > 16 or sum(lengths) != S:
        return None
    half = chunk_len(S, 2)
    n = np.asarray(lengths, dtype=np.int64)
    bits = (np.arange(1 << m)[:, None] >> np.arange(m)) & 1
    toks, work = bits @ n, bits @ (n * (n + 1) // 2)
    total = int((n * (n + 1) // 2).sum())
    best = None
    for d in range(m):  # d straddles with head p = half - toks (none when p == 0)
        p = half - toks
        ok = (bits[:, d] == 0) & (p >= 0) & (p < n[d])
        w0 = work + p * (p + 1) // 2
        ok &= np.maximum(w0, total - w0) <= (1 + slack) * total / 2
        if ok.any():
            kv = int(p[ok].min())
            best = kv if best is None else min(best, kv)
    return best


def point(dist: str, S: int, B: int, c: int) -> dict:
    """Greedy and CP-aware packing of the same documents at one grid point."""
    layout = make_layout(dist, S * B, B, SEED)
    greedy = [[e - s for s, e in row] for row in layout.rows]
    lengths = [n for row in greedy for n in row]
    t0 = time.process_time()
    order = pack_order(lengths, S, cp_size=c)
    t_pack = time.process_time() - t0
    g = _measure(greedy, S, c)
    g["pad"] = 0.0
    p = _measure(order.lengths, S, c)
    p["pad"] = order.padded / (len(order.rows) * S)
    cs = chunk_len(S, c)
    mean = MEANS.get(dist, statistics.fmean(lengths))
    lb = forced_kv(lengths, S, c, B)
    exact = exact_two_kv(lengths, S) if (B, c) == (1, 2) else None
    if exact is not None:
        lb = max(lb, exact)  # the exact optimum (a shard of few documents: found by trying all)
    return {
        "dist": dist, "S": S, "B": B, "c": c, "docs": len(lengths), "per_shard": cs / mean,
        "lb": lb, "greedy": g, "cp": p, "pack_ms": t_pack * 1e3,
    }


def _goal(r: dict) -> str:
    if r["per_shard"] < 8:
        return ""
    p = r["cp"]
    ok = p["q"] == 0 and p["kv_ag"] <= 0.01 and p["imb0"] <= 1.02 and p["pad"] <= 0.005
    if ok:
        return "**met**"
    return "forced" if r["lb"] > 0.01 * r["B"] * r["S"] * (r["c"] - 1) / r["c"] else "missed"


def grid_table(res: list[dict]) -> str:
    rows = []
    for r in res:
        g, p = r["greedy"], r["cp"]
        lb = r["lb"] if math.isfinite(r["lb"]) else "queries must move"
        near = f"{p['kv'] / lb:.2f}x" if isinstance(lb, int) and lb else "-"
        rows.append([
            r["dist"], token_label(r["S"]), r["B"], r["c"], f"{r['per_shard']:.1f}",
            g["q"], p["q"], g["kv"], p["kv"], f"{100 * g['kv_ag']:.2f}%", f"{100 * p['kv_ag']:.2f}%",
            lb, near, f"{g['imb0']:.3f}", f"{p['imb0']:.3f}", f"{g['imb']:.3f}", f"{p['imb']:.3f}",
            f"{100 * p['pad']:.2f}%", f"{r['pack_ms']:.1f}", _goal(r),
        ])
    return markdown_table(
        ["dist", "S", "B", "cp", "mean docs / shard", "q moved greedy", "q moved cp", "K/V greedy",
         "K/V cp", "K/V / AG greedy", "K/V / AG cp", "K/V forced (LB)", "cp / LB",
         "imb owner-first greedy", "imb owner-first cp", "imb plan greedy", "imb plan cp",
         "padding cp", "pack ms", "goal"], rows)


def run_grid(args) -> list[dict]:
    res = []
    for S, B in args.grid:
        for dist in args.dists:
            for c in args.cp:
                if S // c < MIN_TOKENS_PER_RANK or (B * S // c) > (1 << 24):
                    continue
                t0 = time.perf_counter()
                res.append(point(dist, S, B, c))
                print(f"  {dist:14s} S={token_label(S):>5s} B={B} c={c:<5d} {time.perf_counter() - t0:6.2f}s",
                      file=sys.stderr, flush=True)
    return res


# ---- streaming -------------------------------------------------------------------------------
def stream_point(dist: str, S: int, c: int, rows: int, lookahead: int, batches: int) -> dict:
    rng = np.random.default_rng([SEED, S, c])
    lengths = [n for _ in range(batches * rows) for n in row_lengths(dist, S, rng)]
    emitted = [0]
    read_at: list[int] = []  # batches already out when each document was read

    def source():
        for n in lengths:
            read_at.append(emitted[0])
            yield torch.empty(n, dtype=torch.int8)

    out = []
    t0 = time.process_time()
    for batch in pack_stream(source(), S, cp_size=c, rows=rows, lookahead=lookahead):
        out.append(batch)
        emitted[0] += 1
    secs = time.process_time() - t0
    stats, waits = [], []
    for k, p in enumerate(out):
        waits += [k - read_at[i] for i in p.doc_index.unique().tolist() if i != PAD]
        if k == len(out) - 1:
            break  # the last batch takes what is left
        lens = [[int(x) for x in r.diff().tolist() if x > 0] for r in p.cu_seqlens]
        m = _measure(lens, S, c)
        m["pad"] = p.padded_fraction
        stats.append(m)
    return {
        "dist": dist, "S": S, "c": c, "rows": rows, "lookahead": lookahead, "batches": len(out),
        "q0": sum(m["q"] == 0 for m in stats) / len(stats),
        "q": statistics.fmean(m["q"] for m in stats),
        "kv_ag": statistics.fmean(m["kv_ag"] for m in stats),
        "imb0": statistics.fmean(m["imb0"] for m in stats),
        "imb0_max": max(m["imb0"] for m in stats),
        "pad": statistics.fmean(m["pad"] for m in stats),
        "wait": max(waits),
        "ms": secs * 1e3 / len(out),
    }


def stream_table(res: list[dict]) -> str:
    rows = [[
        r["dist"], token_label(r["S"]), r["c"], r["rows"], r["lookahead"], r["batches"] - 1,
        f"{100 * r['q0']:.0f}%", f"{r['q']:.0f}", f"{100 * r['kv_ag']:.2f}%", f"{r['imb0']:.3f}",
        f"{r['imb0_max']:.3f}", f"{100 * r['pad']:.2f}%", r["wait"], f"{r['ms']:.1f}",
    ] for r in res]
    return markdown_table(["dist", "S", "cp", "rows per batch", "look-ahead (batches)", "batches",
                   "batches with no query moved", "q moved mean", "K/V / AG mean",
                   "imb owner-first mean", "imb owner-first max", "padding mean",
                   "max wait (batches after read)", "ms per batch"], rows)


# ---- timing ----------------------------------------------------------------------------------
def timing_table(dists: list[str], cps: list[int]) -> str:
    """pack_order on 1M tokens of documents: median process CPU ms of 5, one torch thread."""
    rows = []
    for dist in dists:
        for S, B in ((1 << 17, 8), (1 << 20, 1)):
            layout = make_layout(dist, 1 << 20, B, SEED)
            lengths = [e - s for row in layout.rows for s, e in row]
            row = [dist, token_label(S), len(lengths)]
            for c in cps:
                ts = []
                for _ in range(5):
                    t0 = time.process_time()
                    pack_order(lengths, S, cp_size=c)
                    ts.append(time.process_time() - t0)
                row.append(f"{statistics.median(ts) * 1e3:.1f}")
            rows.append(row)
    return markdown_table(["dist", "S (rows of 1M tokens)", "docs"] + [f"cp {c} ms" for c in cps], rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--stream", action="store_true", help="only the streaming trade-off")
    p.add_argument("--timing", action="store_true", help="only the packing time of 1M tokens")
    p.add_argument("--cp", type=int, nargs="+", default=CPS)
    p.add_argument("--dists", nargs="+", choices=DISTS, default=DISTS)
    add_dry_run(p, "one small cell (2 rows of 8k, lognormal 512, CP 4), no streaming or timing tables")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    args.grid = GRID
    if args.dry_run:
        args.quick, args.cp, args.dists, args.grid = True, [4], ["lognormal-512"], [(1 << 13, 2)]
    elif args.quick:
        args.cp, args.dists, args.grid = [4, 8, 64], ["lognormal-512", "lognormal-2k"], [(1 << 17, 1), (1 << 17, 8)]
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    print(f"# Greedy vs CP-aware packing (real planner; CPU; {time.strftime('%Y-%m-%d')}, "
          f"torch {torch.__version__}, seed {SEED})\n")
    if not (args.stream or args.timing):
        res = run_grid(args)
        print("## Grid (B rows of S tokens per batch; K/V and queries: max over ranks, forward)\n")
        print(grid_table(res))
        goal = [r for r in res if r["per_shard"] >= 8]
        met = sum(_goal(r) == "**met**" for r in goal)
        forced = [r for r in goal if _goal(r) == "forced"]
        q_forced = sum(not math.isfinite(r["lb"]) for r in forced)
        print(f"\nGoal cells (>= 8 mean documents per shard): {met}/{len(goal)} met; "
              f"{len(forced)} 'forced' ({q_forced} where no packing moves no query, "
              f"{len(forced) - q_forced} where any packing that moves none receives more than 1% of "
              f"all-gather's K/V); {sum(_goal(r) == 'missed' for r in goal)} missed\n")
    if not (args.timing or args.quick) or args.stream:
        sres = []
        for dist in ("lognormal-2k", "lognormal-512"):
            for rows in (1, 4):
                for la in (1, 2, 4, 8):
                    sres.append(stream_point(dist, 1 << 17, 8, rows, la, 24 if rows == 1 else 8))
                    print(f"  stream {dist} rows={rows} lookahead={la}", file=sys.stderr, flush=True)
        print("## Streaming: look-ahead vs balance (S=128k, CP=8)\n")
        print(stream_table(sres))
        print()
    if not (args.stream or args.quick) or args.timing:
        print("## Packing time, 1M tokens of documents (pack_order, median process CPU ms of 5, "
              "one thread)\n")
        print(timing_table(["lognormal-512", "lognormal-2k", "lognormal-8k", "powerlaw", "long+short"], [2, 8, 64, 1024]))
    print(f"\n{time.perf_counter() - t0:.0f} s wall; load average before/after "
          f"{load0:.2f}/{os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
