"""Context parallelism at scale, on paper: our real planner against analytical peer designs.

Nothing here runs attention. For each (document-length distribution, tokens per CP group T,
CP size c) the script builds the packed layout, runs OUR planner
(``doc_packed.cp.plan.build_plan``, causal, ``query_cost = Hq/Hkv`` and ``tolerance = 0.01``
as the runtime uses them), times it, and compares the plan's exact per-rank work and traffic
with other context-parallel designs. Rank ``r`` owns the ``r``-th ``torch.chunk`` of every row.

Layout: a CP group processes T = B*S tokens. By default B = 1: one packed row of S = T tokens
per group (``--rows B`` cuts T into B rows of S = T/B, each drawn independently).
Combinations with T/c < 64 tokens per rank are skipped.

Traffic, in BYTES per rank per layer, forward (bf16 = 2 bytes, lse fp32 = 4 bytes; defaults
Hq = 32, Hkv = 8, D = 128, i.e. GQA: one K/V token is 4x smaller than one query token):

- ours / min-heap:  kv_recv * (2*Hkv*D*2)  +  q_moved * (2*Hq*D*2 + 4*Hq)
  (K and V of every received key; for each moved query: the query in, the output back and its
  lse back). kv_recv = |union of the key ranges the rank's queries see| - keys it owns;
  q_moved = queries it computes for other owners. Per-rank bytes are computed per rank, and
  the max over ranks is reported.
- all-gather CP (torch CP, torchtitan, NeMo) and ring P2P (TE, ring-flash-attn):
  T*(c-1)/c tokens of K and V:  2*Hkv*D*2 * T*(c-1)/c.
- Ulysses all-to-all (q, k, v in by heads, out back by tokens):
  (2*Hq + 2*Hkv') * D * 2 * (T/c) * (c-1)/c  with Hkv' = max(Hkv, c): for c > Hkv every rank
  needs one whole K/V head, so K/V heads are replicated (GQA cap). Not possible for c > Hq.

Backward (for the step-time model), same conventions as doc_packed/cp/attention.py:
- ours / min-heap: K/V fetched again and partial dK/dV reduced back to owners in bf16
  (2x the forward K/V bytes); per moved query q, out, dout (3*Hq*D*2) + lse (4*Hq) in and
  dQ (Hq*D*2) back.
- all-gather / ring: K/V gathered again + dK/dV reduce-scattered: 2x the forward bytes.
- Ulysses: dout in, dq/dk/dv back (activations kept head-sharded from the forward): 1x.

Work: exact (query, key) pairs (``doc_packed._mask.prefix_pairs``), causal inside documents.
Locality-blind min-heap (MagiAttention's default dispatch, reimplemented here): each row is cut
into 8c chunks of ~S/(8c) tokens (at chunk size only, not at documents), each weighed by its
exact pair count, assigned largest first to the least-loaded rank that holds fewer than
ceil(n_chunks/c) chunks. All-gather CP computes with head-tail balancing (row cut in 2c
chunks, rank r gets chunks r and 2c-1-r), its exact work is counted too.

Step-time model, attention only, per layer, forward + backward, no compute/comm overlap:
    t = work_max * 4*Hq*D * 3.5 / (TFLOP/s)  +  bytes_fwd_bwd_max / (GB/s)  [+ fixed ms]
(4*Hq*D flops per pair forward, backward 2.5x forward; max work and max bytes over ranks.)
All-gather is shown twice: with its row-level head-tail split (exact work, what torch CP does
on a packed row) and perfectly balanced (e.g. per-document zigzag, which needs every document
length % 2c == 0). Ulysses computes total/c pairs per rank. One GPU (pure DP, no CP) computes
all T tokens with no traffic; speedup = t_1 / t_c.
The constants below come from ../shared/notes/landscape.md (one H200, torch 2.11 varlen,
2 GPUs over NCCL) and are overridable with --tflops / --a2a-gbps / --ag-gbps; the optional
fixed exchange cost per layer (--a2a-fixed-ms for ours, min-heap and Ulysses, --ag-fixed-ms for
all-gather) defaults to 0.

Validation (--validate bench_cp.json): for every (S, layout) that bench/bench_cp.py measured,
rebuild that layout with bench_cp.py's own generator, plan it at the run's CP size (the JSON's
"gpus" field, so CP=2 and CP=4 files both work) with
bench_cp.py's call, check the plan equals the one the run recorded, and predict CP and
all-gather fwd+bwd times with the model above, the compute rate taken from the measured
one-GPU time of the same layout (3.5 * 4 * pairs * Hq * D / t_1GPU). Prints predicted vs
measured, a breakdown, and a least-squares fit of the non-compute time as fixed + bytes / GB/s.

Planner time: ``build_plan``'s process CPU time, median of --repeats runs, one torch thread;
growth exponents are log-log slopes of time vs T (fixed c) and vs c (fixed T).

Usage:
    python bench/simulate_cp.py --quick              # reduced grid, < 1 minute
    python bench/simulate_cp.py --out docs/          # full grid, tables + docs/sim_*.png
    python bench/simulate_cp.py --validate docs/results/bench_cp_2xh200.json --out docs/
"""

from __future__ import annotations

import argparse
import gc
import heapq
import math
import os
import statistics
import sys
import time
import zlib
from bisect import bisect_right
from dataclasses import dataclass

import numpy as np
import torch

from doc_packed._layout import DocLayout
from doc_packed._mask import prefix_pairs
from doc_packed.cp.plan import build_plan, owner_ranges

# ---- model and hardware constants (landscape.md; override on the command line) ------------
HQ, HKV, HEAD_DIM = 32, 8, 128
BF16, LSE_BYTES = 2, 4
TFLOPS = 277.0  # H200 varlen fwd+bwd, 64k tokens, lognormal documents (277-327 measured)
A2A_GBPS = 283.0  # all_to_all_single out per rank, 2 x H200, 256 MB
AG_GBPS = 256.0  # all_gather, 2 x H200
BWD_FACTOR = 2.5  # backward flops / forward flops

# ---- grid ------------------------------------------------------------------------------------
CP_SIZES = [8, 16, 32, 64, 128, 256, 512, 1024]
TOKENS = [1 << 17, 1 << 19, 1 << 21, 1 << 23]  # 128k, 512k, 2M, 8M
DISTS = ["lognormal-512", "lognormal-2k", "lognormal-8k", "powerlaw", "one-doc", "long+short"]
QUICK_CP = [8, 64, 256]
QUICK_TOKENS = [1 << 17, 1 << 19]
MIN_TOKENS_PER_RANK = 64
CHUNKS_PER_RANK = 8  # min-heap baseline: chunks of ~S/(8c)
GOAL_CP = 64
SEED = 2026
TOLERANCE = 0.01  # the runtime's (doc_packed/cp/attention.py)

CAUSAL, LEFT, RIGHT = True, -1, 0


# ---- layouts ---------------------------------------------------------------------------------
def _fill(sampler, S: int) -> list[int]:
    """Draw lengths until they cover S tokens; the last one is cut to fit exactly."""
    out, total = [], 0
    while total < S:
        for n in sampler():
            n = int(min(max(1, n), S - total))
            out.append(n)
            total += n
            if total == S:
                break
    return out


def lognormal_lengths(S: int, mean: float, rng, sigma: float = 1.0) -> list[int]:
    mu = math.log(mean) - sigma * sigma / 2  # so that E[length] = mean
    return _fill(lambda: np.rint(rng.lognormal(mu, sigma, 1024)), S)


def powerlaw_lengths(S: int, rng, alpha: float = 1.5, xmin: int = 128) -> list[int]:
    """Pareto(alpha) with minimum xmin, capped at S."""
    return _fill(lambda: np.minimum(np.floor((rng.pareto(alpha, 1024) + 1) * xmin), S), S)


def row_lengths(dist: str, S: int, rng) -> list[int]:
    if dist.startswith("lognormal-"):
        mean = {"512": 512, "2k": 2048, "8k": 8192}[dist.split("-")[1]]
        return lognormal_lengths(S, mean, rng)
    if dist == "powerlaw":
        return powerlaw_lengths(S, rng)
    if dist == "one-doc":
        return [S]
    if dist == "long+short":  # half the tokens in one document, at a random place among the rest
        long = S // 2
        short = lognormal_lengths(S - long, 512, rng)
        at = int(rng.integers(0, len(short) + 1))
        return short[:at] + [long] + short[at:]
    raise ValueError(f"unknown distribution {dist!r}")


def make_layout(dist: str, total: int, rows: int, seed: int) -> DocLayout:
    """B = rows packed rows of S = total/rows tokens; the same layout for every CP size."""
    if total % rows:
        raise ValueError(f"--rows {rows} does not divide {total} tokens")
    S = total // rows
    rng = np.random.default_rng([seed, zlib.crc32(dist.encode()), total, rows])
    bounds = []
    for _ in range(rows):
        bounds.append(np.concatenate([[0], np.cumsum(row_lengths(dist, S, rng))]).tolist())
    return DocLayout(bounds, S)


# ---- exact work of a token range of a row ---------------------------------------------------
class RowMask:
    """Exact causal pair counts and key ranges of token ranges of one packed row."""

    def __init__(self, docs):
        self.starts = [s for s, _ in docs]
        self.ends = [e for _, e in docs]

    def _first(self, a: int) -> int:
        return bisect_right(self.starts, a) - 1

    def work(self, a: int, e: int) -> int:
        w, i = 0, self._first(a)
        while i < len(self.starts) and self.starts[i] < e:
            ds, de = self.starts[i], self.ends[i]
            n = de - ds
            w += prefix_pairs(min(de, e) - ds, n, CAUSAL, LEFT, RIGHT)
            w -= prefix_pairs(max(a, ds) - ds, n, CAUSAL, LEFT, RIGHT)
            i += 1
        return w

    def key_start(self, a: int) -> int:
        """Causal keys of queries [a, e) are [start of a's document, e)."""
        return self.starts[self._first(a)]


def _cuts(S: int, n: int) -> list[int]:
    return [S * i // n for i in range(n + 1)]


def _outside(s: int, e: int, os_: int, oe: int) -> int:
    return (e - s) - max(0, min(e, oe) - max(s, os_))


@dataclass
class Assignment:
    work: list[int]
    kv_recv: list[int]
    q_moved: list[int]

    @property
    def imbalance(self) -> float:
        total = sum(self.work)
        return max(self.work) * len(self.work) / total if total else 1.0


def minheap_assign(layout: DocLayout, c: int, masks: list[RowMask]) -> Assignment:
    """MagiAttention-style locality-blind dispatch: LPT over ~S/(8c) chunks, equal-count cap."""
    S = layout.seq_len
    chunks = []  # (work, row, start, end)
    for b, mask in enumerate(masks):
        cuts = _cuts(S, CHUNKS_PER_RANK * c)
        for a, e in zip(cuts[:-1], cuts[1:]):
            if e > a:
                chunks.append((mask.work(a, e), b, a, e))
    cap = -(-len(chunks) // c)
    chunks.sort(key=lambda x: (-x[0], x[1], x[2]))
    heap = [(0, r) for r in range(c)]
    count = [0] * c
    work = [0] * c
    mine: list[list[tuple[int, int, int]]] = [[] for _ in range(c)]
    for w, b, a, e in chunks:
        _, r = heapq.heappop(heap)
        work[r] += w
        count[r] += 1
        mine[r].append((b, a, e))
        if count[r] < cap:
            heapq.heappush(heap, (work[r], r))
    return _traffic(layout, c, masks, work, mine)


def _traffic(layout, c, masks, work, mine) -> Assignment:
    owned = owner_ranges(layout.seq_len, c)
    kv, qm = [], []
    for r in range(c):
        os_, oe = owned[r]
        keys = sorted((b, masks[b].key_start(a), e) for b, a, e in mine[r])
        merged: list[list[int]] = []
        for b, s, e in keys:
            if merged and merged[-1][0] == b and s <= merged[-1][2]:
                merged[-1][2] = max(merged[-1][2], e)
            else:
                merged.append([b, s, e])
        kv.append(sum(_outside(s, e, os_, oe) for _, s, e in merged))
        qm.append(sum(_outside(a, e, os_, oe) for _, a, e in mine[r]))
    return Assignment(work, kv, qm)


def kv_lower_bound(layout: DocLayout, c: int) -> int:
    """Max K/V tokens ANY plan must send to some rank: whoever computes a document's last
    query needs all its keys, and owns at most its overlap with one shard."""
    owned = owner_ranges(layout.seq_len, c)
    cs = owned[0][1]
    lb = 0
    for docs in layout.rows:
        for ds, de in docs:
            if de - ds <= lb:
                continue
            best = max(min(de, owned[r][1]) - max(ds, owned[r][0])
                       for r in range(ds // cs, (de - 1) // cs + 1))
            lb = max(lb, de - ds - best)
    return lb


def head_tail_work(layout: DocLayout, c: int, masks: list[RowMask]) -> list[int]:
    """All-gather CP's compute: row in 2c chunks, rank r gets chunks r and 2c-1-r."""
    cuts = _cuts(layout.seq_len, 2 * c)
    work = [0] * c
    for mask in masks:
        for r in range(c):
            for j in (r, 2 * c - 1 - r):
                work[r] += mask.work(cuts[j], cuts[j + 1])
    return work


# ---- bytes --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Model:
    hq: int = HQ
    hkv: int = HKV
    d: int = HEAD_DIM
    tflops: float = TFLOPS
    a2a_gbps: float = A2A_GBPS
    ag_gbps: float = AG_GBPS
    a2a_fixed_ms: float = 0.0  # per layer fwd+bwd, all-to-all designs (ours, min-heap, Ulysses)
    ag_fixed_ms: float = 0.0  # per layer fwd+bwd, all-gather designs

    @property
    def kv_tok(self) -> int:  # K and V of one token
        return 2 * self.hkv * self.d * BF16

    @property
    def q_fwd(self) -> int:  # query in, output and lse back
        return 2 * self.hq * self.d * BF16 + LSE_BYTES * self.hq

    @property
    def q_bwd(self) -> int:  # q, out, dout and lse in, dq back
        return 4 * self.hq * self.d * BF16 + LSE_BYTES * self.hq

    def exchange_bytes(self, kv: list[int], q: list[int]) -> tuple[int, int]:
        """(max fwd, max fwd+bwd) bytes over ranks for a plan's per-rank kv_recv / q_moved."""
        fwd = [k * self.kv_tok + m * self.q_fwd for k, m in zip(kv, q)]
        both = [f + 2 * k * self.kv_tok + m * self.q_bwd for f, k, m in zip(fwd, kv, q)]
        return max(fwd), max(both)

    def allgather_bytes(self, T: int, c: int) -> int:
        return self.kv_tok * T * (c - 1) // c

    def ulysses_bytes(self, T: int, c: int) -> float:
        if c > self.hq:
            return math.nan
        return (2 * self.hq + 2 * max(self.hkv, c)) * self.d * BF16 * (T / c) * (c - 1) / c

    def compute_s(self, pairs: float) -> float:
        return pairs * 4 * self.hq * self.d * (1 + BWD_FACTOR) / (self.tflops * 1e12)

    def a2a_s(self, nbytes: float) -> float:
        """Exchange time of an all-to-all design, fwd+bwd: fixed cost + bytes / bandwidth."""
        return self.a2a_fixed_ms * 1e-3 + nbytes / (self.a2a_gbps * 1e9)

    def ag_s(self, nbytes: float) -> float:
        return self.ag_fixed_ms * 1e-3 + nbytes / (self.ag_gbps * 1e9)


# ---- one grid point --------------------------------------------------------------------------
def time_plan(layout: DocLayout, c: int, repeats: int, query_cost: float, tolerance=TOLERANCE):
    """(plan, median CPU seconds) of build_plan; fewer repeats for slow points.

    CPU time of this process (``time.process_time``, one torch thread), not wall time, so that
    other jobs on the machine inflate it less.
    """
    times, plan = [], None
    gc.collect()  # the previous points' garbage is not collected inside the timed calls
    for i in range(repeats):
        t0 = time.process_time()
        plan = build_plan(
            layout, c, CAUSAL, LEFT, RIGHT, query_cost=query_cost, tolerance=tolerance
        )
        times.append(time.process_time() - t0)
        if i == 0 and times[0] > 1.0:
            break
    return plan, statistics.median(times)


def _check_accounting(layout, c, masks, plan) -> None:
    """The baseline's accounting, applied to our plan, must give the planner's own numbers."""
    mine = [list(q) for q in plan.q_ranges]
    work = [sum(masks[b].work(a, e) for b, a, e in m) for m in mine]
    got = _traffic(layout, c, masks, work, mine)
    if (got.work, got.kv_recv, got.q_moved) != (
        list(plan.work), list(plan.kv_recv_tokens), list(plan.q_moved_tokens)
    ):
        raise AssertionError(f"traffic accounting disagrees with the planner at c={c}")


def evaluate(dist: str, T: int, c: int, layout: DocLayout, masks, m: Model, repeats: int) -> dict:
    plan, secs = time_plan(layout, c, repeats, m.hq / m.hkv)
    heap = minheap_assign(layout, c, masks)
    _check_accounting(layout, c, masks, plan)
    ht = head_tail_work(layout, c, masks)
    total_work = sum(plan.work)
    ours_fwd, ours_both = m.exchange_bytes(plan.kv_recv_tokens, plan.q_moved_tokens)
    heap_fwd, heap_both = m.exchange_bytes(heap.kv_recv, heap.q_moved)
    # ours at min-heap's balance: re-plan with the tolerance min-heap achieved (diagnostic)
    matched = None
    if plan.imbalance > heap.imbalance:
        tight, _ = time_plan(layout, c, 1, m.hq / m.hkv, max(heap.imbalance - 1, 1e-4))
        matched = (max(tight.kv_recv_tokens), tight.imbalance)
    ag = m.allgather_bytes(T, c)
    uly = m.ulysses_bytes(T, c)
    t1 = m.compute_s(total_work)
    step = {
        "ours": m.compute_s(max(plan.work)) + m.a2a_s(ours_both),
        "minheap": m.compute_s(max(heap.work)) + m.a2a_s(heap_both),
        "allgather": m.compute_s(max(ht)) + m.ag_s(3 * ag),
        "allgather_ideal": m.compute_s(total_work / c) + m.ag_s(3 * ag),
        "ulysses": m.compute_s(total_work / c) + m.a2a_s(2 * uly),
    }
    return {
        "dist": dist, "T": T, "c": c, "docs": sum(len(r) for r in layout.rows),
        "plan_s": secs,
        "imb": plan.imbalance, "heap_imb": heap.imbalance,
        "ag_imb": max(ht) * c / total_work,
        "kv_max": max(plan.kv_recv_tokens), "kv_mean": statistics.fmean(plan.kv_recv_tokens),
        "q_max": max(plan.q_moved_tokens),
        "heap_kv_max": max(heap.kv_recv), "heap_q_max": max(heap.q_moved),
        "kv_lb": kv_lower_bound(layout, c), "matched": matched,
        "ours_kv_bytes": max(plan.kv_recv_tokens) * m.kv_tok,
        "heap_kv_bytes": max(heap.kv_recv) * m.kv_tok,
        "ours_bytes": ours_fwd, "heap_bytes": heap_fwd, "ag_bytes": ag, "uly_bytes": uly,
        "t1": t1, "step": step,
    }


def run_grid(dists, tokens, cps, rows, seed, m: Model, repeats: int) -> list[dict]:
    results = []
    for dist in dists:
        for T in tokens:
            layout = make_layout(dist, T, rows, seed)
            masks = [RowMask(docs) for docs in layout.rows]
            for c in cps:
                if T // c < MIN_TOKENS_PER_RANK:
                    continue
                t0 = time.perf_counter()
                results.append(evaluate(dist, T, c, layout, masks, m, repeats))
                print(f"  {dist:14s} T={_tok(T):>5s} c={c:<5d} "
                      f"{time.perf_counter() - t0:6.2f}s", file=sys.stderr, flush=True)
    return results


# ---- reporting ------------------------------------------------------------------------------
def _tok(n: int) -> str:
    for unit, div in (("M", 1 << 20), ("k", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div}{unit}"
    return str(n)


def _mb(b: float) -> str:
    return "n/a" if math.isnan(b) else f"{b / 1e6:.1f}"


def table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(x) for x in r) + " |" for r in rows]
    return "\n".join(lines)


def traffic_table(res: list[dict]) -> str:
    rows = []
    for r in res:
        rows.append([
            r["dist"], _tok(r["T"]), r["docs"], r["c"], f"{r['imb']:.3f}", f"{r['heap_imb']:.3f}",
            r["kv_max"], f"{r['kv_mean']:.0f}", r["q_max"], r["heap_kv_max"], r["kv_lb"],
            _mb(r["ours_kv_bytes"]), _mb(r["ours_bytes"]), _mb(r["heap_bytes"]),
            _mb(r["ag_bytes"]), _mb(r["uly_bytes"]),
            f"{100 * r['ours_kv_bytes'] / r['ag_bytes']:.1f}%",
        ])
    return table(
        ["dist", "T", "docs", "cp", "imb ours", "imb heap", "kv max", "kv mean", "q moved max",
         "heap kv max", "kv LB", "ours K/V MB", "ours MB", "heap MB", "all-gather MB", "Ulysses MB",
         "ours K/V / AG"], rows)


def summary_table(res: list[dict], c: int) -> str:
    """The goal's view: one row per (distribution, T) at one CP size."""
    rows = []
    for r in (r for r in res if r["c"] == c):
        kvb, heap = r["ours_kv_bytes"], r["heap_kv_bytes"]
        lb = f"{100 * r['kv_lb'] / r['kv_max']:.0f}%" if r["kv_max"] else "-"
        rows.append([
            r["dist"], _tok(r["T"]), _mb(kvb), _mb(heap), _mb(r["ag_bytes"]),
            f"{100 * kvb / r['ag_bytes']:.1f}%", lb, f"{kvb / heap:.2f}" if heap else "-",
            f"{r['imb']:.3f}", f"{r['heap_imb']:.3f}",
        ])
    return table(["dist", "T", "ours K/V MB", "min-heap K/V MB", "all-gather MB", "ours / AG",
                  "lower bound / ours", "ours / min-heap", "imb ours", "imb min-heap"], rows)


def timing_table(res: list[dict], cps: list[int]) -> str:
    cell = {(r["dist"], r["T"], r["c"]): r["plan_s"] for r in res}
    keys = sorted({(r["dist"], r["T"]) for r in res}, key=lambda k: (DISTS.index(k[0]), k[1]))
    rows = []
    for dist, T in keys:
        row = [dist, _tok(T)]
        for c in cps:
            s = cell.get((dist, T, c))
            row.append("-" if s is None else f"{s * 1e3:.1f}")
        rows.append(row)
    return table(["dist", "T"] + [f"cp {c} (ms)" for c in cps], rows)


def loglog_slope(xs, ys) -> float:
    if len(xs) < 2:
        return math.nan
    return float(np.polyfit(np.log(xs), np.log(ys), 1)[0])


def slopes(res: list[dict]) -> tuple[list[list], list[list]]:
    """Growth exponents of planner time: vs tokens at fixed cp, vs cp at fixed tokens."""
    by_tokens, by_cp = [], []
    for dist in DISTS:
        mine = [r for r in res if r["dist"] == dist]
        for c in sorted({r["c"] for r in mine}):
            pts = sorted((r["T"], r["plan_s"]) for r in mine if r["c"] == c)
            if len(pts) >= 2:
                by_tokens.append([dist, c, loglog_slope(*zip(*pts))])
        for T in sorted({r["T"] for r in mine}):
            pts = sorted((r["c"], r["plan_s"]) for r in mine if r["T"] == T)
            if len(pts) >= 2:
                by_cp.append([dist, T, loglog_slope(*zip(*pts))])
    return by_tokens, by_cp


def slope_table(by_tokens, by_cp) -> str:
    flag = lambda s: f"{s:.2f}" + (" **>1.2**" if s > 1.2 else "")  # noqa: E731
    a = table(["dist", "cp", "slope vs tokens"], [[d, c, flag(s)] for d, c, s in by_tokens])
    b = table(["dist", "T", "slope vs cp"], [[d, _tok(T), flag(s)] for d, T, s in by_cp])
    return a + "\n\n" + b


def step_table(res: list[dict]) -> str:
    rows = []
    def ms(s):
        return "n/a" if math.isnan(s) else f"{s * 1e3:.2f}"

    def sp(r, k):
        return "n/a" if math.isnan(r["step"][k]) else f"{r['t1'] / r['step'][k]:.1f}"

    for r in res:
        st = r["step"]
        rows.append([
            r["dist"], _tok(r["T"]), r["c"], f"{r['ag_imb']:.2f}", ms(r["t1"]), ms(st["ours"]),
            ms(st["allgather"]), ms(st["allgather_ideal"]), ms(st["ulysses"]), ms(st["minheap"]),
            sp(r, "ours"), sp(r, "allgather"), sp(r, "allgather_ideal"), sp(r, "ulysses"),
            sp(r, "minheap"),
        ])
    return table(
        ["dist", "T", "cp", "AG head-tail imb", "1 GPU ms", "ours ms", "AG head-tail ms",
         "AG balanced ms", "Ulysses ms", "min-heap ms", "speedup ours", "speedup AG head-tail",
         "speedup AG balanced", "speedup Ulysses", "speedup heap"], rows)


# ---- goals ----------------------------------------------------------------------------------
def check_goals(res: list[dict], by_tokens, by_cp) -> list[tuple[bool | str, str]]:
    """(passed, line) per check; G3' lines are diagnostics ("info"), not counted."""
    out = []
    at = [r for r in res if r["c"] == GOAL_CP]
    for r in at:
        if r["dist"] in ("lognormal-512", "lognormal-2k"):
            ratio = r["ours_kv_bytes"] / r["ag_bytes"]
            tot = r["ours_bytes"] / r["ag_bytes"]
            lb = r["kv_lb"] * HKV * HEAD_DIM * 2 * BF16 / r["ag_bytes"]
            out.append((ratio <= 0.10,
                        f"G1 K/V bytes <= 10% of all-gather  {r['dist']} T={_tok(r['T'])} "
                        f"cp={GOAL_CP}: {100 * ratio:.1f}% (incl. moved queries {100 * tot:.1f}%; "
                        f"any plan >= {100 * lb:.1f}%)"))
    for r in at:
        out.append((r["imb"] <= 1.05,
                    f"G2 imbalance <= 1.05               {r['dist']} T={_tok(r['T'])} "
                    f"cp={GOAL_CP}: {r['imb']:.3f}"))
    for r in at:
        ok = r["kv_max"] < r["heap_kv_max"] and r["imb"] <= r["heap_imb"]
        out.append((ok,
                    f"G3 K/V < min-heap, balance <= heap {r['dist']} T={_tok(r['T'])} "
                    f"cp={GOAL_CP}: kv {r['kv_max']} vs {r['heap_kv_max']}, "
                    f"imb {r['imb']:.3f} vs {r['heap_imb']:.3f}"))
        if not ok and r["matched"] is not None:
            kv, imb = r["matched"]
            out.append(("info" if kv < r["heap_kv_max"] and imb <= r["heap_imb"] else "info-fail",
                        f"G3' same, tolerance = heap's       {r['dist']} T={_tok(r['T'])} "
                        f"cp={GOAL_CP}: kv {kv} vs {r['heap_kv_max']}, "
                        f"imb {imb:.4f} vs {r['heap_imb']:.4f}"))
    for r in res:
        if r["T"] == 1 << 17 and r["c"] == 16 and r["dist"] in ("lognormal-512", "lognormal-2k"):
            out.append((r["plan_s"] <= 0.010,
                        f"G4 planner <= 10 ms                {r['dist']} T=128k cp=16: "
                        f"{r['plan_s'] * 1e3:.2f} ms"))
    worst_t = max(by_tokens, key=lambda x: x[2], default=None)
    worst_c = max(by_cp, key=lambda x: x[2], default=None)
    if worst_t:
        out.append((worst_t[2] <= 1.2, f"G5 time vs tokens slope <= 1.2 (worst: {worst_t[0]} "
                                       f"cp={worst_t[1]}): {worst_t[2]:.2f}"))
    if worst_c:
        out.append((worst_c[2] <= 1.2, f"G5 time vs cp slope <= 1.2 (worst: {worst_c[0]} "
                                       f"T={_tok(worst_c[1])}): {worst_c[2]:.2f}"))
    return out


# ---- validation against a measured CP run (bench/bench_cp.py --json) ------------------------
def _bench_cp_module():
    """bench/bench_cp.py itself, so that its layouts are regenerated by its own code."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_cp.py")
    spec = importlib.util.spec_from_file_location("bench_cp", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def bench_cp_lengths(S: int, name: str, bench=None) -> list[int]:
    """Document lengths of the layout bench/bench_cp.py times under ``name`` at length S."""
    if name == "one doc":
        return [S]
    if name == "lognormal 2k":
        bench = bench or _bench_cp_module()
        return bench.lognormal_lengths(S, 2048, seed=S)  # bench_cp.py's own call
    raise ValueError(f"unknown bench_cp layout {name!r}")


def validate_point(row: dict, m: Model, bench=None) -> dict:
    """Predict one measured (S, layout) point of bench_cp.py with the step-time model.

    Compute rate: the measured one-GPU fwd+bwd of this very layout, as an effective TFLOP/s
    (3.5 * 4 * pairs * Hq * D / time), so the prediction tests the split of the work and the
    traffic term, not the kernel's speed. Exchange: ``m.a2a_s`` for ours, ``m.ag_s`` for the
    all-gather baseline (bytes / bandwidth, plus the fixed costs if set); the refetch the
    bench times alone is predicted as bytes / ``m.a2a_gbps``.
    """
    from dataclasses import replace

    from doc_packed import cu_seqlens_from_lengths, plan_context_parallel

    S, name, c = row["S"], row["layout"], row["gpus"]
    lengths = bench_cp_lengths(S, name, bench)
    if len(lengths) != row["docs"]:
        raise AssertionError(f"{name} S={S}: {len(lengths)} documents, the run had {row['docs']}")
    cu = cu_seqlens_from_lengths([lengths], S, max_docs=len(lengths) + 8)
    # bench_cp.py's call (= the runtime's: causal, window (-1, 0), tolerance 0.01)
    plan = plan_context_parallel(cu, c, query_cost=m.hq / m.hkv)
    same_plan = (list(plan.kv_recv_tokens) == row["plan"]["kv_recv_tokens"]
                 and list(plan.q_moved_tokens) == row["plan"]["q_moved_tokens"])
    bounds = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    layout = DocLayout([bounds], S)
    masks = [RowMask(docs) for docs in layout.rows]
    pairs = sum(prefix_pairs(n, n, CAUSAL, LEFT, RIGHT) for n in lengths)
    if pairs != sum(plan.work):
        raise AssertionError(f"{name} S={S}: plan work {sum(plan.work)} != {pairs} pairs")
    t1 = row["one_gpu"]["fwdbwd_ms"] / 1e3
    mm = replace(m, tflops=4 * m.hq * m.d * (1 + BWD_FACTOR) * pairs / t1 / 1e12)
    _, ours_bytes = mm.exchange_bytes(plan.kv_recv_tokens, plan.q_moved_tokens)
    ht = head_tail_work(layout, c, masks)
    ag_bytes = 3 * mm.allgather_bytes(S, c)
    # the refetch the bench times: K/V rows and moved (q, out) rows received, max over ranks
    refetch_bytes = max(k * mm.kv_tok + q * 2 * mm.hq * mm.d * BF16
                        for k, q in zip(plan.kv_recv_tokens, plan.q_moved_tokens))
    out = {
        "S": S, "layout": name, "docs": len(lengths), "c": c, "same_plan": same_plan,
        "tflops": mm.tflops, "imb": plan.imbalance, "ag_imb": max(ht) * c / pairs,
        "one_gpu_ms": row["one_gpu"]["fwdbwd_ms"],
        "ours_ms": row["ours"]["fwdbwd_ms"], "ag_ms": row["allgather"]["fwdbwd_ms"],
        "ours_compute_ms": mm.compute_s(max(plan.work)) * 1e3,
        "ours_comm_ms": mm.a2a_s(ours_bytes) * 1e3,
        "ours_bytes": ours_bytes,
        "ag_compute_ms": mm.compute_s(max(ht)) * 1e3,
        "ag_comm_ms": mm.ag_s(ag_bytes) * 1e3,
        "ag_bytes": ag_bytes,
        "refetch_ms": row["ours"].get("refetch_ms", math.nan),
        "refetch_pred_ms": refetch_bytes / (mm.a2a_gbps * 1e9) * 1e3,
        "refetch_bytes": refetch_bytes,
    }
    out["ours_pred_ms"] = out["ours_compute_ms"] + out["ours_comm_ms"]
    out["ag_pred_ms"] = out["ag_compute_ms"] + out["ag_comm_ms"]
    return out


def validate(path: str, m: Model) -> list[dict]:
    import json

    with open(path) as f:
        rows = json.load(f)
    bench = _bench_cp_module()
    return [validate_point(r, m, bench) for r in rows]


def _err(pred: float, meas: float) -> str:
    return f"{100 * (pred - meas) / meas:+.1f}%"


def validation_tables(res: list[dict]) -> str:
    main = []
    for r in res:
        main.append([
            _tok(r["S"]), r["layout"], f"{r['one_gpu_ms']:.1f}", f"{r['ours_ms']:.1f}",
            f"{r['ours_pred_ms']:.1f}", _err(r["ours_pred_ms"], r["ours_ms"]),
            f"{r['ag_ms']:.1f}", f"{r['ag_pred_ms']:.1f}", _err(r["ag_pred_ms"], r["ag_ms"]),
        ])
    cp = "CP=" + "/".join(str(c) for c in dict.fromkeys(r["c"] for r in res))  # the runs' "gpus"
    a = table(["S", "layout", "measured 1 GPU ms", f"measured {cp} ms", f"predicted {cp} ms",
               "error", "measured all-gather ms", "predicted all-gather ms", "error"], main)
    diag = []
    for r in res:
        diag.append([
            _tok(r["S"]), r["layout"], r["docs"], "yes" if r["same_plan"] else "**NO**",
            f"{r['tflops']:.0f}", f"{r['imb']:.4f}", f"{r['ours_compute_ms']:.2f}",
            f"{r['ours_comm_ms']:.2f}", _mb(r["ours_bytes"]),
            f"{r['ours_ms'] - r['ours_pred_ms']:+.2f}",
            f"{r['refetch_pred_ms']:.2f}", f"{r['refetch_ms']:.2f}",
            f"{r['ag_imb']:.3f}", f"{r['ag_ms'] - r['ag_pred_ms']:+.2f}",
        ])
    b = table(["S", "layout", "docs", "plan = run's", "effective TFLOP/s (1 GPU)",
               "imb ours", "ours compute ms", "ours exchange ms", "ours MB fwd+bwd",
               "ours measured - predicted ms", "refetch predicted ms", "refetch measured ms",
               "AG head-tail imb", "AG measured - predicted ms"], diag)
    return a + "\n\n" + b


def fit_exchange(res: list[dict]) -> list[list]:
    """Least-squares fit of the measured time the model does not attribute to compute
    (measured - compute at the one-GPU rate) as ``fixed + bytes / bandwidth``, per design,
    over all points and per layout: what --a2a-fixed-ms/--a2a-gbps (ours) and
    --ag-fixed-ms/--ag-gbps (all-gather) would have to be to match these runs."""
    out = []
    for design, meas, comp, nbytes in (("ours", "ours_ms", "ours_compute_ms", "ours_bytes"),
                                       ("all-gather", "ag_ms", "ag_compute_ms", "ag_bytes")):
        for sel in [None] + list(dict.fromkeys(r["layout"] for r in res)):
            rs = [r for r in res if sel is None or r["layout"] == sel]
            if len(rs) < 2:
                continue
            x = np.array([r[nbytes] / 1e9 for r in rs])
            y = np.array([r[meas] - r[comp] for r in rs])
            (fixed, ms_per_gb), *_ = np.linalg.lstsq(np.stack([np.ones_like(x), x], 1), y,
                                                     rcond=None)
            resid = y - fixed - ms_per_gb * x
            gbps = 1e3 / ms_per_gb if ms_per_gb > 0 else math.inf
            out.append([design, sel or f"all {len(rs)} points",
                        " / ".join(f"{v:.1f}" for v in y), f"{fixed:+.2f}",
                        "n/a (slope <= 0)" if math.isinf(gbps) else f"{gbps:.0f}",
                        f"{np.abs(resid).max():.2f}"])
    return out


def validation_plot(res: list[dict], m: Model, out_dir: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layouts = list(dict.fromkeys(r["layout"] for r in res))
    fig, axes = plt.subplots(1, len(layouts), figsize=(6 * len(layouts), 4.5), squeeze=False)
    for ax, name in zip(axes[0], layouts):
        rs = [r for r in res if r["layout"] == name]
        x = np.arange(len(rs))
        w = 0.2
        one = np.array([r["one_gpu_ms"] for r in rs])
        bars = [
            ("ours measured", [r["ours_ms"] for r in rs], "tab:blue", None),
            ("ours predicted", [r["ours_pred_ms"] for r in rs], "tab:blue", "//"),
            ("all-gather measured", [r["ag_ms"] for r in rs], "tab:gray", None),
            ("all-gather predicted", [r["ag_pred_ms"] for r in rs], "tab:gray", "//"),
        ]
        for i, (label, ys, col, hatch) in enumerate(bars):
            ax.bar(x + (i - 1.5) * w, one / np.array(ys), w, color=col, hatch=hatch,
                   alpha=0.55 if hatch else 0.9, edgecolor="black", lw=0.5, label=label)
        c = max(r["c"] for r in rs)
        ax.axhline(c, color="red", lw=0.8, ls=":", label=f"ideal {c}x")
        ax.set_xticks(x, [_tok(r["S"]) for r in rs])
        ax.set_xlabel("S (one packed row)")
        ax.set_ylabel("speedup over one GPU (fwd+bwd)")
        ax.set_title(name)
        ax.set_ylim(0, 1.1 * c)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=8, loc="lower right")
    fixed = (f", fixed {m.a2a_fixed_ms:g} / {m.ag_fixed_ms:g} ms"
             if m.a2a_fixed_ms or m.ag_fixed_ms else ", no fixed cost")
    cps = "/".join(str(c) for c in dict.fromkeys(r["c"] for r in res))
    fig.suptitle(f"CP={cps}: measured vs step-time model (compute rate from the measured "
                 f"one-GPU run; all-to-all {m.a2a_gbps:g} GB/s, all-gather {m.ag_gbps:g} GB/s"
                 f"{fixed})", fontsize=10)
    fig.tight_layout()
    return _save(fig, out_dir, "sim_validation.png")


# ---- plots ----------------------------------------------------------------------------------
def plots(res: list[dict], out_dir: str, plot_tokens: int) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    sel = [r for r in res if r["T"] == plot_tokens]
    if not sel:
        plot_tokens = max(r["T"] for r in res)
        sel = [r for r in res if r["T"] == plot_tokens]
    dists = [d for d in DISTS if any(r["dist"] == d for r in sel)]

    # (a) bytes per rank vs cp
    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5), sharex=True, sharey=True)
    for ax, dist in zip(axes.flat, dists):
        rs = sorted((r for r in sel if r["dist"] == dist), key=lambda r: r["c"])
        cs = [r["c"] for r in rs]
        ax.plot(cs, [r["ag_bytes"] / 1e6 for r in rs], "k-o", ms=4, label="all-gather / ring")
        ax.plot(cs, [r["uly_bytes"] / 1e6 for r in rs], "-s", color="tab:purple", ms=4,
                label="Ulysses (c <= Hq)")
        ax.plot(cs, [r["heap_bytes"] / 1e6 for r in rs], "-^", color="tab:orange", ms=4,
                label="min-heap (K/V + queries)")
        ax.plot(cs, [r["ours_bytes"] / 1e6 for r in rs], "-o", color="tab:blue", ms=4,
                label="ours (K/V + queries)")
        ax.plot(cs, [r["ours_kv_bytes"] / 1e6 for r in rs], "--", color="tab:blue",
                label="ours (K/V only)")
        ax.plot(cs, [r["kv_lb"] * HKV * HEAD_DIM * 2 * BF16 / 1e6 for r in rs], ":",
                color="gray", label="K/V lower bound, any plan")
    paths.append(_finish_cp_grid(
        fig, axes, dists, "MB per rank per layer (fwd, max)",
        f"(a) per-rank traffic, T = {_tok(plot_tokens)} tokens per CP group "
        f"(Hq={HQ}, Hkv={HKV}, D={HEAD_DIM}, bf16) - simulation with our real planner",
        0.05, out_dir, "sim_traffic.png",
    ))

    # (b) imbalance vs cp, every T; plotted as max/mean - 1 so that 1.001 and 1.6 both read
    excess = lambda x: max(x - 1, 1e-5)  # noqa: E731
    fig, axes = plt.subplots(2, 3, figsize=(15, 8), sharex=True, sharey=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    all_T = sorted({r["T"] for r in res})
    for ax, dist in zip(axes.flat, dists):
        for col, T in zip(colors, all_T):
            rs = sorted((r for r in res if r["dist"] == dist and r["T"] == T), key=lambda r: r["c"])
            cs = [r["c"] for r in rs]
            ax.plot(cs, [excess(r["imb"]) for r in rs], "-o", color=col, ms=4,
                    label=f"ours T={_tok(T)}")
            ax.plot(cs, [excess(r["heap_imb"]) for r in rs], "--^", color=col, ms=4, alpha=0.6,
                    label=f"min-heap T={_tok(T)}")
        ax.axhline(0.05, color="red", lw=0.8, ls=":", label="goal 1.05")
        ax.axhline(TOLERANCE, color="gray", lw=0.8, ls=":", label="planner tolerance 1.01")
    paths.append(_finish_cp_grid(
        fig, axes, dists, "max/mean work - 1 (log; floor 1e-5)",
        "(b) work imbalance (solid: ours, dashed: locality-blind min-heap)",
        0.08, out_dir, "sim_imbalance.png",
    ))

    # (c) planner time vs tokens
    pdists = [d for d in ("lognormal-512", "powerlaw", "one-doc")
              if any(r["dist"] == d for r in res)]
    fig, axes = plt.subplots(1, len(pdists), figsize=(5 * len(pdists), 4.5), sharey=True,
                             squeeze=False)
    for ax, dist in zip(axes[0], pdists):
        rs = [r for r in res if r["dist"] == dist]
        for c in sorted({r["c"] for r in rs}):
            pts = sorted((r["T"], r["plan_s"] * 1e3) for r in rs if r["c"] == c)
            if len(pts) >= 2:
                ax.plot(*zip(*pts), "-o", ms=4, label=f"cp {c}")
        ref = sorted((r["T"], r["plan_s"] * 1e3) for r in rs if r["c"] == min(r["c"] for r in rs))
        if ref:
            t0, y0 = ref[0]
            ts = sorted({r["T"] for r in rs})
            ax.plot(ts, [y0 * t / t0 for t in ts], "k--", lw=0.8, alpha=0.5, label="linear")
        ax.axhline(10, color="red", lw=0.8, ls=":", label="10 ms")
        ax.set_xscale("log", base=2)
        ticks = sorted({r["T"] for r in rs})
        ax.set_xticks(ticks, [_tok(t) for t in ticks])
        ax.set_yscale("log")
        ax.set_xlabel("tokens per CP group")
        ax.set_title(dist)
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("build_plan CPU ms (median, 1 thread)")
    axes[0][0].legend(fontsize=7)
    fig.suptitle("(c) planner CPU time vs tokens")
    fig.tight_layout()
    paths.append(_save(fig, out_dir, "sim_planner_time.png"))
    return paths


def _finish_cp_grid(fig, axes, dists, ylabel, title, bottom, out_dir, name) -> str:
    """Log-log axes per distribution, CP-size x labels, one shared legend; saves the figure."""
    for ax, dist in zip(axes.flat, dists):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(dist)
        ax.grid(True, which="both", alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("CP size")
    for ax in axes[:, 0]:
        ax.set_ylabel(ylabel)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=6, fontsize=9)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, bottom, 1, 1))
    return _save(fig, out_dir, name)


def _save(fig, out_dir: str, name: str) -> str:
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---- main -----------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="reduced grid (< 1 minute)")
    p.add_argument("--rows", type=int, default=1, help="packed rows per CP group (B); S = T/B")
    p.add_argument("--cp", type=int, nargs="+", help="CP sizes (default: 8 .. 1024)")
    p.add_argument("--tokens", type=int, nargs="+", help="tokens per CP group")
    p.add_argument("--dists", nargs="+", choices=DISTS, help="distributions")
    p.add_argument("--repeats", type=int, default=5, help="build_plan timings per point (median)")
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--tflops", type=float, default=TFLOPS, help="attention fwd+bwd TFLOP/s")
    p.add_argument("--a2a-gbps", type=float, default=A2A_GBPS, help="all-to-all GB/s per rank")
    p.add_argument("--ag-gbps", type=float, default=AG_GBPS, help="all-gather GB/s per rank")
    p.add_argument("--a2a-fixed-ms", type=float, default=0.0,
                   help="fixed exchange cost per layer fwd+bwd of the all-to-all designs "
                        "(ours, min-heap, Ulysses); fit it with --validate")
    p.add_argument("--ag-fixed-ms", type=float, default=0.0,
                   help="fixed exchange cost per layer fwd+bwd of the all-gather designs")
    p.add_argument("--out", help="directory for sim_*.png plots (e.g. docs/)")
    p.add_argument("--plot-tokens", type=int, default=1 << 21, help="T shown in plots (a), (b)")
    p.add_argument("--validate", metavar="JSON",
                   help="instead of the grid: predict the CP runs measured by bench/bench_cp.py "
                        "(e.g. docs/results/bench_cp_2xh200.json) and compare; with --out, "
                        "also writes sim_validation.png")
    return p.parse_args(argv)


def _fixed_note(m: Model) -> str:
    if not (m.a2a_fixed_ms or m.ag_fixed_ms):
        return ""
    return (f", fixed exchange cost per layer fwd+bwd {m.a2a_fixed_ms:g} ms (all-to-all designs) / "
            f"{m.ag_fixed_ms:g} ms (all-gather)")


def main_validate(args, m: Model) -> int:
    res = validate(args.validate, m)
    print(f"# Step-time model vs measured CP runs ({args.validate})\n")
    print(f"Hq={m.hq}, Hkv={m.hkv}, D={m.d}, bf16, causal; planner query_cost={m.hq / m.hkv:g}, "
          f"tolerance={TOLERANCE}; compute rate per point = the measured one-GPU fwd+bwd of that "
          f"layout; all-to-all {m.a2a_gbps:g} GB/s (ours), all-gather {m.ag_gbps:g} GB/s"
          f"{_fixed_note(m)}; "
          "error = (predicted - measured) / measured\n")
    print(validation_tables(res))
    print("\nFit of the non-compute time (measured - compute at the one-GPU rate, ms, in the "
          "order of the table) as fixed + bytes / bandwidth:\n")
    print(table(["design", "points", "measured - compute ms", "fixed ms", "GB/s",
                 "max |residual| ms"], fit_exchange(res)))
    if args.out:
        print(f"\nwrote {validation_plot(res, m, args.out)}")
    return 0 if all(r["same_plan"] for r in res) else 1


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    cps = args.cp or (QUICK_CP if args.quick else CP_SIZES)
    tokens = args.tokens or (QUICK_TOKENS if args.quick else TOKENS)
    dists = args.dists or DISTS
    m = Model(tflops=args.tflops, a2a_gbps=args.a2a_gbps, ag_gbps=args.ag_gbps,
              a2a_fixed_ms=args.a2a_fixed_ms, ag_fixed_ms=args.ag_fixed_ms)
    if args.validate:
        return main_validate(args, m)
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    res = run_grid(dists, tokens, cps, args.rows, args.seed, m, args.repeats)
    wall = time.perf_counter() - t0
    by_tokens, by_cp = slopes(res)

    print("# Context-parallel simulation "
          "(our real planner; analytical peers; not GPU measurements)")
    print(f"\nrows per CP group B={args.rows}, seed={args.seed}, causal, Hq={HQ}, Hkv={HKV}, "
          f"D={HEAD_DIM}, bf16; planner query_cost={HQ / HKV:g}, tolerance={TOLERANCE}; "
          f"model: {m.tflops:g} TFLOP/s, all-to-all {m.a2a_gbps:g} GB/s, "
          f"all-gather {m.ag_gbps:g} GB/s{_fixed_note(m)}\n")
    if any(r["c"] == GOAL_CP for r in res):
        print(f"## Summary at CP={GOAL_CP} "
              "(K/V bytes per rank per layer, forward, max over ranks)\n")
        print(summary_table(res, GOAL_CP))
        print()
    print("## Traffic and balance (bytes per rank per layer, forward, max over ranks)\n")
    print(traffic_table(res))
    print("\n## Planner CPU time (build_plan, median process CPU ms, torch.set_num_threads(1))\n")
    print(timing_table(res, cps))
    print("\n## Growth exponents of planner time (log-log slope)\n")
    print(slope_table(by_tokens, by_cp))
    print("\n## Predicted attention step time per layer (fwd+bwd) and speedup over one GPU\n")
    print(step_table(res))
    print("\n## Goal checks\n")
    goals = check_goals(res, by_tokens, by_cp)
    for ok, line in goals:
        tag = {"info": "info (would pass)", "info-fail": "info (would fail)"}.get(ok)
        print(f"{tag or ('PASS' if ok else 'FAIL')}  {line}")
    counted = [ok for ok, _ in goals if not isinstance(ok, str)]
    print(f"\n{sum(counted)}/{len(counted)} checks pass; grid of {len(res)} points "
          f"in {wall:.0f} s wall; load average before/after: {load0:.2f}/{os.getloadavg()[0]:.2f} "
          f"on {os.cpu_count()} CPUs")
    if args.out:
        for path in plots(res, args.out, args.plot_tokens):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
