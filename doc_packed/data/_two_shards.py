"""One row of few documents over two ranks: every split tried at once (:func:`two_shards`)."""

from __future__ import annotations

import numpy as np

from ..cp.plan import chunk_len
from ._rows import PAD, PAD_PIECE
from ._work import Docs

__all__ = ["exact_applies", "two_shards"]

_EXACT_DOCS = 16  # one row over 2 ranks with at most this many documents: every split is tried
_EXACT_IMBALANCE = 1.009  # ... and balanced means below the planner's tolerance (cp.plan.TOLERANCE)


def exact_applies(c: int, R: int, causal: bool, left: int, docs: int, tokens: int, seq_len: int) -> bool:
    """Whether :func:`two_shards` takes the batch: one row over 2 ranks, causal without a
    window, 1 to ``_EXACT_DOCS`` documents."""
    return c == 2 and R == 1 and causal and left < 0 and 0 < docs <= _EXACT_DOCS and tokens <= seq_len


def two_shards(docs: Docs, seq_len: int):
    """One row of few documents over 2 ranks, causal, no window: every split tried at once.
    Rank 0 holds a subset of the documents and possibly the head of one more (``p`` tokens: the
    keys rank 1 receives), padding fills the rest. Returns the ``(order, lengths)`` of the
    balanced split (owner-first imbalance at most ``_EXACT_IMBALANCE``) with the fewest keys
    received, then the best balance; None if no split is balanced."""
    live = docs.live
    half, P = chunk_len(seq_len, 2), seq_len - docs.tokens
    # per subset of the documents (bit j: live[j]): tokens, pairs, longest document in it
    toks, work, longest = (np.zeros(1, dtype=np.int64) for _ in range(3))
    for i in live:
        n, w = docs.L[i], docs.work[i]
        toks, work = np.concatenate([toks, toks + n]), np.concatenate([work, work + w])
        longest = np.concatenate([longest, np.maximum(longest, n)])
    outside = longest[::-1]  # longest document NOT in the subset (the complement's index)

    def pad_work(x: np.ndarray) -> np.ndarray:  # padding in pieces of PAD_PIECE (as pad_rows cuts it)
        q, r = np.divmod(x, PAD_PIECE)
        return q * (PAD_PIECE * (PAD_PIECE + 1) // 2) + r * (r + 1) // 2

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
