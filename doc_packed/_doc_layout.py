"""Host-side facts about one ``cu_seqlens`` tensor, validated and cached per distinct tensor.

Reading ``cu_seqlens`` on the host is a device sync, so it happens once per distinct tensor,
not once per call: every layer of a step passes the same tensor and hits the cache. The cache
keeps a reference to each tensor it describes, so a cached tensor's memory cannot be reused by
another one while its entry lives, and the key (address, shape, strides, version counter)
cannot silently match different contents. In-place writes bump the version counter and miss.

Anything derived from the layout that layers can share (flattened offsets on the device, block
bounds for the CPU kernel, context-parallel plans) hangs off :meth:`DocLayout.derived`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from . import _compat

_T = TypeVar("_T")
_CACHE_SIZE = 32


class DocLayout:
    """Validated document boundaries of a ``[B, MAX_DOCS + 1]`` ``cu_seqlens``."""

    __slots__ = ("seq_len", "rows", "_derived")

    def __init__(self, bounds: list[list[int]], seq_len: int):
        self.seq_len = seq_len
        # per row, the (start, end) of each non-empty document
        self.rows: tuple[tuple[tuple[int, int], ...], ...] = tuple(
            tuple((s, e) for s, e in zip(row[:-1], row[1:]) if e > s) for row in bounds
        )
        self._derived: dict[Any, Any] = {}

    @property
    def batch(self) -> int:
        return len(self.rows)

    def derived_get(self, key: Any) -> Any:
        """The value memoised under ``key``, or None."""
        return self._derived.get(key)

    def derived(self, key: Any, factory: Callable[[], _T]) -> _T:
        """Memoise ``factory()`` under ``key`` for the lifetime of this layout."""
        try:
            return self._derived[key]
        except KeyError:
            value = self._derived[key] = factory()
            return value


def cp_degree(local_len: int, seq_len: int) -> int:
    """How many ranks share a row of ``seq_len`` tokens when this one holds ``local_len``: 1 for
    a local call, else the context-parallel degree whose ``torch.chunk`` gives ``local_len``."""
    return -(-seq_len // local_len)


def validate_bounds(bounds: list[list[int]], seq_len: int) -> None:
    """Raise ValueError naming the first row and rule that ``cu_seqlens`` breaks."""
    for b, row in enumerate(bounds):
        if row[0] != 0:
            raise ValueError(f"cu_seqlens[{b}] must start at 0, got {row[0]}")
        for j in range(1, len(row)):
            if row[j] < row[j - 1]:
                raise ValueError(
                    f"cu_seqlens[{b}] must be non-decreasing, but entry {j} ({row[j]}) < entry {j - 1} ({row[j - 1]})"
                )
            if row[j] > seq_len:
                raise ValueError(f"cu_seqlens[{b}] entry {j} is {row[j]}, past the sequence length {seq_len}")
        if row[-1] != seq_len:
            raise ValueError(
                f"cu_seqlens[{b}] must end at the sequence length {seq_len} (unused slots repeat it), got {row[-1]}"
            )


_cache: OrderedDict[tuple, tuple[torch.Tensor, DocLayout]] = OrderedDict()


def _key(cu: torch.Tensor, seq_len: int) -> tuple:
    version = _compat.tensor_version(cu)  # None for inference tensors
    return (cu.device, cu.data_ptr(), tuple(cu.shape), cu.stride(), version, seq_len)


def get_layout(cu_seqlens: torch.Tensor, seq_len: int) -> DocLayout:
    """The validated :class:`DocLayout` of ``cu_seqlens`` (one host read per distinct tensor)."""
    key = _key(cu_seqlens, seq_len)
    hit = _cache.get(key)
    if hit is not None:
        _cache.move_to_end(key)
        return hit[1]
    bounds = cu_seqlens.detach().to("cpu", torch.int64).tolist()
    validate_bounds(bounds, seq_len)
    layout = DocLayout(bounds, seq_len)
    _cache[key] = (cu_seqlens, layout)
    if len(_cache) > _CACHE_SIZE:
        _cache.popitem(last=False)
    return layout
