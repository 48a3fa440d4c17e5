"""Drop-ins with the peers' exact signatures and defaults, over :func:`doc_packed_attn_varlen`.

Change one import and keep the call::

    from flash_attn import flash_attn_varlen_func            # flash-attention 2.x
    from doc_packed.compat import flash_attn_varlen_func     # same arguments, same defaults

    from torch.nn.attention.varlen import varlen_attn        # torch 2.11 / 2.13
    from doc_packed.compat import varlen_attn

    from flash_attn.cute import flash_attn_varlen_func       # FlashAttention-4 (flash-attn-4)
    from doc_packed.compat.cute import flash_attn_varlen_func

Each keeps its library's defaults (full attention inside each document unless the call asks for
a causal mask or a window) and its mask rules, written out in docs/coming_from.md and tested
against a float64 oracle of the peer's semantics in tests/test_compat.py. What doc-packed cannot
do raises ``ValueError`` naming the argument, before any kernel: dropout, ALiBi, paged or cached
K/V, and queries and keys with different boundaries (doc-packed is self-attention over one
``cu_seqlens``). FlashAttention-4's interface lives in :mod:`doc_packed.compat.cute`, as FA4's
own lives in ``flash_attn.cute``: the same function name with another argument list.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .. import _compat
from .._checks import check_max_seqlen_arg
from ..varlen import doc_packed_attn_varlen

__all__ = ["flash_attn_varlen_func", "varlen_attn"]


def _unsupported(name: str, value: object, why: str) -> ValueError:
    shown = f"a {type(value).__name__}" if isinstance(value, torch.Tensor) else repr(value)
    return ValueError(f"{name}={shown} is not supported by doc_packed: {why}")


def _window(name: str, window_size: object) -> tuple[int, int]:
    """flash's and torch's window: any negative side is unbounded (their kernels test ``< 0``)."""
    if (
        not isinstance(window_size, Sequence)
        or len(window_size) != 2
        or not all(isinstance(w, int) and not isinstance(w, bool) for w in window_size)
    ):
        raise TypeError(f"{name} must be a pair of ints (left, right), -1 unbounded; got {window_size!r}")
    left, right = window_size
    return (-1 if left < 0 else left, -1 if right < 0 else right)


def _same_boundaries(name_q: str, name_k: str, cu_q: object, cu_k: object) -> None:
    """One ``cu_seqlens`` serves queries and keys. The same tensor costs nothing; two tensors are
    compared by value (one device sync in eager code, an in-graph assertion under compile)."""
    if cu_k is cu_q:
        return
    if not isinstance(cu_q, torch.Tensor) or not isinstance(cu_k, torch.Tensor):
        raise TypeError(f"{name_q} and {name_k} must be tensors, got {type(cu_q).__name__} and {type(cu_k).__name__}")
    if cu_q.shape != cu_k.shape:
        raise _cross(name_q, name_k, f"shapes {tuple(cu_q.shape)} and {tuple(cu_k.shape)}")
    if torch.compiler.is_compiling():
        _compat.assert_async((cu_q == cu_k).all(), f"{name_q} and {name_k} differ: doc_packed is self-attention")
    elif not torch.equal(cu_q, cu_k.to(cu_q.dtype)):
        raise _cross(name_q, name_k, "values")


def _cross(name_q: str, name_k: str, what: str) -> ValueError:
    return ValueError(
        f"{name_q} and {name_k} differ ({what}): doc_packed attends within one set of document "
        f"boundaries (self-attention). Pass the same tensor as both; cross-attention and KV caches "
        "are not supported"
    )


def _max_seqlen(names: tuple[str, str], max_q: object, max_k: object) -> int | None:
    """Both bounds must be ints (the peers require them) and the smaller must bound the longest
    document, checked in eager calls; under compile neither int is read, so a new value each
    step does not recompile."""
    if torch.compiler.is_compiling():
        return None
    for name, value in zip(names, (max_q, max_k)):
        if value is None:
            raise TypeError(f"{name} must be an int (an upper bound of the document lengths), got None")
        check_max_seqlen_arg(value, name)
    return min(max_q, max_k)  # type: ignore[call-overload]


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: torch.Tensor | None = None,
) -> Any:
    """flash-attention 2's ``flash_attn_varlen_func``, same arguments, order and defaults.

    Semantics as flash's kernel applies them: ``causal=True`` sets the right window to 0 (a
    ``window_size[1] > 0`` is ignored, where :func:`doc_packed_attn_varlen` raises); a negative
    window side is unbounded, so ``(-1, -1)`` is no window and ``causal=False,
    window_size=(-1, 0)`` is causal; ``softcap=0.0`` is off (a negative one raises: flash would
    ignore it). ``deterministic=True`` runs ``backend="auto-invariant"`` (the math kernel, whose
    backward is deterministic and batch-invariant: slower than flash on a GPU).
    ``return_attn_probs=True`` returns ``(out, softmax_lse [H, T] float32, S_dmask)`` where
    ``S_dmask`` is empty, as flash returns it without dropout.

    Not supported (``ValueError`` naming the argument): ``dropout_p > 0``, ``alibi_slopes``,
    ``block_table``, ``cu_seqlens_q`` unlike ``cu_seqlens_k``.
    """
    if not isinstance(dropout_p, (int, float)) or isinstance(dropout_p, bool) or dropout_p != 0:
        raise _unsupported("dropout_p", dropout_p, "no attention dropout; pass dropout_p=0.0")
    if alibi_slopes is not None:
        raise _unsupported("alibi_slopes", alibi_slopes, "no ALiBi bias; pass alibi_slopes=None")
    if block_table is not None:
        raise _unsupported("block_table", block_table, "no paged KV cache; pass block_table=None")
    if not isinstance(return_attn_probs, bool):
        raise TypeError(f"return_attn_probs must be a bool, got {type(return_attn_probs).__name__}")
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap must be a float (0.0: off), got {type(softcap).__name__}")
    if softcap < 0:
        raise ValueError(f"softcap={softcap} is negative; flash-attention ignores it, doc_packed asks: 0.0 is off")
    _same_boundaries("cu_seqlens_q", "cu_seqlens_k", cu_seqlens_q, cu_seqlens_k)
    left, right = _window("window_size", window_size)
    if causal:
        right = 0  # flash: "if (is_causal) window_size_right = 0"
    out = doc_packed_attn_varlen(
        q,
        k,
        v,
        cu_seqlens_q,
        _max_seqlen(("max_seqlen_q", "max_seqlen_k"), max_seqlen_q, max_seqlen_k),
        causal=causal,
        window_size=(left, right),
        scale=softmax_scale,
        softcap=float(softcap) if softcap > 0 else None,
        return_lse=return_attn_probs,
        backend="auto-invariant" if deterministic else "auto",
    )
    if not return_attn_probs:
        return out
    out, lse = out
    return out, lse, q.new_empty(0)  # flash's S_dmask without dropout: an empty tensor


def varlen_attn(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor | None,
    max_q: int,
    max_k: int,
    *,
    return_aux: Any | None = None,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    enable_gqa: bool = False,
    seqused_k: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> Any:
    """torch's ``torch.nn.attention.varlen.varlen_attn``, torch 2.13's signature and defaults
    (2.11's is the same without ``enable_gqa``, ``seqused_k``, ``block_table``, ``num_splits``).

    Semantics as torch's: no ``is_causal``; ``window_size=(-1, -1)`` (default) is full
    attention, ``(-1, 0)`` causal, ``(W, 0)`` a causal window of ``W`` keys before the query;
    ``return_aux=AuxRequest(lse=True)`` also returns the lse ``[H_q, T]`` (float32). GQA needs no
    ``enable_gqa`` (``H_q % H_kv == 0`` is GQA, as on torch 2.11; 2.13 raises without it, so
    accepting is the superset and never changes a result). ``num_splits=1`` (torch: "enables
    batch invariance") runs ``backend="auto-invariant"``; other values only tune torch's kernel
    and are ignored.

    Not supported (``ValueError`` naming the argument): ``seqused_k``, ``block_table``,
    ``cu_seq_k`` unlike ``cu_seq_q`` (or None).
    """
    if seqused_k is not None:
        raise _unsupported("seqused_k", seqused_k, "no KV cache; pass seqused_k=None")
    if block_table is not None:
        raise _unsupported("block_table", block_table, "no paged KV cache; pass block_table=None")
    if cu_seq_k is None:
        raise _unsupported("cu_seq_k", None, "it is torch's paged-KV form; pass cu_seq_q's tensor")
    if not isinstance(enable_gqa, bool):
        raise TypeError(f"enable_gqa must be a bool, got {type(enable_gqa).__name__}")
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int)):
        raise TypeError(f"num_splits must be an int or None, got {type(num_splits).__name__}")
    want_lse = return_aux is not None and bool(getattr(return_aux, "lse", False))
    _same_boundaries("cu_seq_q", "cu_seq_k", cu_seq_q, cu_seq_k)
    out = doc_packed_attn_varlen(
        query,
        key,
        value,
        cu_seq_q,
        _max_seqlen(("max_q", "max_k"), max_q, max_k),
        causal=False,  # torch's mask is the window alone: (-1, 0) is causal
        window_size=_window("window_size", window_size),
        scale=scale,
        return_lse=want_lse,
        backend="auto-invariant" if num_splits == 1 else "auto",
    )
    return out
