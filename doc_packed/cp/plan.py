"""The context-parallel plan: which rank computes which queries, and what each must receive.

Rank ``r`` owns the ``r``-th ``torch.chunk`` of every row (DTensor's ``Shard(1)``). Work is
counted exactly: a run of queries costs its number of visible (query, key) pairs
(:mod:`doc_packed._mask`). The planner solves balance and locality together:

1. *Owner-first.* Every row is cut at document and shard boundaries into pieces; each piece
   starts on its owner. Nothing moves yet, so traffic is only the keys a rank's queries need
   from the previous shards of their own documents.
2. *Shed the excess, cheapest first.* Ranks above the mean (by more than ``tolerance``) hand
   work to ranks below it, one contiguous run of queries at a time, cut to move exactly the
   work needed (token granularity). Each move is chosen by its marginal traffic per unit of
   work moved: ``query_cost * queries + keys the receiver does not already hold``. Receivers
   tried are the owners of the run's keys (which already hold part of them: for causal
   attention these are the earlier, lighter shards of the same document) and the ranks with
   the most room. A piece moves at most once, and only whole runs of one document move.
3. *Balance time, not pairs* (``row_cost``, what the runtime passes). Kernels also pay per row
   each call spans (FA4: pre- and post-processing per query row, one backward program per 128
   keys and query head), so a rank whose queries read remote keys, or that took moved runs,
   costs more than its pairs. The plan of step 2 prices each rank's extra rows in pairs
   (:class:`RowCost`); step 2 runs again with those as fixed per-rank loads, so ranks with more
   rows end with fewer pairs, and the plan whose busiest rank is cheapest in pairs plus priced
   rows is kept; the first one unless the re-plan beats it by 3% (moved runs bring rows of their
   own, and bytes). docs/context_parallel.md, "Balancing time".

The result keeps documents together and queries at or next to their owners; a rank receives
each key it needs once, and only keys its queries see. The plan depends only on the layout,
the group size and the mask, so every rank computes the same one.
"""

from __future__ import annotations

import functools
import heapq
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from .._checks import check_cost, check_count, check_cu_seqlens, check_int_rows, check_window
from .._doc_layout import DocLayout, get_layout, validate_bounds
from .._mask import key_bounds, prefix_pairs

__all__ = [
    "ROW_COST",
    "TOLERANCE",
    "ContextParallelPlan",
    "RowCost",
    "build_plan",
    "owner_ranges",
    "plan_context_parallel",
    "runtime_plan",
]

# Allowed work imbalance over the mean: what the runtime plans with.
TOLERANCE = 0.01
# fractions of the priced rows given as fixed loads, each tried once: half of them was also
# tried until it won 3 of 300 random layouts (CP 2 and 4, 32k-128k) for one more balance pass
# (~0.75 ms of host time) per layout
_ROW_STEPS = (1.0,)
# a re-plan must beat the pairs-only plan's busiest priced rank by this much: the row prices'
# fit is 2.7% off per rank on average, and moved queries cost exchange bytes it does not price
_ROW_MARGIN = 0.03
_TOP_PIECES = 4
_TOP_RECEIVERS = 3
_ROW_START = operator.itemgetter(0, 1)  # a piece's (batch, start)


def chunk_len(seq_len: int, cp_size: int) -> int:
    """``torch.chunk``'s chunk length: ``ceil(seq_len / cp_size)`` (the last chunk may be shorter)."""
    return -(-seq_len // cp_size)


def owner_range(seq_len: int, cp_size: int, rank: int) -> tuple[int, int]:
    """``torch.chunk`` semantics: rank ``r`` holds ``[r * c, (r + 1) * c)`` with ``c = ceil(S / n)``."""
    cs = chunk_len(seq_len, cp_size)
    return min(rank * cs, seq_len), min((rank + 1) * cs, seq_len)


def owner_ranges(seq_len: int, cp_size: int) -> list[tuple[int, int]]:
    """:func:`owner_range` of every rank."""
    return [owner_range(seq_len, cp_size, r) for r in range(cp_size)]


@functools.lru_cache(maxsize=64)
def _owners(seq_len: int, cp_size: int) -> tuple[tuple[int, int], ...]:
    """:func:`owner_ranges` as a tuple, made once per (seq_len, cp_size): the planner and each
    schedule read it (``plan.owners`` makes the list again)."""
    return tuple(owner_ranges(seq_len, cp_size))


class RowCost(NamedTuple):
    """What a rank's kernel calls cost beyond their (query, key) pairs, in pairs: per query row
    and per key row a call beyond the rank's own-shard call spans, and per row merged by lse."""

    query: float
    key: float
    merged: float


# What the runtime plans with (step 3 of the module docstring): FA4's per-row rates over its
# per-tile rate, fitted to one H200's emulation (bench/cp_call_cost.py's H200_FA4: 0.0146 /
# 0.0264 / 0.0215 us per query / key / merged row, 1.479 us per 128 x 128 tile). Every kernel
# pays per row it spans; plans are exact whatever the prices.
ROW_COST = RowCost(query=162.0, key=292.0, merged=238.0)


@dataclass(frozen=True)
class Segment:
    """Queries ``[start, end)`` of row ``batch`` (inside one document) and the keys they see."""

    batch: int
    start: int
    end: int
    key_start: int
    key_end: int
    # where the document's bidirectional prefix ends (its start + prefix length; 0: none):
    # queries before it see every key before it and nothing after (docs/contract.md section 9)
    prefix_end: int = 0


def _frozen(cls, fields: dict):
    """``cls(**fields)`` for a frozen dataclass, the same instance (``fields``: every field, in
    field order, a dict of its own) without its ``__init__``, which sets each field through
    ``object.__setattr__``: the instance's ``__dict__`` is ``fields``. On the 2-core box, kept
    alive as plans and schedules keep them: a :class:`~.schedule.Call` 1.69 -> 1.10 us, a
    :class:`~.schedule.RankSchedule` (21 fields, its dict built) 4.5 -> 1.5 us; a
    :class:`Segment` 0.64 us, as the ``__dict__.update`` of keywords that made it before."""
    obj = object.__new__(cls)
    object.__setattr__(obj, "__dict__", fields)
    return obj


@dataclass(frozen=True)
class ContextParallelPlan:
    """Immutable plan for one layout, group size and mask (the same on every rank).

    Attributes:
        q_ranges: per rank, the ``(batch, start, end)`` global token ranges whose queries it
            computes; together they cover every query exactly once.
        work: per rank, the exact number of (query, key) pairs it computes.
        kv_recv_tokens: per rank, the key/value tokens it receives in the forward.
        q_moved_tokens: per rank, the queries it computes for other owners.
        segments: per rank, the kernel segments (one document each) behind ``q_ranges``.
        kv_ranges: per rank, the ``(batch, start, end)`` key ranges it needs (its own shard
            included), disjoint and sorted.
        extra_rows: per rank, the ``(query, key, merged)`` rows its kernel calls span beyond
            its own-shard call: own queries that see remote keys (the queries, those keys, and
            the queries again, merged), and moved-in queries (the queries, and the span of keys
            each shard's part of them sees).
        query_cost, tolerance, row_cost: what it was planned with.
        documents: per row, the ``(start, end)`` of each non-empty document it was planned for
            (with ``prefixes``, each one's bidirectional prefix length, or None): what
            :func:`doc_packed.cp.prepare` checks a plan against.
    """

    cp_size: int
    seq_len: int
    batch: int
    causal: bool
    window_size: tuple[int, int]
    q_ranges: tuple[tuple[tuple[int, int, int], ...], ...]
    work: tuple[int, ...]
    kv_recv_tokens: tuple[int, ...]
    q_moved_tokens: tuple[int, ...]
    segments: tuple[tuple[Segment, ...], ...] = field(repr=False)
    kv_ranges: tuple[tuple[tuple[int, int, int], ...], ...] = field(repr=False)
    extra_rows: tuple[tuple[int, int, int], ...] = field(repr=False, default=())
    query_cost: float = 1.0
    tolerance: float = TOLERANCE
    row_cost: RowCost | None = None
    documents: tuple[tuple[tuple[int, int], ...], ...] = field(repr=False, default=())
    prefixes: tuple[tuple[int, ...], ...] | None = field(repr=False, default=None)

    @property
    def imbalance(self) -> float:
        """Largest per-rank work over the mean (1.0 is perfect)."""
        total = sum(self.work)
        return max(self.work) * self.cp_size / total if total else 1.0

    @property
    def owners(self) -> list[tuple[int, int]]:
        return owner_ranges(self.seq_len, self.cp_size)

    def priced(self, cost: RowCost) -> tuple[int, ...]:
        """Per rank, its pairs plus its :attr:`extra_rows` priced by ``cost`` (what a plan made
        with ``row_cost=cost`` balances)."""
        return tuple(w + _price(rows, cost) for w, rows in zip(self.work, self.extra_rows))

    def __repr__(self) -> str:
        return (
            f"ContextParallelPlan(cp_size={self.cp_size}, seq_len={self.seq_len}, batch={self.batch}, "
            f"causal={self.causal}, window_size={self.window_size}, imbalance={self.imbalance:.3f}, "
            f"work={self.work}, kv_recv_tokens={self.kv_recv_tokens}, q_moved_tokens={self.q_moved_tokens})"
        )

    def __str__(self) -> str:
        """A table per rank: what ``print(plan)`` shows (``repr`` is one line)."""
        left, right = self.window_size
        mask = "causal" if self.causal else "bidirectional"
        if left != -1 or (right != -1 and not (self.causal and right == 0)):  # causal stores right 0
            mask += f", window {self.window_size}"
        gather = self.batch * (self.seq_len - self.seq_len // self.cp_size)
        lines = [
            f"context-parallel plan: {self.cp_size} ranks, {self.batch} row(s) of {self.seq_len} tokens, {mask}",
            f"  imbalance {self.imbalance:.3f} (largest attention work / mean; 1.0 is even); an all-gather "
            f"would send each rank {gather} K/V tokens",
            f"  {'rank':>4}  {'work (q-k pairs)':>16}  {'K/V received':>12}  {'queries moved':>13}  query ranges (row, start, end)",
        ]
        for r in range(self.cp_size):
            ranges = ", ".join(f"({b}, {s}, {e})" for b, s, e in self.q_ranges[r][:4])
            if len(self.q_ranges[r]) > 4:
                ranges += f", ... {len(self.q_ranges[r]) - 4} more"
            lines.append(
                f"  {r:>4}  {self.work[r]:>16,}  {self.kv_recv_tokens[r]:>12,}  {self.q_moved_tokens[r]:>13,}  {ranges}"
            )
        return "\n".join(lines)

    def summary(self) -> str:
        ag = 2 * self.batch * (self.seq_len - self.seq_len // self.cp_size)
        return (
            f"cp={self.cp_size} imbalance={self.imbalance:.3f} "
            f"kv_recv max={max(self.kv_recv_tokens)} (all-gather {ag // 2}) "
            f"q_moved max={max(self.q_moved_tokens)}"
        )


class _Doc:
    __slots__ = ("start", "end", "length", "prefix")

    def __init__(self, start: int, end: int, prefix: int = 0):
        self.start, self.end, self.length, self.prefix = start, end, end - start, prefix


class _Planner:
    def __init__(self, layout_rows, seq_len, cp_size, causal, left, right, query_cost, tolerance, prefixes=None):
        self.S, self.c = seq_len, cp_size
        self.causal, self.left, self.right = causal, left, right
        self.query_cost, self.tolerance = query_cost, tolerance
        self.cs = chunk_len(seq_len, cp_size)
        self.owned = _owners(seq_len, cp_size)
        self.rows = layout_rows
        self.prefixes = prefixes
        # piece = [batch, start, end, doc, rank]; it never straddles a document or a shard
        self.by_rank: list[list[list]] = [[] for _ in range(cp_size)]
        self.balanced = False  # balance() ran: the pieces are no longer the owner-first ones
        self.offsets = [0] * cp_size  # fixed extra load per rank (:meth:`fresh`)
        self.rows_memo: tuple[list[list[list]], list[tuple[int, int, int]]] | None = None  # _runs_and_rows
        self.load = [0] * cp_size
        # keys each rank holds beyond its own shard: rank -> batch -> sorted disjoint [s, e)
        self.fetched: list[dict[int, list[list[int]]]] = [{} for _ in range(cp_size)]
        cs, work, key_range, owned = self.cs, self._work, self._key_range, self.owned
        by_rank, load = self.by_rank, self.load
        for b, docs in enumerate(layout_rows):
            row_prefixes = prefixes[b] if prefixes is not None else None
            for d, (ds, de) in enumerate(docs):
                doc = _Doc(ds, de, row_prefixes[d] if row_prefixes is not None else 0)
                a, r = ds, ds // cs
                if de <= (r + 1) * cs:  # inside one shard, and so are its keys (they are its tokens)
                    by_rank[r].append([b, ds, de, doc, r])
                    load[r] += work(doc, ds, de)
                    continue
                while a < de:  # a piece per shard the document spans
                    e = (r + 1) * cs
                    if e > de:
                        e = de
                    by_rank[r].append([b, a, e, doc, r])
                    load[r] += work(doc, a, e)
                    ks, ke = key_range(doc, a, e)
                    if ks < owned[r][0] or ke > owned[r][1]:  # (_add_keys' own test, without the call)
                        self._add_keys(r, b, ks, ke)
                    a, r = e, r + 1

    def fresh(self, offsets: list[int]) -> _Planner:
        """A planner in this one's state before :meth:`balance`, with ``offsets`` as the fixed
        loads instead (the re-plans start from the same owner-first pieces: copied, not rebuilt).
        The lists are copied, not what they hold: :meth:`balance` replaces a piece it cuts or
        moves and :meth:`_add_keys` a row's fetched intervals, neither changes one in place."""
        assert not self.balanced, "fresh() is for unbalanced planners"
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        new.by_rank = [list(own) for own in self.by_rank]
        new.fetched = [dict(f) for f in self.fetched]
        return new.last_fresh(offsets)

    def last_fresh(self, offsets: list[int]) -> _Planner:
        """This planner, unbalanced, with ``offsets`` as the fixed loads: :meth:`fresh` without the
        copy, for the last plan made from it."""
        self.load = [w - o + n for w, o, n in zip(self.load, self.offsets, offsets)]
        self.offsets = list(offsets)
        self.rows_memo = None
        return self

    # -- mask arithmetic -------------------------------------------------------------------
    def _prefix(self, doc: _Doc, n: int) -> int:
        """Pairs of the document's first ``n`` queries (a bidirectional prefix of ``P`` tokens:
        each of its queries sees ``P`` keys, the rest as the mask says)."""
        pairs = prefix_pairs(n, doc.length, self.causal, self.left, self.right)
        if not doc.prefix:
            return pairs
        m = min(n, doc.prefix)
        return m * doc.prefix + pairs - prefix_pairs(m, doc.length, self.causal, self.left, self.right)

    def _work(self, doc: _Doc, a: int, e: int) -> int:
        return self._prefix(doc, e - doc.start) - self._prefix(doc, a - doc.start)

    def _key_range(self, doc: _Doc, a: int, e: int) -> tuple[int, int]:
        lo, _ = key_bounds(a - doc.start, doc.length, self.causal, self.left, self.right)
        _, hi = key_bounds(e - 1 - doc.start, doc.length, self.causal, self.left, self.right)
        if a - doc.start < doc.prefix:  # prefix queries see the whole prefix, after them too
            lo, hi = 0, max(hi, doc.prefix - 1)
        return doc.start + lo, doc.start + hi + 1

    def _cut(self, doc: _Doc, a: int, e: int, amount: int, tail: bool) -> tuple[int, int]:
        """The run at the tail (or head) of ``[a, e)`` carrying at most ``amount`` work
        (at least one token)."""
        i0, i1 = a - doc.start, e - doc.start
        if tail:
            target = self._prefix(doc, i1) - amount  # smallest m with F(m) >= target
            lo, hi = i0, i1 - 1
            while lo < hi:
                mid = (lo + hi) // 2
                if self._prefix(doc, mid) >= target:
                    hi = mid
                else:
                    lo = mid + 1
            return doc.start + lo, e
        target = self._prefix(doc, i0) + amount  # largest m with F(m) <= target
        lo, hi = i0 + 1, i1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._prefix(doc, mid) <= target:
                lo = mid
            else:
                hi = mid - 1
        return a, doc.start + lo

    # -- key bookkeeping -------------------------------------------------------------------
    def _outside_owned(self, r: int, s: int, e: int) -> list[tuple[int, int]]:
        os_, oe = self.owned[r]
        parts = []
        below = e if e < os_ else os_  # [s, below): the part before the shard
        if s < below:
            parts.append((s, below))
        above = s if s > oe else oe  # [above, e): the part after it
        if above < e:
            parts.append((above, e))
        return parts

    def _new_keys(self, r: int, b: int, s: int, e: int) -> int:
        os_, oe = self.owned[r]
        below = e if e < os_ else os_
        above = s if s > oe else oe
        have = self.fetched[r].get(b)
        if not have:  # nothing fetched yet in this row: every key outside the shard is new
            return (below - s if s < below else 0) + (e - above if above < e else 0)
        n = 0
        for ps, pe in ((s, below), (above, e)):
            if ps >= pe:
                continue
            n += pe - ps
            for fs, fe in have:
                if fs >= pe:
                    break
                lo = fs if fs > ps else ps
                hi = fe if fe < pe else pe
                if hi > lo:
                    n -= hi - lo
        return n

    def _add_keys(self, r: int, b: int, s: int, e: int) -> None:
        os_, oe = self.owned[r]
        if s >= os_ and e <= oe:  # inside the shard: nothing to fetch
            return
        for ps, pe in self._outside_owned(r, s, e):
            ivs = self.fetched[r].setdefault(b, [])
            merged, placed = [], False
            for iv in ivs:
                if iv[1] < ps:
                    merged.append(iv)
                elif iv[0] > pe:
                    if not placed:
                        merged.append([ps, pe])
                        placed = True
                    merged.append(iv)
                else:
                    ps, pe = min(ps, iv[0]), max(pe, iv[1])
            if not placed:
                merged.append([ps, pe])
            self.fetched[r][b] = merged

    # -- balancing ---------------------------------------------------------------------------
    def balance(self) -> None:
        self.rows_memo = None
        self.balanced = True
        total = sum(self.load)
        if total == 0 or self.c == 1:
            return
        mean = total / self.c
        cap = mean * (1 + self.tolerance)
        heap = [(-(mean - w), r) for r, w in enumerate(self.load) if w < mean]
        heapq.heapify(heap)

        def top_receivers() -> list[int]:
            out: list[int] = []
            while heap and len(out) < _TOP_RECEIVERS:
                neg, r = heapq.heappop(heap)
                if -neg == mean - self.load[r] and r not in out:
                    out.append(r)
            for r in out:
                heapq.heappush(heap, (-(mean - self.load[r]), r))
            return out

        for h in sorted(range(self.c), key=lambda r: -self.load[r]):
            while self.load[h] > cap:
                excess = self.load[h] - mean
                move = self._best_move(h, excess, mean, top_receivers())
                if move is None:
                    break
                piece, tail, t = move
                room = mean - self.load[t]
                b, a, e, doc, _ = piece
                amount = max(1, int(min(excess, room, self._work(doc, a, e))))
                ma, me = self._cut(doc, a, e, amount, tail)
                moved = self._work(doc, ma, me)
                # pieces are replaced, never changed: fresh() copies shared them with the planner
                # they came from (list.index and remove find the piece itself: distinct pieces of
                # a rank never compare equal)
                own = self.by_rank[h]
                if (ma, me) == (a, e):
                    own.remove(piece)
                else:
                    own[own.index(piece)] = [b, a, ma, doc, h] if tail else [b, me, e, doc, h]
                self.by_rank[t].append([b, ma, me, doc, t])
                self.load[h] -= moved
                self.load[t] += moved
                self._add_keys(t, b, *self._key_range(doc, ma, me))
                if self.load[t] < mean:
                    heapq.heappush(heap, (-(mean - self.load[t]), t))

    def _densities(self, pieces: list[list]) -> list[float]:
        """Work per query of each piece (one call for all: its key in :meth:`_best_move`'s sort)."""
        work = self._work
        return [work(p[3], p[1], p[2]) / (p[2] - p[1]) for p in pieces]

    def _best_move(self, h, excess, mean, receivers):
        # the ranks a move may go to, and the room each has (the same all through this call)
        load = self.load
        room = {t: mean - load[t] for t in range(self.c) if t != h and load[t] < mean}
        own = [p for p in self.by_rank[h] if p[2] > p[1]]
        if not own or not room:
            return None
        # the densest pieces first, ties in list order (sorted(own, key=density, reverse=True), by index)
        density = self._densities(own)
        cands = [own[i] for i in sorted(range(len(own)), key=density.__getitem__, reverse=True)[:_TOP_PIECES]]
        # runs continuing a document from the previous shard: that shard holds their prefix
        # (``not in``: distinct pieces of a rank never compare equal, their runs are disjoint)
        first = self.owned[h][0]
        cands += [p for p in own if p[1] == first and p[3].start < p[1] and p not in cands]
        cs, last_rank, query_cost = self.cs, self.c - 1, self.query_cost
        # the loops' calls, looked up once
        work, cut, key_range, new_keys = self._work, self._cut, self._key_range, self._new_keys
        best, best_score = None, float("inf")
        for p in cands:
            b, a, e, doc, _ = p
            w = work(doc, a, e)
            if w == 0:
                continue
            amount = w if w < excess else int(excess)  # max(1, int(min(excess, w))), inline
            if amount < 1:
                amount = 1
            for tail in (True,) if amount >= w else (True, False):
                ma, me = cut(doc, a, e, amount, tail)
                moved = work(doc, ma, me)
                if moved == 0:
                    continue
                # a score is (queries + new keys) / min(moved, room): new keys are >= 0 and so is
                # query_cost, and rounding is monotone, so it is at least queries / share, and that
                # at least queries / moved; when these cannot beat the best, nothing more is priced
                queries = query_cost * (me - ma)
                if queries / moved >= best_score:
                    continue
                ks, ke = key_range(doc, ma, me)
                # the owners of the keys form a range [ks // cs, top]: its last two ranks but h
                # (at most one of the last three is h), then the receivers
                top = (ke - 1) // cs
                if top > last_rank:
                    top = last_rank
                if top == h:
                    top -= 1
                below = top - 1 if top - 1 != h else top - 2
                lo = ks // cs
                for t in ([below, top] if below >= lo else [top] if top >= lo else []) + receivers:
                    space = room.get(t)
                    if space is None:
                        continue
                    share = space if space < moved else moved
                    if queries / share >= best_score:
                        continue
                    score = (queries + new_keys(t, b, ks, ke)) / share
                    if score < best_score:
                        best, best_score = (p, tail, t), score
        return best

    # -- result ------------------------------------------------------------------------------
    def _extra_rows(self, r: int, runs: list[list]) -> tuple[int, int, int]:
        """(query, key, merged) rows of rank ``r``'s calls beyond its own-shard call: each run cut
        at shard boundaries; an own part whose queries see remote keys adds its queries, those
        keys and its queries again as merged rows; a moved-in part adds its queries and the
        span of keys it sees."""
        q = k = m = 0
        cs, key_range = self.cs, self._key_range
        os_, oe = self.owned[r]
        for _, a, e, doc, _ in runs:
            while a < e:
                o = a // cs
                pe = (o + 1) * cs
                if pe > e:
                    pe = e
                ks, ke = key_range(doc, a, pe)
                if o == r:
                    remote = _outside(ks, ke, os_, oe)
                    if remote:
                        q, k, m = q + pe - a, k + remote, m + pe - a
                else:
                    q, k = q + pe - a, k + ke - ks
                a = pe
        return q, k, m

    def _merged(self, r: int) -> list[list]:
        """Rank ``r``'s runs sorted and merged where one continues the previous in a document: the
        pieces themselves where nothing merges (a balanced planner's pieces are only read), a new
        run where pieces merge."""
        merged: list[list] = []
        q = None  # the last run of merged
        for p in sorted(self.by_rank[r], key=_ROW_START):
            if p[2] <= p[1]:
                continue
            if q is not None and q[3] is p[3] and q[2] == p[1]:  # (a document is in one row)
                q = merged[-1] = [q[0], q[1], p[2], q[3], q[4]]
            else:
                merged.append(p)
                q = p
        return merged

    def work(self) -> tuple[int, ...]:
        """Per rank, the pairs it computes (its load without the fixed offsets)."""
        return tuple(w - o for w, o in zip(self.load, self.offsets))

    def _runs_and_rows(self) -> tuple[list[list[list]], list[tuple[int, int, int]]]:
        """Each rank's :meth:`_merged` runs and :meth:`_extra_rows`, computed once for a balanced
        planner (:meth:`priced_rows`, :meth:`priced_below` and :meth:`result` read them)."""
        if self.rows_memo is None:
            merged = [self._merged(r) for r in range(self.c)]
            self.rows_memo = merged, [self._extra_rows(r, runs) for r, runs in enumerate(merged)]
        return self.rows_memo

    def priced_rows(self, cost: RowCost) -> list[int]:
        """Per rank, its extra rows priced by ``cost``, without building the plan."""
        return [_price(rows, cost) for rows in self._runs_and_rows()[1]]

    def priced_below(self, cost: RowCost, bound: float) -> int | None:
        """The busiest rank's pairs plus its extra rows priced by ``cost`` when every rank's is
        below ``bound``, else None (``max(work + priced_rows) < bound``, the same answer): the
        ranks are priced heaviest load first and the rest skipped once one reaches ``bound``, as
        a re-plan that does not beat the plan it is weighed against is dropped (most are)."""
        work, load = self.work(), self.load
        runs: list = [None] * self.c
        rows: list = [None] * self.c
        top = 0
        for r in sorted(range(self.c), key=lambda r: -load[r]):
            runs[r] = self._merged(r)
            rows[r] = self._extra_rows(r, runs[r])
            priced = work[r] + _price(rows[r], cost)
            if priced >= bound:
                return None
            top = priced if priced > top else top
        self.rows_memo = runs, rows
        return top

    def result(self, window, row_cost: RowCost | None) -> ContextParallelPlan:
        all_merged, extra_rows = self._runs_and_rows()
        key_range, new, set_dict = self._key_range, object.__new__, object.__setattr__
        segments, q_ranges, kv_ranges, kv_recv, q_moved = [], [], [], [], []
        for r, merged in enumerate(all_merged):
            os_, oe = self.owned[r]
            segs, queries, moved = [], [], 0
            # the runs' key ranges come sorted by (row, start) whenever the runs are, which every
            # mask's key ranges are (a later query's keys never start earlier): merged without a
            # sort then; pb, pk: the last range's (row, start)
            keys, pb, pk = [], -1, 0
            ordered = True
            for b, a, e, doc, _ in merged:
                ks, ke = key_range(doc, a, e)
                pe = doc.start + doc.prefix if doc.prefix else 0
                seg = new(Segment)  # _frozen(Segment, ...) inline: some 85 a 4 x 32k plan
                set_dict(
                    seg,
                    "__dict__",
                    {"batch": b, "start": a, "end": e, "key_start": ks, "key_end": ke, "prefix_end": pe},
                )
                segs.append(seg)
                queries.append((b, a, e))
                if a < os_ or e > oe:  # its queries outside the shard
                    moved += _outside(a, e, os_, oe)
                if b < pb or (b == pb and ks < pk):
                    ordered = False
                pb, pk = b, ks
                keys.append((b, ks, ke))
            ivs = _merge_sorted(keys) if ordered else _union(keys)
            segments.append(tuple(segs))
            q_ranges.append(tuple(queries))
            q_moved.append(moved)
            kv_ranges.append(tuple(ivs))
            kv_recv.append(sum(_outside(s, e, os_, oe) for _, s, e in ivs if s < os_ or e > oe))
        fields = dict(cp_size=self.c, seq_len=self.S, batch=len(self.rows), causal=self.causal, window_size=window)
        fields.update(q_ranges=tuple(q_ranges), work=self.work(), kv_recv_tokens=tuple(kv_recv))
        fields.update(q_moved_tokens=tuple(q_moved), segments=tuple(segments), kv_ranges=tuple(kv_ranges))
        fields.update(extra_rows=tuple(extra_rows), query_cost=self.query_cost, tolerance=self.tolerance)
        fields.update(row_cost=row_cost, documents=self.rows, prefixes=self.prefixes)
        return _frozen(ContextParallelPlan, fields)


def _causal_pairs(n: int) -> int:
    """Pairs of the first ``n`` queries of a causal document without window or prefix."""
    return n * (n + 1) // 2 if n > 0 else 0


class _CausalPlanner(_Planner):
    """The planner for causal documents without window or prefix (what training runs): the mask
    arithmetic in closed form, the cuts by square root instead of bisection. The same answers
    as :class:`_Planner` to the token (tests/test_cp_plan.py holds them equal), several times
    faster: the planner runs in Python on every new layout."""

    def _prefix(self, doc: _Doc, n: int) -> int:
        return _causal_pairs(n)

    def _work(self, doc: _Doc, a: int, e: int) -> int:
        i0, i1 = a - doc.start, e - doc.start
        return (i1 * (i1 + 1) - i0 * (i0 + 1)) // 2

    def _key_range(self, doc: _Doc, a: int, e: int) -> tuple[int, int]:
        return doc.start, e

    def _extra_rows(self, r: int, runs: list[list]) -> tuple[int, int, int]:
        # the base class's rows with causal key ranges (from the document's start, or from the
        # window's reach for _WindowPlanner, to the part's end) for the runs inside one shard:
        # inside rank r's, a run sees remote keys only when its keys start before the shard;
        # inside another's, it sees all its keys remotely
        os_, oe, cs, left = *self.owned[r], self.cs, self.left
        q = k = m = 0
        rest = []
        for run in runs:
            _, a, e, doc, _ = run
            start = doc.start
            ks = a - left if left >= 0 else start
            if ks < start:
                ks = start
            if os_ <= a and e <= oe:
                if ks < os_:
                    q, k, m = q + e - a, k + os_ - ks, m + e - a
            elif a // cs == (e - 1) // cs:
                q, k = q + e - a, k + e - ks
            else:
                rest.append(run)
        rq, rk, rm = super()._extra_rows(r, rest) if rest else (0, 0, 0)
        return q + rq, k + rk, m + rm

    def _densities(self, pieces: list[list]) -> list[float]:
        # pairs / queries of a causal run [i0, i1) is (i0 + i1 + 1) / 2, exactly (the pairs are
        # (i1 - i0)(i0 + i1 + 1) / 2): the same floats, so the same order, as the base class's
        return [(p[1] + p[2] - 2 * p[3].start + 1) / 2 for p in pieces]

    def _cut(self, doc: _Doc, a: int, e: int, amount: int, tail: bool) -> tuple[int, int]:
        # F(m) = m (m + 1) / 2 (_causal_pairs) and its inverse, the largest m with F(m) <= t, by an
        # integer square root, written out with the clamps compared inline: the balance passes cut
        # some 70 times a 4 x 32k layout (1.5 -> 0.5 us a cut)
        start = doc.start
        i0, i1 = a - start, e - start
        if tail:  # the smallest m in [i0, i1 - 1] with F(m) >= F(i1) - amount, as bisection finds
            target = i1 * (i1 + 1) // 2 - amount
            if target <= 0:  # the whole run (F(0) = 0 already reaches the target)
                return a, e
            m = (math.isqrt(8 * target + 1) - 1) // 2
            if m * (m + 1) // 2 < target:
                m += 1
            return start + (i0 if m < i0 else i1 - 1 if m >= i1 else m), e
        # the largest m in [i0 + 1, i1] with F(m) <= F(i0) + amount (amount >= 1: the target is > 0)
        m = (math.isqrt(8 * (i0 * (i0 + 1) // 2 + amount) + 1) - 1) // 2
        return a, start + (i0 + 1 if m <= i0 else i1 if m > i1 else m)


class _WindowPlanner(_CausalPlanner):
    """The planner for causal documents with a left window ``W`` and no prefix. Query ``i``
    sees keys ``[max(0, i - W), i]``, so the first ``n`` queries hold
    ``F(n) = n (n + 1) / 2`` pairs up to ``K = W + 1`` and ``F(K) + (n - K) K`` past it (every
    later query sees ``K`` keys). The mask arithmetic is in closed form, and so are the cuts: a
    square root while ``F`` is a triangle, a division where it is linear; the extra rows are
    :class:`_CausalPlanner`'s, keys starting at the window's reach. The same answers as
    :class:`_Planner` to the token (tests/test_cp_plan.py holds them equal)."""

    def _prefix(self, doc: _Doc, n: int) -> int:
        k = self.left + 1
        if n <= k:
            return n * (n + 1) // 2 if n > 0 else 0
        return k * (2 * n - k + 1) // 2  # F(K) + (n - K) K

    def _work(self, doc: _Doc, a: int, e: int) -> int:
        k, start = self.left + 1, doc.start
        i0, i1 = a - start, e - start
        if i0 >= k:  # the whole run past the window's fill: K pairs a query
            return (i1 - i0) * k
        f0 = i0 * (i0 + 1) // 2
        return (i1 * (i1 + 1) // 2 if i1 <= k else k * (2 * i1 - k + 1) // 2) - f0

    def _key_range(self, doc: _Doc, a: int, e: int) -> tuple[int, int]:
        ks = a - self.left
        return (ks if ks > doc.start else doc.start), e

    def _densities(self, pieces: list[list]) -> list[float]:
        # the base class's (pairs / queries, the same int over the same int) without the calls
        k, out = self.left + 1, []
        for p in pieces:
            a, e, start = p[1], p[2], p[3].start
            i0, i1 = a - start, e - start
            if i0 >= k:
                out.append((i1 - i0) * k / (e - a))
            else:
                f1 = i1 * (i1 + 1) // 2 if i1 <= k else k * (2 * i1 - k + 1) // 2
                out.append((f1 - i0 * (i0 + 1) // 2) / (e - a))
        return out

    def _cut(self, doc: _Doc, a: int, e: int, amount: int, tail: bool) -> tuple[int, int]:
        # the base class's bisection answers with F's inverse: below F(K) = K (K + 1) / 2 the
        # largest m with m (m + 1) / 2 <= t is an integer square root (as _CausalPlanner's),
        # from F(K) on F rises by K a query
        k, start = self.left + 1, doc.start
        fk = k * (k + 1) // 2
        i0, i1 = a - start, e - start
        if tail:  # the smallest m in [i0, i1 - 1] with F(m) >= F(i1) - amount, as bisection finds
            target = (i1 * (i1 + 1) // 2 if i1 <= k else k * (2 * i1 - k + 1) // 2) - amount
            if target <= 0:  # the whole run (F(0) = 0 already reaches the target)
                return a, e
            if target <= fk:
                m = (math.isqrt(8 * target + 1) - 1) // 2
                if m * (m + 1) // 2 < target:
                    m += 1
            else:
                m = k - (fk - target) // k  # K + ceil((target - F(K)) / K)
            return start + (i0 if m < i0 else i1 - 1 if m >= i1 else m), e
        # the largest m in [i0 + 1, i1] with F(m) <= F(i0) + amount
        target = (i0 * (i0 + 1) // 2 if i0 <= k else k * (2 * i0 - k + 1) // 2) + amount
        if target < fk:
            m = (math.isqrt(8 * target + 1) - 1) // 2
        else:
            m = k + (target - fk) // k
        return a, start + (i0 + 1 if m <= i0 else i1 if m > i1 else m)


def _outside(s: int, e: int, lo: int, hi: int) -> int:
    """Positions of ``[s, e)`` outside ``[lo, hi)`` (ints compared inline, not by min/max: it runs
    per run and per key range of every plan)."""
    a, b = (s if s > lo else lo), (e if e < hi else hi)
    return e - s - (b - a if b > a else 0)


def _price(rows: tuple[int, int, int], cost: RowCost) -> int:
    q, k, m = rows
    return int(cost.query * q + cost.key * k + cost.merged * m)


def _union(ranges) -> list[tuple[int, int, int]]:
    """The ``(batch, start, end)`` ranges merged where they overlap or touch, sorted."""
    return _merge_sorted(sorted(ranges))


def _merge_sorted(ranges) -> list[tuple[int, int, int]]:
    """:func:`_union` of ranges already sorted by ``(batch, start)`` (the open range kept in
    locals, a tuple made once per merged range)."""
    out: list[tuple[int, int, int]] = []
    cb, cs, ce = -1, 0, 0
    for b, s, e in ranges:
        if b == cb and s <= ce:
            if e > ce:
                ce = e
        else:
            if cb >= 0:
                out.append((cb, cs, ce))
            cb, cs, ce = b, s, e
    if cb >= 0:
        out.append((cb, cs, ce))
    return out


def build_plan(
    layout: DocLayout,
    cp_size: int,
    causal: bool,
    left: int,
    right: int,
    *,
    query_cost: float = 1.0,
    tolerance: float = TOLERANCE,
    prefixes: tuple[tuple[int, ...], ...] | None = None,
    row_cost: RowCost | None = None,
) -> ContextParallelPlan:
    """Plan from a validated layout; ``left``/``right`` already normalised (right=0 if causal);
    ``prefixes``: per row, each non-empty document's bidirectional prefix length (causal only);
    ``row_cost``: balance pairs plus rows priced so (step 3 of the module docstring)."""
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}")
    query_cost = check_cost("query_cost", query_cost)  # the moves' pruning needs it >= 0

    kind = _Planner
    if causal and prefixes is None:
        kind = _CausalPlanner if left < 0 else _WindowPlanner
    start = kind(layout.rows, layout.seq_len, cp_size, causal, left, right, query_cost, tolerance, prefixes)

    def planner(offsets: list[int] | None = None, last: bool = False) -> _Planner:
        offsets = offsets if offsets is not None else [0] * cp_size
        planner = start.last_fresh(offsets) if last else start.fresh(offsets)
        planner.balance()
        return planner

    best = planner()
    if row_cost is None or cp_size == 1:
        return best.result((left, right), None)
    # the re-plans are priced without building them; only the one kept becomes a plan
    extra = best.priced_rows(row_cost)
    first_max = max(w + x for w, x in zip(best.work(), extra))
    best_max = first_max * (1 - _ROW_MARGIN)
    # a re-plan moves pairs against the ranks' spread of priced rows, so it gains at most about
    # that spread: when the spread is under the margin a re-plan cannot be kept, and is not run
    if max(extra) - min(extra) > _ROW_MARGIN * first_max:
        for i, step in enumerate(_ROW_STEPS):
            candidate = planner([int(step * (e - min(extra))) for e in extra], last=i == len(_ROW_STEPS) - 1)
            priced = candidate.priced_below(row_cost, best_max)
            if priced is not None:
                best, best_max = candidate, priced
    return best.result((left, right), row_cost)


def runtime_plan(
    layout: DocLayout,
    cp_size: int,
    causal: bool,
    left: int,
    right: int,
    query_cost: float,
    prefixes: tuple[tuple[int, ...], ...] | None = None,
    *,
    tolerance: float | None = None,
    row_cost: RowCost | None = ROW_COST,
) -> ContextParallelPlan:
    """:func:`build_plan`, memoised on the layout: the runtime, :func:`plan_context_parallel` and
    :func:`doc_packed.cp.prepare` share one plan per (layout, group size, mask, costs).
    ``tolerance`` None: this module's :data:`TOLERANCE` as it is at the call (a bench may set it)."""
    tolerance = TOLERANCE if tolerance is None else tolerance
    key = ("cp_plan", cp_size, causal, left, right, float(query_cost), tolerance, row_cost, prefixes)
    return layout.derived(
        key,
        lambda: build_plan(
            layout,
            cp_size,
            causal,
            left,
            right,
            query_cost=query_cost,
            tolerance=tolerance,
            prefixes=prefixes,
            row_cost=row_cost,
        ),
    )


def query_cost_of(num_heads: object, query_cost: object) -> float:
    """The planner's query cost from ``num_heads=(H_q, H_kv)`` (``H_q / H_kv``, the runtime's) or
    an explicit ``query_cost``; 1.0 when neither is given."""
    if num_heads is not None and query_cost is not None:
        raise TypeError("pass num_heads=(H_q, H_kv) or query_cost, not both (query_cost is H_q / H_kv)")
    if num_heads is None:
        return 1.0 if query_cost is None else check_cost("query_cost", query_cost)
    if not isinstance(num_heads, (tuple, list)) or len(num_heads) != 2:
        raise TypeError(f"num_heads must be (H_q, H_kv), got {num_heads!r}")
    hq, hkv = (check_count(f"num_heads[{i}]", h) for i, h in enumerate(num_heads))
    if hq % hkv:
        raise ValueError(f"num_heads: H_q={hq} must be a multiple of H_kv={hkv} (grouped-query attention)")
    return hq / hkv


def plan_context_parallel(
    cu_seqlens: torch.Tensor | Sequence[Sequence[int]],
    cp_size: int,
    *,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    num_heads: tuple[int, int] | None = None,
    query_cost: float | None = None,
    tolerance: float | None = None,
    row_cost: RowCost | None = ROW_COST,
) -> ContextParallelPlan:
    """The plan context parallelism runs for this layout over ``cp_size`` ranks.

    ``cu_seqlens`` is the whole rows' ``[B, MAX_DOCS + 1]`` layout (any device; read once), or
    the same boundaries as lists of ints per row (no tensor: usable under a fake-tensor mode).
    ``num_heads=(H_q, H_kv)`` are the attention's head counts (the runtime weighs moving a query
    against fetching a key/value row by ``H_q / H_kv``; ``query_cost`` sets that weight directly;
    neither: 1.0). With the defaults for ``tolerance`` (allowed work imbalance above the mean; None:
    :data:`TOLERANCE` as it is at the call, as the runtime reads it) and
    ``row_cost`` (the rows each rank's calls span, priced in pairs; None: pairs alone), this is
    exactly the plan ``doc_packed_attn`` runs for a call with those heads and this mask: the same
    object, memoised on the layout. The plan is a value: print it, keep it, pickle it, hand it
    to :func:`doc_packed.cp.prepare`.
    """
    check_count("cp_size", cp_size)
    qc = query_cost_of(num_heads, query_cost)
    tolerance = check_cost("tolerance", TOLERANCE if tolerance is None else tolerance)
    if row_cost is not None:
        if not isinstance(row_cost, tuple) or len(row_cost) != 3:
            raise TypeError(f"row_cost must be a RowCost (query, key, merged) or None, got {row_cost!r}")
        row_cost = RowCost(*(check_cost(f"row_cost.{n}", x) for n, x in zip(("query", "key", "merged"), row_cost)))
    left, right = check_window(causal, window_size)
    if not isinstance(cu_seqlens, torch.Tensor):
        bounds = check_int_rows("cu_seqlens", cu_seqlens)
        validate_bounds(bounds, bounds[0][-1])
        layout = DocLayout(bounds, bounds[0][-1])
    else:
        check_cu_seqlens(cu_seqlens)
        layout = get_layout(cu_seqlens, int(cu_seqlens[0, -1]))
    return runtime_plan(layout, cp_size, causal, left, right, qc, tolerance=tolerance, row_cost=row_cost)
