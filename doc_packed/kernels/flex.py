"""flex_attention (Triton, via Inductor) for packed varlen problems, forward and backward.

The mask is the spec's per-query key interval ``[lo[q], hi[q]]`` (document, causal and window
in one; see :meth:`VarlenSpec.key_bounds`), passed to the kernel as two int32 buffers. The
``BlockMask`` is built in closed form from those intervals, once per spec, so every layer of a
step shares it and no ``[S, S]`` mask is ever evaluated. Rows of a local call map to
flex's batch dim (``[B, H, S, D]`` views of the packed tensors, no copies); a context-parallel
problem is one row of ``T_q`` queries against ``T_k`` keys.

The backward runs flex's backward kernel on the saved ``out`` and ``lse`` without recomputing
the forward. torch has no public entry point for that, so both passes call the flex
higher-order ops directly: each is traced once per shape signature with ``make_fx`` and
compiled with Inductor (``compile_fx``); block-mask tensors and the interval buffers are graph
inputs, so one compiled function serves every layout of that shape. This uses private torch
APIs (checked on 2.11 and 2.13); if compiling fails, ``backend="auto"`` falls back to the
next backend with a warning, while ``backend="flex"`` raises.
"""

from __future__ import annotations

import functools
import math
from typing import Any, cast

import torch

from .. import _compat
from .spec import Variant, VarlenSpec

BLOCK = 128
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_HEAD_DIMS = (16, 32, 64, 128, 256)
_LN2 = math.log(2.0)


@functools.cache
def available() -> bool:
    """Whether flex_attention's Triton kernels can be built here (torch + triton)."""
    try:
        import triton  # noqa: F401
        from torch.nn.attention.flex_attention import BlockMask  # noqa: F401

        _compat.create_fw_bw_graph(), _compat.flex_attention_hop(), _compat.flex_attention_backward_hop()
    except ImportError:
        return False
    return True


def unsupported_reason(q: torch.Tensor, rows: tuple[int, int, int] | None) -> str | None:
    """Why flex cannot take ``q`` (``[T, H, D]`` or ``[B, S, H, D]``) with problem ``rows``.

    ``rows`` is ``(num_rows, q_len, k_len)`` per row (see :func:`problem_rows`), or None when
    unknown yet. Returns None when flex can run it.
    """
    if q.device.type != "cuda":
        return f"needs a CUDA tensor, got {q.device.type}"
    if q.dtype not in SUPPORTED_DTYPES:
        return f"needs float16/bfloat16/float32, got {q.dtype}"
    if q.shape[-1] not in _HEAD_DIMS:
        return f"needs head dim in {_HEAD_DIMS}, got {q.shape[-1]}"
    if rows is not None and (rows[1] % BLOCK or rows[2] % BLOCK):
        return f"needs sequence lengths divisible by {BLOCK}, got {rows[1]} queries and {rows[2]} keys per row"
    if not available():
        return "needs triton and torch's flex_attention"
    return None


def variant_reason(var: Variant) -> str | None:
    """Why flex cannot run this variant: a value head dim outside the q/k rule. Softcap is a
    score_mod and prefixes are in the key intervals, so both run."""
    if var.v_dim is not None and var.v_dim not in _HEAD_DIMS:
        return f"needs v's head dim in {_HEAD_DIMS}, got {var.v_dim}"
    return None


def problem_rows(spec: VarlenSpec) -> tuple[int, int, int]:
    """``(num_rows, q_len, k_len)``: the flex batch a spec maps to."""
    if spec.row_len is not None and spec.total_q == spec.total_k:
        return spec.total_q // spec.row_len, spec.row_len, spec.row_len
    return 1, spec.total_q, spec.total_k


# ----------------------------------------------------------------------------- block mask


def _mask_mod(b, h, q_idx, kv_idx, lo, hi):
    return (kv_idx >= lo[b, q_idx]) & (kv_idx <= hi[b, q_idx])


def _score_mod(score, b, h, q_idx, kv_idx):
    return score


@functools.cache
def score_mod(softcap: float):
    """The pass's score_mod: identity, or ``softcap * tanh(score / softcap)`` (flex scales first)."""
    if not softcap:
        return _score_mod

    def capped(score, b, h, q_idx, kv_idx):
        return softcap * torch.tanh(score / softcap)

    return capped


def _ordered(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """flex's ``(num_blocks [..., nQ], indices [..., nQ, nKV])`` of a dense block mask."""
    num = mask.sum(-1, dtype=torch.int32).contiguous()
    idx = torch.argsort((~mask).to(torch.int8), dim=-1, stable=True)
    return num, idx.to(torch.int32, memory_format=torch.contiguous_format)


def block_tables(spec: VarlenSpec, device: torch.device | None = None):
    """Tensors ``(lo, hi, partial, full)`` for the spec's flex batch, built on ``device``.

    ``lo/hi`` are ``[B, L_q]`` int32 row-local key intervals; ``partial`` and ``full`` are
    ``[B, nQ, nKV]`` bool: a block is *full* when every query row of it sees every key column,
    *partial* when some (not all) pairs are visible. Each row's interval is contiguous and
    both ends are non-decreasing in the query index within a segment, so a query block sees
    the hull of its rows' intervals and sees a key block in full when the block lies inside
    every row's interval. Only the per-query bounds come from the host; the block arithmetic
    and sorting run on ``device`` (tens of ms per 64k-token row on a CPU, well under one on a
    GPU).
    """
    B, Lq, Lk = problem_rows(spec)
    lo, hi = (x.to(device) for x in spec.key_bounds())
    offset = torch.arange(B, dtype=torch.int64, device=lo.device)[:, None] * Lk
    lo = lo.view(B, Lq) - offset
    hi = hi.view(B, Lq) - offset
    live = hi >= lo
    nq, nk = Lq // BLOCK, Lk // BLOCK
    big = torch.iinfo(torch.int64).max
    blo, bhi, blive = lo.view(B, nq, BLOCK), hi.view(B, nq, BLOCK), live.view(B, nq, BLOCK)
    hull_lo = blo.masked_fill(~blive, big).amin(-1)  # [B, nQ]
    hull_hi = bhi.masked_fill(~blive, -1).amax(-1)
    all_live = blive.all(-1)
    inner_lo, inner_hi = blo.amax(-1), bhi.amin(-1)
    k0 = torch.arange(nk, dtype=torch.int64, device=lo.device) * BLOCK  # [nKV]
    k1 = k0 + BLOCK - 1
    any_ = (k0 <= hull_hi[..., None]) & (k1 >= hull_lo[..., None])
    full = all_live[..., None] & (inner_lo[..., None] <= k0) & (inner_hi[..., None] >= k1)
    return lo.to(torch.int32), hi.to(torch.int32), any_ & ~full, full


class _Mask:
    """A spec's BlockMask on one device, split for the traced passes."""

    __slots__ = ("hi", "lo", "pos", "signature", "template", "tensors")

    def __init__(self, bm, lo: torch.Tensor, hi: torch.Tensor):
        self.template = bm.as_tuple()
        self.pos = tuple(i for i, x in enumerate(self.template) if isinstance(x, torch.Tensor))
        self.tensors = tuple(self.template[i] for i in self.pos)
        self.lo, self.hi = lo, hi
        consts = tuple(x for x in self.template if not isinstance(x, torch.Tensor) and not callable(x))
        # what a compiled pass bakes in: block sizes, lengths, table shapes (not values)
        self.signature = (consts, tuple(tuple(t.shape) for t in self.tensors))

    def rebuild(self, tensors) -> tuple:
        """The ``as_tuple()`` form with ``tensors`` (graph inputs) in place of the block tensors."""
        t = list(self.template)
        for i, x in zip(self.pos, tensors):
            t[i] = x
        return tuple(t)


def block_mask(spec: VarlenSpec, device: torch.device) -> _Mask:
    """The spec's BlockMask and interval buffers on ``device``, cached on the spec."""

    def build():
        from torch.nn.attention.flex_attention import BlockMask

        lo, hi, partial, full = block_tables(spec, device)
        partial, full = partial[:, None], full[:, None]  # one mask for every head
        _, Lq, Lk = problem_rows(spec)
        bm = BlockMask.from_kv_blocks(
            *_ordered(partial),
            *_ordered(full),
            BLOCK_SIZE=BLOCK,
            mask_mod=cast(Any, _mask_mod),  # (b, h, q, kv) plus our two buffers: flex passes them
            seq_lengths=(Lq, Lk),
            compute_q_blocks=False,
        )
        # the backward's column view, from our dense tables (torch's own transpose uses vmap,
        # which fails when this runs inside a compiled graph)
        bm.q_num_blocks, bm.q_indices = _ordered(partial.transpose(-2, -1))
        bm.full_q_num_blocks, bm.full_q_indices = _ordered(full.transpose(-2, -1))
        return _Mask(bm, lo, hi)

    return spec.cached(("flex_block_mask", device), build)


# ----------------------------------------------------------------------------- compiled passes


@functools.cache
def _kernel_options() -> dict:
    opts: dict[str, object] = {"BACKEND": "TRITON"}
    try:
        dummy = torch.empty(0)
        opts = _compat.apply_kernel_options()(dummy, dummy, dummy, True, opts)
    except (ImportError, TypeError, ValueError):  # pragma: no cover - older/newer torch
        opts.update(
            PRESCALE_QK=False,
            ROWS_GUARANTEED_SAFE=False,
            BLOCKS_ARE_CONTIGUOUS=False,
            WRITE_DQ=True,
            OUTPUT_LOGSUMEXP=True,
            OUTPUT_MAX=False,
        )
    opts["OUTPUT_LOGSUMEXP"] = True
    return opts


@functools.cache
def _score_graphs(device: torch.device, dtype: torch.dtype, softcap: float = 0.0):
    """flex's ``(fw_graph, joint_graph)`` of the pass's score_mod, built once per softcap."""
    create_fw_bw_graph = _compat.create_fw_bw_graph()
    scalar = torch.zeros((), device=device, dtype=dtype, requires_grad=True)
    index = tuple(torch.zeros((), device=device, dtype=torch.int) for _ in range(4))
    # backward passes run with grad mode off: a score_mod that computes (softcap's tanh) would
    # then trace no gradient, and Inductor's lowering fails ("joint_subgraph_buffer is None")
    with torch.enable_grad():
        return create_fw_bw_graph(score_mod(softcap), (scalar, *index), ())


class CompileError(RuntimeError):
    """Tracing or compiling a flex pass failed (private torch APIs moved, no Triton, ...)."""


_compiled: dict = {}


def _compile(key, fn, inputs, compile_graph: bool):
    """Trace ``fn`` on fake copies of ``inputs``; compile with Inductor (cached by ``key``)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    try:
        gm = make_fx(fn, tracing_mode="fake")(*inputs)
        if compile_graph:
            compiled = _compat.compile_fx()(gm, list(inputs))
        else:  # CPU tests: run the traced graph eagerly (flex's dense math path)
            compiled = gm
    except Exception as err:
        raise CompileError(f"{type(err).__name__}: {err}") from err
    _compiled[key] = compiled
    return compiled


def _first_call(key, fn, inputs):
    """Run a fresh compiled pass; Triton builds its kernels here, so failures count as compile
    failures (the entry is dropped). Out-of-memory errors pass through unchanged."""
    try:
        return fn(*inputs)
    except torch.OutOfMemoryError:
        raise
    except Exception as err:
        _compiled.pop(key, None)
        raise CompileError(f"{type(err).__name__}: {err}") from err


def _key(pass_, spec, q, k, scale, mask: _Mask, compile_graph, v=None, softcap=0.0) -> tuple:
    return (
        pass_,
        compile_graph,
        problem_rows(spec),
        tuple(q.shape),
        tuple(k.shape),
        None if v is None else v.shape[-1],
        q.dtype,
        q.device,
        scale,
        softcap,
        mask.signature,
    )


def _views(spec, *xs):
    """``[B, H, L, D]`` views of packed ``[T, H, D]`` tensors."""
    B = problem_rows(spec)[0]
    return [x.view(B, x.shape[0] // B, *x.shape[1:]).transpose(1, 2) for x in xs]


def _run_pass(key, inputs: tuple, make_fn, compile_graph: bool):
    """Run the compiled pass cached under ``key``; trace and compile ``make_fn()`` first if new.

    The inputs' strides join the key: a compiled graph asserts the strides it was traced with,
    and a strided caller (``[B, H, S, D].transpose(1, 2)`` with B = 1 reaches here as a view)
    lays its tensors out differently from a contiguous one."""
    key = (*key, *(x.stride() for x in inputs if isinstance(x, torch.Tensor)))
    fn = _compiled.get(key)
    if fn is not None:
        return fn(*inputs)
    return _first_call(key, _compile(key, make_fn(), inputs, compile_graph), inputs)


def forward(spec: VarlenSpec, q, k, v, scale: float, softcap: float = 0.0, *, compile_graph: bool | None = None):
    """``(out [T_q, H_q, D_v], lse [H_q, T_q] float32)``; rows that see nothing: out 0, lse -inf."""
    compile_graph = q.device.type == "cuda" if compile_graph is None else compile_graph
    mask = block_mask(spec, q.device)
    q4, k4, v4 = _views(spec, q, k, v)

    def make_fn():
        flex_hop = _compat.flex_attention_hop()
        opts = dict(_kernel_options())  # a private copy per traced pass

        def run(q4, k4, v4, lo, hi, *bt):
            out, lse, *_ = flex_hop(q4, k4, v4, score_mod(softcap), mask.rebuild(bt), scale, opts, (), (lo, hi))
            return out, lse

        return run

    out4, lse2 = _run_pass(
        _key("fwd", spec, q, k, scale, mask, compile_graph, v, softcap),
        (q4, k4, v4, mask.lo, mask.hi, *mask.tensors),
        make_fn,
        compile_graph,
    )
    out = out4.transpose(1, 2).reshape(*q.shape[:2], v.shape[-1])
    return out, (lse2 * _LN2).transpose(0, 1).reshape(q.shape[1], -1)


def max_logits(spec: VarlenSpec, q, k, scale: float, softcap: float = 0.0, *, compile_graph: bool | None = None):
    """``[H_q]`` max logits (float32): one flex forward that writes each row's running max
    (``OUTPUT_MAX``, log2 units inside flex) against a 16-wide zero value (the cheapest ``P V``
    flex takes); rows that see nothing give -inf."""
    compile_graph = q.device.type == "cuda" if compile_graph is None else compile_graph
    mask = block_mask(spec, q.device)
    v = q.new_zeros((k.shape[0], k.shape[1], 16))
    q4, k4, v4 = _views(spec, q, k, v)

    def make_fn():
        flex_hop = _compat.flex_attention_hop()
        opts = dict(_kernel_options())
        opts["OUTPUT_MAX"] = True

        def run(q4, k4, v4, lo, hi, *bt):
            _, _, row_max, *_ = flex_hop(q4, k4, v4, score_mod(softcap), mask.rebuild(bt), scale, opts, (), (lo, hi))
            return row_max

        return run

    row_max = _run_pass(
        _key("max", spec, q, k, scale, mask, compile_graph, v, softcap),
        (q4, k4, v4, mask.lo, mask.hi, *mask.tensors),
        make_fn,
        compile_graph,
    )  # [B, H_q, L] in log2 units
    return row_max.amax((0, 2)).float() * _LN2


def backward(spec: VarlenSpec, dout, q, k, v, out, lse, scale: float, softcap: float = 0.0, *, compile_graph=None):
    """``(dq, dk, dv)`` from the saved ``out`` and natural-log ``lse [H_q, T_q]``."""
    compile_graph = q.device.type == "cuda" if compile_graph is None else compile_graph
    mask = block_mask(spec, q.device)
    B = problem_rows(spec)[0]
    q4, k4, v4, o4, do4 = _views(spec, q, k, v, out, dout)
    lse2 = (lse / _LN2).view(lse.shape[0], B, -1).transpose(0, 1).contiguous()

    def make_fn():
        flex_attention_backward = _compat.flex_attention_backward_hop()
        opts = dict(_kernel_options())  # a private copy per traced pass
        fw_graph, joint_graph = _score_graphs(q.device, q.dtype, softcap)

        def run(q4, k4, v4, o4, lse2, do4, lo, hi, *bt):
            dq, dk, dv, *_ = flex_attention_backward(
                q4, k4, v4, o4, lse2, do4, None, fw_graph, joint_graph, mask.rebuild(bt), scale, opts, (), (lo, hi)
            )
            return dq, dk, dv

        return run

    dq, dk, dv = _run_pass(
        _key("bwd", spec, q, k, scale, mask, compile_graph, v, softcap),
        (q4, k4, v4, o4, lse2, do4, mask.lo, mask.hi, *mask.tensors),
        make_fn,
        compile_graph,
    )
    return (
        dq.transpose(1, 2).reshape(q.shape),
        dk.transpose(1, 2).reshape(k.shape),
        dv.transpose(1, 2).reshape(v.shape),
    )
