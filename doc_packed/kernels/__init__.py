"""Kernel dispatch for packed varlen attention problems (:class:`VarlenSpec`).

Backends:
- ``"flash"``: torch's flash varlen kernel (CUDA, fp16/bf16, head dim % 8 == 0 and <= 256).
- ``"flex"``: flex_attention's Triton kernels with a closed-form BlockMask (CUDA, fp16/bf16/
  fp32, head dim a power of two in 16..256, row lengths divisible by 128).
- ``"math"``: exact blockwise plain-torch kernel (any device and dtype; the CPU path).
- ``"auto"``: flex for local calls it can take, else flash, else math (see :func:`choose`).
  Context-parallel kernel calls change shape every step, so under ``auto`` they use flash
  (flex compiles once per shape).

Every backend produces and consumes the same ``(out, lse)``, so passes may differ.
"""

from __future__ import annotations

import torch

from . import blockwise, flash, flex
from .spec import VarlenSpec

__all__ = ["BACKENDS", "VarlenSpec", "backward", "check_backend", "choose", "forward"]

BACKENDS = ("auto", "flash", "flex", "math")

_flex_broken: list[Exception] = []  # set once flex failed to compile under ``auto``


def check_backend(backend: str, q: torch.Tensor) -> None:
    """Raise if ``backend`` is unknown or a forced backend cannot take ``q`` at all."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "flash" and not flash.supports(q):
        raise ValueError(
            f"backend='flash' needs a CUDA tensor of float16/bfloat16 with head dim % 8 == 0 "
            f"and <= 256; got {q.device.type} {q.dtype} with head dim {q.shape[-1]}"
        )
    if backend == "flex":
        why = flex.unsupported_reason(q, None)
        if why is not None:
            raise ValueError(f"backend='flex' {why}")


def choose(backend: str, spec: VarlenSpec, q: torch.Tensor) -> str:
    """The concrete backend that runs ``spec`` (``q`` is packed ``[T, H, D]``)."""
    if backend == "flex":  # the shape-level checks of check_backend plus the row lengths
        why = flex.unsupported_reason(q, flex.problem_rows(spec))
        if why is not None:
            raise ValueError(f"backend='flex' {why}")
        return "flex"
    check_backend(backend, q)
    if backend != "auto":
        return backend
    # flex measured fastest in every layout and size we ran (docs/benchmarks.md section 1);
    # only for local calls, whose shapes (hence compiled kernels) stay fixed across steps
    if (
        not _flex_broken
        and spec.row_len is not None
        and flex.unsupported_reason(q, flex.problem_rows(spec)) is None
    ):
        return "flex"
    return "flash" if flash.supports(q) else "math"


def _module(name: str):
    return {"flash": flash, "flex": flex, "math": blockwise}[name]


def _run(pass_: str, backend: str, spec: VarlenSpec, q: torch.Tensor, args: tuple):
    name = choose(backend, spec, q)
    if name == "flex" and backend == "auto":
        try:
            return getattr(flex, pass_)(spec, *args)
        except flex.CompileError as err:
            _flex_broken.append(err)
            flex.warn_fallback(err)
            name = "flash" if flash.supports(q) else "math"
    return getattr(_module(name), pass_)(spec, *args)


def forward(spec: VarlenSpec, q, k, v, scale: float, backend: str):
    """``(out [T_q, H_q, D], lse [H_q, T_q])`` of a packed problem."""
    if spec.total_q == 0:
        lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        return torch.empty_like(q), q.new_empty((q.shape[1], 0), dtype=lse_dtype)
    return _run("forward", backend, spec, q, (q, k, v, scale))


def backward(spec: VarlenSpec, dout, q, k, v, out, lse, scale: float, backend: str):
    """``(dq, dk, dv)`` of a packed problem from the saved ``out`` and ``lse``."""
    if spec.total_q == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    return _run("backward", backend, spec, q, (dout, q, k, v, out, lse, scale))
