"""Host-side values of ``prefix_lens`` (prefix-bidirectional documents), validated and cached.

``prefix_lens [B, MAX_DOCS]`` holds, per document slot of ``cu_seqlens``, the length of the
document's bidirectional prefix. Kernels need the values on the host once per layout (they become
the :class:`~doc_packed.kernels.VarlenSpec`'s per-segment ``prefix``), so they are cached the way
:mod:`doc_packed._doc_layout` caches ``cu_seqlens``: CPU tensors by value, others by identity and
version counter (one device sync per distinct pair of tensors), and validated before an entry is
made: each value in ``[0, its document's length]``.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from . import _compat
from ._doc_layout import _CACHE_SIZE

__all__ = ["prefixes"]

# key -> per row, the prefix length of each non-empty document (zero-length slots dropped, as
# DocLayout.rows drops them); identity keys also hold the two tensors
_by_value: OrderedDict[tuple, tuple[tuple[int, ...], ...]] = OrderedDict()
_by_identity: OrderedDict[tuple, tuple[torch.Tensor, torch.Tensor, tuple[tuple[int, ...], ...]]] = OrderedDict()


def _put(cache: OrderedDict, key: tuple, value) -> None:
    cache[key] = value
    if len(cache) > _CACHE_SIZE:
        cache.popitem(last=False)


def _read(cu: torch.Tensor, pl: torch.Tensor) -> tuple[tuple[int, ...], ...]:
    bounds = cu.to(torch.int64).tolist()
    lens = pl.to(torch.int64).tolist()
    rows = []
    for b, (row, plen) in enumerate(zip(bounds, lens)):
        kept = []
        for d, (s, e) in enumerate(zip(row[:-1], row[1:])):
            if not 0 <= plen[d] <= e - s:
                raise ValueError(
                    f"prefix_lens[{b}, {d}] is {plen[d]}, outside [0, {e - s}] (the length of document {d} "
                    f"of row {b}): a bidirectional prefix lies inside its document"
                )
            if e > s:
                kept.append(plen[d])
        rows.append(tuple(kept))
    return tuple(rows)


def _value_key(t: torch.Tensor) -> tuple:
    t = t.contiguous()
    return (t.dtype, tuple(t.shape), t.numpy().tobytes())


def _identity(t: torch.Tensor) -> tuple | None:
    version = _compat.tensor_version(t)
    if version is None:
        return None
    return (t.device, t.data_ptr(), tuple(t.shape), t.stride(), version)


def prefixes(cu_seqlens: torch.Tensor, prefix_lens: torch.Tensor) -> tuple[tuple[int, ...], ...]:
    """Per row, the prefix length of each non-empty document (the order of ``DocLayout.rows``).
    ``cu_seqlens`` must already be a valid layout (the op reads it first)."""
    cu, pl = cu_seqlens.detach(), prefix_lens.detach()
    if cu.device.type == "cpu" and pl.device.type == "cpu":
        key = (_value_key(cu), _value_key(pl))
        hit = _by_value.get(key)
        if hit is None:
            hit = _read(cu, pl)
            _put(_by_value, key, hit)
        return hit
    ids = (_identity(cu), _identity(pl))
    if ids[0] is None or ids[1] is None:
        return _read(cu.cpu(), pl.cpu())
    entry = _by_identity.get(ids)
    if entry is None:
        entry = (cu_seqlens, prefix_lens, _read(cu.cpu(), pl.cpu()))  # the one device sync
        _put(_by_identity, ids, entry)
    return entry[2]


def clear_cache() -> None:
    """Forget every cached prefix table (tests)."""
    _by_value.clear()
    _by_identity.clear()
