"""The attention work the packer balances, counted as the planner counts it.

Work is exact (query, key) pairs under the mask (:func:`doc_packed._mask.prefix_pairs`,
vectorised here over NumPy arrays); a rank's load is the work of the positions of its
``torch.chunk`` of every row (*owner first*: before the planner moves anything); the keys a rank
receives when no query moves are the parts of straddling documents on other ranks' shards.
"""

from __future__ import annotations

import numpy as np

from ..cp.plan import chunk_len

__all__ = ["Docs", "column_loads", "prefix_pairs_np", "straddle_keys"]


def _ramp_np(n: np.ndarray, a: np.ndarray | int) -> np.ndarray:
    m = n - 1 - a
    return np.where(m > 0, m * (m + 1) // 2, 0)


def prefix_pairs_np(n: np.ndarray, length: np.ndarray, causal: bool, left: int, right: int) -> np.ndarray:
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


class Docs:
    """What every packing pass over one list of lengths shares: each document's work and the
    least-work fill curve (the shortest documents first, cumulative)."""

    def __init__(self, lengths: list[int], causal: bool, left: int, right: int):
        self.L = lengths
        arr = np.asarray(lengths, dtype=np.int64)
        self.work = prefix_pairs_np(arr, arr, causal, left, right).tolist()
        live = np.flatnonzero(arr > 0)
        self.live = live.tolist()
        by_len = live[np.argsort(arr[live], kind="stable")]  # (length, index) order
        self.fill_toks = np.concatenate([[0], np.cumsum(arr[by_len])])
        self.fill_work = np.concatenate([[0], np.cumsum(np.asarray(self.work, dtype=np.int64)[by_len])])
        self.fill_toks_l: list[int] = self.fill_toks.tolist()
        self.fill_work_l: list[int] = self.fill_work.tolist()
        self.tokens = int(self.fill_toks[-1])


def column_loads(lens: list[list[int]], seq_len: int, c: int, causal: bool, left: int, right: int) -> list[int]:
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
    before = np.concatenate([[0], np.cumsum(prefix_pairs_np(flat, flat, causal, left, right))])
    hi = np.minimum(np.arange(1, c + 1, dtype=np.int64) * chunk_len(seq_len, c), seq_len)  # owner_ranges' ends
    at = (np.arange(len(lens), dtype=np.int64)[:, None] * seq_len + hi[None, :]).ravel()
    at = np.concatenate([[0], at])  # ... and the start of row 0 (every other start is an end)
    k = np.searchsorted(ends, at, side="right")
    kk = np.minimum(k, flat.size - 1)
    inside = prefix_pairs_np(at - starts[kk], flat[kk], causal, left, right)
    cum = before[k] + np.where(k < flat.size, inside, 0)
    per_cell = np.diff(cum).reshape(len(lens), c)
    return per_cell.sum(axis=0).tolist()


def straddle_keys(lens: list[list[int]], seq_len: int, c: int, causal: bool, left: int, right: int) -> int:
    """Most keys a rank needs from other ranks' shards when no query moves (summed over rows):
    per shard, the part of a document crossing its start that lies before it (and, without
    ``causal``, the part of one crossing its end that lies after it), within the window."""
    step = chunk_len(seq_len, c)
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
