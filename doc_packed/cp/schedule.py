"""One rank's schedule for a context-parallel plan: what moves, and which kernel calls run where.

Built once per (layout, group, mask) on the host, moved to the device once, reused by every
layer. The per-layer path (:mod:`.attention`) runs it top to bottom:

1. **Exchange** (asynchronous, one AllToAll-V): K/V rows other ranks' queries need, and the
   queries the plan moves, each sent as runs of local rows straight from the local tensors.
   Received rows land in their field's buffer (K, V, q), grouped by source rank and in position
   order inside each source, so a document's remote keys are one contiguous run (the part from
   an earlier rank ends that rank's block, the part from a later rank starts its block, and this
   rank's own block is empty).
2. **Stage A**, while the exchange is in flight: this rank's own queries against its own keys,
   on the local tensors in place.
3. **Stage B**, once the data has landed: queries against received keys, and moved-in queries
   against local keys; each call reads its buffers in place.
4. **Merge** by log-sum-exp, only on the rows a stage B touches; moved-in rows go back to their
   owners (one message: output and lse).

Every kernel call is one varlen problem over a slice of a query buffer and a slice of a key
buffer. Its segments are *pieces*: a run of queries and a run of keys of one document, each
contiguous in its buffer and in position, so the document mask is a causal flag or a window in
the kernels' bottom-right-aligned convention. Rows of the slices that a call does not use are
covered by empty segments (queries with no keys give out 0 and lse -inf, which merging ignores).
"""

from __future__ import annotations

import operator
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import islice
from typing import NamedTuple

import numpy as np
import torch

from .._host import queue_filled, queue_to
from ..kernels import VarlenSpec
from ..kernels.spec import OFFSETS_ALIGN
from .plan import ContextParallelPlan, _frozen, _owners, chunk_len

__all__ = ["Call", "RankSchedule", "build_schedule", "call_masks"]

LOCAL, RECV = "local", "recv"  # the two buffers a query or key row can sit in


class _Piece(NamedTuple):
    q_buf: str
    q0: int  # first row in its buffer
    nq: int
    q_pos: int  # position of the first query in its row
    k_buf: str
    k0: int
    nk: int
    k_pos: int
    full: bool = False  # every query sees every key (a bidirectional prefix's block)


_CALL_ORDER = operator.itemgetter(0, 4, 1, 5)  # how _calls walks the pieces: (q_buf, k_buf, q0, k0)
_new_piece = tuple.__new__  # _new_piece(_Piece, fields): a _Piece without its Python-level __new__


@dataclass(frozen=True)
class Call:
    """One kernel call: queries ``q_buf[q0:q1]`` against keys ``k_buf[k0:k1]`` under ``spec``;
    ``rows`` (device, relative to ``q0``) are the query rows it really computes, None when that
    is every row of the slice (``n_rows`` of them either way); ``k_rows`` likewise the key rows
    some query sees (relative to ``k0``), None when every one is; ``merge``: an earlier call of
    the schedule (stage A, then stage B, in order) computed some of these rows too, so the
    forward merges this call's output into theirs by lse instead of copying it."""

    q_buf: str
    k_buf: str
    q0: int
    q1: int
    k0: int
    k1: int
    spec: VarlenSpec
    rows: torch.Tensor | None
    n_rows: int
    k_rows: torch.Tensor | None
    merge: bool


@dataclass(frozen=True)
class RankSchedule:
    rank: int
    local_rows: int  # B * L
    # K/V exchange: rows received from each peer (the runs: kv_send_runs / kv_recv_runs below)
    kv_recv_splits: list[int]
    # partial dK/dV of the rows sent come home run by run (the runs of kv_send_runs, peer by
    # peer) into a buffer of kv_back_rows rows laid out for summing: rows sent to one peer only
    # land as they are; an interval of rows sent to k peers (overlapping runs) lands as a
    # [k, interval] grid, each run in its own grid row at its offset, the cells no run covers
    # (kv_back_gaps, device rows) zeroed before the exchange. kv_back_sums (first buffer row, k,
    # first local row, rows): one float32 sum over the k grid rows (k = 1: the run as it is),
    # added once, so every row's sum is taken in float32 and rounded once. kv_back_recv: where
    # each peer's runs land (first buffer row, rows). kv_shared: some row was sent to several
    # peers.
    kv_back_sums: tuple[tuple[int, int, int, int], ...]
    kv_back_recv: tuple[tuple[tuple[int, int], ...], ...]
    kv_back_rows: int
    kv_back_gaps: torch.Tensor
    kv_shared: bool
    # query exchange (only when the plan moves queries): send q_send_index; the same rows come
    # back (output, lse, dq) in the reverse direction
    q_send_index: torch.Tensor
    q_send_splits: list[int]
    q_recv_splits: list[int]
    # the same exchanges as runs (comm.Field): per peer, the runs of local rows sent straight
    # from the local tensors, and where the runs received from it land in the receive buffer
    # (grouped by source rank, in order), each as (first row, rows)
    kv_send_runs: tuple[tuple[tuple[int, int], ...], ...]
    kv_recv_runs: tuple[tuple[tuple[int, int], ...], ...]
    q_send_runs: tuple[tuple[tuple[int, int], ...], ...]
    q_recv_runs: tuple[tuple[tuple[int, int], ...], ...]
    stage_a: tuple[Call, ...]  # local queries x local keys (overlaps the exchange)
    stage_b: tuple[Call, ...]  # everything that reads a received buffer
    kv_traffic: bool  # does any rank of the group receive K/V (same on every rank)
    q_traffic: bool  # does any rank of the group move queries (same on every rank)
    plan_tag: int  # the plan's query and key ranges hashed (ints only: the same in every process)

    @property
    def collectives(self) -> tuple[int, int]:
        """Data-carrying exchanges (one AllToAll-V each, of all its fields) per (forward,
        backward) call: out, and home when queries moved (forward) / always (backward)."""
        out = int(self.kv_traffic or self.q_traffic)
        return out + int(self.q_traffic), 2 * out


def _parts(b: int, s: int, e: int, cs: int, seq_len: int) -> list[tuple[int, int, int]]:
    """Split positions ``[s, e)`` of row ``b`` at shard boundaries: ``(owner, s, e)``."""
    o = s // cs
    if s < e and e <= (o + 1) * cs and e <= seq_len:  # inside one shard (most ranges)
        return [(o, s, e)]
    out = []
    while s < e:
        o = s // cs
        pe = min(e, (o + 1) * cs, seq_len)
        out.append((o, s, pe))
        s = pe
    return out


def _reach(causal: bool, left: int, right: int) -> tuple[int | None, int | None]:
    """``(lo, hi)``: query ``i`` of a document sees key ``j`` when ``i - lo <= j <= i + hi``
    (None: no bound on that side)."""
    return (left if left >= 0 else None), (0 if causal else (right if right >= 0 else None))


def _visible(qs: int, qe: int, ks: int, ke: int, lo: int | None, hi: int | None) -> tuple[int, int, int, int] | None:
    """Trim queries ``[qs, qe)`` and keys ``[ks, ke)`` of one document (positions) to the rows
    that see something under :func:`_reach`'s bounds: ``(qa, qz, a, z)``, the queries
    ``[qa, qz)`` and keys ``[a, z)`` kept, or None when no query sees any key."""
    a = ks if lo is None or ks >= qs - lo else qs - lo  # keys some query sees
    z = ke if hi is None or ke <= qe + hi else qe + hi
    if a >= z:
        return None
    qa = qs if hi is None or qs >= a - hi else a - hi  # queries that see some of them
    qz = qe if lo is None or qe <= z + lo else z + lo
    return (qa, qz, a, z) if qa < qz else None


def _kernel_mask(p: _Piece, causal: bool, left: int, right: int) -> tuple[bool, int, int]:
    """(causal, left, right) for a piece in the kernels' bottom-right-aligned convention."""
    _, _, nq, q_pos, _, _, nk, k_pos, full = p  # (one unpacking, not a property per field)
    if full:
        return False, -1, -1
    shift = (q_pos + nq) - (k_pos + nk)  # key j <= query i + shift (causal) in index terms
    if causal:
        if k_pos + nk - 1 <= q_pos and (left < 0 or k_pos >= q_pos + nq - 1 - left):
            return False, -1, -1  # every query sees every key
        if shift == 0:
            return True, left, 0
        return False, (left - shift if left >= 0 else -1), shift
    wl = left - shift if left >= 0 else -1
    wr = right + shift if right >= 0 else -1
    return False, wl, wr


class _Written:
    """Rows of one query buffer that earlier calls computed: sorted disjoint ``[start, end)``
    intervals (host ints; a schedule has a handful of calls, each a handful of runs)."""

    def __init__(self) -> None:
        self.ivs: list[tuple[int, int]] = []

    def overlaps(self, runs: list[tuple[int, int]]) -> bool:
        return any(s < e2 and s2 < e for s, e in runs for s2, e2 in self.ivs)

    def add(self, runs: list[tuple[int, int]]) -> None:
        self.ivs = _merged([*self.ivs, *runs])


def _merged(runs) -> list[tuple[int, int]]:
    """Sorted disjoint ``[start, end)`` intervals covering ``runs`` (empty ones dropped)."""
    out: list[tuple[int, int]] = []
    for s, e in sorted(runs):
        if s >= e:
            continue
        if out and s <= out[-1][1]:
            if e > out[-1][1]:
                out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


class _Indices:
    """Every index a schedule reads on the device, gathered on the host without torch ops (plain
    ints and NumPy, whose work does not depend on torch's intra-op thread pool) and moved in one
    copy per dtype: int64 rows (kept as runs, expanded once), int32 segment offsets. ``add_*``
    return a slot; after :meth:`to`, :meth:`get` gives the slot's view of the device copy.

    Slots of the same int64 runs are one slot (a stage A call's query and key rows are often the
    same, and each is up to a buffer's rows): the rows are expanded, copied and held once, and
    every index on the device is read only. The views are made by one split per dtype."""

    def __init__(self) -> None:
        self.runs: list[tuple[int, int]] = []  # every int64 slot's [start, end) runs, in order
        self.offsets: list[int] = []  # every int32 slot's values, in order
        self.int32_at = 0  # len(self.offsets)
        # per dtype, the lengths its copy splits into, in order: every slot's, and the int32 gaps
        self.parts: dict[torch.dtype, list[int]] = {torch.int64: [], torch.int32: []}
        self.slots: list[tuple[torch.dtype, int]] = []  # (dtype, its part)
        self.same: dict[tuple[tuple[int, int], ...], int] = {}  # int64 runs -> their slot
        self.views: dict[torch.dtype, Sequence[torch.Tensor]] = {}

    def add_offsets(self, values: Sequence[int]) -> int:
        """A slot holding ``values`` as int32, starting on a 16-byte boundary (FA4 copies
        offsets that do not: :data:`~doc_packed.kernels.spec.OFFSETS_ALIGN`)."""
        parts = self.parts[torch.int32]
        gap = -self.int32_at % OFFSETS_ALIGN
        if gap:
            self.offsets.extend([0] * gap)
            parts.append(gap)
        self.offsets.extend(values)
        self.int32_at += gap + len(values)
        parts.append(len(values))
        self.slots.append((torch.int32, len(parts) - 1))
        return len(self.slots) - 1

    def add_runs(self, runs: Sequence[tuple[int, int]]) -> int:
        """A slot holding the int64 rows of the ``[start, end)`` ``runs``, in order."""
        key = tuple(runs)
        slot = self.same.get(key)
        if slot is None:
            self.runs.extend(runs)
            parts = self.parts[torch.int64]
            parts.append(sum(e - s for s, e in runs))
            self.slots.append((torch.int64, len(parts) - 1))
            slot = self.same[key] = len(self.slots) - 1
        return slot

    def to(self, device: torch.device) -> None:
        runs, n = self.runs, sum(self.parts[torch.int64])
        flat64 = queue_filled(n, torch.int64, lambda out: _expand(runs, out), device)  # (never waits for the device)
        flat32 = queue_to(np.array(self.offsets, dtype=np.int32), device)
        self.views[torch.int64] = torch.split_with_sizes(flat64, self.parts[torch.int64])
        self.views[torch.int32] = torch.split_with_sizes(flat32, self.parts[torch.int32])

    def get(self, slot: int) -> torch.Tensor:
        dtype, part = self.slots[slot]
        return self.views[dtype][part]


_RAMP = np.zeros(0, dtype=np.int64)  # 0, 1, 2, ...: every run's rows are a view of it (read-only)


def _expand(runs: Sequence[tuple[int, int]], out: np.ndarray) -> None:
    """The rows of ``[start, end)`` runs, in order, written into ``out`` (int64, as many): views
    of one cached ramp, joined, so each row is written once and nothing else is (an ``arange``
    per run wrote every row twice, some 16,000 rows a 4 x 32k schedule, up to 83,000: 43 -> 13 us
    at the median). The ramp grows by doubling to the largest row asked for (a row index is below
    a buffer's rows)."""
    global _RAMP
    if not runs:
        return
    ramp = _RAMP
    top = max(e for _, e in runs)
    if len(ramp) < top:
        ramp = np.arange(max(top, 2 * len(ramp)), dtype=np.int64)
        ramp.flags.writeable = False
        _RAMP = ramp
    np.concatenate([ramp[s:e] for s, e in runs], out=out)


class _Pending(NamedTuple):
    """A call whose device tensors wait for the schedule's one copy: :class:`Call`'s fields but
    ``rows``/``k_rows`` (``where``: its buffers, slices and spec), and the slots (in an
    :class:`_Indices`) of its spec's offsets and of the rows it will index (None: every row of
    its slice)."""

    where: tuple[str, str, int, int, int, int, VarlenSpec]
    n_rows: int
    merge: bool
    cu: tuple[int, int]
    rows: int | None
    k_rows: int | None

    def on_device(self, index: _Indices, device: torch.device) -> Call:
        q_buf, k_buf, q0, q1, k0, k1, spec = self.where
        # the spec's device offsets are views of the schedule's one copy (VarlenSpec.cu_tensors)
        spec.cached(("cu", device), lambda: (index.get(self.cu[0]), index.get(self.cu[1])))
        rows = None if self.rows is None else index.get(self.rows)
        k_rows = None if self.k_rows is None else index.get(self.k_rows)
        # Call(...), the same instance, without the frozen __init__'s object.__setattr__ per field
        fields = {"q_buf": q_buf, "k_buf": k_buf, "q0": q0, "q1": q1, "k0": k0, "k1": k1, "spec": spec}
        fields.update(rows=rows, n_rows=self.n_rows, k_rows=k_rows, merge=self.merge)
        return _frozen(Call, fields)


def call_masks(causal: bool, left: int, right: int) -> tuple[tuple[bool, int, int], ...]:
    """One ``(causal, left, right)`` of each kind the kernel calls of any schedule for this mask
    can carry (:func:`_kernel_mask`'s cases; kinds differ in being causal and in which window
    sides are set, never in the window's values), for building kernels ahead (cp/warmup.py).
    ``left``/``right`` normalised (right 0 when causal)."""
    out = {(False, -1, -1)}  # every query sees every key (a bidirectional prefix's block too)
    if causal:
        out.add((True, left, 0))  # queries and keys end together
        out.add((False, -1, 1))  # keys end before the queries (shift > 0), no window left
        if left >= 0:
            out.add((False, 1, 1))  # ... with the window's left side still set
    else:  # left - shift may drop below 0 (unset); right + shift below 0, to 0 or above
        for wl in (-1, 1) if left >= 0 else (-1,):
            for wr in (-1, 0, 1) if right >= 0 else (-1,):
                out.add((False, wl, wr))
    return tuple(sorted(out))


def _calls(
    pieces: list[_Piece],
    causal: bool,
    left: int,
    right: int,
    index: _Indices,
    written: dict[str, _Written],
    span: int | None = None,
) -> list[_Pending]:
    """Group pieces into kernel calls: same buffers and mask; within a call queries and keys both
    run forward without overlap. ``span``: every call covers rows ``[0, span)`` of both buffers
    (stage A on the local tensors: the first call's outputs then serve as the result buffers).

    The calls come widest first, so that the first call on a query buffer usually spans all of it
    and its output becomes the result buffer (no zero-filled buffer, no merge). ``written``
    records the rows earlier calls computed and is updated here: it sets each call's ``merge``.
    Host ints only; the device rows and offsets go into ``index``."""
    groups: dict[tuple, list[list[_Piece]]] = {}
    # pieces read by index below (q_buf 0, q0 1, nq 2, k_buf 4, k0 5, nk 6): a _Piece's fields
    # are properties, some ten reads a piece
    for p in sorted(pieces, key=_CALL_ORDER):
        key = (p[0], p[4], _kernel_mask(p, causal, left, right))
        calls = groups.get(key)
        if calls is None:
            groups[key] = [[p]]
            continue
        for call in calls:
            last = call[-1]
            if last[1] + last[2] <= p[1] and last[5] + last[6] <= p[5]:
                call.append(p)
                break
        else:
            calls.append([p])
    made = []
    for (q_buf, k_buf, (c, wl, wr)), calls in groups.items():
        for members in calls:
            first, last = members[0], members[-1]
            q0, k0 = first[1], first[5]
            q1, k1 = last[1] + last[2], last[5] + last[6]
            if span is not None:
                q0, k0, q1, k1 = 0, 0, span, span
            cu_q, cu_k = [0], [0]
            cq = ck = 0  # cu_q[-1], cu_k[-1]
            # the rows of the slices the members compute and read, adjacent runs joined: the
            # members run forward in both buffers without overlap, so these are sorted and disjoint
            # (the open run of each kept in locals, [qa, qz) and [ka, kz); none open yet: -1)
            q_runs: list[tuple[int, int]] = []
            k_runs: list[tuple[int, int]] = []
            qa = qz = ka = kz = -1
            n_rows = n_keys = 0  # rows of the runs: each member adds its own to one run
            for _, pq, nq, _, _, pk, nk, _, _ in members:
                qs, ks = pq - q0, pk - k0
                # empty segments cover the gaps: queries without keys, then keys without queries
                if qs > cq:
                    cu_q.append(qs)
                    cu_k.append(ck)
                    cq = qs
                if ks > ck:
                    cu_q.append(cq)
                    cu_k.append(ks)
                    ck = ks
                cq += nq
                ck += nk
                cu_q.append(cq)
                cu_k.append(ck)
                if qz != qs:
                    if qz >= 0:
                        q_runs.append((qa, qz))
                    qa = qs
                qz = qs + nq
                if kz != ks:
                    if kz >= 0:
                        k_runs.append((ka, kz))
                    ka = ks
                kz = ks + nk
                n_rows += nq
                n_keys += nk
            q_runs.append((qa, qz))
            k_runs.append((ka, kz))
            if cq < q1 - q0:  # trailing rows: queries without keys, keys without queries
                cu_q.append(q1 - q0)
                cu_k.append(ck)
                cq = q1 - q0
            if ck < k1 - k0:
                cu_q.append(cq)
                cu_k.append(k1 - k0)
            spec = VarlenSpec(cu_q, cu_k, c, wl, wr)
            made.append((q_buf, k_buf, q0, q1, k0, k1, spec, cu_q, cu_k, q_runs, k_runs, n_rows, n_keys))
    out = []
    for q_buf, k_buf, q0, q1, k0, k1, spec, cu_q, cu_k, q_runs, k_runs, n_rows, n_keys in sorted(
        made, key=lambda m: m[2] - m[3]
    ):
        absolute = [(s + q0, e + q0) for s, e in q_runs]
        buf = written[q_buf]
        merge = buf.overlaps(absolute)
        buf.add(absolute)
        cu = (index.add_offsets(cu_q), index.add_offsets(cu_k))
        rows = None if n_rows == q1 - q0 else index.add_runs(q_runs)
        k_rows = None if n_keys == k1 - k0 else index.add_runs(k_runs)
        out.append(_Pending((q_buf, k_buf, q0, q1, k0, k1, spec), n_rows, merge, cu, rows, k_rows))
    return out


def _home_grid(runs: list[tuple[int, int]]):
    """Where the partial dK/dV of the sent ``runs`` ``(first local row, rows)`` land when they
    come home (in this order), and how they are summed (RankSchedule's ``kv_back_*``).

    Overlapping runs form one interval of L rows; its k runs land in a [k, L] block, run j in
    block row j at its offset in the interval, so the interval's sum is one reduction over k.
    Returns (landing row of each run, rows in all, gap runs (cells no run covers), sums
    ``(first row, k, first local row, L)``, shared)."""
    merged: list[list[int]] = []  # disjoint sorted [start, end) of every row sent
    for r0, n in sorted(runs):
        if merged and r0 < merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], r0 + n)
        else:
            merged.append([r0, r0 + n])
    starts = [a for a, _ in merged]
    members: list[list[int]] = [[] for _ in merged]  # indices of the runs in each interval
    for i, (r0, _) in enumerate(runs):
        members[bisect_right(starts, r0) - 1].append(i)
    land = [0] * len(runs)
    gaps: list[tuple[int, int]] = []  # [start, end) runs, some empty
    sums: list[tuple[int, int, int, int]] = []
    at = 0
    for (a, e), idx in zip(merged, members):
        width = e - a
        for j, i in enumerate(idx):
            r0, n = runs[i]
            row = at + j * width
            land[i] = row + r0 - a
            gaps += [(row, land[i]), (land[i] + n, row + width)]
        sums.append((at, len(idx), a, width))
        at += len(idx) * width
    shared = sum(e - a for a, e in merged) < sum(n for _, n in runs)
    return land, at, gaps, tuple(sums), shared


def _runs(parts: list[tuple[int, int, int]], start: int, length: int) -> tuple[tuple[int, int], ...]:
    """The sender's runs of local rows ``(first row, rows)`` for the parts ``(row, s, e)`` it
    sends one peer, in order, adjacent rows merged: sender and receiver both derive the
    exchange's runs from the same parts through this, so they agree one by one."""
    runs: list[tuple[int, int]] = []
    r0 = r1 = -1  # the open run's rows [r0, r1) (rows are >= 0: none open yet)
    for b, s, e in parts:
        row = b * length + s - start
        if row == r1:
            r1 += e - s
        else:
            if r0 >= 0:
                runs.append((r0, r1 - r0))
            r0, r1 = row, row + e - s
    if r0 >= 0:
        runs.append((r0, r1 - r0))
    return tuple(runs)


_Parts = list[list[tuple[int, int, int]]]  # per peer rank: (row, start, end) runs of positions


def _owned_by(ranges, rank: int, cs: int, S: int) -> list[tuple[int, int, int]]:
    """The parts of ``(row, start, end)`` ranges that ``rank``'s shard holds (each range's
    intersection with the shard: what :func:`_parts` gives for this owner, without splitting)."""
    lo, hi = rank * cs, min((rank + 1) * cs, S)
    return [(b, s if s > lo else lo, e if e < hi else hi) for b, s, e in ranges if s < hi and e > lo]


def _by_owner(ranges, rank: int, c: int, cs: int, S: int) -> tuple[_Parts, list[int]]:
    """The parts of ``(row, start, end)`` ranges that other ranks (of ``c``) hold, per owner, and
    how many positions each owner holds."""
    parts: _Parts = [[] for _ in range(c)]
    for b, s0, e0 in ranges:
        o = s0 // cs
        if s0 < e0 and e0 <= (o + 1) * cs and e0 <= S:  # inside one shard (most ranges): _parts' first case
            if o != rank:
                parts[o].append((b, s0, e0))
            continue
        for o, s, e in _parts(b, s0, e0, cs, S):
            if o != rank:
                parts[o].append((b, s, e))
    return parts, [sum(e - s for _, s, e in ps) for ps in parts]


class _Received:
    """Where received key positions land in the receive buffer: grouped by source rank, in order."""

    def __init__(self, recv_parts: _Parts):
        remote: dict[int, list[tuple[int, int, int]]] = {}  # row -> sorted (s, e, first recv row)
        pos = 0
        for parts in recv_parts:
            for b, s, e in parts:
                remote.setdefault(b, []).append((s, e, pos))
                pos += e - s
        for runs in remote.values():
            runs.sort()
        self.remote = remote
        self.starts = {b: [r[0] for r in runs] for b, runs in remote.items()}

    def row(self, b: int, s: int, e: int) -> int:
        """The receive buffer row of position ``s`` of row ``b`` (``[s, e)`` lands contiguously)."""
        j = bisect_right(self.starts[b], s) - 1
        rs, re_, r0 = self.remote[b][j]
        assert rs <= s and e <= re_, "key range not covered by the plan's kv_ranges"
        return r0 + s - rs


def _landing(parts: _Parts, owners) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Where each source's runs land in the receive buffer: grouped by source rank, in order,
    as (first row, rows)."""
    out, at = [], 0
    for o, ps in enumerate(parts):
        lands = []
        start, end = owners[o]
        for _, n in _runs(ps, start, end - start):
            lands.append((at, n))
            at += n
        out.append(tuple(lands))
    return tuple(out)


def _pieces(
    plan: ContextParallelPlan, rank: int, received: _Received, q_runs: list, cs: int, my_start: int, L: int
) -> list[_Piece]:
    """(query part, key part) of each of ``rank``'s segments, each contiguous in its buffer:
    local rows where ``rank`` owns the positions, received rows elsewhere (``q_runs``: per
    segment, its queries' runs as (buffer, first row, s, e); ``cs``: the shard length; the rank's
    shard starts at ``my_start`` and is ``L`` long)."""
    S = plan.seq_len
    lo, hi = _reach(plan.causal, *plan.window_size)
    pieces: list[_Piece] = []
    for seg, seg_q_runs in zip(plan.segments[rank], q_runs):
        b, k_start, k_end = seg.batch, seg.key_start, seg.key_end
        o = k_start // cs
        if k_start < k_end and k_end <= (o + 1) * cs and k_end <= S:  # keys inside one shard (most)
            if o == rank:
                k_runs = [(LOCAL, b * L + k_start - my_start, k_start, k_end)]
            else:
                k_runs = [(RECV, received.row(b, k_start, k_end), k_start, k_end)]
        else:  # (buffer, first row, s, e), merged when contiguous
            k_runs = []
            for o, s, e in _parts(b, k_start, k_end, cs, S):
                buf, row = (LOCAL, b * L + s - my_start) if o == rank else (RECV, received.row(b, s, e))
                last = k_runs[-1] if k_runs else None
                if last is not None and last[0] == buf and last[3] == s and last[1] + last[3] - last[2] == row:
                    k_runs[-1] = (buf, last[1], last[2], e)
                else:
                    k_runs.append((buf, row, s, e))
        pe = seg.prefix_end
        for qb, qr, qs, qe in seg_q_runs:
            if qs < pe:  # prefix queries: every key of the prefix, nothing after it
                n = min(qe, pe) - qs
                for kb, kr, ks, ke in k_runs:
                    if ks < pe:
                        pieces.append(_new_piece(_Piece, (qb, qr, n, qs, kb, kr, min(ke, pe) - ks, ks, True)))
                qr, qs = qr + n, qs + n
                if qs >= qe:
                    continue
            for kb, kr, ks, ke in k_runs:
                vis = _visible(qs, qe, ks, ke, lo, hi)
                if vis is not None:
                    qa, qz, a, z = vis
                    pieces.append(_new_piece(_Piece, (qb, qr + qa - qs, qz - qa, qa, kb, kr + a - ks, z - a, a, False)))
    return pieces


def build_schedule(plan: ContextParallelPlan, rank: int, device: torch.device) -> RankSchedule:
    """Rank ``rank``'s schedule of ``plan``, its device indices queued to ``device``."""
    c, S = plan.cp_size, plan.seq_len
    cs = chunk_len(S, c)
    owners = _owners(S, c)
    my_start, my_end = owners[rank]
    L = my_end - my_start
    left, right = plan.window_size
    causal = plan.causal

    # keys: the parts of peers' needed ranges this rank owns (sent), and what it needs (received)
    kv_send_parts = [_owned_by(plan.kv_ranges[t], rank, cs, S) if t != rank else [] for t in range(c)]
    recv_parts, kv_recv_splits = _by_owner(plan.kv_ranges[rank], rank, c, cs, S)
    # queries: its rows other ranks compute (sent), and the rows it computes for others (received)
    q_send_parts = [_owned_by(plan.q_ranges[t], rank, cs, S) if t != rank else [] for t in range(c)]
    q_send_splits = [sum(e - s for _, s, e in ps) for ps in q_send_parts]
    q_recv_parts, q_recv_splits = _by_owner(plan.q_ranges[rank], rank, c, cs, S)
    q_base = [sum(q_recv_splits[:o]) for o in range(c)]
    q_runs, seen = [], [0] * c  # per segment, its queries' runs: (buffer, first row, s, e)
    for b, s0, e0 in plan.q_ranges[rank]:
        if my_start <= s0 < e0 <= my_end:  # its own queries (most segments): _parts' first case
            q_runs.append([(LOCAL, b * L + s0 - my_start, s0, e0)])
            continue
        runs = []
        for o, s, e in _parts(b, s0, e0, cs, S):
            if o == rank:
                runs.append((LOCAL, b * L + s - my_start, s, e))
            else:  # moved in: received from its owner, in order
                runs.append((RECV, q_base[o] + seen[o], s, e))
                seen[o] += e - s
        q_runs.append(runs)
    pieces = _pieces(plan, rank, _Received(recv_parts), q_runs, cs, my_start, L)

    stage_a: list[_Piece] = []
    stage_b: list[_Piece] = []
    for p in pieces:
        (stage_a if p[0] == LOCAL and p[4] == LOCAL else stage_b).append(p)  # (q_buf, k_buf)
    index = _Indices()
    written = {LOCAL: _Written(), RECV: _Written()}  # rows of each query buffer computed so far
    pending_a = _calls(stage_a, causal, left, right, index, written, span=plan.batch * L)
    pending_b = _calls(stage_b, causal, left, right, index, written)

    kv_send_runs = tuple(_runs(ps, my_start, L) for ps in kv_send_parts)
    q_send_runs = tuple(_runs(ps, my_start, L) for ps in q_send_parts)
    q_send = index.add_runs([(r0, r0 + n) for runs in q_send_runs for r0, n in runs])
    flat = [run for runs in kv_send_runs for run in runs]  # the order they come home in
    land, back_rows, gaps, back_sums, shared = _home_grid(flat)
    lands = iter(zip(land, (n for _, n in flat)))
    kv_back_recv = tuple(tuple(islice(lands, len(runs))) for runs in kv_send_runs)
    back_gaps = index.add_runs([(a, e) for a, e in gaps if e > a])
    index.to(device)  # the schedule's one host-to-device copy per dtype, queued

    return _frozen(
        RankSchedule,
        dict(
            rank=rank,
            local_rows=plan.batch * L,
            kv_recv_splits=kv_recv_splits,
            kv_back_sums=back_sums,
            kv_back_recv=kv_back_recv,
            kv_back_rows=back_rows,
            kv_back_gaps=index.get(back_gaps),
            kv_shared=shared,
            q_send_index=index.get(q_send),
            q_send_splits=q_send_splits,
            q_recv_splits=q_recv_splits,
            kv_send_runs=kv_send_runs,
            kv_recv_runs=_landing(recv_parts, owners),
            q_send_runs=q_send_runs,
            q_recv_runs=_landing(q_recv_parts, owners),
            stage_a=tuple(p.on_device(index, device) for p in pending_a),
            stage_b=tuple(p.on_device(index, device) for p in pending_b),
            kv_traffic=sum(plan.kv_recv_tokens) > 0,
            q_traffic=sum(plan.q_moved_tokens) > 0,
            plan_tag=hash((plan.q_ranges, plan.kv_ranges)),
        ),
    )
