"""Kernel dispatch for packed varlen attention problems (:class:`VarlenSpec`).

Backends:
- ``"flash"``: torch's flash varlen kernel (CUDA, fp16/bf16, head dim % 8 == 0 and <= 256).
- ``"math"``: exact blockwise plain-torch kernel (any device and dtype; the CPU path).
- ``"auto"``: the fastest backend that takes the input (see :func:`resolve`).
"""

from __future__ import annotations

import torch

from . import blockwise, flash
from .spec import VarlenSpec

__all__ = ["VarlenSpec", "BACKENDS", "resolve", "forward", "backward"]

BACKENDS = ("auto", "flash", "math")


def resolve(backend: str, q: torch.Tensor) -> str:
    """The concrete backend for ``q``; raises ValueError if a forced one cannot take it."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "flash" if flash.supports(q) else "math"
    if backend == "flash" and not flash.supports(q):
        raise ValueError(
            f"backend='flash' needs a CUDA tensor of float16/bfloat16 with head dim % 8 == 0 "
            f"and <= 256; got {q.device.type} {q.dtype} with head dim {q.shape[-1]}"
        )
    return backend


def _module(name: str):
    return flash if name == "flash" else blockwise


def forward(spec: VarlenSpec, q, k, v, scale: float, backend: str):
    """``(out [T_q, H_q, D], lse [H_q, T_q])`` of a packed problem; ``backend`` is concrete."""
    if spec.total_q == 0:
        lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        return torch.empty_like(q), q.new_empty((q.shape[1], 0), dtype=lse_dtype)
    return _module(backend).forward(spec, q, k, v, scale)


def backward(spec: VarlenSpec, dout, q, k, v, out, lse, scale: float, backend: str):
    """``(dq, dk, dv)`` of a packed problem from the saved ``out`` and ``lse``."""
    if spec.total_q == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    return _module(backend).backward(spec, dout, q, k, v, out, lse, scale)
