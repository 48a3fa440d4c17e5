"""The ``doc_packed`` custom ops: forward and backward, fake kernels, autograd, flop formulas.

``doc_packed::attn_fwd(q, k, v, cu_seqlens, seq_len, causal, window_left, window_right, scale,
backend, cp_group, planning_doc_len, planning_cp_dim) -> (out, lse)`` and ``doc_packed::attn_bwd(dout, q, k, v,
out, lse, cu_seqlens, ...same...) -> (dq, dk, dv)``. :data:`FWD_ARGS` / :data:`BWD_ARGS` are the
one place these positions are written down; :func:`arg_index` reads them.

``seq_len`` is the length of a *whole* row. When ``q.shape[1] == seq_len`` the call is local.
When it is smaller, the tensors are this rank's ``torch.chunk`` of the sequence dim and
``cp_group`` must name the process group holding the other chunks: the call then runs the
context-parallel exchange (:mod:`doc_packed.cp`). Sharding rules and AutoParallel see the
sequence-sharded call through that mismatch, which is also how the flop formula knows the
sequence-parallel degree from local shapes alone.

``planning_doc_len`` and ``planning_cp_dim`` only shape planning: the mean document length cost
estimates on fake tensors assume when ``cu_seqlens`` has no values (0: one document per row),
and the mesh dim name that may shard the sequence (None: any). They travel with the call, so a
traced graph, the sharding rules and AutoParallel's cost cache carry them
(:func:`doc_packed.planning`).

Autograd saves ``(q, k, v, cu_seqlens, out, lse)`` and calls ``attn_bwd``: the forward is never recomputed.
A gradient flowing into ``lse`` (when the caller uses it) is handled by composing the two ops.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils.flop_counter import register_flop_formula

from . import _variants, flops, kernels
from ._call import Call
from ._doc_layout import DocLayout, cp_degree, get_layout
from .kernels import lse_dtype

__all__ = [
    "BWD_ARGS",
    "Call",
    "FWD_ARGS",
    "HOST_WORK_TAGS",
    "MAX_ARGS",
    "arg_index",
    "node_arg",
    "attn_bwd",
    "attn_fwd",
    "attn_max_logits",
    "autograd_outputs",
    "backward_impl",
    "cp_degree",
    "forward_impl",
    "input_grads",
    "lse_dtype",
]

# (name, schema type, default) of the arguments both ops share, after their tensors
_SHARED: tuple[tuple[str, str, str | None], ...] = (
    ("cu_seqlens", "Tensor", None),
    ("seq_len", "int", None),
    ("causal", "bool", None),
    ("window_left", "int", None),
    ("window_right", "int", None),
    ("scale", "float", None),
    ("backend", "str", None),
    ("cp_group", "str?", None),
    ("planning_doc_len", "int", "0"),
    ("planning_cp_dim", "str?", "None"),
    # attention variants (docs/contract.md, "Variants"): 0.0 / None is the plain op
    ("softcap", "float", "0.0"),
    ("sinks", "Tensor?", "None"),
    ("prefix_lens", "Tensor?", "None"),
)
FWD_ARGS: tuple[str, ...] = ("q", "k", "v", *(n for n, _, _ in _SHARED))
BWD_ARGS: tuple[str, ...] = ("dout", "q", "k", "v", "out", "lse", *(n for n, _, _ in _SHARED))

# Every call does host work a recorded CUDA graph would skip on replay (reading the layout of
# cu_seqlens, its per-layout offsets, a context-parallel call's agreement and exchange), so
# Inductor must run these ops between its CUDA graphs (graph partitions) or record none:
# torch.compile(mode="reduce-overhead") then stays correct (tests/test_gpu_cudagraphs.py).
HOST_WORK_TAGS: tuple[torch.Tag, ...] = (torch.Tag.cudagraph_unsafe,)


assert tuple(Call.__annotations__) == tuple(n for n, _, _ in _SHARED), "Call and the schema list the same arguments"


def _schema(tensors: tuple[str, ...], outputs: int) -> str:
    args = [f"Tensor {n}" for n in tensors] + [f"{t} {n}" + (f"={d}" if d else "") for n, t, d in _SHARED]
    return f"({', '.join(args)}) -> ({', '.join(['Tensor'] * outputs)})"


# ``attn_max_logits``'s arguments (its schema below): after q and k, fields of :class:`Call`
MAX_ARGS: tuple[str, ...] = (
    "q",
    "k",
    "cu_seqlens",
    "seq_len",
    "causal",
    "window_left",
    "window_right",
    "scale",
    "cp_group",
    "softcap",
    "prefix_lens",
    "backend",
)


def arg_index(op: object, name: str) -> int:
    """Position of argument ``name`` in ``op`` (``attn_fwd``/``attn_bwd``/``attn_max_logits``,
    packet or overload)."""
    if op in (torch.ops.doc_packed.attn_fwd, torch.ops.doc_packed.attn_fwd.default):
        return FWD_ARGS.index(name)
    if op in (torch.ops.doc_packed.attn_max_logits, torch.ops.doc_packed.attn_max_logits.default):
        return MAX_ARGS.index(name)
    return BWD_ARGS.index(name)


def node_arg(node: Any, name: str, default: Any = None) -> Any:
    """Argument ``name`` of a traced call of one of these ops (an FX node: positional or
    keyword), ``default`` where the call left it out."""
    i = arg_index(node.target, name)
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


def local_spec(
    layout: DocLayout, causal: bool, left: int, right: int, prefixes: tuple[tuple[int, ...], ...] | None = None
) -> kernels.VarlenSpec:
    """One segment per non-empty document, rows flattened ``[B, S] -> [B * S]``; ``prefixes``:
    per row, each non-empty document's bidirectional prefix (:func:`doc_packed._variants.prefixes`)."""
    S = layout.seq_len
    cu = [0]
    for b, row in enumerate(layout.rows):
        cu.extend(b * S + e for _, e in row)
    flat = None if prefixes is None else [p for row in prefixes for p in row]
    return kernels.VarlenSpec(cu, cu, causal, left, right, row_len=S, prefix=flat)


def _local_problem(cu_seqlens, seq_len, causal, left, right, prefix_lens=None) -> kernels.VarlenSpec:
    """The kernels' problem of a local call: its layout's, memoised on the layout."""
    layout = get_layout(cu_seqlens, seq_len)
    prefixes = None if prefix_lens is None else _variants.prefixes(cu_seqlens, prefix_lens)
    return layout.derived(
        ("local_spec", causal, left, right, prefixes), lambda: local_spec(layout, causal, left, right, prefixes)
    )


def _call_problem(call: Call) -> kernels.VarlenSpec:
    return _local_problem(
        call.cu_seqlens, call.seq_len, call.causal, call.window_left, call.window_right, call.prefix_lens
    )


def _pad_dim(x: torch.Tensor, width: int) -> torch.Tensor:
    """``x`` with its last dim zero-padded to ``width`` (itself when it is that wide)."""
    return x if x.shape[-1] == width else torch.nn.functional.pad(x, (0, width - x.shape[-1]))


def add_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The sink term joins a finished row (once per query): ``lse' = logaddexp(lse, sink)`` and
    ``out' = out * exp(lse - lse')`` (``out [B, S, H, Dv]``, ``lse [B, H, S]``)."""
    acc = lse.dtype
    new = torch.logaddexp(lse, sinks.to(acc)[None, :, None])
    w = torch.exp(lse - new).transpose(1, 2)[..., None]
    return (out.to(acc) * w).to(out.dtype), new


def _check_local(q: torch.Tensor, seq_len: int) -> None:
    if cp_degree(q.shape[1], seq_len) != 1:
        raise ValueError(
            f"q holds {q.shape[1]} of {seq_len} tokens per row (a sequence shard) but no "
            "context-parallel group was given. Under AutoParallel call "
            "shardings.autoparallel.lower_context_parallel(autop, placement) before "
            "apply_placement; with plain tensors pass cp_group= to doc_packed_attn."
        )


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.flatten(0, 1)  # a view where the strides allow ([B, S] mergeable), else one copy


def forward_impl(q, k, v, *args) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``attn_fwd`` runs on real tensors (also called directly by :mod:`doc_packed._eager`)."""
    out, lse = _forward(q, k, v, Call(*args))
    assert lse is not None
    return out, lse


def forward_out(q, k, v, *args) -> torch.Tensor:
    """:func:`forward_impl`'s output alone, for eager calls that keep neither lse nor a graph: a
    backend that can skip writing lse does (FA4)."""
    return _forward(q, k, v, Call(*args), need_lse=False)[0]


def _forward(q, k, v, call: Call, *, need_lse=True) -> tuple[torch.Tensor, torch.Tensor | None]:
    if call.cp_group is not None:
        from .cp import attention as cp_attention

        d, dv = q.shape[-1], v.shape[-1]
        w = max(d, dv)  # the exchange moves K and V in one buffer: one head dim, zero-padded
        out, lse = cp_attention.forward(_pad_dim(q, w), _pad_dim(k, w), _pad_dim(v, w), call)
        if dv < w:
            out = out[..., :dv].contiguous()
        if call.sinks is not None:  # once per query, after the merge over stages and ranks
            out, lse = add_sinks(out, lse, call.sinks)
    else:
        B, S, Hq, D = q.shape
        if S != call.seq_len:
            _check_local(q, call.seq_len)
        spec = _call_problem(call)
        out, lse = kernels.forward(
            spec, _flat(q), _flat(k), _flat(v), call.scale, call.backend, call.softcap, call.sinks, need_lse
        )
        # contiguous, as the fake kernel promises (flex's out is a transposed view of [H, T, D])
        out = out.view(B, S, Hq, v.shape[-1]).contiguous()
        if lse is not None:
            lse = (lse.view(Hq, B, S).transpose(0, 1) if B > 1 else lse[None]).contiguous()
    return out, lse


def backward_impl(dout, q, k, v, out, lse, *args) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What ``attn_bwd`` runs on real tensors (also called directly by :mod:`doc_packed._eager`).
    ``lse`` includes the sink terms, so the kernels need nothing else for sinks; their gradient
    is :func:`input_grads`'s."""
    call = Call(*args)
    if call.cp_group is not None:
        from .cp import attention as cp_attention

        d, dv = q.shape[-1], v.shape[-1]
        w = max(d, dv)
        dout, q, k, v, out = (_pad_dim(x, w) for x in (dout, q, k, v, out))
        dq, dk, dv_ = cp_attention.backward(dout, q, k, v, out, lse, call)
        if w == d == dv:
            return dq, dk, dv_
        return dq[..., :d].contiguous(), dk[..., :d].contiguous(), dv_[..., :dv].contiguous()
    B, S, Hq, D = q.shape
    if S != call.seq_len:
        _check_local(q, call.seq_len)
    spec = _call_problem(call)
    lse_flat = lse.transpose(0, 1).reshape(Hq, B * S) if B > 1 else lse[0]
    dq, dk, dv = kernels.backward(
        spec,
        _flat(dout.contiguous()),
        _flat(q),
        _flat(k),
        _flat(v),
        _flat(out.contiguous()),
        lse_flat,
        call.scale,
        call.backend,
        call.softcap,
    )
    return dq.view(q.shape).contiguous(), dk.view(k.shape).contiguous(), dv.view(v.shape).contiguous()


@torch.library.custom_op("doc_packed::attn_fwd", mutates_args=(), schema=_schema(FWD_ARGS[:3], 2), tags=HOST_WORK_TAGS)
def attn_fwd(q, k, v, *args) -> tuple[torch.Tensor, torch.Tensor]:
    return forward_impl(q, k, v, *args)


@attn_fwd.register_fake
def _(q, k, v, *args):
    B, S, Hq, _ = q.shape
    return q.new_empty((B, S, Hq, v.shape[3])), q.new_empty((B, Hq, S), dtype=lse_dtype(q.dtype))


@torch.library.custom_op("doc_packed::attn_bwd", mutates_args=(), schema=_schema(BWD_ARGS[:6], 3), tags=HOST_WORK_TAGS)
def attn_bwd(dout, q, k, v, out, lse, *args) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return backward_impl(dout, q, k, v, out, lse, *args)


@attn_bwd.register_fake
def _(dout, q, k, v, *args):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


# ----------------------------------------------------------------------------- autograd


def _setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens, *rest = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, cu_seqlens, out, lse)
    ctx.args = tuple(rest)
    ctx.set_materialize_grads(False)


def input_grads(saved, args: tuple, dout, dlse, fwd, bwd) -> tuple:
    """``(dq, dk, dv, dsinks)`` from the saved ``(q, k, v, cu_seqlens, out, lse)``, the op's
    other arguments and the gradients of ``out`` and ``lse`` (either may be None), with
    ``fwd``/``bwd`` the forward and backward to call: the custom ops, or their implementations
    on the eager path. ``dsinks`` is None without sinks."""
    q, k, v, cu_seqlens, out, lse = saved
    call = Call(cu_seqlens, *args)
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = bwd(dout, q, k, v, out, lse, *call)
    if dlse is not None:
        # d lse_i / d s_ij = p_ij, so the lse gradient adds p_ij * dlse_i to dS:
        #   dq_i += scale * dlse_i * sum_j p_ij k_j     (attention with values := keys)
        #   dk_j += scale * sum_i p_ij dlse_i q_i        (the dV slot of a backward whose
        #                                                 output gradient is scale*dlse*q)
        if call.softcap:
            # through a cap dS_ij = p_ij dlse_i (1 - tanh_ij^2) has a per-pair slope, which the
            # two passes below cannot express: two backwards do (see _capped_lse_grads)
            dq2, dk2 = _capped_lse_grads(q, k, lse, dlse, call, bwd)
            return dq + dq2, dk + dk2, dv, _sink_grad(call, dout, out, lse, dlse)
        w = dlse.to(lse_dtype(q.dtype)).transpose(1, 2)
        w = w[..., None]  # [B, S, Hq, 1]
        pk, _ = fwd(q, k, k, *call)
        dq = dq + (call.scale * w * pk.to(w.dtype)).to(dq.dtype)
        g = (call.scale * w * q.to(w.dtype)).to(q.dtype)
        # only the dV slot is used: any out of g's shape serves (v's head dim may differ)
        out_g = out if out.shape == g.shape else torch.zeros_like(g)
        _, _, dk_extra = bwd(g, q, k, k, out_g, lse, *call)
        dk = dk + dk_extra
    return dq, dk, dv, _sink_grad(call, dout, out, lse, dlse)


def _sink_grad(call: Call, dout, out, lse, dlse):
    """``dsinks`` (None without sinks): ``d out_i / d sink = -p_sink_i out_i`` and
    ``d lse_i / d sink = p_sink_i``, with ``p_sink_i = exp(sink - lse_i)``."""
    sinks = call.sinks
    if sinks is None:
        return None
    acc = lse.dtype
    p_sink = torch.exp(sinks.to(acc)[None, :, None] - lse)  # [B, Hq, S]
    g = -(dout * out).sum(-1, dtype=acc).transpose(1, 2)  # products in out's dtype, summed in acc
    if dlse is not None:
        g = g + dlse.to(acc)
    return (p_sink * g).sum((0, 2)).to(sinks.dtype)


def _capped_lse_grads(q, k, lse, dlse, call: Call, bwd):
    """``(dq, dk)`` of ``sum_i dlse_i lse_i`` under softcapping, where ``dS_ij = p_ij dlse_i
    (1 - tanh_ij^2)`` (the cap's slope per pair), from two ordinary backwards.

    A backward with values ``v' = e_0`` (one column of ones, padded to q's head dim so every
    backend takes it) and output gradient ``dout'_i = dlse_i e_0`` has ``dP_ij = dlse_i`` and
    ``dS = P' (dlse - delta) slope``. With ``lse' = lse - log a`` (so ``P' = a P``) and the output
    that ``P'`` gives, ``out'_i = a m_i e_0`` (``m_i = 1 - p_sink_i``, the keys' share of the row),
    every backend computes the same ``delta_i = a m_i dlse_i`` (from ``out'`` or from ``P' dP``),
    so ``dS(a) = P dlse slope (a - m a^2)``; ``2 dS(1) - dS(2) / 2 = P dlse slope`` exactly."""
    acc = lse.dtype
    w = dlse.to(acc)
    sinks = call.sinks
    mass = -torch.expm1(sinks.to(acc)[None, :, None] - lse) if sinks is not None else torch.ones_like(lse)
    unit = torch.cat([torch.ones_like(k[..., :1]), torch.zeros_like(k[..., 1:])], -1)
    rest = torch.zeros_like(q[..., 1:])
    g = torch.cat([w.transpose(1, 2)[..., None].to(q.dtype), rest], -1)
    parts = []
    for a in (1.0, 2.0):
        o = torch.cat([(mass * a).transpose(1, 2)[..., None].to(q.dtype), rest], -1)
        dq_a, dk_a, _ = bwd(g, q, k, unit, o, lse - math.log(a), *call)
        parts.append((dq_a.to(acc), dk_a.to(acc)))
    (dq1, dk1), (dq2, dk2) = parts
    return (2 * dq1 - 0.5 * dq2).to(q.dtype), (2 * dk1 - 0.5 * dk2).to(k.dtype)


def autograd_outputs(grads: tuple) -> tuple:
    """The gradients of every ``attn_fwd`` argument from :func:`input_grads`'s four."""
    dq, dk, dv, dsinks = grads
    out: list = [dq, dk, dv] + [None] * (len(FWD_ARGS) - 3)
    out[FWD_ARGS.index("sinks")] = dsinks
    return tuple(out)


def _backward(ctx, dout, dlse):
    grads = input_grads(
        ctx.saved_tensors, ctx.args, dout, dlse, torch.ops.doc_packed.attn_fwd, torch.ops.doc_packed.attn_bwd
    )
    return autograd_outputs(grads)


attn_fwd.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------- max logits


@torch.library.custom_op(
    "doc_packed::attn_max_logits",
    mutates_args=(),
    schema=(
        "(Tensor q, Tensor k, Tensor cu_seqlens, int seq_len, bool causal, int window_left, int window_right, "
        "float scale, str? cp_group, float softcap=0.0, Tensor? prefix_lens=None, str backend='auto') -> Tensor"
    ),
    tags=HOST_WORK_TAGS,
)
def attn_max_logits(
    q,
    k,
    cu_seqlens,
    seq_len,
    causal,
    window_left,
    window_right,
    scale,
    cp_group,
    softcap=0.0,
    prefix_lens=None,
    backend="auto",
) -> torch.Tensor:
    """``[H_q]`` max logits (no gradient): the largest visible scaled, softcapped logit per head."""
    call = Call(
        cu_seqlens,
        seq_len,
        causal,
        window_left,
        window_right,
        scale,
        backend,
        cp_group,
        softcap=softcap,
        prefix_lens=prefix_lens,
    )
    if cp_group is not None:
        from .cp import max_logits as cp_max_logits

        return cp_max_logits.max_logits(q, k, call)
    _check_local(q, seq_len)
    return kernels.max_logits(_call_problem(call), _flat(q), _flat(k), scale, softcap, backend)


@attn_max_logits.register_fake
def _(q, k, *args, **kwargs):
    return q.new_empty((q.shape[2],), dtype=lse_dtype(q.dtype))


# ----------------------------------------------------------------------------- flop formulas


def _flop_count(names: tuple[str, ...], args: tuple, kwargs: dict, backward: bool) -> int:
    a = dict(zip(names, args), **kwargs)
    return flops.attention_flops(
        a["q"],
        a["k"].shape[2],
        a["cu_seqlens"],
        a["seq_len"],
        a["causal"],
        a["window_left"],
        a["window_right"],
        a["cp_group"],
        backward=backward,
        doc_len=a.get("planning_doc_len", 0),
        cp_dim=a.get("planning_cp_dim"),
        v_dim=a["v"].shape[-1] if a["v"].shape[-1] != a["q"].shape[-1] else None,
        prefix_lens=a.get("prefix_lens"),
    )


@register_flop_formula(torch.ops.doc_packed.attn_fwd, get_raw=True)
def _attn_fwd_flop(*args, out_val=None, **kwargs):
    return _flop_count(FWD_ARGS, args, kwargs, backward=False)


@register_flop_formula(torch.ops.doc_packed.attn_bwd, get_raw=True)
def _attn_bwd_flop(*args, out_val=None, **kwargs):
    return _flop_count(BWD_ARGS, args, kwargs, backward=True)
