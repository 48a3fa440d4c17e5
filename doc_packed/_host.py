"""Host arrays queued to a device without waiting for it and without torch's intra-op pool.

Per-layout metadata (a schedule's indices, ``cu_seqlens``) goes to the GPU once per layout. From
pageable memory the copy would wait for the device's queue (a host sync per layout), so it goes
from pinned memory; ``Tensor.pin_memory()`` fills that with torch's copy, which spreads over the
intra-op pool above 32768 elements, a pool as wide as the host in every rank that shares it (the
per-layout host time then depends on the launcher's thread setting). NumPy fills it instead.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch


def queue_to(host: torch.Tensor | np.ndarray, device: torch.device) -> torch.Tensor:
    """``host`` (a CPU tensor or NumPy array) on ``device``: on CUDA a non-blocking copy from
    pinned memory filled by NumPy; on the CPU the data itself (a tensor as it is, an array
    without a copy); elsewhere ``Tensor.to``."""
    t = torch.from_numpy(host) if isinstance(host, np.ndarray) else host
    if device.type == "cpu":
        return t
    if device.type != "cuda":
        return t.to(device)
    pinned = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    pinned.numpy()[...] = t.numpy()
    return pinned.to(device, non_blocking=True)


_NUMPY = {torch.int64: np.int64, torch.int32: np.int32}  # the dtypes queue_filled takes


def queue_filled(n: int, dtype: torch.dtype, fill: Callable[[np.ndarray], None], device: torch.device) -> torch.Tensor:
    """A 1-D tensor of ``n`` values of ``dtype`` (int64 or int32) on ``device``, written by
    ``fill`` into an empty host array: :func:`queue_to` of that array, except on CUDA, where
    ``fill`` writes straight into the pinned buffer the copy goes from (no host array of its own
    to fill, then copy: one pass over the values, a schedule's int64 rows some 16,000-90,000 at
    4 x 32k)."""
    if device.type == "cuda":
        pinned = torch.empty(n, dtype=dtype, pin_memory=True)
        fill(pinned.numpy())
        return pinned.to(device, non_blocking=True)
    host = np.empty(n, dtype=_NUMPY[dtype])
    fill(host)
    return queue_to(host, device)
