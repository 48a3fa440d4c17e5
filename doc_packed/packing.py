"""Packing documents into rows, optionally for context parallelism.

Documents in a packed row are independent, so which row holds a document and where it sits in
the row are free choices. With ``cp_size`` the packer uses them: rank ``r`` owns the ``r``-th
``torch.chunk`` of every row (:func:`doc_packed.cp.plan.owner_ranges`), and documents are placed
so that every rank's contiguous shards carry the same attention work (exact (query, key) pairs,
:mod:`doc_packed._mask`, what the planner counts) and shard boundaries fall between documents.
Then :func:`doc_packed.plan_context_parallel` moves no queries and only the few documents that
straddle a boundary send keys. Positions (per document) and labels are unchanged by the order.

Algorithm (``rows`` rows of ``seq_len`` tokens, ``c`` shards each; a *cell* is one row's shard,
a *column* all cells of one rank; the target is ``total pairs / c`` per column):

1. *Heavy documents first* (longer than a shard, or too much work for one column): each is
   placed across cells so that no column exceeds the target, ending as far right in its last
   cell as that allows (the rank holding its last piece receives the fewest keys:
   ``length - last piece``, the minimum when the last piece is a whole shard).
2. *The rest, longest first*, each to the column that most needs dense work (largest
   ``(target - load) / free tokens``), in that column's cell with the most room.
3. *Close the cells*, row by row, left to right: a cell's gap is filled exactly from the
   documents that fit nowhere (subset sum), else best-fit; what is left straddles the boundary
   with the smallest document available, whose first part (the keys the next rank receives) is
   smaller than every unplaced document; a cell that cannot be closed is padded (its own
   document of padding tokens).

Where that packing leaves documents out or moves queries, one more is tried in which every column
a heavy document's piece leaves room only for light documents *claims* the lightest tokens it
needs (the shortest documents held back for step 3 excluded): later heavy documents count only
on the rest, so no two columns are promised the same light documents (:meth:`_Packer._claim`).
Where the claimed packing still moves queries (or the first left documents out), its heavy
documents are also *evened*: a last piece placed for the fewest keys leaves its column just
enough room for the lightest documents, and closing a cell before a heavy document can shift
it left (each token of shift puts a shard's length of pairs more on a whole-shard piece); a shorter
last piece (at most ``_EVEN_KEYS`` of all-gather's keys more) moves work to the document's other
pieces until the worst of its columns is lowest. Last, a packing whose heaviest column is at
most ``_CLAIM_BELOW`` over is brought under the planner's tolerance where *trades between
cells* can (:func:`_trade_cells`: a document of that column for shorter ones of equal total
length from a column with room; no cell changes length and no straddling document moves, so
the keys stay the same).

Without ``cp_size`` it packs first-fit in the given order (the historical behaviour).
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left, bisect_right, insort
from collections.abc import Iterable, Iterator, Sequence
from typing import NamedTuple

import numpy as np
import torch

from ._checks import check_count, check_length, check_window
from ._mask import prefix_pairs
from .cp.plan import owner_ranges

__all__ = ["PAD", "PackOrder", "Packed", "pack_order", "pack_documents", "pack_stream"]

_DEBUG = False
_PASSES = 2  # packing passes at most, the second aiming the columns the first one missed
_TOLERANCE = 0.004  # imbalance below which one pass is enough (the planner moves work above 1.01)
_RETRY_BELOW = 0.05  # ... and above which a second pass does not help (measured)
_PLANNER_TOLERANCE = 0.01  # the runtime planner moves queries above this imbalance
_CLAIM_BELOW = 0.1  # claimed light tokens are tried below this imbalance (above it a document
# alone outweighs a column, and claims do not change that; measured on the bench grid)
_EVEN_KEYS = 0.002  # keys an even split may add to a heavy document's last rank, of all-gather's
_TRADES = 32  # trades between cells at most (_trade_cells)
_TRADE_LONGEST = 2048  # longest document a trade gives (the subset sums it takes cost its length)
_TRADE_GOAL = 0.008  # ... which aim each column this far below the planner's tolerance
_TRADE_WORK = 1 << 23  # ... and least-work table entries they may compute, the first tables included
# (a work count, not a time. Measured over 600 draws, the bench grid and 88 streaming runs: the one
# trade kept took 0.8M; lognormal-512 in one 1M row over 16 ranks, seed 1, took 33M for 32 trades,
# none kept, 75 of its 92 ms)
_PAD_PIECE = 64  # longest padding segment with cp_size (pairs wasted on padding: <= 64 per token)
_SWAP = 48  # shortest documents of a row that may be traded to fill it exactly
_SLACK = 100  # 1/100 of every cell is left free while assigning: room for swaps, closed by the reserve
_RESERVE_PER_ROW = 12  # shortest documents held back per row to close cells exactly
_MIN_PER_SHARD = 3  # below this many documents per shard on average: first-fit rows (measured:
# at 2-3 the CP-aware rows were first-fit's in 7 of 9 bench cells, a trade in 2, and took 20-135 ms)
_EXACT_DOCS = 16  # one row over 2 ranks with at most this many documents: every split is tried
_EXACT_IMBALANCE = 1.009  # ... and balanced means below the runtime planner's 1% tolerance
PAD = -1  # the document index of padding segments and padding positions


class PackOrder(NamedTuple):
    """Rows as orders of document indices (:func:`pack_order`).

    Attributes:
        rows: per row, the index of each segment's document in order; :data:`PAD` (-1) for a
            padding segment.
        lengths: per row, the segment lengths in the same order (each row sums to ``seq_len``):
            ``cu_seqlens_from_lengths(order.lengths, seq_len)`` is the layout.
        padded: padding tokens over all rows.
    """

    rows: list[list[int]]
    lengths: list[list[int]]
    padded: int

    @property
    def padded_fraction(self) -> float:
        total = sum(sum(r) for r in self.lengths)
        return self.padded / total if total else 0.0


class Packed(tuple):
    """Packed rows (:func:`pack_documents`): unpacks as ``(rows, cu_seqlens)``, as before, and
    carries what maps tokens back.

    Attributes:
        rows: ``[B, seq_len, ...]``, padding positions hold ``pad_value``.
        cu_seqlens: ``[B, max_docs + 1]`` int32; every padding segment is a document of its own.
        doc_index: ``[B, seq_len]`` int64, the index in ``documents`` of each position's
            document, :data:`PAD` (-1) for padding.
        padded_fraction: padding positions over all positions.
    """

    doc_index: torch.Tensor
    padded_fraction: float

    def __new__(cls, rows: torch.Tensor, cu_seqlens: torch.Tensor, doc_index: torch.Tensor, padded_fraction: float):
        obj = super().__new__(cls, (rows, cu_seqlens))
        obj.doc_index = doc_index
        obj.padded_fraction = padded_fraction
        return obj

    @property
    def rows(self) -> torch.Tensor:
        return self[0]

    @property
    def cu_seqlens(self) -> torch.Tensor:
        return self[1]


# ---- checks -----------------------------------------------------------------------------------
def _check_lengths(lengths: object, seq_len: int) -> list[int]:
    try:
        out = [int(n) for n in lengths]  # type: ignore[attr-defined]
    except TypeError:
        raise TypeError(f"lengths must be a sequence of ints, got {type(lengths).__name__}") from None
    for i, n in enumerate(out):
        if n < 0 or n > seq_len:
            raise ValueError(f"lengths[{i}] = {n}: each document must have 0 to seq_len={seq_len} tokens")
    return out


def _check_cp(cp_size: object) -> int | None:
    return None if cp_size is None else check_count("cp_size", cp_size)


# ---- greedy (no cp_size) ----------------------------------------------------------------------
def _first_fit(lengths: list[int], seq_len: int) -> list[list[int]]:
    rows: list[list[int]] = []
    room: list[int] = []
    for i, n in enumerate(lengths):
        if n == 0:
            continue
        for r, free in enumerate(room):
            if n <= free:
                rows[r].append(i)
                room[r] -= n
                break
        else:
            rows.append([i])
            room.append(seq_len - n)
    return rows


# ---- CP-aware ---------------------------------------------------------------------------------
def _ramp_np(n: np.ndarray, a: np.ndarray | int) -> np.ndarray:
    m = n - 1 - a
    return np.where(m > 0, m * (m + 1) // 2, 0)


def _prefix_pairs_np(n: np.ndarray, length: np.ndarray, causal: bool, left: int, right: int) -> np.ndarray:
    """:func:`doc_packed._mask.prefix_pairs` of int64 arrays, elementwise (the same integers)."""
    n = np.maximum(n, 0)
    sum_lo = 0 if left < 0 else _ramp_np(n, left)
    if causal:
        sum_hi = n * (n - 1) // 2
    elif right < 0:
        sum_hi = n * (length - 1)
    else:
        a = np.maximum(length - 1 - right, 0)
        sum_hi = np.where(right >= length - 1, n * (length - 1), n * (n - 1) // 2 + n * right - _ramp_np(n, a))
    return np.where(n > 0, sum_hi - sum_lo + n, 0)


class _Docs:
    """What every packing pass over one list of lengths shares: each document's work and the
    least-work fill curve (the shortest documents first, cumulative)."""

    def __init__(self, lengths: list[int], causal: bool, left: int, right: int):
        self.L = lengths
        arr = np.asarray(lengths, dtype=np.int64)
        self.work = _prefix_pairs_np(arr, arr, causal, left, right).tolist()
        live = np.flatnonzero(arr > 0)
        self.live = live.tolist()
        by_len = live[np.argsort(arr[live], kind="stable")]  # (length, index) order
        self.fill_toks = np.concatenate([[0], np.cumsum(arr[by_len])])
        self.fill_work = np.concatenate([[0], np.cumsum(np.asarray(self.work, dtype=np.int64)[by_len])])
        self.fill_toks_l: list[int] = self.fill_toks.tolist()
        self.fill_work_l: list[int] = self.fill_work.tolist()
        self.tokens = int(self.fill_toks[-1])


class _LeftOut(Exception):
    """A packing pass with ``bail`` stops: this document will be left out whatever follows."""

    def __init__(self, doc: int):
        super().__init__(doc)
        self.doc = doc


class _Packer:
    """One batch of ``n_rows`` rows balanced over ``c`` columns (see the module docstring)."""

    def __init__(
        self,
        lengths: list[int],
        seq_len: int,
        c: int,
        causal: bool,
        left: int,
        right: int,
        n_rows: int,
        shift: Sequence[float] | None = None,
        docs: _Docs | None = None,
        claim: bool = False,
        bail: bool = False,
        even: int | None = None,
    ):
        docs = docs or _Docs(lengths, causal, left, right)
        self.docs = docs
        self.L, self.S, self.c, self.R = lengths, seq_len, c, n_rows
        self.mask = (causal, left, right)
        step = -(-seq_len // c)  # owner_ranges(seq_len, c): torch.chunk's shards
        self.lo = [min(r * step, seq_len) for r in range(c)]
        self.hi = [min((r + 1) * step, seq_len) for r in range(c)]
        self.cap = [e - a for a, e in zip(self.lo, self.hi)]
        self.cs = max(self.cap)
        self.work = docs.work
        # more documents than room (a streaming batch): the shortest are the ones left out
        excess = docs.tokens - n_rows * seq_len
        k = bisect_left(docs.fill_toks_l, excess) if excess > 0 else 0
        kept = docs.fill_work_l[-1] - docs.fill_work_l[k]
        self.target = kept / c
        # per-column targets: the mean, less what a previous pass ended above it
        self.tg = [self.target - (shift[r] if shift else 0.0) for r in range(c)]
        self._tg_np = np.asarray(self.tg)
        self._keys: np.ndarray | None = None  # _end_keys of every column while heavy documents are placed
        # free interval of every cell, [fs, fe), and the documents assigned to it
        self.fs = [list(self.lo) for _ in range(n_rows)]
        self.fe = [list(self.hi) for _ in range(n_rows)]
        self.cell: list[list[list[int]]] = [[[] for _ in range(c)] for _ in range(n_rows)]
        self.used = [[0] * c for _ in range(n_rows)]
        self.pinned: list[dict[int, int]] = [{} for _ in range(n_rows)]  # row -> start -> doc
        self.colw = [0.0] * c
        self.left_over: list[tuple[int, int]] = []  # sorted (length, doc)
        # the least work that fills x tokens: the shortest documents (cumulative, for _fill)
        self._fill_toks, self._fill_work = docs.fill_toks_l, docs.fill_work_l
        # with ``claim`` (see _claim), less the shortest documents, which run() holds back to close
        # cells with (they end up in every column: none can count on them; about as many as
        # run() keeps) and the light tokens columns claimed
        self.claiming = claim
        self.bail = bail  # stop at the first document sure to be left out (_LeftOut)
        # with ``even``: a heavy document's last piece is shortened (its rank receives up to
        # ``even`` keys from it) where that evens the columns of its pieces (:meth:`_best_end`)
        self.even = even
        keep = min(len(docs.live) // 4, _RESERVE_PER_ROW * n_rows) if claim else 0
        self._held: tuple[float, float] = (docs.fill_toks_l[keep], docs.fill_work_l[keep])
        self._claims: dict[int, float] = {}  # column -> light tokens it claimed, in stacking order
        self.slack = max(0, n_rows * seq_len - docs.tokens)
        self.colfree = [n_rows * self.cap[r] for r in range(c)]

    def _raw_fill(self, x: float) -> float:
        """Least work of the ``x`` shortest tokens of all documents (the last document in part)."""
        j = bisect_right(self._fill_toks, x)
        if j >= len(self._fill_toks):
            return float(self._fill_work[-1])
        t0, w0 = self._fill_toks[j - 1], self._fill_work[j - 1]
        n = self._fill_toks[j] - t0
        return w0 + float((self._fill_work[j] - w0) * (x - t0)) / n  # rounds as _fill_np does

    def _fill(self, x: int) -> float:
        """Least work of ``x`` tokens of documents: the shortest ones not held back or claimed,
        the last one in part (:meth:`_raw_fill`, inlined: it is called often)."""
        t_h, w_h = self._held
        at = x + t_h
        j = bisect_right(self._fill_toks, at)
        if j >= len(self._fill_toks):
            return float(self._fill_work[-1]) - w_h
        t0, w0 = self._fill_toks[j - 1], self._fill_work[j - 1]
        n = self._fill_toks[j] - t0
        return w0 + float((self._fill_work[j] - w0) * (at - t0)) / n - w_h  # rounds as _fill_np does

    def _fill_np(self, x: np.ndarray, held: bool = True) -> np.ndarray:
        """:meth:`_fill` of an int64 array (``held=False``: counting every document)."""
        toks, work = self.docs.fill_toks, self.docs.fill_work
        t_h, w_h = self._held if held else (0, 0)
        x = x + t_h
        j = np.minimum(np.searchsorted(toks, x, side="right"), len(toks) - 1)
        t0, w0 = toks[j - 1], work[j - 1]
        part = w0 + (work[j] - w0) * (x - t0) / np.maximum(toks[j] - t0, 1)
        return np.where(x >= toks[-1], work[-1].astype(np.float64), part) - w_h

    def _claim(self, k: int) -> None:
        """Column ``k`` just took a piece of a heavy document: it may now afford only light
        documents for its free tokens. It claims the fewest of the lightest tokens that, with
        the rest of its free tokens at the mean density of what remains, keep it at its target;
        claimed tokens leave the fill that later placements count on (no two columns get the
        same light documents). A column's claim is replaced when it is touched again."""
        t_h, w_h = self._held
        t_h -= self._claims.pop(k, 0.0)  # (re-inserted below: the dict is in stacking order)
        w_h = self._raw_fill(t_h)
        f, budget = self.colfree[k], self.tg[k] - self.colw[k]
        left_t = self.docs.tokens - t_h
        x = 0.0
        rho = (self._fill_work[-1] - w_h) / left_t if left_t > 0 else 0.0
        if 0 < f < left_t and f * rho > budget:

            def over(x: float) -> float:
                light = self._raw_fill(t_h + x) - w_h
                return light + (f - x) * (self._fill_work[-1] - w_h - light) / max(left_t - x, 1) - budget

            a, x = 0.0, float(f)
            for _ in range(24):
                m = (a + x) / 2
                if over(m) > 0:
                    a = m
                else:
                    x = m
        self._claims[k] = x
        self._held = (t_h + x, self._raw_fill(t_h + x))

    # -- work ---------------------------------------------------------------------------------
    def _piece(self, n: int, a: int, e: int) -> int:
        causal, left, right = self.mask
        return prefix_pairs(e, n, causal, left, right) - prefix_pairs(a, n, causal, left, right)

    def _pieces(self, n: int, s: int) -> list[tuple[int, int, int]]:
        """(column, in-document start, in-document end) of a document of ``n`` tokens at ``s``."""
        e = s + n
        out = []
        r = min(s // self.cs, self.c - 1)
        while r < self.c and self.lo[r] < e:
            a, b = max(s, self.lo[r]), min(e, self.hi[r])
            if b > a:
                out.append((r, a - s, b - s))
            r += 1
        return out

    # -- 1. heavy documents ---------------------------------------------------------------------
    def _reserve_padding(self) -> None:
        """Room no document fills (fewer tokens than rows): padding spread evenly over the cells
        (at their ends), so that every rank loses the same share of its tokens to it."""
        open_cells = [
            (b, r) for b in range(self.R) for r in range(self.c) if self.fe[b][r] == self.hi[r] > self.fs[b][r]
        ]
        left = self.slack
        for k, (b, r) in enumerate(open_cells):
            take = max(0, min(left // (len(open_cells) - k), self.fe[b][r] - self.fs[b][r] - self.used[b][r]))
            self.fe[b][r] -= take
            self.colfree[r] -= take
            left -= take

    def _heavy_all(self) -> list[bool]:
        """Per document: longer than a shard less the slack :meth:`_assign` keeps (so it would not
        fit a cell there), or more work than a column can take next to the least work that
        fills the rest of its tokens."""
        n = np.asarray(self.L, dtype=np.int64)
        fill = self._fill_np(np.maximum(self.R * self.cs - n, 0), held=False)
        longest = self.cs - self.cs // _SLACK
        return ((n > longest) | (np.asarray(self.work, dtype=np.int64) + fill > self.target)).tolist()

    def _place_heavy(self, i: int) -> bool:
        n = self.L[i]
        # end columns to try: the least loaded ones (the last piece is the heaviest)
        if self._keys is None:
            self._keys = self._end_keys(range(self.c))
        best = None
        for k in np.argsort(self._keys, kind="stable")[: self.tries].tolist():
            tried = 0
            memo: dict = {}  # rows in the same state (y range) score the same: computed once
            for b in range(self.R):
                if self.fs[b][k] != self.lo[k] or self.fe[b][k] <= self.lo[k]:
                    continue
                cand = self._best_end(b, k, n, memo)
                if cand is None:
                    continue
                tried += 1
                if best is None or cand[0] < best[0]:
                    best = cand
                if tried >= 3:
                    break
        if best is None:
            return False
        _, b, s = best
        pieces = self._pieces(n, s)
        if len(pieces) == 1:  # fits in one cell: an ordinary assignment
            r = pieces[0][0]
            self.cell[b][r].append(i)
            self.used[b][r] += n
        else:
            self.pinned[b][s] = i
            first, last = pieces[0][0], pieces[-1][0]
            self.fe[b][first] = s
            for r, _, _ in pieces[1:-1]:
                self.fs[b][r] = self.fe[b][r] = self.hi[r]
            self.fs[b][last] = s + n
        for r, a, e in pieces:
            self.colw[r] += self._piece(n, a, e)
            self.colfree[r] -= e - a
        if self.claiming:
            for r, _, _ in pieces:
                self._claim(r)
            self._keys = self._end_keys(range(self.c))
        else:
            for r, _, _ in pieces:
                self._keys[r] = self.colw[r] + self._fill(self.colfree[r]) - self.tg[r]
        return True

    def _end_keys(self, cols) -> np.ndarray:
        """How far each column of ``cols`` ends above its target if the rest of its tokens get
        the least work there is (heavy documents end in the lowest first)."""
        cols = list(cols)
        w = np.array([self.colw[r] for r in cols], dtype=np.float64)
        free = np.array([self.colfree[r] for r in cols], dtype=np.int64)
        return w + self._fill_np(free) - self._tg_np[cols]

    def _best_end(self, b: int, k: int, n: int, memo: dict):
        """Best placement of ``n`` tokens ending in cell (b, k): (score, b, start) or None.
        The score depends on the row only through the range of last-piece lengths it allows:
        ``memo`` (one per end column and document) keeps the scores and the fits tried. The
        last piece is the longest that fits; with ``self.even``, up to that many tokens shorter
        where that lowers the worst column of the document's pieces (evened)."""
        lo, fe = self.lo[k], self.fe[b][k]
        y_max = min(fe - lo - self.used[b][k], n)  # the cell's documents still fit after it
        # leftmost start allowed: walk back over cells that are free and empty
        s_min, j = lo, k - 1
        while s_min > lo - n + 1 and j >= 0:
            if self.fs[b][j] == self.lo[j] and self.fe[b][j] == self.hi[j] and not self.used[b][j]:
                s_min = self.lo[j]
                j -= 1
                continue
            if self.fe[b][j] == self.hi[j]:
                s_min = self.fs[b][j] + self.used[b][j]
            break
        y_min = max(1, s_min + n - lo)
        if y_min > y_max:
            return None
        got = memo.get((y_min, y_max))
        if got is not None:
            return got[0], b, lo + got[1] - n

        cw, cf, t, fill = self.colw[k], self.colfree[k], max(self.tg[k], 1.0), self._fill
        causal, left, right = self.mask
        whole = prefix_pairs(n, n, causal, left, right)

        def over(y: int) -> tuple[float, float]:
            """(last piece's column over its target, worst other column over its target)."""
            s = lo + y - n
            last, other = 0.0, -math.inf
            colw, colfree, tg, lo_, hi_ = self.colw, self.colfree, self.tg, self.lo, self.hi
            r = min(s // self.cs, self.c - 1)  # the pieces, as _pieces(n, s)
            e = s + n
            prev = prefix_pairs(max(s, lo_[r]) - s, n, causal, left, right)
            while r < self.c and lo_[r] < e:
                a, z = max(s, lo_[r]), min(e, hi_[r])
                if z > a:
                    nxt = prefix_pairs(z - s, n, causal, left, right)
                    v = (colw[r] + (nxt - prev) + fill(colfree[r] - (z - a))) / max(tg[r], 1.0) - 1
                    prev = nxt
                    if r == k:
                        last = v
                    else:
                        other = max(other, v)
                r += 1
            return last, other

        plain = causal and left < 0  # prefix_pairs(m, n) = m (m + 1) / 2

        def last_over(y: int) -> float:
            v = memo.get(y)
            if v is None:
                m = n - y
                piece = whole - (m * (m + 1) // 2 if plain else prefix_pairs(m, n, causal, left, right))
                v = memo[y] = (cw + piece + fill(cf - y)) / t - 1  # piece: self._piece(n, n - y, n)
            return v

        # largest y whose last piece fits (monotone for causal masks)
        a, z = y_min, y_max
        if last_over(a) > 0:
            y = a  # even the smallest last piece overflows
        elif causal and left < 0 and last_over(z) <= 0:
            y = z  # the largest fits (the usual case): no search
        else:
            while a < z:
                m = (a + z + 1) // 2
                if last_over(m) <= 0:
                    a = m
                else:
                    z = m - 1
            y = a
        last, other = over(y)
        if self.even is not None and y < n and last > other:
            # a shorter last piece moves work to the document's other pieces (the last one's
            # column falls as y does, the others' rise): the y where they meet leaves the most
            # room in the worst of them for the documents that fill them, at more keys
            floor = max(y_min, y - self.even)
            a, z = floor, y
            while a < z:
                m = (a + z) // 2
                lm, om = over(m)
                if lm >= om:
                    z = m
                else:
                    a = m + 1
            if a < y:
                y2 = min((v for v in (a - 1, a) if v >= floor), key=lambda v: max(over(v)))
                if max(over(y2)) < last:
                    y = y2
                    last, other = over(y)
        worst = max(last, other, 0.0)  # (other: -inf for a document whole in one cell)
        kv = 0 if y == n else n - y
        feasible = worst <= 1e-9
        score = (0 if feasible else 1, kv if feasible else worst, kv)
        memo[y_min, y_max] = (score, y)
        return score, b, lo + y - n

    # -- 2. the rest ------------------------------------------------------------------------------
    def _assign(self, docs: list[int]) -> None:
        """Longest first, each to the column that most needs dense work (largest
        ``(target - load) / free tokens``), in its cell with the most room."""
        R = self.R
        # room[r][b]: free tokens of cell (b, r), less the slack (column-major: one list per column)
        room = [
            [max(0, self.fe[b][r] - self.fs[b][r] - self.used[b][r] - self.cap[r] // _SLACK) for b in range(R)]
            for r in range(self.c)
        ]
        colroom = [sum(x) for x in room]
        colmax = [max(x) for x in room]
        tg, colw, L, work, cell, used = self.tg, self.colw, self.L, self.work, self.cell, self.used
        colfree = self.colfree
        push, pop = heapq.heappush, heapq.heappop

        heap = [(-(tg[r] - colw[r]) / colroom[r], r) for r in range(self.c) if colroom[r] > 0]
        heapq.heapify(heap)
        parked: list[tuple[float, int]] = []  # (-largest cell room, column): too full for now
        for i in docs:  # lengths do not increase, so a parked column's turn comes back by size
            n = L[i]
            while parked and -parked[0][0] >= n:
                _, r = pop(parked)
                push(heap, (-(tg[r] - colw[r]) / colroom[r], r))
            while heap and colmax[heap[0][1]] < n:
                _, r = pop(heap)
                push(parked, (-colmax[r], r))
            if not heap:
                insort(self.left_over, (n, i))
                continue
            r = heap[0][1]  # popped below (replaced, when it goes back in)
            rr = room[r]
            b = rr.index(colmax[r]) if R > 1 else 0  # the cell with the most room, first row on ties
            cell[b][r].append(i)
            used[b][r] += n
            rr[b] -= n
            colroom[r] -= n
            colmax[r] = max(rr) if R > 1 else rr[0]
            colfree[r] -= n
            colw[r] += work[i]
            if colroom[r] > 0 and colmax[r] >= n:
                heapq.heapreplace(heap, (-(tg[r] - colw[r]) / colroom[r], r))
            else:
                pop(heap)
                if colroom[r] > 0:
                    push(parked, (-colmax[r], r))

    def _rebalance(self) -> None:
        """Swap documents between the heaviest and the lightest column while that lowers the
        heavier of the two; loads are projected with the gaps filled at the density of the
        documents still unplaced (what closes them). Each round takes the move (one document
        alone, or one for one with a neighbour in net work) whose net work is nearest half the
        gap; on ties the first in (row, cell order) of the heavy column, alone before a swap."""
        toks = sum(n for n, _ in self.left_over)
        rho = sum(self.work[i] for _, i in self.left_over) / toks if toks else 0.0
        room = np.array(
            [[self.fe[b][r] - self.fs[b][r] - self.used[b][r] for r in range(self.c)] for b in range(self.R)],
            dtype=np.int64,
        )
        proj = [w + rho * x for w, x in zip(self.colw, room.sum(axis=0).tolist())]
        L = np.asarray(self.L, dtype=np.int64)
        net = np.asarray(self.work, dtype=np.int64) - rho * L
        off = np.arange(-2, 2)
        rows = np.arange(self.R)
        cell, tg = self.cell, self.tg
        thr = 1e-3 * self.target
        for _ in range(8 * self.c):
            over = [p - t for p, t in zip(proj, tg)]
            top, bottom = max(over), min(over)
            h, lo = over.index(top), over.index(bottom)  # the first heaviest, the first lightest
            gap = top - bottom
            if gap <= thr:
                return
            want = gap / 2
            ch, cl = [x[h] for x in cell], [x[lo] for x in cell]
            mine = np.array([i for x in ch for i in x], dtype=np.int64)  # (row, cell order)
            if not mine.size:
                return
            mrow = np.repeat(rows, [len(x) for x in ch])
            nm, lm, room_lo = net[mine], L[mine], room[:, lo]
            b2 = int(room_lo.argmax())  # the lightest column's cell with the most room
            # candidates per document of the heavy column: [alone, 4 neighbours in net work]
            err = np.empty((mine.size, 5))
            ok = (nm > 0) & (nm < gap) & (room_lo[b2] >= lm)
            err[:, 0] = np.where(ok, np.abs(nm - want), np.inf)
            their = np.array([j for x in cl for j in x], dtype=np.int64)
            if their.size:
                trow = np.repeat(rows, [len(x) for x in cl])
                kt = net[their]
                srt = np.lexsort((their, kt))  # by net work, then document
                their, trow, keys = their[srt], trow[srt], kt[srt]
                j = np.searchsorted(keys, nm - want, side="left")[:, None] + off
                jc = np.minimum(np.maximum(j, 0), their.size - 1)
                moved = nm[:, None] - keys[jc]
                d = L[their][jc] - lm[:, None]
                ok = (j == jc) & (moved > 0) & (moved < gap)
                ok &= (d <= room[:, h][mrow][:, None]) & (-d <= room_lo[trow][jc])
                err[:, 1:] = np.where(ok, np.abs(moved - want), np.inf)
            else:
                err[:, 1:] = np.inf
            flat = int(np.argmin(err))
            if not err.flat[flat] < gap:
                return
            a, slot = divmod(flat, 5)
            i, bi = int(mine[a]), int(mrow[a])
            if slot == 0:
                self._move(i, (bi, h), (b2, lo), room)
                moved_w = float(net[i])
            else:
                jj = int(jc[a, slot - 1])
                k, bk = int(their[jj]), int(trow[jj])
                self._move(i, (bi, h), (bk, lo), room)
                self._move(k, (bk, lo), (bi, h), room)
                moved_w = float(net[i]) - float(net[k])
            proj[h] -= moved_w
            proj[lo] += moved_w

    def _move(self, i: int, src: tuple[int, int], dst: tuple[int, int], room: np.ndarray) -> None:
        """Document ``i`` from cell ``src`` to the end of cell ``dst`` (``(row, column)``), with
        the rooms, fills and column loads that follow it."""
        (bs, rs), (bd, rd) = src, dst
        self.cell[bs][rs].remove(i)
        self.cell[bd][rd].append(i)
        room[bs, rs] += self.L[i]
        room[bd, rd] -= self.L[i]
        self.used[bs][rs] -= self.L[i]
        self.used[bd][rd] += self.L[i]
        self.colw[rs] -= self.work[i]
        self.colw[rd] += self.work[i]

    # -- 3. close the cells ---------------------------------------------------------------------
    def _exact(self, space: int, own: list[int]) -> list[int] | None:
        """Documents summing to exactly ``space`` tokens: the cell's own (kept where possible)
        and unplaced ones (subset sum on a bitset). None if there is no such set."""
        pool = [(self.L[i], i) for i in own]
        pool += self.left_over[: bisect_right(self.left_over, (space, math.inf))][-2 * _SWAP :]
        if sum(n for n, _ in pool) < space:
            return None
        full = (1 << (space + 1)) - 1
        reach = [1]
        for n, _ in pool:
            reach.append((reach[-1] | (reach[-1] << n)) & full)
        if not reach[-1] >> space & 1:
            return None
        out, t = [], space
        for j in range(len(pool), 0, -1):  # late (unplaced) documents are skipped when possible
            if t and not reach[j - 1] >> t & 1:
                out.append(pool[j - 1][1])
                t -= pool[j - 1][0]
        return out

    def _best_fit(self, pool: list[tuple[int, int]], gap: int) -> list[int]:
        """Documents of ``pool`` (sorted), longest that fits first, while one fits ``gap``."""
        out = []
        while gap > 0:
            j = bisect_right(pool, (gap, math.inf)) - 1
            if j < 0:
                break
            n, i = pool.pop(j)
            out.append(i)
            gap -= n
        return out

    def _share_rows(self) -> None:
        """Give every row unplaced documents that bring it to exactly ``seq_len`` tokens where
        possible (its cells' gaps are then closed with them), trading its shortest documents
        for unplaced ones when no subset fits."""
        self.pool: list[list[tuple[int, int]]] = [[] for _ in range(self.R)]
        need = [sum(self.fe[b][r] - self.fs[b][r] - self.used[b][r] for r in range(self.c)) for b in range(self.R)]
        pending = sorted((b for b in range(self.R) if need[b] > 0), key=lambda x: (-need[x], x))
        for _ in range(3):  # a row that cannot close now may after others traded documents back
            later = []
            for b in pending:
                mine = sorted((self.L[i], i, r) for r in range(self.c) for i in self.cell[b][r])[:_SWAP]
                own = [i for _, i, _ in mine]
                exact = self._exact(need[b] + sum(n for n, _, _ in mine), own)
                if exact is None:
                    later.append(b)
                    continue
                chosen, mine_ids = set(exact), set(own)
                for n, i, r in mine:
                    if i not in chosen:
                        self.cell[b][r].remove(i)
                        self.used[b][r] -= n
                        insort(self.left_over, (n, i))
                for i in exact:
                    if i not in mine_ids:
                        self._take((self.L[i], i))
                        self.pool[b].append((self.L[i], i))
                need[b] = 0
            if not later or len(later) == len(pending) and _ > 0:
                pending = later
                break
            pending = later
        for b in pending:
            for i in self._best_fit(self.left_over, need[b]):
                self.pool[b].append((self.L[i], i))
        for p in self.pool:
            p.sort()

    def _close_row(self, b: int) -> tuple[list[int], list[int]]:
        pool = self.pool[b]
        order: list[int] = []
        lens: list[int] = []
        carry = 0
        for r in range(self.c):
            fs, fe = self.fs[b][r], self.fe[b][r]
            pin = self.pinned[b].get(fe) if fe < self.hi[r] else None
            if fe > fs:
                space = fe - fs - carry
                docs = sorted(self.cell[b][r], key=lambda i: (-self.L[i], i))
                used = sum(self.L[i] for i in docs)
                while used > space:  # the carried-in piece pushed some out: the shortest go
                    i = docs.pop()
                    used -= self.L[i]
                    insort(pool, (self.L[i], i))
                nxt = r + 1
                open_right = fe == self.hi[r] and nxt < self.c and self.fs[b][nxt] == self.lo[nxt] < self.fe[b][nxt]
                if used < space:
                    docs += self._exact_from(pool, space - used) or self._best_fit(pool, space - used)
                gap = space - sum(self.L[i] for i in docs)
                if gap > 0 and open_right and not pool:
                    # nothing left to close it with: borrow the next cell's shortest documents
                    later = self.cell[b][nxt]
                    later.sort(key=lambda i: (self.L[i], i))
                    while later and self.L[later[0]] <= gap:
                        i = later.pop(0)
                        docs.append(i)
                        gap -= self.L[i]
                    if gap > 0 and later:
                        i = later.pop(0)
                        insort(pool, (self.L[i], i))
                order += docs
                lens += [self.L[i] for i in docs]
                carry = 0
                if gap > 0 and open_right:
                    j = bisect_right(pool, (gap, math.inf))
                    if j < len(pool) and pool[j][0] - gap <= self.fe[b][nxt] - self.fs[b][nxt]:
                        n, i = pool.pop(j)
                        order.append(i)
                        lens.append(n)
                        carry, gap = n - gap, 0
                if gap > 0 and pin is not None and self._shift_left(b, r, fe, gap):
                    fe, gap = fe - gap, 0
                if pin is None and fe < self.hi[r]:  # padding reserved at the cell's end
                    gap += self.hi[r] - fe
                if gap > 0:
                    order.append(PAD)
                    lens.append(gap)
            else:
                for i in self.cell[b][r]:  # a cell with no room left (cannot happen; kept safe)
                    insort(pool, (self.L[i], i))
            if fe <= fs and pin is None and fe < self.hi[r]:
                order.append(PAD)
                lens.append(self.hi[r] - fe)
            if pin is not None:
                i = self.pinned[b][fe]
                order.append(i)
                lens.append(self.L[i])
        for item in pool:
            insort(self.left_over, item)
        pool.clear()
        return order, lens

    def _exact_from(self, pool: list[tuple[int, int]], gap: int) -> list[int] | None:
        """Documents of ``pool`` summing to exactly ``gap`` (removed from it), or None."""
        saved, self.left_over = self.left_over, pool
        try:
            got = self._exact(gap, [])
            if got is not None:
                for i in got:
                    self._take((self.L[i], i))
            return got
        finally:
            self.left_over = saved

    def _shift_left(self, b: int, r: int, s: int, d: int) -> bool:
        """Move the pinned document starting at ``s`` (in cell ``r``) ``d`` tokens left, if its
        last cell keeps a piece of it; that cell gets the ``d`` tokens of room instead."""
        i = self.pinned[b][s]
        e = s + self.L[i]
        k = min((e - 1) // self.cs, self.c - 1)
        while self.lo[k] >= e:
            k -= 1
        if e - d <= self.lo[k] or self.fs[b][k] != e:
            return False
        del self.pinned[b][s]
        self.pinned[b][s - d] = i
        self.fe[b][r] = s - d
        self.fs[b][k] = e - d
        return True

    def _take(self, item: tuple[int, int]) -> None:
        del self.left_over[bisect_left(self.left_over, item)]

    # -- all ----------------------------------------------------------------------------------------
    def run(self) -> tuple[list[list[int]], list[list[int]], list[int]]:
        live = self.docs.live
        is_heavy = self._heavy_all()
        heavy = sorted((i for i in live if is_heavy[i]), key=lambda i: (-self.work[i], i))
        self.tries = min(self.c, 6 if len(heavy) <= self.c else 2)  # end columns tried per heavy document
        rest = []
        for i in heavy:
            if not self._place_heavy(i):
                if self.bail and self.L[i] > 2 * self.cs:
                    # only a piece carried over one boundary can join a closed row later: a
                    # document longer than two shards that found no place is left out for sure
                    raise _LeftOut(i)
                rest.append(i)
        rest += [i for i in live if not is_heavy[i]]
        if self.slack:
            self._reserve_padding()
        rest.sort(key=lambda i: (-self.L[i], i))
        # the shortest documents are held back to close cells and rows exactly
        keep = min(len(rest) // 4, _RESERVE_PER_ROW * self.R)
        for i in rest[len(rest) - keep :]:
            insort(self.left_over, (self.L[i], i))
        self._assign(rest[: len(rest) - keep])
        self._rebalance()
        self._share_rows()
        rows, lens = [], []
        for b in range(self.R):
            o, ln = self._close_row(b)
            rows.append(o)
            lens.append(ln)
        return rows, lens, [i for _, i in self.left_over]


def _column_loads(lens: list[list[int]], seq_len: int, c: int, causal: bool, left: int, right: int) -> list[int]:
    """Owner-first work of every rank (what the planner starts from) for rows of segments: the
    cumulative work of each row at every shard boundary, differenced."""
    flat = np.fromiter((n for row in lens for n in row), dtype=np.int64)
    if not flat.size:
        return [0] * c
    row_of = np.repeat(np.arange(len(lens), dtype=np.int64), [len(row) for row in lens])
    ends = np.cumsum(flat)
    starts = ends - flat
    row_start = np.concatenate([[0], np.cumsum([sum(row) for row in lens])[:-1]])
    shift = row_of * seq_len - row_start[row_of]
    starts, ends = starts + shift, ends + shift  # positions on one axis: row b from b * seq_len
    before = np.concatenate([[0], np.cumsum(_prefix_pairs_np(flat, flat, causal, left, right))])
    hi = np.minimum(np.arange(1, c + 1, dtype=np.int64) * (-(-seq_len // c)), seq_len)  # owner_ranges' ends
    at = (np.arange(len(lens), dtype=np.int64)[:, None] * seq_len + hi[None, :]).ravel()
    at = np.concatenate([[0], at])  # ... and the start of row 0 (every other start is an end)
    k = np.searchsorted(ends, at, side="right")
    kk = np.minimum(k, flat.size - 1)
    inside = _prefix_pairs_np(at - starts[kk], flat[kk], causal, left, right)
    cum = before[k] + np.where(k < flat.size, inside, 0)
    per_cell = np.diff(cum).reshape(len(lens), c)
    return per_cell.sum(axis=0).tolist()


def _trade_cells(
    rows: list[list[int]], lens: list[list[int]], loads: list[int], docs: _Docs, seq_len: int, c: int
) -> tuple[list[list[int]], list[list[int]], list[int]] | None:
    """Rows whose heaviest column is brought within the planner's tolerance by trades between
    cells: a whole document of the heaviest column for documents of the same total length and
    less work from one cell of a column with room (the least-work such set: subset sum), the
    trade that leaves the larger of the two columns lowest first. Every cell keeps its length
    and every straddling document its place, so ranks need the same keys. At most ``_TRADES``
    trades, and none begun once the least-work tables have cost ``_TRADE_WORK`` entries (a
    deterministic bound). Returns the rows, lengths and loads, or None where some column stays
    above the tolerance."""
    cs = -(-seq_len // c)
    load = np.asarray(loads, dtype=np.int64)
    mean = float(load.sum()) / c
    goal, cap = mean * (1 + _TRADE_GOAL), mean * (1 + _PLANNER_TOLERANCE)
    work = docs.work
    cells: dict[tuple[int, int], dict[int, int]] = {}  # (row, column) -> its whole documents' lengths
    for b, (row, ln) in enumerate(zip(rows, lens)):
        at = 0
        for i, n in zip(row, ln):
            if i != PAD and at // cs == (at + n - 1) // cs:
                cells.setdefault((b, at // cs), {})[i] = n
            at += n
    # the longest document a trade gives: of the columns above the goal, at most _TRADE_LONGEST
    X = min(max((n for (_, r), d in cells.items() if load[r] > goal for n in d.values()), default=0), _TRADE_LONGEST)
    if X < 2:
        return None if load.max() > cap else (rows, lens, load.tolist())
    keys = list(cells)
    col = np.asarray([r for _, r in keys], dtype=np.int64)
    big = np.int64(1) << 60
    least = np.full((len(keys), X + 1), big, dtype=np.int64)  # per cell: least work of t tokens

    def fill(k: int) -> int:
        """Cell ``k``'s table; returns the entries computed (its documents up to X, times X + 1)."""
        t = least[k]
        t[:] = big
        t[0] = 0
        done = 0
        for i, n in cells[keys[k]].items():
            if n <= X:
                t[n:] = np.minimum(t[n:], t[: X + 1 - n] + work[i])
                done += 1
        return done * (X + 1)

    spent = sum(fill(k) for k in range(len(keys)))
    # trades made: (row of x, row of the set, x, its length, the set as (document, length))
    done: list[tuple[int, int, int, int, list[tuple[int, int]]]] = []
    for _ in range(_TRADES):
        h = int(load.argmax())
        if load[h] <= goal or spent > _TRADE_WORK:
            break
        xs = [(i, n, k) for k, key in enumerate(keys) if key[1] == h for i, n in cells[key].items() if 1 < n <= X]
        if not xs:
            break
        xn = np.fromiter((n for _, n, _ in xs), dtype=np.int64, count=len(xs))
        xw = np.fromiter((work[i] for i, _, _ in xs), dtype=np.int64, count=len(xs))
        gain = xw[None, :] - least[:, xn]  # [cells, documents of h]
        gain[col == h] = 0
        if load[h] - np.maximum(gain.max(axis=0), 0).sum() > cap:
            break  # every document of h traded at its best would not bring it under: give up
        after = np.maximum(load[h] - gain, load[col][:, None] + gain)
        after[(gain <= 0) | (load[col] >= goal)[:, None]] = big
        j = int(np.argmin(after))
        if not after.flat[j] < load[h]:
            break
        ko, kx = divmod(j, len(xs))
        x, nx, kh = xs[kx]
        (b, _), (b2, r2) = keys[kh], keys[ko]
        take = _least_set(cells[keys[ko]], nx, work)
        g = int(gain[ko, kx])
        load[h] -= g
        load[r2] += g
        done.append((b, b2, x, nx, [(i, cells[keys[ko]][i]) for i in take]))
        for i in take:
            cells[keys[kh]][i] = cells[keys[ko]].pop(i)
        cells[keys[ko]][x] = cells[keys[kh]].pop(x)
        spent += fill(kh) + fill(ko)
    if load.max() > cap:
        return None
    rows, lens = [list(r) for r in rows], [list(x) for x in lens]
    for b, b2, x, nx, got in done:  # the rows, trade by trade (only where they are kept)
        # x's place takes the set, the set's first document's place takes x
        into = {x: got}
        into.update({i: [] for i, _ in got})
        into[next(i for i in rows[b2] if i in into and i != x)] = [(x, nx)]
        for bb in {b, b2}:
            row, ln = [], []
            for i, n in zip(rows[bb], lens[bb]):
                for m, q in into.get(i, [(i, n)]) if i != PAD else [(i, n)]:
                    row.append(m)
                    ln.append(q)
            rows[bb], lens[bb] = row, ln
    return rows, lens, load.tolist()


def _least_set(cell: dict[int, int], total: int, work: list[int]) -> list[int]:
    """The documents of ``cell`` (doc -> length) summing to ``total`` tokens with the least work
    (one exists), by subset sum traced back."""
    items = [(i, n) for i, n in cell.items() if n <= total]
    big = np.int64(1) << 60
    tables = [np.full(total + 1, big, dtype=np.int64)]
    tables[0][0] = 0
    for i, n in items:
        t = tables[-1].copy()
        t[n:] = np.minimum(t[n:], tables[-1][: total + 1 - n] + work[i])
        tables.append(t)
    out, t = [], total
    for k in range(len(items), 0, -1):
        if tables[k][t] != tables[k - 1][t]:
            out.append(items[k - 1][0])
            t -= items[k - 1][1]
    return out


def _exact_applies(c: int, R: int, causal: bool, left: int, docs: int, tokens: int, seq_len: int) -> bool:
    """Whether :func:`_two_shards` takes the batch: one row over 2 ranks, causal without a
    window, 1 to ``_EXACT_DOCS`` documents."""
    return c == 2 and R == 1 and causal and left < 0 and 0 < docs <= _EXACT_DOCS and tokens <= seq_len


def _two_shards(docs: _Docs, seq_len: int):
    """One row of few documents over 2 ranks, causal, no window: every split tried at once.
    Rank 0 holds a subset of the documents and possibly the head of one more (``p`` tokens: the
    keys rank 1 receives), padding fills the rest. Returns the ``(order, lengths)`` of the
    balanced split (owner-first imbalance at most ``_EXACT_IMBALANCE``) with the fewest keys
    received, then the best balance; None if no split is balanced."""
    live = docs.live
    half, P = -(-seq_len // 2), seq_len - docs.tokens
    # per subset of the documents (bit j: live[j]): tokens, pairs, longest document in it
    toks, work, longest = (np.zeros(1, dtype=np.int64) for _ in range(3))
    for i in live:
        n, w = docs.L[i], docs.work[i]
        toks, work = np.concatenate([toks, toks + n]), np.concatenate([work, work + w])
        longest = np.concatenate([longest, np.maximum(longest, n)])
    outside = longest[::-1]  # longest document NOT in the subset (the complement's index)

    def pad_work(x: np.ndarray) -> np.ndarray:  # padding in pieces of _PAD_PIECE (as _finish cuts it)
        q, r = np.divmod(x, _PAD_PIECE)
        return q * (_PAD_PIECE * (_PAD_PIECE + 1) // 2) + r * (r + 1) // 2

    # option 0: rank 0 = the subset and padding; option 1: ... and the head (p tokens, the least
    # the padding allows) of a longer document outside it, which straddles
    total_work = int(work[-1])
    cand = np.flatnonzero((toks <= half) & (half - toks - P < np.maximum(outside, 1)))  # either may hold
    toks, work, outside = toks[cand], work[cand], outside[cand]
    p = np.stack([np.zeros_like(toks), np.maximum(1, half - toks - P)])
    ok = np.stack([half - toks <= P, (p[1] < outside) & (toks + p[1] <= half)])
    pad0 = np.where(ok, half - toks - p, 0)
    w0 = work + p * (p + 1) // 2 + pad_work(pad0)  # the head's pairs: causal, no window
    total = total_work + pad_work(pad0) + pad_work(P - pad0)
    imb = np.maximum(w0, total - w0) / (total / 2)
    ok &= imb <= _EXACT_IMBALANCE
    if not ok.any():
        return None
    kv = np.where(ok, p, np.iinfo(np.int64).max)
    opt, k = divmod(int(np.argmin(np.where(kv == kv.min(), imb, np.inf))), toks.size)  # first best
    a = int(cand[k])
    inside = [i for j, i in enumerate(live) if a >> j & 1]
    rest = [i for j, i in enumerate(live) if not a >> j & 1]
    order = inside + ([PAD] if pad0[opt, k] else [])
    lens = [docs.L[i] for i in inside] + ([int(pad0[opt, k])] if pad0[opt, k] else [])
    if opt:  # the straddling document: the longest outside the subset (the first such)
        d = max(rest, key=lambda i: (docs.L[i], -i))
        rest.remove(d)
        order, lens = order + [d], lens + [docs.L[d]]
    return order + rest, lens + [docs.L[i] for i in rest]


def _best_pass(
    lengths: list[int],
    seq_len: int,
    c: int,
    causal: bool,
    left: int,
    right: int,
    R: int,
    bail: bool = False,
    *,
    one_remedy: bool = False,
):
    """The better of up to ``_PASSES`` packings (fewest documents left out, then balance), and
    its owner-first column loads. Where the first leaves documents out or moves queries (and
    is within ``_CLAIM_BELOW`` of balance), one packing with claimed light tokens
    (:meth:`_Packer._claim`) is tried too, and kept where it leaves fewer documents out, or as
    many and is no worse in balance and either moves no query or needs no more keys on any
    rank; kept at once if it moves no query. Its heavy documents are evened (``even``, see
    :meth:`_Packer._best_end`) where the first left documents out; where it improved on the
    first but still moves queries, one more claimed packing with them evened is tried and kept
    on the same terms. A result that still moves queries gets :func:`_trade_cells`, kept
    where they bring it within the planner's tolerance. With ``bail`` (the caller has no use for a packing
    that leaves documents out), a pass sure to leave one out stops there: that one is returned
    as the only one left out, with no rows. With ``one_remedy`` (:func:`pack_order`'s batch),
    the shifted pass is not tried after a claimed one: at most three packings (first, claimed,
    evened) before trades. On 600 draws (5 distributions, 8 x 128k and 1 x 1M, CP 4-64, seeds
    0-9) and the bench grid, a shifted pass after a claimed one on the batch never brought it
    within the planner's tolerance with nothing left out (13 tries; one draw's rows changed, 1.0486
    -> 1.0499, fewer queries moved), and it cost a whole pass (lognormal-512, 8 x 128k, CP 32,
    seed 9: 64 -> 45 ms, the same rows). Rows packed alone after a batch left documents out
    and streaming batches keep it: there it did help (1 of 10 single rows; 7 of bench_packing's
    16 streaming settings change without it, some for the worse)."""
    docs = _Docs(lengths, causal, left, right)
    if _exact_applies(c, R, causal, left, len(docs.live), docs.tokens, seq_len):
        got = _two_shards(docs, seq_len)
        if got is not None:
            done = _finish([list(got[0])], [list(got[1])], seq_len, c).lengths
            return [got[0]], [got[1]], [], _column_loads(done, seq_len, c, causal, left, right)
    args = (docs, lengths, seq_len, c, causal, left, right, R, bail)
    try:
        best = first = _pass(*args, None, False)
    except _LeftOut as e:
        return [], [], [e.doc], None
    claimed = None
    tried_claim = (first[0][0] or first[0][1] > 1 + _PLANNER_TOLERANCE) and first[0][1] <= 1 + _CLAIM_BELOW
    if tried_claim:
        # where the first left documents out, room is contested: heavy pieces are evened at once
        even = _even_keys(R, seq_len, c)
        try:
            claimed = _pass(*args, None, True, even if first[0][0] else None)
        except _LeftOut:
            claimed = None
        if claimed is not None and not first[0][0] and (0, 1 + _PLANNER_TOLERANCE) < claimed[0] < first[0]:
            # better than the first but still moving queries: again with heavy documents evened
            try:
                evened = _pass(*args, None, True, even)
            except _LeftOut:
                evened = None
            if evened is not None and _better_claimed(evened, claimed, seq_len, c, causal, left, right):
                claimed = evened
        if claimed is not None and _better_claimed(claimed, first, seq_len, c, causal, left, right):
            if claimed[0] <= (0, 1 + _PLANNER_TOLERANCE):
                return (*claimed[1], claimed[2])
        else:
            claimed = None
    shift = None
    for _ in range(0 if one_remedy and tried_claim else _PASSES - 1):
        score, loads = best[0], best[2]
        if not 1 + _TOLERANCE < score[1] <= 1 + _RETRY_BELOW:
            break  # balanced, or a document alone outweighs a column: another pass cannot help
        # the next pass aims each column lower by what the last one ended above the mean
        mean = sum(loads) / c
        shift = [(shift[r] if shift else 0.0) + (loads[r] - mean) for r in range(c)]
        try:
            got = _pass(*args, shift, False)
        except _LeftOut:
            break
        if got[0] < best[0]:
            best = got
        else:
            break
    if claimed is not None and _better_claimed(claimed, best, seq_len, c, causal, left, right):
        best = claimed
    if not best[0][0] and 1 + _PLANNER_TOLERANCE < best[0][1] <= 1 + _CLAIM_BELOW:
        traded = _trade_cells(best[1][0], best[1][1], best[2], docs, seq_len, c)
        if traded is not None:  # no query moves now
            return traded[0], traded[1], best[1][2], traded[2]
    return (*best[1], best[2])


def _pass(
    docs: _Docs,
    lengths: list[int],
    seq_len: int,
    c: int,
    causal: bool,
    left: int,
    right: int,
    R: int,
    bail: bool,
    shift: Sequence[float] | None,
    claim: bool,
    even: int | None = None,
):
    """One packing: ``(score, packing, loads, padded lengths)``, the score ``(documents left
    out, owner-first imbalance)``. Raises :class:`_LeftOut` where ``bail`` stops it."""
    got = _Packer(lengths, seq_len, c, causal, left, right, R, shift, docs, claim, bail, even).run()
    done = _finish([list(r) for r in got[0]], [list(x) for x in got[1]], seq_len, c).lengths
    loads = _column_loads(done, seq_len, c, causal, left, right)
    mean = sum(loads) / c
    score = (len(got[2]), max(loads) / mean if mean else 1.0)
    if _DEBUG:
        print("pass", claim, even, score)
    return score, got, loads, done


def _even_keys(R: int, seq_len: int, c: int) -> int:
    """Keys a heavy document's last rank may receive from it where that evens its pieces'
    columns (:meth:`_Packer._best_end`): ``_EVEN_KEYS`` of all-gather's per rank."""
    return int(_EVEN_KEYS * R * (seq_len - -(-seq_len // c)))


def _better_claimed(new, old, seq_len: int, c: int, causal: bool, left: int, right: int) -> bool:
    """Whether the packing with claimed light tokens replaces ``old`` (see :func:`_best_pass`)."""
    (spill, imb), (spill0, imb0) = new[0], old[0]
    if spill != spill0:
        return spill < spill0
    if imb > imb0:
        return False
    if imb <= 1 + _PLANNER_TOLERANCE:
        return True  # no query moves now (some did)
    keys = _straddle_keys(new[3], seq_len, c, causal, left, right)
    return keys <= _straddle_keys(old[3], seq_len, c, causal, left, right)


def _straddle_keys(lens: list[list[int]], seq_len: int, c: int, causal: bool, left: int, right: int) -> int:
    """Most keys a rank needs from other ranks' shards when no query moves (summed over rows):
    per shard, the part of a document crossing its start that lies before it (and, without
    ``causal``, the part of one crossing its end that lies after it), within the window."""
    step = -(-seq_len // c)
    need = np.zeros(c, dtype=np.int64)
    for row in lens:
        ends = np.cumsum(np.asarray(row, dtype=np.int64))
        starts = ends - np.asarray(row, dtype=np.int64)
        lo = np.minimum(np.arange(c, dtype=np.int64) * step, seq_len)
        hi = np.minimum(lo + step, seq_len)
        k = np.searchsorted(ends, lo, side="right")  # the segment holding position lo (if any)
        k = np.minimum(k, len(row) - 1)
        before = np.where((starts[k] < lo) & (lo < ends[k]), lo - starts[k], 0)
        need += before if left < 0 else np.minimum(before, left)
        if not causal:
            k = np.minimum(np.searchsorted(ends, hi - 1, side="right"), len(row) - 1)
            after = np.where((starts[k] < hi) & (hi < ends[k]), ends[k] - hi, 0)
            need += after if right < 0 else np.minimum(after, right)
    return int(need.max())


def _cp_order(lengths: list[int], seq_len: int, c: int, causal: bool, left: int, right: int, n_rows: int | None):
    total = sum(lengths)
    R = n_rows if n_rows is not None else max(1, -(-total // seq_len))
    live = [n for n in lengths if n]
    few = total > len(live) * max(e - a for a, e in owner_ranges(seq_len, c)) // _MIN_PER_SHARD
    if n_rows is None and live and few and not _exact_applies(c, R, causal, left, len(live), total, seq_len):
        # fewer than _MIN_PER_SHARD documents per shard on average: most must straddle, and
        # placing them one by one costs more than it gains; first-fit rows (the planner balances)
        fit = _first_fit(lengths, seq_len)
        return fit, [[lengths[i] for i in r] for r in fit], []
    rows, lens, spill, loads = _best_pass(
        lengths, seq_len, c, causal, left, right, R, n_rows is None, one_remedy=n_rows is None
    )
    fit = _first_fit(lengths, seq_len) if n_rows is None else []

    if spill and n_rows is None:
        # some documents fit no cell: rather than rows of their own, take first-fit's rows and
        # order each row's documents alone (a row that still cannot close keeps first-fit order)
        rows, lens, loads = [], [], None
        for row in fit:
            sub = [lengths[i] for i in row]
            if R > 1:  # (one row of all the documents: its pass is the one that just left some out)
                one, one_lens, left_out, _ = _best_pass(sub, seq_len, c, causal, left, right, 1, True)
                if not left_out:
                    rows.append([row[j] if j != PAD else PAD for j in one[0]])
                    lens.append(one_lens[0])
                    continue
            rows.append(list(row))
            lens.append(sub)
        spill = []
    if n_rows is None:
        # never worse than first-fit on the heaviest rank (a safety net for inputs the greedy
        # assignment handles badly; measured: long+short documents in several rows)
        fit_lens = [[lengths[i] for i in r] for r in fit]
        if len(fit) <= len(rows):
            if loads is None:
                done = _finish([list(r) for r in rows], [list(x) for x in lens], seq_len, c).lengths
                loads = _column_loads(done, seq_len, c, causal, left, right)
            mine = max(loads)
            theirs = max(
                _column_loads(
                    _finish([list(r) for r in fit], [list(x) for x in fit_lens], seq_len).lengths,
                    seq_len,
                    c,
                    causal,
                    left,
                    right,
                )
            )
            if theirs < mine:
                return fit, fit_lens, []
    return rows, lens, spill


def _finish(rows: list[list[int]], lens: list[list[int]], seq_len: int, cp_size: int | None = None) -> PackOrder:
    """Pad every row to ``seq_len``. For context parallelism, padding is cut at shard boundaries
    and into segments of at most ``_PAD_PIECE`` tokens: as one document it would cost its
    length squared over 2 pairs of wasted work, all on the last rank."""
    padded = 0
    cs = -(-seq_len // cp_size) if cp_size else seq_len
    for b, (order, ln) in enumerate(zip(rows, lens)):
        rest = seq_len - sum(ln)
        if rest > 0:
            order.append(PAD)
            ln.append(rest)
        if PAD not in order:
            continue
        padded += sum(n for i, n in zip(order, ln) if i == PAD)
        if cp_size:
            new_o, new_l, at = [], [], 0
            for i, n in zip(order, ln):
                if i != PAD:
                    new_o.append(i)
                    new_l.append(n)
                else:  # pieces of _PAD_PIECE from each shard boundary, the last one shorter
                    end = at + n
                    while at < end:
                        stop = min(end, (at // cs + 1) * cs)
                        q, rem = divmod(stop - at, _PAD_PIECE)
                        new_o += [PAD] * (q + (1 if rem else 0))
                        new_l += [_PAD_PIECE] * q + ([rem] if rem else [])
                        at = stop
                    continue
                at += n
            rows[b], lens[b] = new_o, new_l
    return PackOrder(rows, lens, padded)


def pack_order(
    lengths: Sequence[int],
    seq_len: int,
    *,
    cp_size: int | None = None,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
) -> PackOrder:
    """Rows of ``seq_len`` tokens as orders of the documents of ``lengths`` (each at most
    ``seq_len``), for loaders that pack themselves.

    Without ``cp_size``: first-fit in the given order. With ``cp_size``: every document once,
    rows and order chosen so that the ``torch.chunk`` shards of ``cp_size`` ranks carry equal
    attention work (counted for ``causal``/``window_size`` as the planner counts it, summed over
    the rows: the rows are meant to be planned together, as one batch) and shard boundaries fall
    between documents where the lengths allow. Deterministic: depends on the lengths only.
    """
    seq_len = check_length("seq_len", seq_len)
    c = _check_cp(cp_size)
    left, right = check_window(causal, window_size)
    ls = _check_lengths(lengths, seq_len)
    if c is None or c == 1:
        rows = _first_fit(ls, seq_len)
        return _finish(rows, [[ls[i] for i in row] for row in rows], seq_len)
    rows, lens, _ = _cp_order(ls, seq_len, c, causal, left, right, None)
    return _finish(rows, lens, seq_len, c)


def _split(documents: Sequence[torch.Tensor], seq_len: int, split_long: bool) -> tuple[list[torch.Tensor], list[int]]:
    """Documents as pieces of at most ``seq_len`` tokens, and each piece's document index."""
    pieces, owner = [], []
    for i, d in enumerate(documents):
        if not isinstance(d, torch.Tensor) or d.dim() < 1:
            raise TypeError(f"documents[{i}] must be a tensor with a token dim first, got {type(d).__name__}")
        if d.shape[0] > seq_len and not split_long:
            raise ValueError(f"documents[{i}] has {d.shape[0]} tokens, more than seq_len={seq_len}")
        for p in d.split(seq_len) if d.shape[0] > 0 else []:
            pieces.append(p)
            owner.append(i)
    return pieces, owner


def _materialise(
    pieces: list[torch.Tensor], owner: list[int], order: PackOrder, seq_len: int, max_docs: int | None, pad_value
) -> Packed:
    from .layout import cu_seqlens_from_lengths

    tail = pieces[0].shape[1:]
    B = len(order.rows)
    out = torch.full((B, seq_len, *tail), pad_value, dtype=pieces[0].dtype)
    index = torch.full((B, seq_len), PAD, dtype=torch.int64)
    for b, (row, ln) in enumerate(zip(order.rows, order.lengths)):
        parts, at = [], 0
        for j, n in zip(row, ln):
            if j != PAD:
                parts.append(pieces[j])
                index[b, at : at + n] = owner[j]
            else:
                parts.append(out[b, at : at + n])
            at += n
        if parts:
            out[b] = torch.cat(parts, 0)
    cu = cu_seqlens_from_lengths(order.lengths, seq_len, max_docs=max_docs)
    return Packed(out, cu, index, order.padded_fraction)


def pack_documents(
    documents: Sequence[torch.Tensor],
    seq_len: int,
    *,
    cp_size: int | None = None,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    max_docs: int | None = None,
    pad_value: float | int = 0,
    split_long: bool = True,
) -> Packed:
    """Pack variable-length documents ``[L_i, ...]`` into rows ``[B, seq_len, ...]``.

    A document longer than ``seq_len`` is cut into pieces of at most ``seq_len`` tokens, each its
    own document (``split_long=False`` raises instead). Without ``cp_size``: first-fit in the
    given order, the unfilled tail of a row is padding. With ``cp_size``: the order of
    :func:`pack_order` (balanced ``torch.chunk`` shards for that many ranks, under the mask of
    ``causal``/``window_size``; the rows are one batch). Padding is ``pad_value`` and every
    padding segment is its own document. Returns :class:`Packed`
    ``(rows, cu_seqlens, doc_index, padded_fraction)``.
    """
    if not documents:
        raise ValueError("documents is empty")
    seq_len = check_length("seq_len", seq_len)
    pieces, owner = _split(documents, seq_len, split_long)
    if not pieces:
        raise ValueError("documents holds no tokens")
    order = pack_order([p.shape[0] for p in pieces], seq_len, cp_size=cp_size, causal=causal, window_size=window_size)
    return _materialise(pieces, owner, order, seq_len, max_docs, pad_value)


def pack_stream(
    documents: Iterable[torch.Tensor],
    seq_len: int,
    *,
    cp_size: int,
    rows: int = 1,
    lookahead: int = 4,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    max_docs: int | None = None,
    pad_value: float | int = 0,
) -> Iterator[Packed]:
    """Streaming :func:`pack_documents`: documents in, batches of ``rows`` packed rows out.

    Holds the next ``lookahead`` batches' worth of tokens (``lookahead * rows * seq_len``) and
    packs each batch from them: the oldest held documents worth half a batch always go in, the
    rest is a cross-section of everything held (every length class in proportion), which the
    CP-aware packer places; what it leaves stays for the next batch. A document passed over
    ``2 * lookahead`` times is placed by force (that batch is first-fit, oldest first, if the
    packer left it out), so a document is out within about ``4 * lookahead`` batches of being
    read (tests/test_packing.py checks ``4 * lookahead + 2``; docs/packing.md has the measured
    waits and what look-ahead buys). Documents longer
    than ``seq_len`` are split as in :func:`pack_documents`; ``doc_index`` counts documents
    from the start of the stream.
    """
    seq_len = check_length("seq_len", seq_len)
    c = check_count("cp_size", cp_size)
    rows = check_count("rows", rows)
    lookahead = check_count("lookahead", lookahead)
    left, right = check_window(causal, window_size)
    budget = lookahead * rows * seq_len
    held: list[tuple[torch.Tensor, int, int]] = []  # (piece, document index, batches passed over)
    tokens, index, done = 0, 0, False
    it = iter(documents)
    while True:
        while not done and tokens < budget:
            try:
                d = next(it)
            except StopIteration:
                done = True
                break
            pieces, _ = _split([d], seq_len, True)
            held += [(p, index, 0) for p in pieces]
            tokens += sum(p.shape[0] for p in pieces)
            index += 1
        if not held:
            return
        lens = [p.shape[0] for p, _, _ in held]
        overdue = {j for j, h in enumerate(held) if h[2] >= 2 * lookahead}
        placed = _stream_batch(lens, seq_len, c, causal, left, right, rows, overdue)
        order = _finish(placed[0], placed[1], seq_len, c if c > 1 else None)
        yield _materialise([p for p, _, _ in held], [i for _, i, _ in held], order, seq_len, max_docs, pad_value)
        taken = {j for r in order.rows for j in r if j != PAD}
        held = [(p, i, w + 1) for j, (p, i, w) in enumerate(held) if j not in taken]
        tokens = sum(p.shape[0] for p, _, _ in held)


def _stream_batch(
    lens: list[int], seq_len: int, c: int, causal: bool, left: int, right: int, rows: int, overdue: set[int]
) -> tuple[list[list[int]], list[list[int]]]:
    """One batch of ``rows`` rows from held documents (indices into ``lens``, arrival order);
    the ``overdue`` ones (all among the oldest) must be placed."""
    cap = rows * seq_len
    pick: list[int] = []
    total = 0
    for i, n in enumerate(lens):  # the oldest half batch (at least one document) always goes in
        if pick and total + n > cap // 2:
            break
        pick.append(i)
        total += n
    chosen = set(pick)
    rest = sorted((i for i in range(len(lens)) if i not in chosen), key=lambda i: (-lens[i], i))
    want = cap + cap // 32 - total  # a little more than fits: the packer needs choice to fill exactly
    share = want / max(1, sum(lens[i] for i in rest))
    acc = 0.0
    for i in rest:  # systematic sample by tokens: every length class in proportion
        acc += lens[i] * min(1.0, share)
        if acc >= lens[i] / 2:
            pick.append(i)
            acc -= lens[i]
    sub = [lens[i] for i in pick]
    if c == 1:
        fit = _first_fit(sub, seq_len)[:rows]
        got = [[pick[j] for j in r] for r in fit]
        return got, [[lens[i] for i in r] for r in got]
    rws, lns, _ = _cp_order(sub, seq_len, c, causal, left, right, rows)
    placed = {pick[j] for r in rws for j in r if j != PAD}
    if not overdue <= placed:
        # an overdue document did not fit: first-fit, oldest first (keeps every wait bounded)
        fit = _first_fit(sub, seq_len)[:rows]
        rws, lns = fit, [[sub[j] for j in r] for r in fit]
    return [[pick[j] if j != PAD else PAD for j in r] for r in rws], lns
