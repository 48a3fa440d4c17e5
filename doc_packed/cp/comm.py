"""Communication primitives of the context-parallel exchange, on torch's functional collectives.

- :func:`group_cast`: each rank sends every peer the rows it needs (an AllToAll-V over
  ``all_to_all_single`` with per-peer split sizes, the send buffer gathered per destination).
- :func:`group_reduce`: the adjoint: rows computed for other owners go back and are summed in.
- :func:`check_agreement`: one small all-gather proving every rank runs the same plan.

Split sizes are host ints taken from the plan, so no collective here needs a host sync.
"""

from __future__ import annotations

import hashlib
import struct

import torch
import torch.distributed as dist

from .. import _compat

__all__ = ["all_to_all", "group_cast", "group_reduce", "check_agreement", "group_info"]


def group_info(group_name: str) -> tuple[int, int]:
    """``(rank, size)`` of this process in the named group."""
    pg = _compat.resolve_process_group(group_name)
    return dist.get_rank(pg), dist.get_world_size(pg)


def all_to_all(x: torch.Tensor, send_splits: list[int], recv_splits: list[int], group_name: str) -> torch.Tensor:
    """AllToAll-V along dim 0: ``x`` holds ``send_splits[p]`` rows for peer ``p`` in order."""
    return _compat.all_to_all_single(x.contiguous(), recv_splits, send_splits, group_name)


def group_cast(
    src: torch.Tensor, send_index: torch.Tensor, send_splits: list[int], recv_splits: list[int], group_name: str
) -> torch.Tensor:
    """Send ``src[send_index]`` (grouped by destination) and return what peers sent here."""
    return all_to_all(src.index_select(0, send_index), send_splits, recv_splits, group_name)


def group_reduce(
    dst: torch.Tensor,
    partial: torch.Tensor,
    reduce_index: torch.Tensor,
    send_splits: list[int],
    recv_splits: list[int],
    group_name: str,
) -> torch.Tensor:
    """Return ``partial`` rows to the ranks that cast them and add them into ``dst[reduce_index]``.

    ``send_splits``/``recv_splits`` are those of the matching :func:`group_cast` (the reverse
    direction is taken here). ``partial`` travels in its own dtype and is summed in ``dst``'s
    (float32 accumulation for half-precision gradients). ``dst`` is updated in place.
    """
    back = all_to_all(partial, recv_splits, send_splits, group_name)
    return dst.index_add_(0, reduce_index, back.to(dst.dtype))


def fingerprint(*parts: object) -> torch.Tensor:
    """Two int64 words hashing ``parts`` (their ``repr``), for cross-rank comparison."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=16).digest()
    return torch.tensor(struct.unpack("<qq", digest), dtype=torch.int64)


def check_agreement(
    group_name: str, device: torch.device, what: str, *parts: object, local_error: Exception | None = None
) -> None:
    """Raise ValueError on every rank if any rank has ``local_error`` or the ranks disagree.

    One all-gather of three int64 words per rank (a fingerprint of ``parts`` and an error flag).
    The rank whose own inputs were bad re-raises its error; the others name it.
    """
    rank, size = group_info(group_name)
    mine = torch.cat([fingerprint(*parts), torch.tensor([int(local_error is not None)])])
    got = _compat.all_gather_into_tensor(mine.to(device), size, group_name).view(size, 3).cpu()
    if local_error is not None:
        raise local_error
    failed = [r for r in range(size) if got[r, 2] != 0]
    if failed:
        raise ValueError(
            f"context-parallel ranks {failed} of this group rejected their inputs (see their "
            "errors); no data was exchanged"
        )
    differ = [r for r in range(size) if not torch.equal(got[r, :2], got[rank, :2])]
    if differ:
        raise ValueError(
            f"context-parallel ranks disagree on {what}: rank {rank} differs from ranks {differ} "
            "of its group. Every rank of a context-parallel group must pass the same cu_seqlens, "
            "sequence length, mask, head counts and dtype."
        )
