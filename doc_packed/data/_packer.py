"""One packing pass: documents placed into ``rows`` rows of ``c`` cells each (:class:`Packer`).

A *cell* is one row's shard (rank ``r`` owns the ``r``-th ``torch.chunk`` of every row), a
*column* all cells of one rank; the target is ``total pairs / c`` per column
(:mod:`doc_packed.data._work` counts them). A pass runs three steps:

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

Two options change step 1 (:mod:`doc_packed.data._search` says when they are used): with
``claim``, every column a heavy document's piece leaves room only for light documents *claims*
the lightest tokens it needs, so no two columns are promised the same light documents
(:meth:`Packer._claim`); with ``even``, a heavy document's last piece may be shortened to even
the columns of its pieces (:meth:`Packer._best_end`).
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left, bisect_right, insort
from collections.abc import Sequence

import numpy as np

from .._mask import prefix_pairs
from ..cp.plan import chunk_len, owner_ranges
from ._rows import PAD
from ._work import Docs

__all__ = ["LeftOut", "Packer"]

_SWAP = 48  # shortest documents of a row that may be traded to fill it exactly
_SLACK = 100  # 1/100 of every cell is left free while assigning: room for swaps, closed by the reserve
_RESERVE_PER_ROW = 12  # shortest documents held back per row to close cells exactly


class LeftOut(Exception):
    """A packing pass with ``bail`` stops: this document will be left out whatever follows."""

    def __init__(self, doc: int):
        super().__init__(doc)
        self.doc = doc


class Packer:
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
        docs: Docs | None = None,
        claim: bool = False,
        bail: bool = False,
        even: int | None = None,
    ):
        docs = docs or Docs(lengths, causal, left, right)
        self.docs = docs
        self.L, self.S, self.c, self.R = lengths, seq_len, c, n_rows
        self.mask = (causal, left, right)
        ranges = owner_ranges(seq_len, c)  # torch.chunk's shards
        self.lo = [a for a, _ in ranges]
        self.hi = [e for _, e in ranges]
        self.cap = [e - a for a, e in ranges]
        self.cs = chunk_len(seq_len, c)
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
        self.bail = bail  # stop at the first document sure to be left out (LeftOut)
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
        bounds = self._last_piece_bounds(b, k, n)
        if bounds is None:
            return None
        got = memo.get(bounds)
        if got is None:
            got = memo[bounds] = self._score_end(k, n, *bounds, memo)
        score, y = got
        return score, b, self.lo[k] + y - n

    def _last_piece_bounds(self, b: int, k: int, n: int) -> tuple[int, int] | None:
        """Shortest and longest last piece in cell (b, k) of a document of ``n`` tokens ending
        there, or None: the cell's documents must still fit after it, and the document may
        reach back only over cells that are free and empty."""
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
        return None if y_min > y_max else (y_min, y_max)

    def _score_end(self, k: int, n: int, y_min: int, y_max: int, memo: dict) -> tuple[tuple, int]:
        """``(score, last piece length)`` of a document of ``n`` tokens ending in column ``k``
        with a last piece of ``y_min`` to ``y_max`` tokens. The score, lowest best: fits (no
        column over its target) before not, then the fewest keys received (fits) or the least
        overflow (does not), then the fewest keys."""
        y = self._longest_fitting(k, n, y_min, y_max, memo)
        last, other = self._columns_over(k, n, y)
        if self.even is not None and y < n and last > other:
            y, last, other = self._evened(k, n, y, max(y_min, y - self.even), last, other)
        worst = max(last, other, 0.0)  # (other: -inf for a document whole in one cell)
        kv = 0 if y == n else n - y
        feasible = worst <= 1e-9
        return (0 if feasible else 1, kv if feasible else worst, kv), y

    def _columns_over(self, k: int, n: int, y: int) -> tuple[float, float]:
        """(last piece's column over its target, worst other column over its target) for a
        document of ``n`` tokens whose last piece is ``y`` tokens of column ``k``, each column
        counted with the least work that fills the rest of its free tokens."""
        causal, left, right = self.mask
        s = self.lo[k] + y - n
        last, other = 0.0, -math.inf
        colw, colfree, tg, lo_, hi_, fill = self.colw, self.colfree, self.tg, self.lo, self.hi, self._fill
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

    def _longest_fitting(self, k: int, n: int, y_min: int, y_max: int, memo: dict) -> int:
        """The longest last piece (``y_min`` to ``y_max`` tokens) of a document of ``n`` tokens
        that keeps column ``k`` at its target (by bisection: monotone for causal masks);
        ``y_min`` if none does. ``memo`` keeps the column's overflow per length."""
        causal, left, right = self.mask
        cw, cf, t, fill = self.colw[k], self.colfree[k], max(self.tg[k], 1.0), self._fill
        whole = prefix_pairs(n, n, causal, left, right)
        plain = causal and left < 0  # prefix_pairs(m, n) = m (m + 1) / 2

        def last_over(y: int) -> float:
            v = memo.get(y)
            if v is None:
                m = n - y
                piece = whole - (m * (m + 1) // 2 if plain else prefix_pairs(m, n, causal, left, right))
                v = memo[y] = (cw + piece + fill(cf - y)) / t - 1  # piece: self._piece(n, n - y, n)
            return v

        a, z = y_min, y_max
        if last_over(a) > 0:
            return a  # even the smallest last piece overflows
        if causal and left < 0 and last_over(z) <= 0:
            return z  # the largest fits (the usual case): no search
        while a < z:
            m = (a + z + 1) // 2
            if last_over(m) <= 0:
                a = m
            else:
                z = m - 1
        return a

    def _evened(self, k: int, n: int, y: int, floor: int, last: float, other: float) -> tuple[int, float, float]:
        """``(y, last, other)`` with the last piece in column ``k`` shortened from ``y`` tokens
        to no fewer than ``floor``: a shorter last piece moves work to the document's other
        pieces (the last one's column falls as y does, the others' rise); the y where they meet
        leaves the most room in the worst of them for the documents that fill them, at more
        keys. Kept only where it lowers the worst column (``last, other`` are ``y``'s)."""
        over = self._columns_over
        a, z = floor, y
        while a < z:
            m = (a + z) // 2
            lm, om = over(k, n, m)
            if lm >= om:
                z = m
            else:
                a = m + 1
        if a < y:
            y2 = min((v for v in (a - 1, a) if v >= floor), key=lambda v: max(over(k, n, v)))
            if max(over(k, n, y2)) < last:
                return (y2, *over(k, n, y2))
        return y, last, other

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
                    raise LeftOut(i)
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
