"""FLOPs of ``doc_packed`` attention, from real ``cu_seqlens`` when there are any.

Counting convention (flash-attention's): the forward does two matmuls per visible
(query, key) pair and head, ``4 * pairs * H_q * D`` FLOPs; the backward five (QK^T recompute,
dV, dP, dQ, dK), 2.5x the forward.

``pairs`` honours causality and windows. With real ``cu_seqlens`` it is exact (one host read
per distinct tensor, cached). Under fake tensors -- AutoParallel's planning, ``torch.compile``
tracing -- the values are unknown and every row is assumed to hold documents of
:func:`planning_doc_len` tokens (default: one document per row, the upper bound). A
sequence-sharded call (``q.shape[1] < seq_len``) counts ``1/c`` of the row's work, which is what
the balanced context-parallel plan gives each rank.

Planning-only costs (the context-parallel exchange and the plan's imbalance) are added by a
hook that :mod:`shardings.costs` installs. It only acts on a sequence-shard call that has no
group yet -- which only happens while a solver prices strategies -- so real runs count real
FLOPs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ._layout import get_layout
from ._mask import doc_pairs

_planning_doc_len: int | None = None

# (q_shape, kv_heads, seq_len, causal, left, right, dtype, backward, flops) -> planned flops
planning_cost_hook: Callable[..., int] | None = None


def set_planning_doc_len(mean_doc_len: int | None) -> None:
    """Assume documents of ``mean_doc_len`` tokens when ``cu_seqlens`` values are unknown.

    ``None`` (the default) assumes one document per row. This only shapes cost estimates made
    on fake tensors (AutoParallel's solver, compile-time flop counts); real runs count exactly.
    """
    global _planning_doc_len
    if mean_doc_len is not None and (not isinstance(mean_doc_len, int) or mean_doc_len < 1):
        raise ValueError(f"mean_doc_len must be a positive int or None, got {mean_doc_len!r}")
    _planning_doc_len = mean_doc_len


def planning_doc_len() -> int | None:
    return _planning_doc_len


def assumed_row_pairs(seq_len: int, causal: bool, left: int, right: int) -> int:
    """Pairs in one row of ``seq_len`` tokens under the planning assumption."""
    L = min(_planning_doc_len or seq_len, seq_len)
    full, rem = divmod(seq_len, L)
    return full * doc_pairs(L, causal, left, right) + doc_pairs(rem, causal, left, right)


def _has_values(t: torch.Tensor) -> bool:
    return type(t) is torch.Tensor and t.device.type != "meta"


def total_pairs(cu_seqlens: torch.Tensor, seq_len: int, causal: bool, left: int, right: int) -> int:
    """Pairs over all rows: exact with real values, else the planning assumption."""
    if _has_values(cu_seqlens):
        layout = get_layout(cu_seqlens, seq_len)
        return layout.derived(
            ("pairs", causal, left, right),
            lambda: sum(doc_pairs(e - s, causal, left, right) for row in layout.rows for s, e in row),
        )
    return cu_seqlens.shape[0] * assumed_row_pairs(seq_len, causal, left, right)


def attention_flops(
    q: torch.Tensor,
    kv_heads: int,
    cu_seqlens: torch.Tensor,
    seq_len: int,
    causal: bool,
    left: int,
    right: int,
    cp_group: str | None,
    backward: bool,
) -> int:
    B, S_local, Hq, D = q.shape
    right = 0 if causal else right
    pairs = total_pairs(cu_seqlens, seq_len, causal, left, right)
    flops = 4 * pairs * Hq * D
    if backward:
        flops = flops * 5 // 2
    if S_local < seq_len:
        cp = -(-seq_len // S_local)
        flops = -(-flops // cp)
        if cp_group is None and planning_cost_hook is not None:
            flops = planning_cost_hook(
                tuple(q.shape), kv_heads, seq_len, causal, left, right, q.dtype, backward, flops
            )
    return int(flops)
