"""``doc_packed_attn_varlen``: flash-attention's varlen convention (packed ``[T, H, D]`` tokens,
1-D ``cu_seqlens``, ``max_seqlen``) over the same op as :func:`doc_packed.doc_packed_attn`.

The packed tensors are viewed as one row (``[1, T, H, D]`` and ``cu_seqlens [1, N + 1]``, no
copy), so validation, kernels, the custom ops, context parallelism and the DTensor strategies are
the ones :func:`~doc_packed.doc_packed_attn` uses.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import _compat, api
from ._checks import check_max_seqlen_arg, check_varlen, check_varlen_prefix, varlen_layout_error

__all__ = ["doc_packed_attn_varlen"]


def _group_size(group: dist.ProcessGroup | str) -> int:
    return dist.get_world_size(_compat.resolve_process_group(group) if isinstance(group, str) else group)


def doc_packed_attn_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int | None,
    *,
    causal: bool,
    window_size: tuple[int, int] = (-1, -1),
    scale: float | None = None,
    return_lse: bool = False,
    backend: str = "auto",
    cp_group: dist.ProcessGroup | str | None = None,
    seq_len: int | None = None,
    planning_doc_len: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
    prefix_lens: torch.Tensor | None = None,
    return_max_logits: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Document-packed attention on packed tokens, as ``flash_attn_varlen_func`` takes them.

    Args:
        q: ``[T, H_q, D]``; k, v: ``[T, H_kv, D]`` (self-attention: one ``cu_seqlens`` for
            queries and keys). Any strides with a contiguous head dim.
        cu_seqlens: ``[N + 1]`` int32 or int64 document boundaries: starts at 0,
            non-decreasing (zero-length documents allowed), ends at ``T``.
        max_seqlen: an upper bound of the document lengths, as flash-attention takes it. It is
            checked (ValueError when a document is longer; flash-attention would read past
            it) and not otherwise used: kernels read the exact lengths from the cached layout.
            ``None`` skips the check. Under ``torch.compile`` it is not read at all (neither
            checked nor guarded on), so a new value each step does not recompile.
        causal: required, no default, as :func:`doc_packed_attn` (``flash_attn_varlen_func`` and
            torch's ``varlen_attn`` default to full attention: :mod:`doc_packed.compat` has
            drop-ins with their defaults).
        window_size, scale, backend, planning_doc_len: as :func:`doc_packed_attn`
            (``window_size=(left, right)``, ``(-1, -1)`` no window; ``right > 0`` with
            ``causal=True`` raises).
        return_lse: also return the natural-log lse ``[H_q, T]`` (flash-attention's varlen
            layout; float32, float64 for float64 inputs).
        cp_group, seq_len: context parallelism as :func:`doc_packed_attn`: ``q/k/v`` are this
            rank's ``torch.chunk`` of the ``T`` tokens, ``cu_seqlens`` the whole sequence's.
        sinks, softcap, return_max_logits: as :func:`doc_packed_attn` (``sinks [H_q]``).
        prefix_lens: ``[N]`` int32/int64, each document's bidirectional prefix length (as
            :func:`doc_packed_attn`'s, one row). ``v`` may have its own head dim.

    Compiled with a new packing each step, it compiles once when ``cu_seqlens`` keeps its size
    (pad it with zero-length documents) or is marked dynamic (docs/coming_from.md).

    Under DTensor, ``Shard(0)`` of ``T`` is the sequence placement (context parallel),
    ``Shard(1)`` the heads, ``Replicate`` both; ``cu_seqlens`` is replicated.

    Returns:
        ``out [T, H_q, D_v]`` in q's dtype, then ``lse`` if ``return_lse``, then the ``[H_q]``
        max logits if ``return_max_logits``.
    """
    compiling = torch.compiler.is_compiling()
    try:
        check_varlen(q, k, v, cu_seqlens)
        if not compiling:  # max_seqlen is never read under compile: a new value must not recompile
            check_max_seqlen_arg(max_seqlen)
        check_varlen_prefix(prefix_lens, cu_seqlens)
    except (TypeError, ValueError) as err:
        if not compiling or api.is_dtensor(q):
            raise
        return api.in_graph_error(q, err, return_lse, return_max_logits)
    call = (
        q.unsqueeze(0),
        k.unsqueeze(0),
        v.unsqueeze(0),
        cu_seqlens.unsqueeze(0),
        causal,
        window_size,
        scale,
        True,
        backend,
        cp_group,
        seq_len,
        planning_doc_len,
        None if compiling else max_seqlen,
    )
    variants = dict(
        sinks=sinks,
        softcap=softcap,
        prefix_lens=None if prefix_lens is None else prefix_lens.unsqueeze(0),
        return_max_logits=return_max_logits,
    )
    if compiling:
        result = api.attention(*call, **variants)
    else:
        try:
            result = api.attention(*call, **variants)
        except ValueError as err:  # the layout's rules speak of rows; say it for 1-D cu_seqlens
            cp_size = None if cp_group is None else _group_size(cp_group)
            tokens = seq_len if seq_len is not None else q.shape[0] * (cp_size or 1)
            better = varlen_layout_error(err, tokens, cp_size)
            if better is err:
                raise
            raise better from None
    out, lse = result[0].squeeze(0), result[1].squeeze(0)
    rest = (lse,) if return_lse else ()
    if return_max_logits:
        rest = (*rest, result[2])
    return (out, *rest) if rest else out
