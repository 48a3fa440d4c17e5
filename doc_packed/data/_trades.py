"""Trades between cells: a packing's last resort where its heaviest column is a little over the
planner's tolerance (:func:`trade_cells`)."""

from __future__ import annotations

import numpy as np

from ..cp.plan import TOLERANCE, chunk_len
from ._rows import PAD
from ._work import Docs

__all__ = ["trade_cells"]

_TRADES = 32  # trades between cells at most
_TRADE_LONGEST = 2048  # longest document a trade gives (the subset sums it takes cost its length)
_TRADE_GOAL = 0.008  # ... which aim each column this far above the mean (below the planner's TOLERANCE)
_TRADE_WORK = 1 << 23  # ... and least-work table entries they may compute, the first tables included
# (a work count, not a time. Measured over 600 draws, the bench grid and 88 streaming runs: the one
# trade kept took 0.8M; lognormal-512 in one 1M row over 16 ranks, seed 1, took 33M for 32 trades,
# none kept, 75 of its 92 ms)


def trade_cells(
    rows: list[list[int]], lens: list[list[int]], loads: list[int], docs: Docs, seq_len: int, c: int
) -> tuple[list[list[int]], list[list[int]], list[int]] | None:
    """Rows whose heaviest column is brought within the planner's tolerance by trades between
    cells: a whole document of the heaviest column for documents of the same total length and
    less work from one cell of a column with room (the least-work such set: subset sum), the
    trade that leaves the larger of the two columns lowest first. Every cell keeps its length
    and every straddling document its place, so ranks need the same keys. At most ``_TRADES``
    trades, and none begun once the least-work tables have cost ``_TRADE_WORK`` entries (a
    deterministic bound). Returns the rows, lengths and loads, or None where some column stays
    above the tolerance."""
    load = np.asarray(loads, dtype=np.int64)
    mean = float(load.sum()) / c
    goal, cap = mean * (1 + _TRADE_GOAL), mean * (1 + TOLERANCE)
    whole = _whole_documents(rows, lens, chunk_len(seq_len, c))
    # the longest document a trade gives: of the columns above the goal, at most _TRADE_LONGEST
    X = min(max((n for (_, r), d in whole.items() if load[r] > goal for n in d.values()), default=0), _TRADE_LONGEST)
    if X < 2:
        return None if load.max() > cap else (rows, lens, load.tolist())
    cells = _Cells(whole, X, docs.work)
    done: list[_Trade] = []
    for _ in range(_TRADES):
        h = int(load.argmax())
        if load[h] <= goal or cells.spent > _TRADE_WORK:
            break
        best = _best_trade(cells, load, h, goal, cap)
        if best is None:
            break
        kh, ko, x, gain = best
        load[h] -= gain
        load[cells.col[ko]] += gain
        done.append(cells.trade(kh, ko, x))
    if load.max() > cap:
        return None
    rows, lens = _traded_rows(rows, lens, done)
    return rows, lens, load.tolist()


def _whole_documents(rows: list[list[int]], lens: list[list[int]], cs: int) -> dict[tuple[int, int], dict[int, int]]:
    """(row, column) -> the lengths of the documents wholly inside that cell (columns of ``cs``
    tokens)."""
    cells: dict[tuple[int, int], dict[int, int]] = {}
    for b, (row, ln) in enumerate(zip(rows, lens)):
        at = 0
        for i, n in zip(row, ln):
            if i != PAD and at // cs == (at + n - 1) // cs:
                cells.setdefault((b, at // cs), {})[i] = n
            at += n
    return cells


# a trade made: (row of x, row of the set, x, its length, the set as (document, length))
_Trade = tuple[int, int, int, int, list[tuple[int, int]]]
_BIG = np.int64(1) << 60


class _Cells:
    """The cells' whole documents and, per cell, the least work of ``t`` tokens of them for
    every ``t <= X`` (a subset-sum table), kept current as trades move documents."""

    def __init__(self, docs: dict[tuple[int, int], dict[int, int]], X: int, work: list[int]):
        self.docs, self.X, self.work = docs, X, work
        self.keys = list(docs)
        self.col = np.asarray([r for _, r in self.keys], dtype=np.int64)
        self.least = np.full((len(self.keys), X + 1), _BIG, dtype=np.int64)
        self.spent = sum(self._fill(k) for k in range(len(self.keys)))  # table entries computed

    def _fill(self, k: int) -> int:
        """Cell ``k``'s table; returns the entries computed (its documents up to X, times X + 1)."""
        X, t = self.X, self.least[k]
        t[:] = _BIG
        t[0] = 0
        done = 0
        for i, n in self.docs[self.keys[k]].items():
            if n <= X:
                t[n:] = np.minimum(t[n:], t[: X + 1 - n] + self.work[i])
                done += 1
        return done * (X + 1)

    def givable(self, h: int) -> list[tuple[int, int, int]]:
        """``(document, length, cell)`` of every document column ``h`` may give."""
        docs, X = self.docs, self.X
        return [(i, n, k) for k, key in enumerate(self.keys) if key[1] == h for i, n in docs[key].items() if 1 < n <= X]

    def trade(self, kh: int, ko: int, x: int) -> _Trade:
        """Document ``x`` of cell ``kh`` for the least-work set of its length in cell ``ko``."""
        give, get = self.docs[self.keys[kh]], self.docs[self.keys[ko]]
        nx = give[x]
        take = _least_set(get, nx, self.work)
        made = (self.keys[kh][0], self.keys[ko][0], x, nx, [(i, get[i]) for i in take])
        for i in take:
            give[i] = get.pop(i)
        get[x] = give.pop(x)
        self.spent += self._fill(kh) + self._fill(ko)
        return made


def _best_trade(cells: _Cells, load: np.ndarray, h: int, goal: float, cap: float) -> tuple[int, int, int, int] | None:
    """``(cell of x, cell of the set, x, work moved)``: the trade of a document of the heaviest
    column ``h`` that leaves the larger of the two columns lowest; None where none lowers
    ``h``, or where every document of ``h`` traded at its best would not bring it under ``cap``."""
    xs = cells.givable(h)
    if not xs:
        return None
    xn = np.fromiter((n for _, n, _ in xs), dtype=np.int64, count=len(xs))
    xw = np.fromiter((cells.work[i] for i, _, _ in xs), dtype=np.int64, count=len(xs))
    col = cells.col
    gain = xw[None, :] - cells.least[:, xn]  # [cells, documents of h]
    gain[col == h] = 0
    if load[h] - np.maximum(gain.max(axis=0), 0).sum() > cap:
        return None
    after = np.maximum(load[h] - gain, load[col][:, None] + gain)
    after[(gain <= 0) | (load[col] >= goal)[:, None]] = _BIG
    j = int(np.argmin(after))
    if not after.flat[j] < load[h]:
        return None
    ko, kx = divmod(j, len(xs))
    x, _, kh = xs[kx]
    return kh, ko, x, int(gain[ko, kx])


def _traded_rows(rows: list[list[int]], lens: list[list[int]], done: list[_Trade]):
    """The rows and lengths with the trades ``done`` made, in order: x's place takes the set,
    the set's first document's place takes x."""
    rows, lens = [list(r) for r in rows], [list(x) for x in lens]
    for b, b2, x, nx, got in done:
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
    return rows, lens


def _least_set(cell: dict[int, int], total: int, work: list[int]) -> list[int]:
    """The documents of ``cell`` (doc -> length) summing to ``total`` tokens with the least work
    (one exists), by subset sum traced back."""
    items = [(i, n) for i, n in cell.items() if n <= total]
    tables = [np.full(total + 1, _BIG, dtype=np.int64)]
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
