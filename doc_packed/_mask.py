"""The attention mask inside one document, in closed form.

A query at in-document position ``i`` of a document of length ``L`` sees the keys at
positions ``[lo(i), hi(i)]`` (inclusive) where, with ``(left, right)`` the window and
``-1`` meaning unbounded::

    lo(i) = max(0, i - left)              (0 if left < 0)
    hi(i) = i                             if causal
          = min(L - 1, i + right)         otherwise (L - 1 if right < 0)

Both bounds are non-decreasing in ``i``, so the keys a run of queries needs form one
interval. Everything that counts work (the CPU kernel, the context-parallel planner, the
flop formulas) uses these functions, so they all agree on what "one (query, key) pair" is.
"""

from __future__ import annotations

__all__ = ["key_bounds", "prefix_pairs", "doc_pairs", "doc_pairs_bidirectional"]


def _ramp(n: int, a: int) -> int:
    """sum_{i=0}^{n-1} max(0, i - a) for a >= 0."""
    m = n - 1 - a
    return m * (m + 1) // 2 if m > 0 else 0


def key_bounds(i: int, length: int, causal: bool, left: int, right: int) -> tuple[int, int]:
    """Inclusive key interval ``(lo, hi)`` seen by the query at in-document position ``i``."""
    lo = 0 if left < 0 else max(0, i - left)
    if causal:
        hi = i
    elif right < 0:
        hi = length - 1
    else:
        hi = min(length - 1, i + right)
    return lo, hi


def prefix_pairs(n: int, length: int, causal: bool, left: int, right: int) -> int:
    """Number of (query, key) pairs of the first ``n`` queries of a document of ``length``."""
    if n <= 0:
        return 0
    sum_lo = 0 if left < 0 else _ramp(n, left)
    if causal:
        sum_hi = n * (n - 1) // 2
    elif right < 0 or right >= length - 1:
        sum_hi = n * (length - 1)
    else:
        sum_hi = n * (n - 1) // 2 + n * right - _ramp(n, length - 1 - right)
    return sum_hi - sum_lo + n


def doc_pairs(length: int, causal: bool, left: int, right: int) -> int:
    """Number of (query, key) pairs inside one document."""
    return prefix_pairs(length, length, causal, left, right)


def doc_pairs_bidirectional(length: int, prefix: int, left: int) -> int:
    """Pairs inside one causal document whose first ``prefix`` tokens see each other both ways
    (the causal, left-windowed mask OR the ``prefix x prefix`` block; docs/contract.md)."""
    p = min(max(prefix, 0), length)
    if p == 0:
        return doc_pairs(length, True, left, 0)
    return p * p + doc_pairs(length, True, left, 0) - prefix_pairs(p, length, True, left, 0)
