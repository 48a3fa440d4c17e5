"""torch's flash varlen kernel (``torch.ops.torch_attn``), on torch 2.11 and 2.13+ alike.

The two releases differ in the op's argument list (2.13 adds ``enable_gqa``, ``seqused_k``,
``block_table``, ``num_splits``), so arguments are passed by name and only those the installed
schema has. GQA runs natively in the kernel on both: K/V are never repeated.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from .. import _compat
from .spec import VarlenSpec

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)


@functools.cache
def _ops():
    fwd, bwd = _compat.varlen_attn_ops()
    return fwd, _compat.op_argument_names(fwd), bwd, _compat.op_argument_names(bwd)


def available() -> bool:
    try:
        _ops()
    except (ImportError, AttributeError, RuntimeError):
        return False
    return True


def unsupported_reason(q: Tensor) -> str | None:
    """Why the flash kernel cannot take ``q`` (device, dtype, head size); None when it can."""
    if q.device.type != "cuda":
        return f"needs a CUDA tensor, got {q.device.type}"
    if q.dtype not in SUPPORTED_DTYPES:
        return f"needs float16/bfloat16, got {q.dtype}"
    d = q.shape[-1]
    if d % 8 or d > 256:
        return f"needs head dim % 8 == 0 and <= 256, got {d}"
    if not available():
        return "needs torch.ops.torch_attn._varlen_attn (torch >= 2.11)"
    return None


def supports(q: Tensor) -> bool:
    """Whether the flash kernel takes this input (device, dtype, head size)."""
    return unsupported_reason(q) is None


def _window(spec: VarlenSpec) -> tuple[bool, list[int]]:
    window = [spec.left, 0 if spec.causal else spec.right]
    return window == [-1, 0], window


def _rng_state(device: torch.device) -> Tensor:
    return torch.zeros(2, dtype=torch.uint64, device=device)


def forward(spec: VarlenSpec, q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """``(out [T_q, H_q, D], lse [H_q, T_q] float32)``."""
    fwd, names, _, _ = _ops()
    cu_q, cu_k = spec.cu_tensors(q.device)
    is_causal, window = _window(spec)
    kwargs = {"scale": scale, "window_size": window}
    if "enable_gqa" in names:
        kwargs["enable_gqa"] = q.shape[1] != k.shape[1]
    out, lse, _ = fwd(q, k, v, cu_q, cu_k, spec.max_q, spec.max_k, is_causal, **kwargs)
    return out, lse


def backward(
    spec: VarlenSpec, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    _, _, bwd, _ = _ops()
    cu_q, cu_k = spec.cu_tensors(q.device)
    is_causal, window = _window(spec)
    rng = spec.cached(("rng", q.device), lambda: _rng_state(q.device))
    return bwd(
        dout, q, k, v, out, lse, cu_q, cu_k, spec.max_q, spec.max_k, is_causal, rng, scale=scale, window_size=window
    )
