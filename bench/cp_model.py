"""The context-parallel step-time model: our real planner against analytical peer designs.

The model behind ``bench/simulate_cp.py`` (the CLI, its tables and grid) and
``bench/cp_plots.py`` (its plots); importable on its own (``from bench import cp_model``).
Nothing here runs attention. For each (document-length distribution, tokens per CP group T,
CP size c) :func:`evaluate` takes the packed layout (:func:`make_layout`), runs OUR planner
(``doc_packed.cp.plan.build_plan``, causal, ``query_cost = Hq/Hkv`` and ``tolerance = 0.01``
as the runtime uses them), times it, and compares the plan's exact per-rank work and traffic
with other context-parallel designs. Rank ``r`` owns the ``r``-th ``torch.chunk`` of every row.

Layout: a CP group processes T = B*S tokens. By default B = 1: one packed row of S = T tokens
per group (``--rows B`` cuts T into B rows of S = T/B, each drawn independently).
The CLI skips combinations with T/c < 64 tokens per rank.

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
"""

from __future__ import annotations

import gc
import heapq
import math
import os
import statistics
import time
import zlib
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from doc_packed._doc_layout import DocLayout
from doc_packed._mask import prefix_pairs
from doc_packed.cp.plan import TOLERANCE, build_plan, owner_ranges

from bench.cp_call_cost import HKV, HQ, one_gpu_features, rank_stages

# ---- model and hardware constants (landscape.md; the CLI overrides them) -------------------
HEAD_DIM = 128  # and HQ, HKV (32 / 8) from bench.cp_call_cost
BF16, LSE_BYTES = 2, 4
TFLOPS = 277.0  # H200 varlen fwd+bwd, 64k tokens, lognormal documents (277-327 measured)
A2A_GBPS = 283.0  # all_to_all_single out per rank, 2 x H200, 256 MB
AG_GBPS = 256.0  # all_gather, 2 x H200
BWD_FACTOR = 2.5  # backward flops / forward flops

DISTS = ["lognormal-512", "lognormal-2k", "lognormal-8k", "powerlaw", "one-doc", "long+short"]
CHUNKS_PER_RANK = 8  # min-heap baseline: chunks of ~S/(8c)

CAUSAL, LEFT, RIGHT = True, -1, 0


def token_label(n: int) -> str:
    """A token count as the tables and plots write it: 131072 -> "128k", 2097152 -> "2M"."""
    for unit, div in (("M", 1 << 20), ("k", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div}{unit}"
    return str(n)


# ---- layouts ---------------------------------------------------------------------------------
def _fill(sampler: Callable[[], Any], S: int) -> list[int]:
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


def lognormal_lengths(S: int, mean: float, rng: np.random.Generator, sigma: float = 1.0) -> list[int]:
    """Lognormal document lengths of mean ``mean`` covering S tokens (the last one cut to fit)."""
    mu = math.log(mean) - sigma * sigma / 2  # so that E[length] = mean
    return _fill(lambda: np.rint(rng.lognormal(mu, sigma, 1024)), S)


def powerlaw_lengths(S: int, rng: np.random.Generator, alpha: float = 1.5, xmin: int = 128) -> list[int]:
    """Pareto(alpha) with minimum xmin, capped at S."""
    return _fill(lambda: np.minimum(np.floor((rng.pareto(alpha, 1024) + 1) * xmin), S), S)


def row_lengths(dist: str, S: int, rng: np.random.Generator) -> list[int]:
    """Document lengths of one packed row of S tokens drawn from distribution ``dist``."""
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

    def __init__(self, docs: Sequence[tuple[int, int]]):
        self.starts = [s for s, _ in docs]
        self.ends = [e for _, e in docs]

    def _first(self, a: int) -> int:
        return bisect_right(self.starts, a) - 1

    def work(self, a: int, e: int) -> int:
        """(query, key) pairs of queries [a, e), causal inside documents."""
        w, i = 0, self._first(a)
        while i < len(self.starts) and self.starts[i] < e:
            ds, de = self.starts[i], self.ends[i]
            n = de - ds
            w += prefix_pairs(min(de, e) - ds, n, CAUSAL, LEFT, RIGHT)
            w -= prefix_pairs(max(a, ds) - ds, n, CAUSAL, LEFT, RIGHT)
            i += 1
        return w

    def work_from(self, a: int, e: int, lo: int) -> int:
        """Pairs of queries [a, e) with keys at or after ``lo`` (a rank's own keys, for
        queries inside its shard): documents are cut to start at ``lo``."""
        w, i = 0, self._first(a)
        while i < len(self.starts) and self.starts[i] < e:
            ds, de = max(self.starts[i], lo), self.ends[i]
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
    """Per-rank work (pairs), K/V tokens received and queries moved of one design's dispatch."""

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


def _traffic(layout: DocLayout, c: int, masks: list[RowMask], work: list[int],
             mine: list[list[tuple[int, int, int]]]) -> Assignment:
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


def own_work(plan: Any, c: int, masks: list[RowMask], seq_len: int) -> list[int]:
    """Per rank, the pairs of stage A: its computed queries inside its own shard against the
    keys of its own shard (no exchange needed)."""
    owned = owner_ranges(seq_len, c)
    out = []
    for r in range(c):
        os_, oe = owned[r]
        out.append(sum(masks[b].work_from(max(a, os_), min(e, oe), os_)
                       for b, a, e in plan.q_ranges[r] if min(e, oe) > max(a, os_)))
    return out


def overlap_step_s(plan: Any, c: int, masks: list[RowMask], seq_len: int, m: "Model",
                   calls: Sequence[int] | None = None) -> float:
    """The slowest rank's :meth:`Model.overlap_s` under ``plan``."""
    own = own_work(plan, c, masks, seq_len)
    n = calls or [0] * c
    return max(m.overlap_s(own[r], plan.work[r], plan.kv_recv_tokens[r], plan.q_moved_tokens[r], n[r])
               for r in range(c))


# ---- bytes and seconds ----------------------------------------------------------------------
@dataclass(frozen=True)
class Model:
    """Attention shape and hardware rates: per-design bytes and the step-time terms."""

    hq: int = HQ
    hkv: int = HKV
    d: int = HEAD_DIM
    tflops: float = TFLOPS
    a2a_gbps: float = A2A_GBPS
    ag_gbps: float = AG_GBPS
    a2a_fixed_ms: float = 0.0  # per layer fwd+bwd, all-to-all designs (ours, min-heap, Ulysses)
    ag_fixed_ms: float = 0.0  # per layer fwd+bwd, all-gather designs
    launch_us: float = 0.0  # host cost per kernel call of ours (validation only: it counts calls)

    @property
    def kv_tok(self) -> int:  # K and V of one token
        return 2 * self.hkv * self.d * BF16

    @property
    def q_fwd(self) -> int:  # query in, output and lse back
        return 2 * self.hq * self.d * BF16 + LSE_BYTES * self.hq

    @property
    def q_bwd(self) -> int:  # q, out, dout and lse in, dq back
        return 4 * self.hq * self.d * BF16 + LSE_BYTES * self.hq

    def exchange_bytes(self, kv: Sequence[int], q: Sequence[int]) -> tuple[int, int]:
        """(max fwd, max fwd+bwd) bytes over ranks for a plan's per-rank kv_recv / q_moved."""
        fwd = [k * self.kv_tok + m * self.q_fwd for k, m in zip(kv, q)]
        both = [f + 2 * k * self.kv_tok + m * self.q_bwd for f, k, m in zip(fwd, kv, q)]
        return max(fwd), max(both)

    def allgather_bytes(self, T: int, c: int) -> int:
        """Forward K/V bytes per rank of all-gather / ring CP: T*(c-1)/c tokens of K and V."""
        return self.kv_tok * T * (c - 1) // c

    def ulysses_bytes(self, T: int, c: int) -> float:
        """Forward bytes per rank of Ulysses (K/V heads replicated up to c); nan for c > Hq."""
        if c > self.hq:
            return math.nan
        return (2 * self.hq + 2 * max(self.hkv, c)) * self.d * BF16 * (T / c) * (c - 1) / c

    def compute_s(self, pairs: float) -> float:
        """Seconds of attention fwd+bwd for ``pairs`` (query, key) pairs."""
        return pairs * 4 * self.hq * self.d * (1 + BWD_FACTOR) / (self.tflops * 1e12)

    def a2a_s(self, nbytes: float) -> float:
        """Exchange time of an all-to-all design, fwd+bwd: fixed cost + bytes / bandwidth."""
        return self.a2a_fixed_ms * 1e-3 + nbytes / (self.a2a_gbps * 1e9)

    def overlap_s(self, own: int, work: int, kv: int, qm: int, calls: int = 0) -> float:
        """One rank's fwd+bwd in the staged design (doc_packed/cp/attention.py): stage A
        (``own`` pairs: its queries against its own keys) runs while the exchange lands, stage
        B (the other ``work - own`` pairs) after it, results and gradients go home after that:

            fwd: max(A_f, K/V + q in) + B_f + (out, lse back)
            bwd: max(A_b, K/V + q, out, dout, lse in) + B_b + (dK/dV partials, dq back)

        for ``kv`` K/V tokens received and ``qm`` queries computed for other owners; plus the
        fixed exchange cost and ``calls`` kernel calls at ``launch_us`` each."""
        return self.staged_s(self.compute_s(own), self.compute_s(work - own), kv, qm, calls)

    def staged_s(self, a: float, b: float, kv: int, qm: int, calls: int = 0) -> float:
        """:meth:`overlap_s` for stage A and stage B taking ``a`` and ``b`` seconds (forward and
        backward together, split by ``BWD_FACTOR``)."""
        f = 1 / (1 + BWD_FACTOR)
        row = self.hq * self.d * BF16  # one query's q (or out, dout, dq) row
        bw = self.a2a_gbps * 1e9
        fwd = max(a * f, (kv * self.kv_tok + qm * row) / bw) + b * f + qm * (row + LSE_BYTES * self.hq) / bw
        bwd_in = kv * self.kv_tok + qm * (3 * row + LSE_BYTES * self.hq)
        bwd = max(a * (1 - f), bwd_in / bw) + b * (1 - f) + (kv * self.kv_tok + qm * row) / bw
        return fwd + bwd + self.a2a_fixed_ms * 1e-3 + calls * self.launch_us * 1e-6

    def ag_s(self, nbytes: float) -> float:
        """Exchange time of an all-gather design, fwd+bwd: fixed cost + bytes / bandwidth."""
        return self.ag_fixed_ms * 1e-3 + nbytes / (self.ag_gbps * 1e9)


# ---- one grid point --------------------------------------------------------------------------
def time_plan(layout: DocLayout, c: int, repeats: int, query_cost: float,
              tolerance: float = TOLERANCE) -> tuple[Any, float]:
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


def _check_accounting(layout: DocLayout, c: int, masks: list[RowMask], plan: Any) -> None:
    """The baseline's accounting, applied to our plan, must give the planner's own numbers."""
    mine = [list(q) for q in plan.q_ranges]
    work = [sum(masks[b].work(a, e) for b, a, e in m) for m in mine]
    got = _traffic(layout, c, masks, work, mine)
    if (got.work, got.kv_recv, got.q_moved) != (
        list(plan.work), list(plan.kv_recv_tokens), list(plan.q_moved_tokens)
    ):
        raise AssertionError(f"traffic accounting disagrees with the planner at c={c}")


CALL_COST_MAX_CP = 64  # the call-level model builds every rank's schedule: up to this CP size


def evaluate(dist: str, T: int, c: int, layout: DocLayout, masks: list[RowMask], m: Model,
             repeats: int, call_cost: Any = None) -> dict:
    """Every design's work, bytes and step time at one (layout, c); ``plan_s`` is our planner's time.

    ``call_cost`` (a :class:`bench.cp_call_cost.CallCost`): also price our staged design with
    each rank's kernel calls at those rates (``step["ours_calls"]``, one GPU: ``t1_calls``),
    for ``c <= CALL_COST_MAX_CP``, on the plan the runtime makes (rows priced:
    ``doc_packed.cp.plan.ROW_COST``); the flat-rate designs keep the pairs-only plan."""
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
        "ours_overlap": overlap_step_s(plan, c, masks, layout.seq_len, m),
        "minheap": m.compute_s(max(heap.work)) + m.a2a_s(heap_both),
        "allgather": m.compute_s(max(ht)) + m.ag_s(3 * ag),
        "allgather_ideal": m.compute_s(total_work / c) + m.ag_s(3 * ag),
        "ulysses": m.compute_s(total_work / c) + m.a2a_s(2 * uly),
    }
    t1_calls = None
    if call_cost is not None and c <= CALL_COST_MAX_CP:
        from doc_packed.cp.plan import ROW_COST

        rplan = build_plan(layout, c, CAUSAL, LEFT, RIGHT, query_cost=m.hq / m.hkv, tolerance=TOLERANCE,
                           row_cost=ROW_COST)
        ranks = []
        for r in range(c):
            a, b = rank_stages(rplan, r)
            ranks.append(m.staged_s(call_cost.ms(a) / 1e3, call_cost.ms(b) / 1e3,
                                    rplan.kv_recv_tokens[r], rplan.q_moved_tokens[r]))
        step["ours_calls"] = max(ranks)
        t1_calls = call_cost.ms(one_gpu_features(layout.rows, layout.seq_len)) / 1e3
    return {
        "t1_calls": t1_calls,
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


# ---- validation against a measured CP run (bench/bench_cp.py --json) ------------------------
def _bench_cp_module() -> ModuleType:
    """bench/bench_cp.py itself, so that its layouts are regenerated by its own code."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_cp.py")
    spec = importlib.util.spec_from_file_location("bench_cp", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def bench_cp_lengths(S: int, name: str, bench: ModuleType | None = None, c: int | None = None) -> list[int]:
    """Segment lengths of the layout bench/bench_cp.py times under ``name`` at length S on ``c``
    GPUs (``c`` matters only for the CP-aware order of ``--packing cp``)."""
    if name == "one doc":
        return [S]
    bench = bench or _bench_cp_module()
    means = {"lognormal 2k": 2048, "lognormal 512": 512}
    base = name.removesuffix(" cp-packed")
    if base not in means:
        raise ValueError(f"unknown bench_cp layout {name!r}")
    if base == name:
        return bench.lognormal_lengths(S, means[base], seed=S)  # bench_cp.py's own call
    if c is None:
        raise ValueError(f"layout {name!r} depends on the CP size: pass c")
    return dict(bench.layouts(S, c, "cp", [means[base]], S))[name]  # bench_cp.py's own packing


def validate_point(row: dict, m: Model, bench: ModuleType | None = None) -> dict:
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
    lengths = bench_cp_lengths(S, name, bench, c)
    if len(lengths) != row["docs"]:
        raise AssertionError(f"{name} S={S}: {len(lengths)} documents, the run had {row['docs']}")
    cu = cu_seqlens_from_lengths([lengths], S, max_docs=len(lengths) + 8)
    # bench_cp.py's call as the validated rows were planned: causal, window (-1, 0), tolerance
    # 0.01, pairs alone (row prices came later; plan_context_parallel's default now has them)
    plan = plan_context_parallel(cu, c, query_cost=m.hq / m.hkv, row_cost=None)
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
    calls = schedule_calls(plan, c)
    out["calls"] = calls
    out["ours_overlap_ms"] = overlap_step_s(plan, c, masks, S, mm, calls) * 1e3
    out["ours_pred_ms"] = out["ours_compute_ms"] + out["ours_comm_ms"]
    out["ag_pred_ms"] = out["ag_compute_ms"] + out["ag_comm_ms"]
    return out


def schedule_calls(plan: Any, c: int) -> list[int]:
    """Kernel calls per rank in one forward+backward (the runtime's schedule, on CPU)."""
    import torch

    from doc_packed.cp.schedule import build_schedule

    out = []
    for r in range(c):
        sch = build_schedule(plan, r, torch.device("cpu"))
        out.append(2 * (len(sch.stage_a) + len(sch.stage_b)))
    return out


def validate(path: str, m: Model) -> list[dict]:
    """:func:`validate_point` of every point of a bench/bench_cp.py ``--json`` file."""
    import json

    with open(path) as f:
        rows = json.load(f)
    bench = _bench_cp_module()
    return [validate_point(r, m, bench) for r in rows]


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
