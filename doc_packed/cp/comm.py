"""Communication primitives of the context-parallel exchange, on torch's functional collectives.

- :func:`start_all_to_all` / :func:`wait`: an AllToAll-V over ``all_to_all_single`` with
  per-peer split sizes, issued so that compute runs while it is in flight.
- :func:`check_agreement`: one small all-gather proving every rank runs the same plan.

Split sizes are host ints taken from the plan, so no collective here needs a host sync.
"""

from __future__ import annotations

import hashlib
import struct

import torch
import torch.distributed as dist

from .. import _compat

__all__ = ["all_to_all", "check_agreement", "group_info", "start_all_to_all", "wait"]


def group_info(group_name: str) -> tuple[int, int]:
    """``(rank, size)`` of this process in the named group."""
    pg = _compat.resolve_process_group(group_name)
    return dist.get_rank(pg), dist.get_world_size(pg)


def all_to_all(x: torch.Tensor, send_splits: list[int], recv_splits: list[int], group_name: str) -> torch.Tensor:
    """AllToAll-V along dim 0: ``x`` holds ``send_splits[p]`` rows for peer ``p`` in order."""
    return _compat.all_to_all_single(x.contiguous(), recv_splits, send_splits, group_name)


def start_all_to_all(x: torch.Tensor, send_splits: list[int], recv_splits: list[int], group_name: str) -> torch.Tensor:
    """Issue an AllToAll-V along dim 0 and return at once; :func:`wait` before reading the result."""
    return _compat.all_to_all_single_async(x.contiguous(), recv_splits, send_splits, group_name)


def wait(x: torch.Tensor) -> torch.Tensor:
    """The landed result of :func:`start_all_to_all`."""
    return _compat.wait_tensor(x)


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
