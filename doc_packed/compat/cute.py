"""FlashAttention-4's varlen entry (``flash_attn.cute.flash_attn_varlen_func``) over
:func:`doc_packed_attn_varlen`, with FA4's argument list, order and defaults (flash-attn-4
4.0.0b36). Change the import and keep the call::

    from flash_attn.cute import flash_attn_varlen_func
    from doc_packed.compat.cute import flash_attn_varlen_func

This module mirrors ``flash_attn.cute`` (as :mod:`doc_packed.compat` mirrors ``flash_attn`` 2.x
and torch), so the function keeps FA4's name while FA2's keeps its own: both are called
``flash_attn_varlen_func`` with different argument lists. docs/coming_from.md maps each argument;
tests/test_compat.py checks the signature against 4.0.0b36's and the results against a float64
oracle of FA4's rules (and, on a GPU with FA4, against FA4 itself).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._checks import check_max_seqlen_arg, describe
from ..varlen import doc_packed_attn_varlen
from . import _same_boundaries, _unsupported

__all__ = ["flash_attn_varlen_func"]

# what each argument doc_packed cannot honour would ask for (ValueError unless None)
_NOT_SUPPORTED = {
    "qv": "no MLA weight-absorbed form (softmax(q k^T + qv v^T) v); pass qv=None",
    "seqused_q": "no per-sequence used lengths; cu_seqlens_q alone bounds each document",
    "seqused_k": "no per-sequence used lengths (KV cache); cu_seqlens_k alone bounds each document",
    "gather_kv_indices": "no top-k sparse (gathered) keys; pass gather_kv_indices=None",
    "page_table": "no paged KV cache; pass page_table=None",
    "score_mod": "no score_mod besides softcap (softcap=) and sinks (learnable_sink=)",
    "score_mod_bwd": "no score_mod besides softcap (softcap=) and sinks (learnable_sink=)",
    "mask_mod": "the mask is the documents of cu_seqlens, causal and window_size; no mask_mod",
    "block_sparse_tensors": "no block-sparse masks; pass block_sparse_tensors=None",
}


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _window(causal: bool, window_size: object) -> tuple[bool, tuple[int, int]]:
    """FA4's ``_resolve_causal_local_window`` (4.0.0b36), in doc_packed's terms: ``(causal,
    (left, right))`` with -1 unbounded. Both sides negative is no window (flash-attention 2's
    ``(-1, -1)``); then ``causal`` sets the right side to 0; a window whose right side is 0 is
    causal. A side left negative is, to FA4's kernel, an offset past the query (``(-1, 0)`` sees
    no key at all): doc_packed's windows always hold the query, so that raises."""
    if (
        not isinstance(window_size, Sequence)
        or isinstance(window_size, str)
        or len(window_size) != 2
        or not all(w is None or _is_int(w) for w in window_size)
    ):
        raise TypeError(
            f"window_size must be a pair (left, right) of ints or None (None: unbounded), got {describe(window_size)}"
        )
    left, right = window_size
    if left is not None and right is not None and left < 0 and right < 0:
        left = right = None
    if causal:
        right = 0
    for side, w in (("left", left), ("right", right)):
        if w is not None and w < 0:
            with_causal = " with causal=True" if causal else ""
            raise ValueError(
                f"window_size={describe(tuple(window_size))}{with_causal} is not supported by doc_packed: "
                f"FA4 reads a negative {side} side as an offset past the query (a window without the query "
                "itself); doc_packed's windows always hold the query. Use None for an unbounded side"
            )
    is_causal = right == 0
    return is_causal, (-1 if left is None else left, -1 if right is None else right)


def _softcap(softcap: object) -> float | None:
    """FA4's ``softcap``: 0.0 (its default) or None is off, a positive float caps."""
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap must be a float (0.0: off), got {type(softcap).__name__}")
    if softcap == 0:
        return None
    if softcap < 0:
        raise ValueError(
            f"softcap={softcap} is negative; FA4 computes c * tanh(s / c), the same as for {-softcap}: "
            f"pass softcap={-softcap} (0.0 is off)"
        )
    return float(softcap)


def _bound(max_seqlen_q: object, max_seqlen_k: object) -> int | None:
    """FA4's ``max_seqlen_q/k``: each an int bound, a device tensor (a hint FA4 does not read on
    the host) or None. The smaller int must bound the longest document (checked in eager calls;
    under compile neither is read, so a new value each step does not recompile)."""
    if torch.compiler.is_compiling():
        return None
    ints: list[int] = []
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if value is None or isinstance(value, torch.Tensor):
            continue
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name} must be an int, a tensor or None, got {describe(value)}")
        check_max_seqlen_arg(value, name)
        ints.append(value)
    return min(ints) if ints else None


def _check_sink(learnable_sink: object, q: object) -> None:
    """``learnable_sink``: None or a floating ``[H_q]`` tensor on q's device (named as FA4
    names it; the op's own rules speak of ``sinks``)."""
    if learnable_sink is None or not isinstance(q, torch.Tensor) or q.dim() != 3:
        return  # q's own rules come first, in doc_packed_attn_varlen
    if not isinstance(learnable_sink, torch.Tensor):
        raise TypeError(f"learnable_sink must be a tensor [H_q] or None, got {type(learnable_sink).__name__}")
    if not learnable_sink.dtype.is_floating_point:
        raise TypeError(f"learnable_sink must be a floating tensor (one logit per q head), got {learnable_sink.dtype}")
    if learnable_sink.dim() != 1 or learnable_sink.shape[0] != q.shape[1]:
        raise ValueError(
            f"learnable_sink must be [H_q] = [{q.shape[1]}] (one logit per q head), got shape "
            f"{tuple(learnable_sink.shape)}"
        )
    if learnable_sink.device != q.device:
        raise ValueError(f"learnable_sink is on {learnable_sink.device} but q is on {q.device}; use one device")


def _check_flag(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


def _check_optional_int(name: str, value: object) -> None:
    if value is not None and not _is_int(value):
        raise TypeError(f"{name} must be an int or None, got {type(value).__name__}")


def _check_hints(min_seqlen_k, num_splits, pack_gqa, seqlen_k_per_split, disable_scheduler_metadata) -> None:
    """Arguments that only steer FA4's kernels (tiles, splits, schedulers): type-checked, then
    ignored (doc_packed's kernels choose their own; the result is the same attention)."""
    _check_optional_int("min_seqlen_k", min_seqlen_k)
    if not _is_int(num_splits):
        raise TypeError(f"num_splits must be an int, got {type(num_splits).__name__}")
    if pack_gqa is not None:
        _check_flag("pack_gqa", pack_gqa)
    _check_optional_int("seqlen_k_per_split", seqlen_k_per_split)
    _check_flag("disable_scheduler_metadata", disable_scheduler_metadata)


def _check_unsupported(named: dict[str, object], aux_tensors, aux_scalars, recompute_p, token_chunk) -> None:
    for name, value in named.items():
        if value is not None:
            raise _unsupported(name, value, _NOT_SUPPORTED[name])
    for name, value in (("aux_tensors", aux_tensors), ("aux_scalars", aux_scalars)):
        if value is not None and not (isinstance(value, (list, tuple)) and len(value) == 0):
            raise _unsupported(name, value, "they feed score_mod/mask_mod, which doc_packed does not take")
    _check_flag("gather_bwd_recompute_p", recompute_p)
    if recompute_p or token_chunk is not None:  # FA4 raises the same without gather_kv_indices
        name = "gather_bwd_recompute_p" if recompute_p else "gather_bwd_token_chunk"
        raise _unsupported(name, recompute_p if recompute_p else token_chunk, "it applies to gather_kv_indices only")


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qv: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    min_seqlen_k: int | None = None,
    seqused_q: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
    gather_kv_indices: torch.Tensor | None = None,
    page_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int | None, int | None] = (None, None),
    learnable_sink: torch.Tensor | None = None,
    softcap: float = 0.0,
    num_splits: int = 1,
    pack_gqa: bool | None = None,
    deterministic: bool = False,
    score_mod: Callable | None = None,
    score_mod_bwd: Callable | None = None,
    mask_mod: Callable | None = None,
    block_sparse_tensors: Any | None = None,
    aux_tensors: list | None = None,
    aux_scalars: tuple | None = None,
    return_lse: bool = False,
    scheduler_metadata: Any | None = None,
    seqlen_k_per_split: int | None = None,
    disable_scheduler_metadata: bool = False,
    gather_bwd_recompute_p: bool = False,
    gather_bwd_token_chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """FlashAttention-4's ``flash_attn_varlen_func``: same arguments, order and defaults
    (flash-attn-4 4.0.0b36), on packed ``q [T, H_q, D]``, ``k, v [T, H_kv, D]`` (``v``'s head
    dim may differ) and 1-D ``cu_seqlens_q`` equal to ``cu_seqlens_k``.

    Semantics as FA4 applies them: full attention by default; ``window_size`` sides are ints or
    None (unbounded), both negative is no window, ``causal=True`` sets the right side to 0, and
    ``(None, 0)`` is causal; ``softcap=0.0`` is off; ``learnable_sink [H_q]`` is one extra
    logit per head in each query's softmax (no value, included in the lse, differentiable).
    Returns ``(out, lse)`` as FA4 does: ``lse [H_q, T]`` float32 (natural log, differentiable)
    with ``return_lse=True``; without it the lse FA4 keeps for its backward when an input
    requires grad (detached: FA4 drops its gradient then), else None. ``deterministic=True``
    runs ``backend="auto-invariant"``. ``min_seqlen_k``, ``num_splits``, ``pack_gqa``,
    ``scheduler_metadata``, ``seqlen_k_per_split`` and ``disable_scheduler_metadata`` only
    steer FA4's kernels: checked, then ignored.

    Not supported (``ValueError`` naming the argument): ``qv``, ``seqused_q/k``,
    ``gather_kv_indices`` (and its ``gather_bwd_*``), ``page_table``, ``score_mod(_bwd)``,
    ``mask_mod``, ``block_sparse_tensors``, ``aux_tensors/aux_scalars``, ``cu_seqlens_q`` unlike
    ``cu_seqlens_k`` or None (FA4's fixed-length rows: use :func:`doc_packed.doc_packed_attn`),
    a window side left negative.
    """
    _check_unsupported(
        dict(
            qv=qv,
            seqused_q=seqused_q,
            seqused_k=seqused_k,
            gather_kv_indices=gather_kv_indices,
            page_table=page_table,
            score_mod=score_mod,
            score_mod_bwd=score_mod_bwd,
            mask_mod=mask_mod,
            block_sparse_tensors=block_sparse_tensors,
        ),
        aux_tensors,
        aux_scalars,
        gather_bwd_recompute_p,
        gather_bwd_token_chunk,
    )
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu is None:
            raise _unsupported(
                name,
                None,
                "this drop-in takes packed [T, H, D] tokens with one cu_seqlens for queries and keys: pass it "
                "as both cu_seqlens_q and cu_seqlens_k (fixed-length rows [B, S, H, D]: doc_packed.doc_packed_attn)",
            )
    for name, flag in (("causal", causal), ("deterministic", deterministic), ("return_lse", return_lse)):
        _check_flag(name, flag)
    _check_hints(min_seqlen_k, num_splits, pack_gqa, seqlen_k_per_split, disable_scheduler_metadata)
    is_causal, window = _window(causal, window_size)
    cap = _softcap(softcap)
    _check_sink(learnable_sink, q)
    _same_boundaries("cu_seqlens_q", "cu_seqlens_k", cu_seqlens_q, cu_seqlens_k)
    out, lse = doc_packed_attn_varlen(
        q,
        k,
        v,
        cu_seqlens_q,  # type: ignore[arg-type]
        _bound(max_seqlen_q, max_seqlen_k),
        causal=is_causal,
        window_size=window,
        scale=softmax_scale,
        return_lse=True,  # computed in every call: returning it costs nothing
        backend="auto-invariant" if deterministic else "auto",
        sinks=learnable_sink,
        softcap=cap,
    )
    if return_lse:
        return out, lse
    wants_grad = any(t is not None and t.requires_grad for t in (q, k, v, learnable_sink))
    return out, lse.detach() if wants_grad else None
