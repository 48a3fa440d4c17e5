"""The context-parallel runtime's Triton kernels compile once, not once per document layout.

Triton specializes a kernel on its integer arguments (value 1, divisibility by 16) and on its
pointers' 16-byte alignment. Row counts, offsets, strides and slices of per-layout buffers take
new such values as layouts change, and each new combination is a compile on the training step's
critical path (0.3-0.8 s, measured on 4 x H200: one rank's stall holds every rank at the next
exchange). :func:`jit_once` keeps every runtime argument of a kernel out of the specialization
(a hand-kept list of the "varying" ones missed a stride and still compiled mid-run), so a
kernel compiles once per dtype and ``constexpr`` values; :func:`compiled_variants` counts what
the tracked kernels compiled (``doc_packed.cp.runtime_counts()["kernels_compiled"]``).
"""

from __future__ import annotations

import inspect
from typing import Any

_KERNELS: list[Any] = []


def jit_once(fn: Any) -> Any:
    """``triton.jit(fn)`` with none of ``fn``'s runtime (non-``constexpr``) arguments specialized
    on value or alignment, on every Triton that has the switches (``do_not_specialize_on_alignment``
    is newer than ``do_not_specialize``); the kernel is tracked by :func:`compiled_variants`."""
    import triton

    runtime = runtime_params(triton.jit(fn))
    kw: dict[str, Any] = {"do_not_specialize": runtime}
    if "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters:
        kw["do_not_specialize_on_alignment"] = runtime
    return track(triton.jit(fn, **kw))


def runtime_params(kernel: Any) -> list[str]:
    """The runtime (non-``constexpr``) parameters of a ``triton.jit`` kernel, by name."""
    return [p.name for p in kernel.params if not p.is_constexpr]


def track(kernel: Any) -> Any:
    """Count ``kernel``'s compiled variants in :func:`compiled_variants`; returns it."""
    _KERNELS.append(kernel)
    return kernel


def compiled_variants() -> int:
    """Variants the tracked kernels have compiled in this process, on every device."""
    total = 0
    for kernel in _KERNELS:
        caches = getattr(kernel, "device_caches", None)  # Triton 3.2+: (kernels, keys, ...) per device
        if caches is not None:
            total += sum(len(entry[0]) for entry in caches.values())
        else:  # older Triton: {device: {key: kernel}}
            total += sum(len(c) for c in getattr(kernel, "cache", {}).values())
    return total
