"""Max logits of a context-parallel call (``return_max_logits`` under ``cp_group``).

Each rank gathers the keys of the whole rows (one all-gather of K; no values, no gradient),
finds the largest visible logit of its own queries with the exact blockwise kernel, queries at
their global positions (explicit key intervals, :class:`~doc_packed.kernels.VarlenSpec`'s
``bounds``), and the ranks reduce by max. Costs one all-gather of K per call: a diagnostic
output, not on the attention's own path.
"""

from __future__ import annotations


import torch
import torch.distributed as dist

from .. import _compat, _variants, kernels
from .._call import Call as OpCall  # the op's arguments by name
from .._doc_layout import get_layout
from .._mask import key_bounds
from .plan import chunk_len, owner_range


def _gather_rows(k: torch.Tensor, seq_len: int, group) -> torch.Tensor:
    """``[B, seq_len, H, D]``: every rank's ``torch.chunk`` of the sequence dim, gathered."""
    size = dist.get_world_size(group)
    c = chunk_len(seq_len, size)
    padded = torch.nn.functional.pad(k, (0, 0, 0, 0, 0, c - k.shape[1])).contiguous()
    parts = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(parts, padded, group=group)
    rows = [p[:, : e - s] for p, (s, e) in zip(parts, (owner_range(seq_len, size, r) for r in range(size)))]
    return torch.cat(rows, 1)


def _spec(layout, start: int, end: int, causal: bool, left: int, right: int, prefixes=None) -> kernels.VarlenSpec:
    """This rank's queries ``[start, end)`` of each row against the whole rows' keys (a query in
    its document's bidirectional prefix sees the whole prefix)."""
    cu_q, cu_k, lo, hi = [0], [0], [], []
    for b, row in enumerate(layout.rows):
        for d, (s, e) in enumerate(row):
            plen = prefixes[b][d] if prefixes is not None else 0
            a, z = max(s, start), min(e, end)
            if a >= z:
                continue
            cu_q.append(cu_q[-1] + (z - a))  # queries of the segment, rows of L local tokens
            cu_k.append(cu_k[-1] + (e - s))
            for p in range(a, z):
                x, y = key_bounds(p - s, e - s, causal, left, right)
                if p - s < plen:
                    x, y = 0, max(y, plen - 1)
                lo.append(cu_k[-2] + x)
                hi.append(cu_k[-2] + y)
    bounds = (torch.tensor(lo, dtype=torch.int64), torch.tensor(hi, dtype=torch.int64))
    return kernels.VarlenSpec(cu_q, cu_k, causal, left, right, bounds=bounds)


def max_logits(q: torch.Tensor, k: torch.Tensor, call: OpCall) -> torch.Tensor:
    """``[H_q]`` max logits over every query of the group (the same on every rank)."""
    assert call.cp_group is not None, "a context-parallel call names its group"
    seq_len, causal, left, right = call.seq_len, call.causal, call.window_left, call.window_right
    group = _compat.resolve_process_group(call.cp_group)
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    start, end = owner_range(seq_len, size, rank)
    layout = get_layout(call.cu_seqlens, seq_len)
    prefixes = None if call.prefix_lens is None else _variants.prefixes(call.cu_seqlens, call.prefix_lens)
    full_k = _gather_rows(k, seq_len, group)
    spec = layout.derived(
        ("cp_max_logits_spec", size, rank, causal, left, right, prefixes),
        lambda: _spec(layout, start, end, causal, left, right, prefixes),
    )
    # the spec's queries: each row's local tokens that lie in a document, in row order
    q_rows, k_rows = [], []
    for b, row in enumerate(layout.rows):
        for s, e in row:
            a, z = max(s, start), min(e, end)
            if a < z:
                q_rows.append(q[b, a - start : z - start])
                k_rows.append(full_k[b, s:e])
    Hq = q.shape[2]
    if q_rows:
        best = kernels.max_logits(spec, torch.cat(q_rows), torch.cat(k_rows), call.scale, call.softcap)
    else:
        best = torch.full((Hq,), -float("inf"), dtype=kernels.lse_dtype(q.dtype), device=q.device)
    dist.all_reduce(best, op=dist.ReduceOp.MAX, group=group)
    return best
