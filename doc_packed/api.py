"""The public entry point, :func:`doc_packed_attn`, and :func:`planning`, the cost hint it carries."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch
import torch.distributed as dist

from . import _compat, _eager, kernels, ops
from ._checks import (
    INT32_MAX,
    argument_error,
    check_length,
    check_qkv,
    check_scale,
    check_variants,
    check_window,
    cp_layout_error,
    describe,
)
from ._doc_layout import get_layout

__all__ = ["doc_packed_attn", "planning"]

_hints: list[tuple[int, str | None]] = []  # (doc_len, cp_dim) of each open ``planning`` block


@contextlib.contextmanager
def planning(*, doc_len: int | None, cp_dim: str | None = None) -> Iterator[None]:
    """Planning hints that :func:`doc_packed_attn` calls made inside this block carry.

    - ``doc_len``: the mean document length cost estimates on fake tensors assume (``None``:
      one document per row, the default outside any block); a call's own
      ``planning_doc_len=`` wins.
    - ``cp_dim``: the name of the mesh dim that may shard the sequence. The sharding rules then
      offer the sequence placement on that dim only, and price the context-parallel exchange on
      its links. Without it every dim is offered, and the exchange is priced on the dim whose
      size matches the shard (the slowest such dim when several do, e.g. 8 hosts x 8 GPUs).

    Wrap tracing with it: ``with dp.planning(doc_len=2048, cp_dim="cp"), AutoParallel(...)``.
    The hints become arguments of every traced attention call, so the graph, AutoParallel's
    cost cache and :func:`shardings.autoparallel.describe_attention` all see the values the
    model was planned with; two models planned with different hints never share costs.
    """
    if cp_dim is not None and not isinstance(cp_dim, str):
        raise TypeError(f"cp_dim must be a mesh dim name (str) or None, got {type(cp_dim).__name__}")
    _hints.append((_check_doc_len(doc_len), cp_dim))
    try:
        yield
    finally:
        _hints.pop()


def _check_doc_len(doc_len: object) -> int:
    if doc_len is None:
        return 0
    if isinstance(doc_len, bool) or not isinstance(doc_len, int) or not 1 <= doc_len <= INT32_MAX:
        raise ValueError(
            f"planning_doc_len must be a positive int (at most 2**31 - 1) or None, got {describe(doc_len)}"
        )
    return doc_len


@torch.compiler.assume_constant_result
def _group_size(group_name: str) -> int:
    """Size of a named process group: a constant to torch.compile (no graph break)."""
    return dist.get_world_size(_compat.resolve_process_group(group_name))


def _group_name(group: dist.ProcessGroup | str) -> tuple[str, int]:
    if isinstance(group, str):
        return group, _group_size(group)
    if isinstance(group, dist.ProcessGroup):
        return group.group_name, dist.get_world_size(group)
    raise TypeError(f"cp_group must be a ProcessGroup or a group name, got {type(group).__name__}")


def _as_dtensor_like(q: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """A plain ``cu_seqlens`` (or ``sinks``, ``prefix_lens``) next to DTensor inputs describes the
    whole batch: replicate it."""
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(q, DTensor) and "shardings" not in sys.modules:
        raise RuntimeError(
            "q is a DTensor but the doc_packed sharding rules are not registered: "
            "`import shardings` once (it registers them with DTensor)"
        )
    if isinstance(q, DTensor) and not isinstance(cu_seqlens, DTensor):
        return DTensor.from_local(cu_seqlens, q.device_mesh, [Replicate()] * q.device_mesh.ndim, run_check=False)
    return cu_seqlens


def is_dtensor(x: object) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(x, DTensor)


_VALIDATED: dict[tuple, tuple] = {}  # call signature -> _validated's result (see _validated_once)
_VALIDATED_SIZE = 256


def _validated_once(*args):
    """:func:`_validated`, remembered per call signature: the tensors' type, shape, strides, dtype
    and device, every other argument with its type, and the innermost :func:`planning` block. Its
    rules read metadata only, so a model calling attention with the same shapes in every layer
    pays for them once (~20-40 us of Python per call otherwise; docs/kernels.md, "Host cost per call").
    Plain tensors only, in eager code, with a ``ProcessGroup`` or no group (a group *name* may
    be rebound to another group); failures are never remembered."""
    key: list = [_hints[-1] if _hints else None]
    for a in args:
        if isinstance(a, torch.Tensor):
            if type(a) is not torch.Tensor or a.layout is not torch.strided:
                return _validated(*args)
            key.append((a.shape, a.stride(), a.dtype, a.device))
        else:
            key.append((type(a), a))  # True == 1 == 1.0, but only one of them passes
    try:
        sig = tuple(key)
        hit = _VALIDATED.get(sig)
    except TypeError:  # an unhashable argument (a list window_size): validate every time
        return _validated(*args)
    if hit is None:
        hit = _validated(*args)
        if len(_VALIDATED) >= _VALIDATED_SIZE:
            _VALIDATED.clear()
        _VALIDATED[sig] = hit
    return hit


def _validated(q, k, v, cu_seqlens, causal, window_size, scale, backend, cp_group, seq_len, planning_doc_len):
    """Every per-call rule of :func:`doc_packed_attn` (metadata only; the op checks the values of
    ``cu_seqlens``): ``(left, right, scale, seq_len, group_name, doc_len, cp_dim)`` for the op."""
    check_qkv(q, k, v, cu_seqlens, shard=cp_group is not None)
    left, right = check_window(causal, window_size)
    scale = check_scale(scale, q.shape[-1])
    if not torch.compiler.is_compiling():  # the op checks again when it runs (compiled too)
        kernels.check_backend(backend, q, k.shape[2])
    elif backend not in kernels.BACKENDS:
        raise ValueError(f"backend must be one of {kernels.BACKENDS}, got {describe(backend)}")
    local_len = q.shape[1]
    group_name = None
    if cp_group is not None:
        group_name, cp_size = _group_name(cp_group)
        seq_len = local_len * cp_size if seq_len is None else check_length("seq_len", seq_len)
    elif seq_len is not None and seq_len != local_len:
        raise ValueError(
            f"seq_len={describe(seq_len)} differs from q's sequence length {local_len}; seq_len is only "
            "for context-parallel calls (cp_group=...)"
        )
    else:
        seq_len = local_len
    doc_len, cp_dim = _hints[-1] if _hints else (0, None)
    if planning_doc_len is not None:
        doc_len = _check_doc_len(planning_doc_len)
    return left, right, scale, seq_len, group_name, doc_len, cp_dim


def doc_packed_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
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
    """Attention that stays inside each packed document.

    Args:
        q: ``[B, S, H_q, D]``. k, v: ``[B, S, H_kv, D]`` with ``H_q % H_kv == 0`` (GQA/MQA
            without repeating K/V). One dtype (fp16/bf16/fp32; fp64 on CPU), one device.
        cu_seqlens: ``[B, MAX_DOCS + 1]`` int32 document boundaries per row: starts at 0,
            non-decreasing, ends at ``S``; unused slots repeat ``S``.
        causal: required, no default (flash-attention and torch default to full attention,
            doc-packed 0.1 defaulted to causal: a default would change some port's mask
            silently). ``True``: a query sees only keys at or before its own position;
            ``False``: every key of its document (within ``window_size``).
        window_size: ``(left, right)`` in-document window, ``-1`` unbounded; ``(-1, -1)``
            (the default) is no window, as in flash-attention. A query at position ``p``
            sees ``p'`` when ``p' >= p - left`` and ``p' <= p`` (causal) or
            ``p' <= p + right``. ``right > 0`` with ``causal=True`` is an error (flash
            ignores that ``right``; :mod:`doc_packed.compat` follows flash).
        scale: softmax scale, default ``D ** -0.5``.
        return_lse: also return the log-sum-exp ``[B, H_q, S]`` (float32; float64 for
            float64 inputs, natural log). Gradients through it are supported.
        backend: ``"auto"`` (default: the fastest that takes the input), ``"fa4"``,
            ``"flex"``, ``"flash"`` or ``"math"`` (see :mod:`doc_packed.kernels`);
            ``"auto-isolated"``: the fastest that keeps a NaN/Inf inside its document;
            ``"auto-invariant"``: the fastest batch-invariant one (docs/contract.md).
        cp_group: run context-parallel over this group: ``q/k/v`` are this rank's
            ``torch.chunk`` of the sequence dim, ``cu_seqlens`` is the whole rows' layout.
        seq_len: with ``cp_group``, the whole row length when the chunks are uneven
            (default: local length times group size).
        planning_doc_len: mean document length that cost estimates on fake tensors assume
            (AutoParallel's solver, compile-time flop counts); real runs count exactly. Default:
            the innermost :func:`planning` block's, else one document per row.
        sinks: ``[H_q]`` float learnable sink logits (gpt-oss): one extra logit per head in each
            query's softmax denominator, with no value. Differentiable; the returned lse
            includes it (FA4's convention).
        softcap: logit softcapping (Gemma 2): each scaled logit ``s`` becomes
            ``softcap * tanh(s / softcap)``; a positive float, None for none.
        prefix_lens: ``[B, MAX_DOCS]`` int32/int64, per document slot of ``cu_seqlens``, the
            length of the document's bidirectional prefix (image or prompt tokens): inside it
            every query sees every prefix key; the rest stays causal. Needs ``causal=True``;
            a left window limits only queries after the prefix.
        return_max_logits: also return the ``[H_q]`` max logits (float32; float64 for float64
            inputs), the largest visible scaled post-softcap logit per head over every query
            (MagiAttention's, for clipping q/k weights). No gradient; costs one extra pass
            (flex's forward with its row max where flex runs, else the math kernel's ``Q K^T``).

    ``v`` may have its own head dim ``D_v`` (e.g. 192 / 128): ``out`` is then ``[B, S, H_q, D_v]``.

    Returns:
        ``out`` ``[B, S, H_q, D_v]`` in q's dtype, then ``lse`` if ``return_lse``, then the max
        logits if ``return_max_logits``.
    """
    return attention(
        q,
        k,
        v,
        cu_seqlens,
        causal,
        window_size,
        scale,
        return_lse,
        backend,
        cp_group,
        seq_len,
        planning_doc_len,
        sinks=sinks,
        softcap=softcap,
        prefix_lens=prefix_lens,
        return_max_logits=return_max_logits,
    )


def _variant_args(q, k, v, cu_seqlens, causal, backend, sinks, softcap, prefix_lens, return_max_logits):
    """The variants' checks (metadata only): the call's ``(softcap, sinks, prefix_lens)``,
    ``(0.0, None, None)`` for a plain call."""
    if sinks is None and softcap is None and prefix_lens is None and return_max_logits is False:
        if backend in kernels.AUTO_MODES or v.shape[-1] == q.shape[-1]:
            return _PLAIN  # the plain call (a forced backend was checked with it in _validated)
    cap = check_variants(q, cu_seqlens, causal, sinks, softcap, prefix_lens, return_max_logits)
    if backend not in kernels.AUTO_MODES and not torch.compiler.is_compiling():
        kernels.check_backend(backend, q, k.shape[2], kernels.Variant.of(q, v, cap))
    return cap, sinks, prefix_lens


_PLAIN = (0.0, None, None)


def attention(
    q,
    k,
    v,
    cu_seqlens,
    causal,
    window_size,
    scale,
    return_lse,
    backend,
    cp_group,
    seq_len,
    planning_doc_len,
    max_seqlen=None,
    *,
    sinks=None,
    softcap=None,
    prefix_lens=None,
    return_max_logits=False,
):
    """:func:`doc_packed_attn`'s body, shared with :func:`doc_packed.doc_packed_attn_varlen`
    (which passes its packed tensors as one row and its ``max_seqlen``)."""
    try:
        check = _validated if isinstance(cp_group, str) or torch.compiler.is_compiling() else _validated_once
        left, right, scale, seq_len, group_name, doc_len, cp_dim = check(
            q, k, v, cu_seqlens, causal, window_size, scale, backend, cp_group, seq_len, planning_doc_len
        )
        cap, sinks, prefix_lens = _variant_args(
            q, k, v, cu_seqlens, causal, backend, sinks, softcap, prefix_lens, return_max_logits
        )
    except (TypeError, ValueError) as err:
        if not torch.compiler.is_compiling() or is_dtensor(q):
            if cp_group is not None and not torch.compiler.is_compiling():
                from .cp.attention import reject

                reject(cp_group, err)  # the group's other ranks raise too, instead of waiting
            raise
        return in_graph_error(q, err, return_lse, return_max_logits)
    if not torch.compiler.is_compiling() and max_seqlen is not None:  # the int stays unread under compile
        check_max_seqlen(cu_seqlens, seq_len, max_seqlen)
    if type(q) is not torch.Tensor:
        cu_seqlens = _as_dtensor_like(q, cu_seqlens)
        if is_dtensor(q):  # plain sinks / prefix_lens beside DTensors: replicated
            sinks, prefix_lens = (None if t is None else _as_dtensor_like(q, t) for t in (sinks, prefix_lens))
    call = ops.Call(
        cu_seqlens=cu_seqlens,
        seq_len=seq_len,
        causal=causal,
        window_left=left,
        window_right=right,
        scale=scale,
        backend=backend,
        cp_group=group_name,
        planning_doc_len=doc_len,
        planning_cp_dim=cp_dim,
        softcap=cap,
        sinks=sinks,
        prefix_lens=prefix_lens,
    )
    if group_name is None or torch.compiler.is_compiling():
        out, lse = _eager.attention(q, k, v, call, need_lse=return_lse)
    else:
        try:
            out, lse = _eager.attention(q, k, v, call, need_lse=return_lse)
        except ValueError as err:  # a rank's own chunk of cu_seqlens: say that it is global
            better = cp_layout_error(err, seq_len, _group_size(group_name))
            if better is err:
                raise
            raise better from None
    result = (out, lse) if return_lse else (out,)
    if return_max_logits:
        # attn_max_logits takes the call's fields it names (ops.MAX_ARGS)
        fields = (getattr(call, name) for name in ops.MAX_ARGS[2:])
        result = (*result, torch.ops.doc_packed.attn_max_logits(q.detach(), k.detach(), *fields))
    return result if len(result) > 1 else out


def in_graph_error(q: object, err: Exception, return_lse: bool, return_max_logits: bool = False):
    """Under torch.compile(fullgraph=True) a raise would become a dynamo ``Unsupported``: put the
    error into the graph instead, so the compiled call raises it, before any kernel."""
    out, lse = argument_error(
        q if isinstance(q, torch.Tensor) else torch.empty(0),
        "TypeError" if isinstance(err, TypeError) else "ValueError",
        err.args[0],
    )
    result = (out, lse) if return_lse else (out,)
    if return_max_logits is True:
        result = (*result, lse.new_empty(lse.shape[1:2]))
    return result if len(result) > 1 else out


def check_max_seqlen(cu_seqlens: torch.Tensor, seq_len: int, max_seqlen: int) -> None:
    """``max_seqlen`` must bound the longest document (read from the cached layout: no sync once
    the layout is known; a DTensor ``cu_seqlens`` is checked when it is replicated)."""
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(cu_seqlens, DTensor):
        if any(p != Replicate() for p in cu_seqlens.placements):
            return  # each shard is checked by the op; the bound needs every row
        cu_seqlens = cu_seqlens.to_local()
    layout = get_layout(cu_seqlens, seq_len)
    longest = layout.derived(("longest_doc",), lambda: max((e - s for row in layout.rows for s, e in row), default=0))
    if max_seqlen < longest:
        raise ValueError(
            f"max_seqlen={max_seqlen} is smaller than the longest document in cu_seqlens ({longest} tokens); "
            "pass an upper bound of the document lengths (flash-attention would read past it)"
        )
