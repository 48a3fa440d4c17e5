"""Per-rank index maps and split sizes that turn a plan into data movement.

Built once per (layout, group, mask) on the host, moved to the device once, and reused by every
layer: the per-layer path only runs ``index_select``, ``all_to_all_single`` and the kernel.

Orders (both sides of every transfer derive them from the same plan):
- queries ``o -> t``: the parts of ``t``'s segments that ``o`` owns, in ``t``'s segment order;
- keys ``o -> t``: the parts of ``t``'s needed key ranges that ``o`` owns, in range order.

On the receiving rank, the kernel's query buffer is assembled from runs of local and received
rows, and so is its key buffer: each segment's queries and the keys they see, contiguous, as
the varlen kernel wants them. A run list is a handful of slices in practice, so assembling is
one ``cat`` (no copy at all when the buffer is the local tensor itself), and only rows that
move are gathered for sending. Segments are grouped into kernel calls by the window they need
in the kernel's bottom-right-aligned convention (one call for causal and full attention).
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

import torch

from ..kernels import VarlenSpec
from .plan import ContextParallelPlan, Segment, chunk_len


Run = tuple[int, int, int]  # (source: 0 local / 1 received, first row, rows)


def assemble(runs: tuple[Run, ...], local: torch.Tensor, received: torch.Tensor) -> torch.Tensor:
    """Rows ``runs`` of (local, received), in order: a view when one run, else one ``cat``."""
    sources = (local, received)
    if len(runs) == 1:
        src, a, n = runs[0]
        return sources[src][a : a + n]
    if not runs:
        return local[:0]
    return torch.cat([sources[src][a : a + n] for src, a, n in runs])


def assemble_or_zeros(runs: tuple[tuple[int, int], ...], rows: torch.Tensor) -> torch.Tensor:
    """Rows ``rows[p : p + n]`` for each ``(p, n)`` run, zeros where ``p == -1``."""
    if len(runs) == 1 and runs[0][0] >= 0:
        p, n = runs[0]
        return rows[p : p + n]
    parts = [rows[p : p + n] if p >= 0 else rows.new_zeros((n, *rows.shape[1:])) for p, n in runs]
    return torch.cat(parts) if parts else rows[:0]


def _gradient_runs(pairs, T_local: int, T_recv: int):
    """Invert the key buffer's ``(src, n)`` pairs per source row space, or None if a row is used
    twice (then dK/dV must be accumulated)."""
    spans: list[list[tuple[int, int, int]]] = [[], []]  # (first row, buffer position, n)
    pos = 0
    for src, n in pairs:
        space, a = (0, src) if src < T_local else (1, src - T_local)
        spans[space].append((a, pos, n))
        pos += n
    out = []
    for space, total in ((0, T_local), (1, T_recv)):
        runs, row = [], 0
        for a, p, n in sorted(spans[space]):
            if a < row:
                return None
            if a > row:
                runs.append((-1, a - row))
            if runs and runs[-1][0] >= 0 and runs[-1][0] + runs[-1][1] == p:
                runs[-1] = (runs[-1][0], runs[-1][1] + n)
            else:
                runs.append((p, n))
            row = a + n
        if row < total:
            runs.append((-1, total - row))
        out.append(tuple(runs))
    return tuple(out)


def _runs(pairs, split: int) -> tuple[Run, ...]:
    """``(start, n)`` pairs in ``cat([local, received])`` row space -> merged runs."""
    out: list[list[int]] = []
    for start, n in pairs:
        src, a = (0, start) if start < split else (1, start - split)
        if out and out[-1][0] == src and out[-1][1] + out[-1][2] == a:
            out[-1][2] += n
        else:
            out.append([src, a, n])
    return tuple((src, a, n) for src, a, n in out)


@dataclass(frozen=True)
class KernelCall:
    spec: VarlenSpec
    q0: int
    q1: int
    k0: int
    k1: int


@dataclass(frozen=True)
class RankExchange:
    rank: int
    local_len: int
    q_traffic: bool  # does any rank of the group move queries (same answer on every rank)
    kv_traffic: bool
    q_send_index: torch.Tensor
    q_send_splits: list[int]
    q_recv_splits: list[int]
    q_runs: tuple[Run, ...]  # kernel query buffer <- (local rows, received rows)
    return_index: torch.Tensor  # kernel rows computed for other owners, in their send order
    out_runs: tuple[Run, ...]  # local rows <- (kernel rows, returned rows)
    kv_send_index: torch.Tensor
    kv_send_splits: list[int]
    kv_recv_splits: list[int]
    k_runs: tuple[Run, ...]  # kernel key buffer <- (local rows, received rows)
    k_index: torch.Tensor  # the same as row indices into cat([local, received]) (for dK/dV)
    # dK/dV without a float32 buffer of every row, when each key row is used at most once:
    # local / received rows <- kernel rows (-1: a row no query here sees, zero gradient)
    grad_runs: tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]] | None
    kv_reduce_rows: torch.Tensor  # distinct local rows that receive partial dK/dV
    kv_reduce_slot: torch.Tensor  # for each row received back, its slot in kv_reduce_rows
    calls: tuple[KernelCall, ...]


def _kernel_window(seg: Segment, causal: bool, left: int, right: int) -> tuple[int, int]:
    """The (left, right) window that reproduces the document mask for this segment's queries
    against its key range under bottom-right alignment (offset = key_end - end)."""
    if causal:
        return left, 0
    if left < 0 and right < 0:
        return -1, -1
    shift = seg.key_end - seg.end
    return (left + shift if left >= 0 else -1), (right - shift if right >= 0 else -1)


def _parts(b: int, s: int, e: int, owners: list[tuple[int, int]], cs: int):
    """Split ``[s, e)`` of row ``b`` at shard boundaries: yields ``(owner, s, e)``."""
    while s < e:
        o = s // cs
        pe = min(e, owners[o][1])
        yield o, s, pe
        s = pe


def build_exchange(plan: ContextParallelPlan, rank: int, device: torch.device) -> RankExchange:
    owners = plan.owners
    c = plan.cp_size
    cs = chunk_len(plan.seq_len, c)
    lens = [e - s for s, e in owners]
    my_start, _ = owners[rank]
    L = lens[rank]
    T_local = plan.batch * L

    def local(b: int, s: int) -> int:
        return b * L + s - my_start

    # ---- queries sent: parts of other ranks' segments that this rank owns
    q_send: list[tuple[int, int]] = []  # (local start, n)
    q_send_splits = [0] * c
    for t in range(c):
        if t == rank:
            continue
        for seg in plan.segments[t]:
            for o, s, e in _parts(seg.batch, seg.start, seg.end, owners, cs):
                if o == rank:
                    q_send.append((local(seg.batch, s), e - s))
                    q_send_splits[t] += e - s

    # ---- queries received, kernel query order, rows to return
    segs = plan.segments[rank]
    windows = [_kernel_window(s, plan.causal, *plan.window_size) for s in segs]
    window_rank = {w: j for j, w in enumerate(dict.fromkeys(windows))}
    call_order = sorted(range(len(segs)), key=lambda i: (window_rank[windows[i]], i))
    q_recv_splits = [0] * c
    recv_parts: list[list[tuple[int, int, int, int]]] = [[] for _ in range(c)]  # (seg, s, e, recv_off)
    for i, seg in enumerate(segs):
        for o, s, e in _parts(seg.batch, seg.start, seg.end, owners, cs):
            if o != rank:
                recv_parts[o].append((i, s, e, q_recv_splits[o]))
                q_recv_splits[o] += e - s
    recv_base = [sum(q_recv_splits[:o]) for o in range(c)]

    seg_qpos: dict[int, int] = {}
    pos = 0
    for i in call_order:
        seg_qpos[i] = pos
        pos += segs[i].end - segs[i].start
    T_buf = pos

    # source index of each part of a segment's queries
    part_src: dict[int, list[tuple[int, int, int]]] = {i: [] for i in range(len(segs))}  # (s, e, src)
    for o in range(c):
        for i, s, e, off in recv_parts[o]:
            part_src[i].append((s, e, T_local + recv_base[o] + off))
    for i, seg in enumerate(segs):
        for o, s, e in _parts(seg.batch, seg.start, seg.end, owners, cs):
            if o == rank:
                part_src[i].append((s, e, local(seg.batch, s)))
    q_index = [(src, e - s) for i in call_order for s, e, src in sorted(part_src[i])]
    return_rows = [(seg_qpos[i] + s - segs[i].start, e - s) for o in range(c) for i, s, e, _ in recv_parts[o]]

    # where each local row's output comes from: the kernel rows, or the rows returned to us
    out_src: list[tuple[int, int, int]] = []  # (local dst, src, n)
    for i, seg in enumerate(segs):
        for o, s, e in _parts(seg.batch, seg.start, seg.end, owners, cs):
            if o == rank:
                out_src.append((local(seg.batch, s), seg_qpos[i] + s - seg.start, e - s))
    off = T_buf
    for dst_start, n in q_send:
        out_src.append((dst_start, off, n))
        off += n
    out_src.sort()

    # ---- keys: the parts of needed ranges owned by other ranks
    kv_send: list[tuple[int, int]] = []
    kv_send_splits = [0] * c
    for t in range(c):
        if t == rank:
            continue
        for b, s0, e0 in plan.kv_ranges[t]:
            for o, s, e in _parts(b, s0, e0, owners, cs):
                if o == rank:
                    kv_send.append((local(b, s), e - s))
                    kv_send_splits[t] += e - s
    kv_recv_splits = [0] * c
    remote: dict[int, list[tuple[int, int, int]]] = {}  # row -> sorted (s, e, recv offset)
    recv_runs: list[list[tuple[int, int, int, int]]] = [[] for _ in range(c)]  # (row, s, e, offset)
    for b, s0, e0 in plan.kv_ranges[rank]:
        for o, s, e in _parts(b, s0, e0, owners, cs):
            if o != rank:
                recv_runs[o].append((b, s, e, kv_recv_splits[o]))
                kv_recv_splits[o] += e - s
    kv_base = [sum(kv_recv_splits[:o]) for o in range(c)]
    for o in range(c):
        for b, s, e, off in recv_runs[o]:
            remote.setdefault(b, []).append((s, e, T_local + kv_base[o] + off))
    for runs in remote.values():
        runs.sort()
    starts = {b: [r[0] for r in runs] for b, runs in remote.items()}

    k_index: list[tuple[int, int]] = []
    calls: list[KernelCall] = []
    kpos = 0
    by_window: dict[tuple[int, int], list[int]] = {}
    for i in call_order:
        by_window.setdefault(windows[i], []).append(i)
    for (wl, wr), members in by_window.items():
        cu_q, cu_k = [0], [0]
        for i in members:
            seg = segs[i]
            for o, s, e in _parts(seg.batch, seg.key_start, seg.key_end, owners, cs):
                if o == rank:
                    k_index.append((local(seg.batch, s), e - s))
                else:
                    j = bisect_right(starts[seg.batch], s) - 1
                    rs, re_, src = remote[seg.batch][j]
                    assert rs <= s and e <= re_, "key range not covered by the plan's kv_ranges"
                    k_index.append((src + s - rs, e - s))
            cu_q.append(cu_q[-1] + seg.end - seg.start)
            cu_k.append(cu_k[-1] + seg.key_end - seg.key_start)
        q0 = seg_qpos[members[0]]
        calls.append(KernelCall(VarlenSpec(cu_q, cu_k, plan.causal, wl, wr), q0, q0 + cu_q[-1], kpos, kpos + cu_k[-1]))
        kpos += cu_k[-1]

    def runs_to_index(runs) -> torch.Tensor:
        if not runs:
            return torch.zeros(0, dtype=torch.int64, device=device)
        return torch.cat([torch.arange(s, s + n, dtype=torch.int64) for s, n in runs]).to(device)

    sent = (
        torch.cat([torch.arange(s, s + n, dtype=torch.int64) for s, n in kv_send])
        if kv_send
        else torch.zeros(0, dtype=torch.int64)
    )
    reduce_rows, reduce_slot = torch.unique(sent, return_inverse=True)

    return RankExchange(
        rank=rank,
        local_len=L,
        q_traffic=sum(plan.q_moved_tokens) > 0,
        kv_traffic=sum(plan.kv_recv_tokens) > 0,
        q_send_index=runs_to_index(q_send),
        q_send_splits=q_send_splits,
        q_recv_splits=q_recv_splits,
        q_runs=_runs(q_index, T_local),
        return_index=runs_to_index(return_rows),
        out_runs=_runs([(src, n) for _, src, n in out_src], T_buf),
        kv_send_index=runs_to_index(kv_send),
        kv_send_splits=kv_send_splits,
        kv_recv_splits=kv_recv_splits,
        k_runs=_runs(k_index, T_local),
        k_index=runs_to_index(k_index),
        grad_runs=_gradient_runs(k_index, T_local, sum(kv_recv_splits)),
        kv_reduce_rows=reduce_rows.to(device),
        kv_reduce_slot=reduce_slot.to(device),
        calls=tuple(calls),
    )
