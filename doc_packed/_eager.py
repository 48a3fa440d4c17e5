"""The attention call with autograd: the custom op where torch must see it, a lean path elsewhere.

:func:`attention` is what :func:`doc_packed.doc_packed_attn` calls after validation. Where torch
has to see ``doc_packed::attn_fwd`` as an op (``torch.compile``, ``torch.jit`` tracing, DTensor
and other tensor subclasses, fake or meta tensors, functorch transforms, any dispatch or
function mode: FlopCounterMode, selective activation checkpointing, AutoParallel's tracing) it
calls the custom op. Otherwise, in plain eager code on real tensors, it runs the op's own
implementations (:func:`doc_packed.ops.forward_impl` / :func:`~doc_packed.ops.backward_impl`)
under a plain :class:`torch.autograd.Function` with the same gradient rule
(:func:`doc_packed.ops.input_grads`). Same kernels, same saved tensors, same results bit for bit;
what it skips is the dispatcher's custom-op machinery, which on torch 2.11 costs ~60-80 us per
op call plus ~300 us for the autograd wrapper around a forward+backward on an H200's host
(docs/kernels.md, "Host cost per call"): more than FA4's own launch at short sequence lengths.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from . import _compat, ops

__all__ = ["attention", "takes_eager_path"]


def takes_eager_path(*tensors: torch.Tensor) -> bool:
    """Whether :func:`attention` would skip the custom op for these inputs (see the module doc)."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing() or _compat.modes_active():
        return False
    for t in tensors:
        if type(t) is not torch.Tensor or t.device.type == "meta" or _compat.is_functorch_wrapped(t):
            return False
    return True


class _Attention(torch.autograd.Function):
    """``attn_fwd`` and its gradient rule without the dispatcher (real tensors, eager only). Its
    arguments are flat, as the op's: autograd sees the tensors among them (``sinks``' gradient)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, *args):
        out, lse = ops.forward_impl(q, k, v, cu_seqlens, *args)
        ctx.save_for_backward(q, k, v, cu_seqlens, out, lse)
        ctx.args = args
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, dout, dlse):
        if _compat.profiler_enabled():
            with torch.profiler.record_function("doc_packed::attn_bwd"):
                grads = ops.input_grads(*_grad_args(ctx, dout, dlse))
        else:
            grads = ops.input_grads(*_grad_args(ctx, dout, dlse))
        return ops.autograd_outputs(grads)


def _grad_args(ctx, dout, dlse) -> tuple:
    return ctx.saved_tensors, ctx.args, dout, dlse, ops.forward_impl, ops.backward_impl


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: ops.Call, *, need_lse: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``doc_packed::attn_fwd(q, k, v, *call)`` with autograd: ``(out, lse)``.
    ``need_lse=False``: the caller drops lse, which may then be None (no graph, FA4)."""
    # the optional tensors (sinks, prefix_lens) decide the path as q, k, v do
    optional = [t for t in (call.sinks, call.prefix_lens) if t is not None]
    if not takes_eager_path(q, k, v, call.cu_seqlens, *optional):
        return torch.ops.doc_packed.attn_fwd(q, k, v, *call)
    if _compat.profiler_enabled():  # traces name the call as they name the op
        with torch.profiler.record_function("doc_packed::attn_fwd"):
            return _run(q, k, v, call, need_lse)
    return _run(q, k, v, call, need_lse)


def _run(q, k, v, call: ops.Call, need_lse: bool):
    sinks = call.sinks
    if torch.is_grad_enabled() and (
        q.requires_grad or k.requires_grad or v.requires_grad or (sinks is not None and sinks.requires_grad)
    ):
        return _Attention.apply(q, k, v, *call)
    if need_lse:
        return ops.forward_impl(q, k, v, *call)
    return ops.forward_out(q, k, v, *call), None
