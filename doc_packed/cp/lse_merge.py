"""Merging two partial attention results of the same query rows by log-sum-exp.

A context-parallel rank computes some query rows in two calls (keys it holds, keys it
received); :func:`merge_` folds the second result into the first, in place:

    lse = logaddexp(lse_a, lse_b),  out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

with the weights and the sum in the lse's dtype (float32 for half inputs) and ``out`` rounded
once. Rows that saw no key in either call (both lse ``-inf``) keep out 0 and lse ``-inf``; a NaN
or ``+inf`` in either side stays in the row. On CUDA with Triton this is one kernel (a read of
both sides, one write); elsewhere the same arithmetic in torch ops (a float32 intermediate of
the rows, several launches). Both paths are compared in ``tests/test_gpu_cp_merge.py``.
"""

from __future__ import annotations

import functools

import torch

from ._triton import jit_once

__all__ = ["merge_"]


def merge_(out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> None:
    """Fold ``(out_b, lse_b)`` into ``(out, lse)`` in place: ``out``/``out_b`` ``[n, H, D]``
    (last dim contiguous), ``lse``/``lse_b`` ``[H, n]`` (any strides)."""
    fused = _triton_merge() if out.is_cuda and out.device.index == torch.cuda.current_device() else None
    if fused is not None and out.shape[0] and out.stride(-1) == 1 and out_b.stride(-1) == 1:
        fused(out, lse, out_b, lse_b)  # (Triton launches on the current device)
        return
    _torch_merge(out, lse, out_b, lse_b)


def _torch_merge(out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> None:
    both = torch.stack([lse, lse_b])  # before lse is overwritten
    new = torch.logaddexp(lse, lse_b, out=lse)  # -inf where neither saw a key; NaN stays NaN
    # each side's weight exp(l - lse), as [2, n, H, 1]; 0 on rows that saw no key at all
    # (lse -inf: subtracting 0 instead keeps exp(-inf) = 0; NaN and +inf stay)
    new_or_0 = new.nan_to_num(nan=float("nan"), posinf=float("inf"), neginf=0.0)
    w = torch.exp(both - new_or_0).transpose(1, 2)[..., None]
    # out_b * w_b + out * w_a in the lse dtype (type promotion), rounded once into out
    torch.addcmul(out_b * w[1], out, w[0], out=out)


@functools.cache
def _triton_merge():
    """The Triton merge, or None where Triton cannot be imported (CPU builds of torch) or the GPU
    is older than compute capability 8.0."""
    kernel = _kernel()
    if kernel is None or not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0):
        return None  # Triton's supported GPUs; older ones take the torch ops
    import triton

    def run(out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> None:
        n, H, D = out.shape
        block_r = 16
        kernel[(triton.cdiv(n, block_r), H)](
            out, lse, out_b, lse_b, n, D,
            out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
            out_b.stride(0), out_b.stride(1), lse_b.stride(0), lse_b.stride(1),
            BLOCK_R=block_r, BLOCK_D=triton.next_power_of_2(D),
        )  # fmt: skip

    return run


@functools.cache
def _kernel():
    """The merge's Triton kernel (defined without a GPU), or None without Triton."""
    try:
        import triton.language as tl
    except ImportError:
        return None

    # one compile for every layout: the rows, their strides and the slices' pointers all vary
    @jit_once
    def kernel(
        o_ptr, l_ptr, ob_ptr, lb_ptr, n, D,
        so_r, so_h, sl_h, sl_r, sob_r, sob_h, slb_h, slb_r,
        BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        d = tl.arange(0, BLOCK_D)
        rm = r < n
        la = tl.load(l_ptr + h * sl_h + r * sl_r, mask=rm, other=0.0).to(tl.float32)
        lb = tl.load(lb_ptr + h * slb_h + r * slb_r, mask=rm, other=0.0).to(tl.float32)
        # torch.logaddexp: equal infinities give themselves, NaN propagates
        hi = tl.where(la > lb, la, lb)
        lo = tl.where(la > lb, lb, la)
        lse = hi + tl.log(1.0 + tl.exp(lo - hi))
        lse = tl.where((hi == lo) & (tl.abs(hi) == float("inf")), hi, lse)
        lse = tl.where((la != la) | (lb != lb), la + lb, lse)
        base = tl.where(lse == float("-inf"), 0.0, lse)
        wa = tl.exp(la - base)[:, None]
        wb = tl.exp(lb - base)[:, None]
        m = rm[:, None] & (d[None, :] < D)
        oa = tl.load(o_ptr + r[:, None] * so_r + h * so_h + d[None, :], mask=m, other=0.0).to(tl.float32)
        ob = tl.load(ob_ptr + r[:, None] * sob_r + h * sob_h + d[None, :], mask=m, other=0.0).to(tl.float32)
        res = ob * wb + oa * wa
        tl.store(o_ptr + r[:, None] * so_r + h * so_h + d[None, :], res.to(o_ptr.dtype.element_ty), mask=m)
        tl.store(l_ptr + h * sl_h + r * sl_r, lse.to(l_ptr.dtype.element_ty), mask=rm)

    return kernel
