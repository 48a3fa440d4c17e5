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
    cs = chunk_len(seq_len, c)
    load = np.asarray(loads, dtype=np.int64)
    mean = float(load.sum()) / c
    goal, cap = mean * (1 + _TRADE_GOAL), mean * (1 + TOLERANCE)
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
