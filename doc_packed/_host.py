"""Host arrays queued to a device without waiting for it and without torch's intra-op pool.

Per-layout metadata (a schedule's indices, ``cu_seqlens``) goes to the GPU once per layout. From
pageable memory the copy would wait for the device's queue (a host sync per layout), so it goes
from pinned memory; ``Tensor.pin_memory()`` fills that with torch's copy, which spreads over the
intra-op pool above 32768 elements, a pool as wide as the host in every rank that shares it (the
per-layout host time then depends on the launcher's thread setting). NumPy fills it instead.
"""

from __future__ import annotations

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
