"""Adding the partial dK/dV that peers send home to the owner's gradients.

A rank's key rows that k peers' queries saw come home as k partial gradients, laid out by the
schedule (``RankSchedule.kv_back_*``): an interval of ``n`` rows sent to ``k`` peers is a
``[k, n, 2, H_kv, D]`` block of the landed buffer (cells a peer's run did not reach are zero).
:func:`add_partials_` adds each interval's sum to ``dk``/``dv`` in place:

    dk[r0 : r0 + n] = round(dk[r0 : r0 + n] + sum_j block[j, :, 0])    (likewise dv, index 1)

summed in the accumulation dtype (float32 for half gradients) and rounded to the gradient's dtype
once. On CUDA with Triton one kernel per interval reads the block and the gradient rows once;
elsewhere torch ops (a float32 sum, then two adds). Both run the float64-referenced cases of
``tests/test_cp_merge.py`` (the Triton kernel in ``tests/test_gpu_cp_merge.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from .. import kernels
from ._triton import jit_once

__all__ = ["add_partials_"]


def add_partials_(
    dk: torch.Tensor, dv: torch.Tensor, back: torch.Tensor, sums: Sequence[tuple[int, int, int, int]]
) -> None:
    """Add the landed partials ``back`` (``[rows, 2, H_kv, D]``) to ``dk``/``dv`` (``[B * L,
    H_kv, D]``), interval by interval: ``sums`` holds ``(first row of back, k, first row of dk,
    rows)``."""
    fused = _triton_partials() if dk.is_cuda and dk.device.index == torch.cuda.current_device() else None
    if fused is not None and dk.is_contiguous() and dv.is_contiguous() and back.is_contiguous():
        for g, k, r0, n in sums:
            fused(dk, dv, back, g, k, r0, n)
        return
    _torch_partials(dk, dv, back, sums)


def _torch_partials(dk, dv, back, sums) -> None:
    acc = kernels.lse_dtype(dk.dtype)
    for g, k, r0, n in sums:  # add_, not += (which copies the slice onto itself)
        part = back[g : g + n] if k == 1 else back[g : g + k * n].view(k, n, *back.shape[1:]).sum(0, dtype=acc)
        dk[r0 : r0 + n].add_(part[:, 0])
        dv[r0 : r0 + n].add_(part[:, 1])


@functools.cache
def _triton_partials():
    """The Triton sum-and-add of one interval, or None where Triton cannot be imported (CPU builds
    of torch) or the GPU is older than compute capability 8.0."""
    kernel = _kernel()
    if kernel is None or not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0):
        return None  # Triton's supported GPUs; older ones take the torch ops
    import triton

    def run(dk: torch.Tensor, dv: torch.Tensor, back: torch.Tensor, g: int, k: int, r0: int, n: int) -> None:
        W = dk[0].numel()
        block_r, block_w = 8, min(triton.next_power_of_2(W), 512)
        grid = (triton.cdiv(n, block_r), triton.cdiv(W, block_w))
        kernel[grid](dk, dv, back, g, k, r0, n, W, BLOCK_R=block_r, BLOCK_W=block_w)

    return run


@functools.cache
def _kernel():
    """The sum-and-add's Triton kernel (defined without a GPU), or None without Triton."""
    try:
        import triton.language as tl
    except ImportError:
        return None

    @jit_once  # one compile for every layout
    def kernel(dk_ptr, dv_ptr, back_ptr, g, k, r0, n, W, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr):
        r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        w = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
        m = (r < n)[:, None] & (w < W)[None, :]
        acc_k = tl.zeros((BLOCK_R, BLOCK_W), dtype=tl.float32)
        acc_v = tl.zeros((BLOCK_R, BLOCK_W), dtype=tl.float32)
        for j in range(k):  # block row j: the partial of the j-th peer that saw the interval
            row = (g + j * n + r)[:, None] * (2 * W) + w[None, :]
            acc_k += tl.load(back_ptr + row, mask=m, other=0.0).to(tl.float32)
            acc_v += tl.load(back_ptr + row + W, mask=m, other=0.0).to(tl.float32)
        at = (r0 + r)[:, None] * W + w[None, :]
        dk = tl.load(dk_ptr + at, mask=m, other=0.0).to(tl.float32) + acc_k
        dv = tl.load(dv_ptr + at, mask=m, other=0.0).to(tl.float32) + acc_v
        tl.store(dk_ptr + at, dk.to(dk_ptr.dtype.element_ty), mask=m)
        tl.store(dv_ptr + at, dv.to(dv_ptr.dtype.element_ty), mask=m)

    return kernel
