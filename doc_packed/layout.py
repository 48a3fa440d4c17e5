"""Helpers around the packed-row layout: building ``cu_seqlens`` and per-token metadata.

``cu_seqlens`` is ``[B, MAX_DOCS + 1]`` int32: row ``b``'s document boundaries, starting at 0,
non-decreasing, ending at ``S``; unused trailing slots repeat ``S`` (zero-length documents), so
every row and every rank sees the same shape.
"""

from __future__ import annotations

import math
import operator
import random
from collections.abc import Sequence

import torch

from .packing import pack_documents  # noqa: F401  (its home is packing.py; importable from here too)

__all__ = ["cu_seqlens_from_lengths", "document_ids", "lognormal_lengths", "positions", "pack_documents"]


def cu_seqlens_from_lengths(
    lengths: Sequence[Sequence[int]],
    seq_len: int,
    *,
    max_docs: int | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """``cu_seqlens`` ``[B, max_docs + 1]`` from per-row document lengths.

    A row whose lengths sum to less than ``seq_len`` gets one more document holding the rest
    (padding tokens then attend only to each other). ``max_docs`` defaults to the largest
    document count of any row; shorter rows are padded with zero-length documents.
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, int):
        raise TypeError(f"seq_len must be an int, got {type(seq_len).__name__}")
    rows = []
    for b, given in enumerate(lengths):
        try:  # ints, or integer scalars (numpy, 0-d tensors): never truncate 5.5 to 5
            row = [operator.index(n) for n in given]
        except TypeError:
            raise TypeError(f"lengths[{b}] must hold ints (token counts), got {list(given)!r}") from None
        if any(isinstance(n, bool) for n in given):
            raise TypeError(f"lengths[{b}] must hold ints (token counts), not bools")
        if any(n < 0 for n in row):
            raise ValueError(f"lengths[{b}] has a negative document length: {row}")
        total = sum(row)
        if total > seq_len:
            raise ValueError(f"lengths[{b}] sums to {total}, more than seq_len={seq_len}")
        if total < seq_len:
            row.append(seq_len - total)
        rows.append([n for n in row if n > 0] or [seq_len])
    if not rows:
        raise ValueError("lengths must hold at least one row")
    need = max(len(r) for r in rows)
    max_docs = need if max_docs is None else max_docs
    if max_docs < need:
        raise ValueError(f"max_docs={max_docs} is smaller than the {need} documents of some row")
    out = torch.full((len(rows), max_docs + 1), seq_len, dtype=torch.int32)
    for b, row in enumerate(rows):
        out[b, 0] = 0
        out[b, 1 : len(row) + 1] = torch.tensor(row, dtype=torch.int64).cumsum(0).to(torch.int32)
    return out.to(device) if device is not None else out


def document_ids(cu_seqlens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """``[B, S]`` int64: index of the document each token belongs to (no host sync)."""
    ends = cu_seqlens[:, 1:].contiguous()
    t = torch.arange(seq_len, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return torch.searchsorted(ends, t.expand(ends.shape[0], seq_len).contiguous(), right=True)


def positions(cu_seqlens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """``[B, S]`` int64: each token's position inside its document (for RoPE; no host sync)."""
    ids = document_ids(cu_seqlens, seq_len)
    starts = torch.gather(cu_seqlens.long(), 1, ids)
    return torch.arange(seq_len, device=cu_seqlens.device) - starts


def lognormal_lengths(total: int, mean: float, seed: int | random.Random = 0, sigma: float = 1.0) -> list[int]:
    """Document lengths summing to ``total``: lognormal draws of mean ``mean`` (log-space
    deviation ``sigma``), at least 1 token, the last one cut to fit. Deterministic per seed."""
    rng = seed if isinstance(seed, random.Random) else random.Random(seed)
    mu = math.log(mean) - sigma**2 / 2
    out, left = [], total
    while left > 0:
        n = max(1, min(left, int(rng.lognormvariate(mu, sigma))))
        out.append(n)
        left -= n
    return out
