"""Argument validation for the public API: every rule raises before any kernel runs.

Shape, dtype, device and layout rules look at metadata only, so they are free under
``torch.compile``. Rules on the *values* of ``cu_seqlens`` live in :mod:`doc_packed._doc_layout`,
which checks each distinct tensor once and caches the result (one host read per tensor, not
per call).
"""

from __future__ import annotations

import torch

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def check_window(causal: bool, window_size: object) -> tuple[int, int]:
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if (
        not isinstance(window_size, (tuple, list))
        or len(window_size) != 2
        or not all(isinstance(w, int) and not isinstance(w, bool) for w in window_size)
    ):
        raise TypeError(f"window_size must be a pair of ints (left, right), got {window_size!r}")
    left, right = int(window_size[0]), int(window_size[1])
    if left < -1 or right < -1:
        raise ValueError(f"window_size={tuple(window_size)}: each side must be >= 0, or -1 for unbounded")
    if causal and right > 0:
        raise ValueError(
            f"window_size={tuple(window_size)} has a right window {right} > 0 but causal=True; "
            "use causal=False for a window that looks ahead"
        )
    return left, (0 if causal else right)


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor) -> None:
    """Ranks, shapes, dtypes, devices and memory layout of the four tensors."""
    for name, t in (("q", q), ("k", k), ("v", v), ("cu_seqlens", cu_seqlens)):
        _check_tensor(name, t)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, S, H, D], got shape {tuple(t.shape)}")
    B, S, Hq, D = q.shape
    if k.shape[:2] != q.shape[:2] or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must share q's [B, S] = {(B, S)}")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if k.shape[3] != D:
        raise ValueError(f"k's head dim {k.shape[3]} must equal q's head dim {D}")
    Hkv = k.shape[2]
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"q has {Hq} heads and k/v have {Hkv}: q heads must be a multiple of k/v heads (GQA)")
    if B == 0 or S == 0 or D == 0:
        raise ValueError(f"q has an empty dimension: shape {tuple(q.shape)}")
    if q.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"q has dtype {q.dtype}; expected one of float16, bfloat16, float32, float64")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype == torch.float64 and q.device.type != "cpu":
        raise TypeError("float64 is supported on CPU only")
    for name, t in (("k", k), ("v", v), ("cu_seqlens", cu_seqlens)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; use one device")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(3) != 1 and t.shape[3] > 1:
            raise ValueError(
                f"{name} has stride {t.stride()}: the head dim must be contiguous (stride 1); "
                f"call .contiguous() on {name}"
            )
        if t.shape[0] > 1 and t.shape[1] > 1 and t.stride(0) != t.shape[1] * t.stride(1):
            raise ValueError(
                f"{name} has stride {t.stride()}: batch and sequence dims must be mergeable into "
                f"one token dim (stride(0) == S * stride(1)); call .contiguous() on {name}"
            )
    if cu_seqlens.dtype != torch.int32:
        raise TypeError(f"cu_seqlens must be int32, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 2 or cu_seqlens.shape[1] < 2:
        raise ValueError(f"cu_seqlens must be [B, MAX_DOCS + 1] with MAX_DOCS >= 1, got {tuple(cu_seqlens.shape)}")
    if cu_seqlens.shape[0] != B:
        raise ValueError(f"cu_seqlens has {cu_seqlens.shape[0]} rows but q has batch size {B}")


def check_scale(scale: object, head_dim: int) -> float:
    if scale is None:
        return float(head_dim) ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    scale = float(scale)
    if not scale > 0 or scale == float("inf"):
        raise ValueError(f"scale must be a positive finite float, got {scale}")
    return scale
