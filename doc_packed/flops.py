"""FLOPs of ``doc_packed`` attention, from real ``cu_seqlens`` when there are any.

Counting convention (flash-attention's): the forward does two matmuls per visible
(query, key) pair and head, ``4 * pairs * H_q * D`` FLOPs; the backward five (QK^T recompute,
dV, dP, dQ, dK), 2.5x the forward.

``pairs`` honours causality and windows. With real ``cu_seqlens`` it is exact (one host read
per distinct tensor, cached). Under fake tensors -- AutoParallel's planning, ``torch.compile``
tracing -- the values are unknown and every row is assumed to be the representative row of the
call's ``planning_doc_len`` (:func:`representative_bounds`: lognormal documents of that mean
length, as packed data holds them; 0: one document per row, the upper bound). Equal documents
would undercount: a lognormal row of mean 2048 has 1.8x the pairs of 2048-token documents. A
sequence-sharded call counts ``1/c`` of the row's work, which is what the balanced
context-parallel plan gives each rank.

While a solver prices strategies, the function :mod:`shardings.costs` installs with
:func:`set_planning_cost` turns the count of a call on fake ``cu_seqlens`` with no group into
the solver's price (measured attention rates, the context-parallel exchange and the plan's
imbalance); it leaves the count alone unless a pricing context is active
(``shardings.costs.pricing``), so real runs count real FLOPs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from ._doc_layout import cp_degree, get_layout
from ._mask import doc_pairs, doc_pairs_bidirectional
from .data.synthetic import lognormal_lengths

# (q_shape, kv_heads, seq_len, causal, left, right, dtype, backward, flops, doc_len, cp_dim) -> flops
PlanningCost = Callable[..., int]
_planning_cost: PlanningCost | None = None


def set_planning_cost(fn: PlanningCost | None) -> None:
    """Install the function that prices a sequence-sharded call while a solver plans
    (:mod:`shardings.costs` does, once); None removes it."""
    global _planning_cost
    _planning_cost = fn


def planned_doc_len(doc_len: int, seq_len: int) -> int:
    """The document length a fake-tensor estimate assumes: ``doc_len`` tokens, capped at the
    row; 0 means one document per row."""
    return min(doc_len or seq_len, seq_len)


@functools.lru_cache(maxsize=256)
def representative_bounds(seq_len: int, doc_len: int) -> tuple[int, ...]:
    """Document boundaries of one representative row of ``seq_len`` tokens: lognormal lengths
    (sigma 1) of mean ``doc_len``, from a fixed seed, so that documents straddle shard
    boundaries the way real packed data does (equal lengths would align with the shards, hide
    context parallelism's traffic and undercount the pairs). ``doc_len`` 0 or ``>= seq_len``:
    one document."""
    if not doc_len or doc_len >= seq_len:
        return (0, seq_len)
    bounds = [0]
    for n in lognormal_lengths(seq_len, doc_len, seed=seq_len * 1_000_003 + doc_len):
        bounds.append(bounds[-1] + n)
    return tuple(bounds)


@functools.lru_cache(maxsize=1024)
def assumed_row_pairs(seq_len: int, causal: bool, left: int, right: int, doc_len: int = 0) -> int:
    """Pairs in one representative row of ``seq_len`` tokens with documents of mean ``doc_len``
    tokens (:func:`representative_bounds`; 0: one document)."""
    b = representative_bounds(seq_len, planned_doc_len(doc_len, seq_len))
    return sum(doc_pairs(e - s, causal, left, right) for s, e in zip(b, b[1:]))


def _has_values(t: torch.Tensor) -> bool:
    return type(t) is torch.Tensor and t.device.type != "meta"


def total_pairs(cu_seqlens: torch.Tensor, seq_len: int, causal: bool, left: int, right: int, doc_len: int = 0) -> int:
    """Pairs over all rows: exact with real values, else rows of ``doc_len``-token documents."""
    if _has_values(cu_seqlens):
        layout = get_layout(cu_seqlens, seq_len)
        return layout.derived(
            ("pairs", causal, left, right),
            lambda: sum(doc_pairs(e - s, causal, left, right) for row in layout.rows for s, e in row),
        )
    return cu_seqlens.shape[0] * assumed_row_pairs(seq_len, causal, left, right, doc_len)


def _prefix_pairs(cu_seqlens: torch.Tensor, prefix_lens: torch.Tensor, seq_len: int, left: int) -> int:
    """Exact pairs of a causal call with bidirectional prefixes (:mod:`doc_packed._mask`)."""
    from ._variants import prefixes

    layout = get_layout(cu_seqlens, seq_len)
    table = prefixes(cu_seqlens, prefix_lens)
    return layout.derived(
        ("prefix_pairs", left, table),
        lambda: sum(
            doc_pairs_bidirectional(e - s, p, left)
            for row, prow in zip(layout.rows, table)
            for (s, e), p in zip(row, prow)
        ),
    )


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
    doc_len: int = 0,
    cp_dim: str | None = None,
    v_dim: int | None = None,
    prefix_lens: torch.Tensor | None = None,
) -> int:
    """FLOPs of one call (this rank's share when sequence-sharded). ``v_dim``: v's head dim when
    it differs from q's (forward ``2 * pairs * H_q * (D + D_v)``, backward ``2 * pairs * H_q *
    (3 D + 2 D_v)``); ``prefix_lens``: bidirectional prefixes (their pairs counted exactly with
    real values; on fake tensors the causal count, a lower bound). Softcap and sinks add no
    matmul work (flash-attention's convention counts matmuls only)."""
    B, S_local, Hq, D = q.shape
    if S_local == 0:
        return 0  # an empty context-parallel shard (torch.chunk gave this rank nothing)
    right = 0 if causal else right
    if prefix_lens is not None and _has_values(cu_seqlens) and _has_values(prefix_lens):
        pairs = _prefix_pairs(cu_seqlens, prefix_lens, seq_len, left)
    else:
        pairs = total_pairs(cu_seqlens, seq_len, causal, left, right, doc_len)
    dv = D if v_dim is None else v_dim
    flops = 2 * pairs * Hq * (D + dv)
    if backward:
        flops = 2 * pairs * Hq * (3 * D + 2 * dv)
    cp = cp_degree(S_local, seq_len)
    if cp > 1:
        flops = -(-flops // cp)
    if cp_group is None and _planning_cost is not None and not _has_values(cu_seqlens):
        flops = _planning_cost(
            tuple(q.shape), kv_heads, seq_len, causal, left, right, q.dtype, backward, flops, doc_len, cp_dim
        )
    return int(flops)
