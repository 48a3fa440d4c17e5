"""Host-side facts about one ``cu_seqlens`` layout, validated once and cached (docs/contract.md).

The cache may never describe values other than the ones a call passes, and never lets invalid
values through. How it knows the values without reading them every call depends on the device:

- **CPU tensors are keyed on their values** (dtype, shape and bytes: ``B x (MAX_DOCS + 1)``
  int32 or int64, read every call, no device sync; hashed on each row's head, compared whole). Every way of writing a CPU tensor (in
  place, under ``torch.inference_mode()``, through ``.data``, a NumPy or DLPack view, its
  storage) changes the key, so a cached entry always describes the values passed.
- **Other devices** (CUDA) would need a device sync to read the values, so a tensor is keyed on
  its identity: address, shape, strides and version counter, holding a reference so the address
  cannot be reused while cached. Every write through a torch op bumps the version counter and
  misses. Inference tensors have no version counter: they are never cached by identity (their
  values are read every call, one sync each). Writes that bypass the version counter (``.data``,
  DLPack consumers, ``untyped_storage()``, kernels writing through ``data_ptr``) are not seen:
  the contract forbids them on a tensor already passed (docs/contract.md).

Whatever the key, values are validated before an entry is made, and only validated values have
entries, so a hit is always a valid layout. Layouts are shared by value: two tensors with the
same boundaries share one :class:`DocLayout` and everything memoised on it, whatever their
dtype. An int64 ``cu_seqlens`` is converted here, once per layout: validation bounds its values
by the row length (at most ``2**31 - 1``), and everything the kernels read (device offsets,
plans) is built from the layout's host ints as int32, so no layer converts or syncs.

Anything derived from the layout that layers can share (flattened offsets on the device, block
bounds for the CPU kernel, context-parallel plans) hangs off :meth:`DocLayout.derived`, a
least-recently-used memo of at most ``_DERIVED_SIZE`` entries per layout.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import torch

from . import _compat
from ._checks import INT32_MAX

_T = TypeVar("_T")
_CACHE_SIZE = 32  # layouts (by value) and CUDA tensors (by identity), each least recently used first out
_DERIVED_SIZE = 32  # memoised values per layout (a spec per mask, plans, exchanges, flop counts)
_HASHED = 64  # entries of each row a values key hashes (:class:`_ValuesKey`)


class DocLayout:
    """Validated document boundaries of a ``[B, MAX_DOCS + 1]`` ``cu_seqlens``."""

    __slots__ = ("seq_len", "rows", "_derived")

    def __init__(
        self,
        bounds: Sequence[Sequence[int]] | np.ndarray,
        seq_len: int,
        *,
        documents: tuple[tuple[tuple[int, int], ...], ...] | None = None,
    ):
        """``documents``: per row, the ``(start, end)`` of each non-empty document when the caller
        found them already from ``bounds`` (then not read again)."""
        self.seq_len = seq_len
        if documents is None:
            documents = _rows(*_increases(_as_array(bounds)))
        self.rows: tuple[tuple[tuple[int, int], ...], ...] = documents
        self._derived: OrderedDict[Any, Any] = OrderedDict()

    @property
    def batch(self) -> int:
        return len(self.rows)

    def put(self, key: Any, value: Any) -> None:
        """Memoise ``value`` under ``key``, replacing what was there."""
        self._derived[key] = value
        self._derived.move_to_end(key)
        if len(self._derived) > _DERIVED_SIZE:
            self._derived.popitem(last=False)

    def derived(self, key: Any, factory: Callable[[], _T]) -> _T:
        """Memoise ``factory()`` under ``key`` (the ``_DERIVED_SIZE`` most recently used keys)."""
        try:
            value = self._derived[key]
        except KeyError:
            value = self._derived[key] = factory()
            if len(self._derived) > _DERIVED_SIZE:
                self._derived.popitem(last=False)
            return value
        self._derived.move_to_end(key)
        return value


def _as_array(bounds: Sequence[Sequence[int]] | np.ndarray) -> np.ndarray:
    """``bounds`` as a ``[B, W]`` array: rows of different lengths are padded with their last
    entry (a repeat starts no document)."""
    if isinstance(bounds, np.ndarray) and bounds.ndim == 2:
        return bounds
    rows = [list(row) for row in bounds]
    width = max(map(len, rows), default=0)
    if any(len(row) != width for row in rows):
        rows = [row + (row[-1:] or [0]) * (width - len(row)) for row in rows]
    return np.array(rows, dtype=np.int64).reshape(len(rows), width)


def _increases(bounds: np.ndarray) -> tuple[list[int], list[int], list[int]]:
    """Every increase ``bounds[b, j] < bounds[b, j + 1]`` (a non-empty document of a valid row):
    its start and end values in row order, and where each row's begin in them (``B + 1`` cuts).
    All rows at once, a dozen NumPy calls whatever the batch: on a new layout the calls' fixed
    costs are most of the read, the values are few (a row of ``MAX_DOCS + 1`` is mostly its
    repeated tail)."""
    n, width = bounds.shape
    if width < 2:
        return [], [], [0] * (n + 1)
    flat = bounds.ravel()
    rising = flat[1:] > flat[:-1]
    rising[width - 1 :: width] = False  # from a row's last entry to the next row's first
    at = rising.nonzero()[0]  # (the method: np.flatnonzero wraps it in Python)
    starts, ends = flat[at].tolist(), flat[at + 1].tolist()
    if n == 1:
        return starts, ends, [0, len(starts)]
    at_list = at.tolist()
    return starts, ends, [bisect.bisect_left(at_list, b * width) for b in range(n + 1)]


def _rows(starts: list[int], ends: list[int], cuts: list[int]) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Per row, the ``(start, end)`` of each of its documents (:func:`_increases`)."""
    return tuple(tuple(zip(starts[i:j], ends[i:j])) for i, j in zip(cuts, cuts[1:]))


def _chained(bounds: np.ndarray, seq_len: int, starts: list[int], ends: list[int], cuts: list[int]) -> bool:
    """Whether ``bounds`` is valid (every row starts at 0, never decreases and ends at
    ``seq_len``), read from its increases: each row's documents must chain from 0 to ``seq_len``
    (each starting where the previous ended) and the row start at 0 and end at ``seq_len``. The
    same answer: between two increases a row never rises, so it is constant there exactly when
    the later increase starts where the earlier ended; before the first it is constant exactly
    when that starts at the row's first entry, 0; after the last exactly when the row ends where
    that ended, ``seq_len``; a row without increases is constant, so valid exactly when
    ``seq_len`` is 0."""
    if bounds.shape[1] == 0:
        return False
    firsts, lasts = bounds[:, 0].tolist(), bounds[:, -1].tolist()
    for b in range(len(firsts)):
        i, j = cuts[b], cuts[b + 1]
        if firsts[b] != 0 or lasts[b] != seq_len:
            return False
        if i == j:
            if seq_len != 0:
                return False
        elif starts[i] != 0 or ends[j - 1] != seq_len or starts[i + 1 : j] != ends[i : j - 1]:
            return False
    return True


def cp_degree(local_len: int, seq_len: int) -> int:
    """How many ranks share a row of ``seq_len`` tokens when this one holds ``local_len``: 1 for
    a local call, else the context-parallel degree whose ``torch.chunk`` gives ``local_len``."""
    return -(-seq_len // local_len)


def validate_bounds(bounds: Sequence[Sequence[int]] | np.ndarray, seq_len: int) -> None:
    """Raise ValueError naming the first row and rule that ``cu_seqlens`` breaks."""
    if seq_len > INT32_MAX:  # an int64 cu_seqlens may say so; kernels take 32-bit offsets
        raise ValueError(f"cu_seqlens rows end at {seq_len}, past 2**31 - 1 (kernels take 32-bit offsets)")
    for b, row in enumerate(bounds):
        r = np.asarray(row, dtype=np.int64)
        if r[0] != 0:
            raise ValueError(f"cu_seqlens[{b}] must start at 0, got {int(r[0])}")
        # the first entry that breaks either rule; a decrease is named before "past" at one entry
        decreasing = np.flatnonzero(r[1:] < r[:-1])
        past = np.flatnonzero(r[1:] > seq_len)
        j_dec = int(decreasing[0]) + 1 if decreasing.size else len(r)
        j_past = int(past[0]) + 1 if past.size else len(r)
        if j_dec <= j_past and j_dec < len(r):
            raise ValueError(
                f"cu_seqlens[{b}] must be non-decreasing, but entry {j_dec} ({int(r[j_dec])}) < entry "
                f"{j_dec - 1} ({int(r[j_dec - 1])})"
            )
        if j_past < len(r):
            raise ValueError(f"cu_seqlens[{b}] entry {j_past} is {int(r[j_past])}, past the sequence length {seq_len}")
        if r[-1] != seq_len:
            raise ValueError(
                f"cu_seqlens[{b}] must end at the sequence length {seq_len} (unused slots repeat it), got {int(r[-1])}"
            )


class _ValuesKey:
    """A cache key by values: equal when dtype, shape, ``seq_len`` and every value are, hashed on
    the first :data:`_HASHED` entries of each row alone. Hashing all of them cost 17-20 us at
    4 x 32k (64 KiB, on every call with a CPU ``cu_seqlens``); the head of a row holds its
    documents (the rest repeats ``seq_len``), and keys whose heads agree are still told apart
    by the comparison of all their bytes."""

    __slots__ = ("head", "values", "_hash")

    def __init__(self, dtype: torch.dtype, values: np.ndarray, seq_len: int):
        self.head = (dtype, values.shape, seq_len, values[..., :_HASHED].tobytes())
        self.values = values.tobytes()  # (a copy: the key outlives later writes to the tensor)
        self._hash = hash(self.head)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _ValuesKey) and self.head == other.head and self.values == other.values


# (values key) -> DocLayout, and (identity key) -> (the tensor, its DocLayout) for non-CPU tensors
_layouts: OrderedDict[_ValuesKey, DocLayout] = OrderedDict()
_tensors: OrderedDict[tuple, tuple[torch.Tensor, DocLayout]] = OrderedDict()
# [tensor, seq_len, version, layout] of two non-CPU tensors, checked before the identity key (same
# answer, fewer steps): the one found last (every layer of a step passes it) and the one
# registered last (the next step's, registered while this step runs), so the next step's first
# call finds its tensor as the later layers do
_NO_TENSOR = (None, -1, -1, None)
_recent: list = [_NO_TENSOR, _NO_TENSOR]


def _lru_put(cache: OrderedDict, key: Any, value: Any) -> None:
    cache[key] = value
    if len(cache) > _CACHE_SIZE:
        cache.popitem(last=False)


def _identity_key(cu: torch.Tensor, seq_len: int) -> tuple | None:
    """The identity key of a non-CPU tensor, or None when its version counter cannot be trusted."""
    version = _compat.tensor_version(cu)  # None for inference tensors
    if version is None:
        return None
    return (cu.device, cu.data_ptr(), tuple(cu.shape), cu.stride(), version, seq_len)


def _layout_of(host: torch.Tensor, seq_len: int) -> DocLayout:
    """The layout of host values: cached by value, validated before it is cached."""
    values = host.numpy()
    key = _ValuesKey(host.dtype, values, seq_len)
    layout = _layouts.get(key)
    if layout is not None:
        _layouts.move_to_end(key)
        return layout
    # NumPy, not torch ops: no intra-op pool per layout; int32 values read as they are (an int64
    # copy cost 8 us and slowed every pass over them at 4 x 32k)
    bounds = values if values.dtype == np.int32 else values.astype(np.int64)
    found = _increases(bounds)
    if seq_len > INT32_MAX or not _chained(bounds, seq_len, *found):
        validate_bounds(bounds, seq_len)  # raises, naming the first row and rule broken
        raise AssertionError("validate_bounds passed values _chained rejects")
    layout = None
    if host.dtype != torch.int32:  # valid values fit int32: share the int32 twin's layout
        twin = _ValuesKey(torch.int32, bounds.astype(np.int32), seq_len)
        layout = _layouts.get(twin)
        if layout is None:
            layout = DocLayout(bounds, seq_len, documents=_rows(*found))
            _lru_put(_layouts, twin, layout)
    if layout is None:
        layout = DocLayout(bounds, seq_len, documents=_rows(*found))
    _lru_put(_layouts, key, layout)
    return layout


def get_layout(cu_seqlens: torch.Tensor, seq_len: int) -> DocLayout:
    """The validated :class:`DocLayout` of ``cu_seqlens`` (CPU: keyed on the values; other
    devices: one host read per distinct tensor and version, see the module doc)."""
    # every layer of a step passes the same tensor (slot 0); a step's first call passes the one
    # registered during the step before (slot 1), which then becomes the one found last
    for slot, (tensor, length, version, layout) in enumerate(_recent):
        if cu_seqlens is tensor and seq_len == length and _compat.tensor_version(cu_seqlens) == version:
            if slot:
                _recent.reverse()
            return layout
    cu = cu_seqlens.detach()
    if cu.device.type == "cpu":
        return _layout_of(cu, seq_len)
    key = _identity_key(cu, seq_len)
    hit = None if key is None else _tensors.get(key)
    if hit is not None:
        assert key is not None
        _tensors.move_to_end(key)
        layout = hit[1]
    else:
        _COUNTS["device_reads"] += 1
        layout = _layout_of(cu.to("cpu"), seq_len)  # the one device sync
        if key is not None:
            _lru_put(_tensors, key, (cu_seqlens, layout))
    if key is not None:
        _recent[0] = (cu_seqlens, seq_len, key[4], layout)
    return layout


def register(cu_seqlens: torch.Tensor, layout: DocLayout) -> None:
    """Give the non-CPU tensor ``cu_seqlens`` ``layout``, the validated layout of the host values
    it was copied from (the caller's promise), so that calls with it never read it back."""
    key = _identity_key(cu_seqlens.detach(), layout.seq_len)
    if key is not None and cu_seqlens.device.type != "cpu":
        _lru_put(_tensors, key, (cu_seqlens, layout))
        _recent[1] = (cu_seqlens, layout.seq_len, key[4], layout)


def registered_seq_len(cu_seqlens: torch.Tensor) -> int | None:
    """The row length a non-CPU tensor was cached or :func:`register`-ed with, or None."""
    key = _identity_key(cu_seqlens.detach(), -1)
    if key is None:
        return None
    for k in reversed(_tensors):
        if k[:5] == key[:5]:
            return k[5]
    return None


def device_reads() -> int:
    """How many times this process read a non-CPU ``cu_seqlens`` back to the host (each one a
    device sync): tensors neither seen before nor :func:`register`-ed."""
    return _COUNTS["device_reads"]


_COUNTS = {"device_reads": 0}


def clear_cache() -> None:
    """Forget every cached layout (tests; memory)."""
    _layouts.clear()
    _tensors.clear()
    _recent[:] = [_NO_TENSOR, _NO_TENSOR]
