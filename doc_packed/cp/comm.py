"""Communication primitives of the context-parallel exchange.

- :func:`start_exchange` / :func:`wait_exchange` (and :func:`exchange`, waited): one AllToAll-V
  of several fields at once (e.g. K rows, V rows and moved query rows), each sent as runs of
  rows where they lie and landing in its own receive buffer where the caller says, so nothing
  is gathered into a message or cut out of one. It is one grouped batch of point-to-point transfers
  (what ``torch.distributed.batch_isend_irecv`` posts: on NCCL one ``ncclGroupStart``/
  ``ncclGroupEnd``, as ``all_to_all_single`` issues too; :func:`doc_packed._compat.post_point_to_point`),
  started so that compute runs while it is in flight.
- :func:`check_agreement`: one small all-gather per context-parallel call proving every rank
  makes the same call, before any data moves (docs/contract.md, section 8).

Row counts are host ints taken from the plan, so no exchange here needs a host sync. The
agreement runs on CPU tensors, on the group itself when it has a CPU backend (gloo, or torch's
default ``cpu:gloo,cuda:nccl``) and otherwise on a gloo companion group created at the group's
first context-parallel call: a host round trip, never a device sync.
"""

from __future__ import annotations

import functools
import hashlib
import json
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from .. import _compat

__all__ = [
    "AGREEMENT_WORDS",
    "Exchange",
    "Field",
    "Runs",
    "by_splits",
    "check_agreement",
    "exchange",
    "fingerprint",
    "group_info",
    "receive_buffer",
    "start_exchange",
    "wait_exchange",
]


def group_info(group_name: str) -> tuple[int, int]:
    """``(rank, size)`` of this process in the named group."""
    pg = _compat.resolve_process_group(group_name)
    return dist.get_rank(pg), dist.get_world_size(pg)


# ----------------------------------------------------------------------------- data exchange

Runs = Sequence[Sequence[tuple[int, int]]]  # per peer: runs (first row, rows), in order


class Field(NamedTuple):
    """One field of an exchange.

    ``rows``: what this rank sends from; ``send[p]``: the runs of ``rows`` for peer ``p``, each
    sent where it lies (no gather into a message; a run several peers need is read once per
    peer, never copied); ``recv[p]``: where peer ``p``'s runs land in the receive buffer, one
    ``(first row, rows)`` per run it sends, in order; ``into``: the receive buffer (rows no run
    lands in keep what they held), or None for a new uninitialised one just long enough. A
    sender's runs to a peer and that peer's landing runs from it must agree one by one."""

    rows: torch.Tensor
    send: Runs
    recv: Runs
    into: torch.Tensor | None = None


def by_splits(x: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int]) -> Field:
    """A field whose rows go out in peer order, ``send_splits[p]`` rows to peer ``p`` (one run
    each), and land grouped by source rank, ``recv_splits[p]`` rows from peer ``p``."""
    return Field(x, _consecutive(send_splits), _consecutive(recv_splits))


def receive_buffer(f: Field) -> torch.Tensor:
    """The buffer ``f`` lands in: its ``into``, or a new uninitialised one just long enough."""
    if f.into is not None:
        return f.into
    rows = max((r0 + n for runs in f.recv for r0, n in runs), default=0)
    return f.rows.new_empty((rows, *f.rows.shape[1:]))


def _consecutive(splits: Sequence[int]) -> list[list[tuple[int, int]]]:
    at = [0, *accumulate(splits)]
    return [[(at[p], n)] if n else [] for p, n in enumerate(splits)]


@dataclass
class Exchange:
    """An exchange in flight: its receive buffers (one per field, not to be read before
    :func:`wait_exchange`), the transfers' handles, and the rows they read and write."""

    received: list[torch.Tensor]
    works: list[Any] = field(default_factory=list)
    sent: list[torch.Tensor] = field(default_factory=list)


# (group name, device type) -> the ProcessGroup whose communicator a collective has created
_warm: dict[tuple[str, str], dist.ProcessGroup] = {}


def _ensure_communicator(group_name: str, pg: dist.ProcessGroup, device: torch.device) -> None:
    """Make sure the group's device communicator exists before a batch of point-to-point
    transfers that may leave some ranks out: NCCL creates it lazily at a group's first
    collective, which every rank must then join (torch's ``batch_isend_irecv`` notes). Every
    rank of a context-parallel group makes the same exchanges (the plan's traffic flags are the
    same on every rank), so each reaches its first one together; one 1-element all-reduce, once.
    Then one 1-element all-to-all: NCCL also connects each pair of ranks lazily, at their first
    transfer, so a new layout that first pairs two ranks would pay that set-up inside a training
    step; every pair is connected here instead. (Not shown to matter: the slow steps measured at
    CP 4 on 4 x H200 stayed with it, docs/end_to_end.md, "4 x H200".)"""
    if device.type == "cpu" or _warm.get((group_name, device.type)) is pg:
        return
    dist.all_reduce(torch.zeros(1, device=device), group=pg)
    n = dist.get_world_size(pg)
    dist.all_to_all_single(torch.empty(n, device=device), torch.zeros(n, device=device), group=pg)
    _warm[(group_name, device.type)] = pg


_EXCHANGE_NS = [0]  # host nanoseconds this process spent issuing exchanges and waiting on them


def exchange_ns() -> int:
    """Nanoseconds of host time this process spent in :func:`start_exchange` and
    :func:`wait_exchange` so far (a clock to take differences of; on CUDA a wait only queues the
    stream's wait, on CPU backends it blocks until the data landed)."""
    return _EXCHANGE_NS[0]


def _host_clocked(fn):
    """Add ``fn``'s host time to :data:`_EXCHANGE_NS`."""

    @functools.wraps(fn)
    def clocked(*args):
        t0 = time.perf_counter_ns()
        try:
            return fn(*args)
        finally:
            _EXCHANGE_NS[0] += time.perf_counter_ns() - t0

    return clocked


@_host_clocked
def start_exchange(fields: Sequence[Field], group_name: str) -> Exchange:
    """Issue one AllToAll-V of every field and return at once (:func:`wait_exchange` before
    reading). Every rank of the group passes the same number of fields, in the same order, and
    field ``f``'s runs for peer ``p`` are what ``p`` expects from this rank in its field ``f``."""
    pg = _compat.resolve_process_group(group_name)
    rank = dist.get_rank(pg)
    ex = Exchange(received=[])
    ops: list[tuple[bool, torch.Tensor, int, int]] = []  # (send, rows, peer, tag), in batch order
    for tag, f in enumerate(fields):
        x, into = f.rows, receive_buffer(f)
        if not into.is_contiguous():
            raise ValueError(f"field {tag} of the exchange lands in a non-contiguous buffer (strides {into.stride()})")
        ex.received.append(into)
        whole = x.is_contiguous()  # then every run of rows is: no per-run check
        for p, (runs_out, runs_in) in enumerate(zip(f.send, f.recv)):
            if p == rank:  # rows this rank keeps: local copies
                for (r0, n), (t0, m) in zip(runs_out, runs_in):
                    into[t0 : t0 + m].copy_(x[r0 : r0 + n])
                continue
            for r0, n in runs_out:
                ops.append((True, x[r0 : r0 + n] if whole else x[r0 : r0 + n].contiguous(), p, tag))
            for t0, m in runs_in:
                ops.append((False, into[t0 : t0 + m], p, tag))
    if fields:  # every rank (some may have no transfer): the traffic flags are every rank's
        _ensure_communicator(group_name, pg, fields[0].rows.device)
    if ops:
        ex.works = _compat.post_point_to_point(pg, fields[0].rows.device, ops)
        ex.sent = [t for _, t, _, _ in ops]  # alive until the transfers are waited on
    return ex


@_host_clocked
def wait_exchange(ex: Exchange) -> list[torch.Tensor]:
    """The landed receive buffers of :func:`start_exchange`, one per field (on CUDA the current
    stream waits for the transfers; the host does not)."""
    for work in ex.works:
        work.wait()
    ex.works, ex.sent = [], []
    return ex.received


def exchange(fields: Sequence[Field], group_name: str) -> list[torch.Tensor]:
    """:func:`start_exchange`, waited."""
    return wait_exchange(start_exchange(fields, group_name))


# ----------------------------------------------------------------------------- agreement

AGREEMENT_WORDS = 3  # int64 words each rank sends per call: a 128-bit fingerprint, an error flag
_AGREEMENTS = [0, 0]  # agreements made by this process, nanoseconds they took (waiting for peers included)


def agreements() -> tuple[int, int]:
    """(agreements this process made, microseconds they took: the host waits for its peers there)."""
    return _AGREEMENTS[0], _AGREEMENTS[1] // 1000


def agreement_ns() -> int:
    """Nanoseconds this process spent in agreements so far (a clock to take differences of)."""
    return _AGREEMENTS[1]


def fingerprint(*parts: object) -> tuple[int, int]:
    """Two int64 words hashing ``parts`` (their ``repr``), for cross-rank comparison."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=16).digest()
    return struct.unpack("<qq", digest)


@functools.lru_cache(maxsize=256)
def _fields_fingerprint(items: tuple) -> tuple[int, int]:
    return fingerprint(*items)


class _Channel:
    """Where a group's agreement runs: CPU tensors, a host round trip, no device work.

    ``backend`` is None when the group itself takes CPU tensors, else its gloo companion. The
    per-call message lives in preallocated buffers (NumPy views, so filling and reading them
    costs no torch op).
    """

    def __init__(self, pg: dist.ProcessGroup, backend: dist.ProcessGroupGloo | None):
        self.pg, self.backend = pg, backend
        self.size = dist.get_world_size(pg)
        self._send = torch.zeros(AGREEMENT_WORDS, dtype=torch.int64)
        self._recv = torch.zeros(self.size, AGREEMENT_WORDS, dtype=torch.int64)
        self._send_np, self._recv_np = self._send.numpy(), self._recv.numpy()
        self._recv_rows = list(self._recv.unbind(0))

    def _gather(self, rows: list[torch.Tensor], x: torch.Tensor) -> None:
        on: Any = self.pg if self.backend is None else self.backend  # c10d's allgather, no wrapper
        on.allgather([rows], [x]).wait()

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` (1-D, CPU), as ``[size, len(x)]``."""
        out = x.new_empty((self.size, x.numel()))
        self._gather(list(out.unbind(0)), x)
        return out

    def exchange(self, words: tuple[int, ...]) -> list[list[int]]:
        """The per-call message: every rank's :data:`AGREEMENT_WORDS` int64 words."""
        self._send_np[:] = words
        self._gather(self._recv_rows, self._send)
        return self._recv_np.tolist()


# group name -> (the ProcessGroup it resolved to, its channel); rebuilt if the name is reused
_channels: dict[str, tuple[dist.ProcessGroup, _Channel]] = {}
_companions_made: dict[tuple[int, ...], int] = {}  # global ranks -> companions made for them


def _has_cpu_backend(pg: dist.ProcessGroup) -> bool:
    """Whether collectives on CPU tensors run on ``pg`` itself (``gloo``, ``cpu:gloo,cuda:nccl``)."""
    return any(part.split(":")[0] == "cpu" for part in dist.get_backend_config(pg).split(","))


def _companion(pg: dist.ProcessGroup) -> dist.ProcessGroupGloo:
    """A gloo group over ``pg``'s ranks. Collective: every rank of ``pg`` must create it together
    (their first context-parallel call on ``pg``); its store prefix names the ranks, so it does
    not depend on how many other groups each rank has made."""
    ranks = tuple(dist.get_process_group_ranks(pg))
    n = _companions_made[ranks] = _companions_made.get(ranks, 0) + 1
    prefix = f"doc_packed/cp_agreement/{'_'.join(map(str, ranks))}/{n}/"
    store = dist.PrefixStore(prefix, _compat.default_store())
    return dist.ProcessGroupGloo(store, dist.get_rank(pg), len(ranks), default_pg_timeout)


def _channel(group_name: str) -> _Channel:
    pg = _compat.resolve_process_group(group_name)
    hit = _channels.get(group_name)
    if hit is not None and hit[0] is pg:
        return hit[1]
    channel = _Channel(pg, None if _has_cpu_backend(pg) else _companion(pg))
    _channels[group_name] = (pg, channel)
    return channel


def _gather_text(channel: _Channel, text: str) -> list[str]:
    """Every rank's ``text`` (two collectives: lengths, then the padded bytes). Error path only."""
    data = text.encode()
    n = channel.all_gather(torch.tensor([len(data)], dtype=torch.int64))[:, 0].tolist()
    buf = torch.zeros(max(n), dtype=torch.uint8)
    buf[: len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    got = channel.all_gather(buf)
    return [bytes(got[r, : n[r]].tolist()).decode(errors="replace") for r in range(channel.size)]


def _ranks(rs: list[int]) -> str:
    return f"rank {rs[0]}" if len(rs) == 1 else f"ranks {rs}"


def _by_value(values: dict[int, str]) -> str:
    """``"rank 0: a; ranks [1, 2]: b"``: which ranks hold which value."""
    groups: dict[str, list[int]] = {}
    for r, v in values.items():
        groups.setdefault(v, []).append(r)
    return "; ".join(f"{_ranks(rs)}: {v}" for v, rs in groups.items())


def check_agreement(
    group_name: str, what: str, fields: dict[str, object] | None = None, *, local_error: Exception | None = None
) -> None:
    """Return if every rank of the group passed the same ``fields`` and none has ``local_error``;
    else raise the same error on every rank.

    One all-gather of :data:`AGREEMENT_WORDS` int64 words per rank (a fingerprint of ``fields``
    and an error flag), on CPU. Only when something is wrong, two more collectives gather each
    rank's error message or its fields, so the error names the ranks and what differs. If every
    rank failed with the same error, each raises its own; otherwise every rank raises one
    ``ValueError`` with the same message (the local error chained as its cause).
    """
    channel = _channel(group_name)
    fields = fields or {}
    try:
        h = _fields_fingerprint(tuple(fields.items()))
    except TypeError:  # an unhashable value
        h = fingerprint(*fields.items())
    t0 = time.perf_counter_ns()
    rows = channel.exchange((*h, int(local_error is not None)))
    _AGREEMENTS[0] += 1
    _AGREEMENTS[1] += time.perf_counter_ns() - t0
    failed = [r for r, row in enumerate(rows) if row[2]]
    if failed:
        mine = "" if local_error is None else f"{type(local_error).__name__}: {local_error}"
        texts = _gather_text(channel, mine)
        if local_error is not None and len(failed) == channel.size and len(set(texts)) == 1:
            raise local_error  # every rank raises this very error
        told = _by_value({r: texts[r] for r in failed})
        raise ValueError(
            f"context-parallel {_ranks(failed)} of this group rejected their inputs to {what} "
            f"({told}); no data was exchanged"
        ) from local_error
    if any(row[:2] != rows[0][:2] for row in rows):
        described = [json.loads(t) for t in _gather_text(channel, json.dumps({k: repr(v) for k, v in fields.items()}))]
        names = list(dict.fromkeys(name for d in described for name in d))
        differ = [
            f"{name} ({_by_value({r: d.get(name, '(not given)') for r, d in enumerate(described)})})"
            for name in names
            if len({d.get(name) for d in described}) > 1
        ]
        raise ValueError(
            f"context-parallel ranks disagree on {what}: {', '.join(differ)}. Every rank of a "
            "context-parallel group must make the same call (cu_seqlens values, sequence length, mask, "
            "head counts, head dim, dtype, scale; forward or backward); no data was exchanged"
        )
