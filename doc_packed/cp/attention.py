"""Context-parallel forward and backward over a process group (called by the custom ops).

Each call runs this rank's :class:`~.schedule.RankSchedule` top to bottom:

- **Forward.** Start the exchange (K|V rows peers need and, when the plan moves queries, the
  moved query rows); run stage A (own queries x own keys, on the local tensors in place) while
  it is in flight; wait; run stage B (everything that reads a received buffer); merge stage B
  into stage A by log-sum-exp on the rows it touches; send moved-in rows' output and lse back
  to their owners.
- **Backward.** The adjoint, with the final output and lse: K|V (and moved rows' q, out, dout,
  lse) fetched again while stage A's backward runs; stage B's backward; dQ of moved rows and
  partial dK/dV of received keys go back to their owners, who add them in float32. Fetching
  again instead of keeping the forward's buffers keeps the ops' saved tensors the local shards
  (docs/context_parallel.md has the measured trade).

Each exchange is one AllToAll-V of all its fields (:func:`comm.start_exchange`), every field
landing in its own buffer. Exchanges per call: forward 1, plus 1 (the way home) when queries
move; backward 2 (out and home).
"""

from __future__ import annotations

import functools
import time
from typing import NamedTuple

import torch

from .. import _variants, kernels
from .._call import Call as OpCall  # the op's arguments by name
from .._doc_layout import DocLayout, get_layout
from . import comm
from .plan import ContextParallelPlan, owner_range, runtime_plan
from .lse_merge import merge_
from .partials import add_partials_
from .schedule import LOCAL, RECV, Call, RankSchedule, build_schedule
from .warmup import warmup


__all__ = [
    "ScheduleKey",
    "backward",
    "call_host_times",
    "forward",
    "get_schedule",
    "install_schedule",
    "layout_tag",
    "reject",
    "schedule_for",
    "schedules_built",
]

# Plans weigh moving one query against fetching one key/value row by their sizes per token
# (q/out and gradients: H_q * D; k/v: H_kv * D), allow plan.TOLERANCE of imbalance and balance
# pairs plus each rank's extra rows priced by plan.ROW_COST (plan.py, step 3).


def get_schedule(
    q: torch.Tensor,
    k: torch.Tensor,
    cu_seqlens: torch.Tensor,
    seq_len: int,
    causal: bool,
    left: int,
    right: int,
    group_name: str,
    *,
    scale: float | None = None,
    backend: str = "auto",
    pass_: str = "forward",
    softcap: float = 0.0,
    prefix_lens: torch.Tensor | None = None,
) -> RankSchedule:
    """This rank's schedule for the call, once every rank of the group agreed to make it.

    Every call (cached or not) first checks its own inputs and finds its schedule (planning is
    local, deterministic and collective-free, cached per layout), then all ranks exchange a
    fingerprint of what the exchange depends on and an error flag (:func:`comm.check_agreement`,
    one small all-gather on CPU, before any data moves). A bad or mismatched input on any rank
    raises the same error on every rank; whether a rank re-planned never matters. The runtime
    calls it through :func:`_call_schedule` (the op's call by name).
    """
    rank, size = comm.group_info(group_name)
    B, local_len, Hq, D = q.shape
    Hkv = k.shape[2]
    fields: dict[str, object] = {}
    error, schedule = None, None
    try:
        layout = get_layout(cu_seqlens, seq_len)
        prefixes = None if prefix_lens is None else _variants.prefixes(cu_seqlens, prefix_lens)
        fields = {
            "cu_seqlens values": layout_tag(layout),
            "seq_len": seq_len,
            "group size": size,
            "causal": causal,
            "window": (left, right),
            "batch": B,
            "q heads": Hq,
            "k/v heads": Hkv,
            "head dim": D,
            "dtype": q.dtype,
            "device type": q.device.type,
            "scale": scale,
            "softcap": softcap,
            "prefix_lens": None
            if prefixes is None
            else layout.derived(("cp_prefix_tag", prefixes), lambda: comm.fingerprint(prefixes)[0]),
            "pass": pass_,
        }
        start, end = owner_range(seq_len, size, rank)
        if local_len != end - start:
            raise ValueError(
                f"rank {rank} of the context-parallel group holds {local_len} tokens per row, but "
                f"torch.chunk of seq_len={seq_len} over {size} ranks gives it {end - start}"
            )
        if layout.batch != B:
            raise ValueError(f"cu_seqlens has {layout.batch} rows but q has batch size {B}")
        key = ScheduleKey(size, rank, causal, left, right, float(Hq / Hkv), q.device)
        built = _COUNTS["schedules"]
        schedule = schedule_for(layout, key, prefixes)
        _COUNTS["in_calls"] += _COUNTS["schedules"] - built  # nothing prepared this layout
        fields["plan"] = schedule.plan_tag  # a plan handed to prepare() must be every rank's
        if backend not in kernels.AUTO_MODES:
            _check_backend(layout, key, schedule, backend, q, Hkv)
    except Exception as e:  # noqa: BLE001  (every rank must hear of it: shared below, then raised)
        error = e
    comm.check_agreement(group_name, "a context-parallel call", fields, local_error=error)
    assert schedule is not None  # check_agreement raised every rank's error otherwise
    return schedule


def reject(cp_group: object, error: Exception) -> None:
    """Tell the other ranks of ``cp_group`` that this rank rejected its call (``doc_packed_attn``'s
    own checks failed here), so they raise instead of waiting for it; returns when the group
    cannot be resolved. The caller raises ``error`` afterwards (or this raises the shared one)."""
    try:
        name = cp_group if isinstance(cp_group, str) else cp_group.group_name  # type: ignore[attr-defined]
        comm.group_info(name)
    except Exception:  # noqa: BLE001  (no usable group: nobody is waiting on it)
        return
    comm.check_agreement(name, "a context-parallel call", None, local_error=error)


def layout_tag(layout: DocLayout) -> str:
    """A short, readable fingerprint of a layout's boundaries (memoised on it)."""
    return layout.derived(("cp_layout_tag",), lambda: _layout_tag(layout))


def _layout_tag(layout: DocLayout) -> str:
    # Python's hash of a tuple of ints: the same in every process of one interpreter (only str
    # and bytes hashes are salted per process), 64 bits, ~1 us at 4 x 32k against ~26 us for a
    # digest of its repr (once per new layout, on every rank)
    digest = hash(layout.rows) & 0xFFFFFFFFFFFFFFFF
    docs = sum(len(r) for r in layout.rows)
    return f"{docs} documents in {layout.batch} rows, digest {digest:016x}"


class ScheduleKey(NamedTuple):
    """What a rank's schedule for one layout is made for (besides bidirectional prefixes)."""

    size: int
    rank: int
    causal: bool
    left: int
    right: int
    query_cost: float  # H_q / H_kv: the planner's price of moving a query against a K/V row
    device: torch.device


def _schedule_slot(key: tuple, prefixes=None) -> tuple:
    """Where the layout's memo keeps the schedule for ``key`` and ``prefixes``: read and written
    by :func:`schedule_for` and :func:`install_schedule` alone."""
    return ("cp_schedule", *key) if prefixes is None else ("cp_schedule", *key, prefixes)


def schedule_for(layout: DocLayout, key: tuple, prefixes=None) -> RankSchedule:
    """Plan and schedule for ``key`` (a :class:`ScheduleKey`) and the bidirectional ``prefixes``
    (None: none): host work, no collective, memoised on the layout (made ahead by
    :func:`doc_packed.cp.prepare`, else by the first call that needs it)."""
    size, rank, causal, left, right, query_cost, device = key

    def build() -> RankSchedule:
        plan = runtime_plan(layout, size, causal, left, right, query_cost, prefixes)
        _COUNTS["schedules"] += 1
        return build_schedule(plan, rank, device)

    return layout.derived(_schedule_slot(key, prefixes), build)


def install_schedule(layout: DocLayout, key: tuple, plan: ContextParallelPlan) -> None:
    """Make calls for ``key`` on this layout run ``plan`` (one handed to
    :func:`doc_packed.cp.prepare`) instead of the one they would make."""
    _, rank, *_, device = key
    layout.put(_schedule_slot(key), build_schedule(plan, rank, device))


_COUNTS = {"schedules": 0, "in_calls": 0}


def schedules_built() -> tuple[int, int]:
    """How many plans-and-schedules this process made, and how many of them inside an attention
    call (nothing prepared them; :func:`doc_packed.cp.runtime_counts`)."""
    return _COUNTS["schedules"], _COUNTS["in_calls"]


# host nanoseconds of the forward and backward calls, split by whether the call was the first of
# its pass on its layout and group (a new layout's costs land there) or a later one, and the parts
# of them spent in the agreement (waiting for the peers to arrive), in the exchanges (issuing the
# transfers, waiting where the backend blocks) and in the attention kernels' calls
_CALL_NS = {"first": [0, 0, 0, 0, 0], "other": [0, 0, 0, 0, 0]}  # [calls, ns, agreement, exchange, kernels]
_KERNEL_NS = [0]  # host nanoseconds inside the schedules' kernel calls so far


def call_host_times() -> dict[str, tuple[int, ...]]:
    """``{"first": (calls, us, agreement us, exchange us, kernel us), "other": (...)}``: host
    time inside this process's context-parallel forward and backward calls (queuing and agreement
    included) and the parts of it spent in the agreement (where a rank waits for late peers), in
    the exchanges and in the attention kernels' calls (their Python and launches; on CPU their
    compute); the first call of each pass on a layout against the later ones
    (:func:`doc_packed.cp.runtime_counts`)."""
    return {k: (n, *(ns // 1000 for ns in parts)) for k, (n, *parts) in _CALL_NS.items()}


def _host_timed(fn):
    """Count ``fn``'s (forward's or backward's) host time in :data:`_CALL_NS`."""

    @functools.wraps(fn)
    def timed(*args):
        t0, starts = time.perf_counter_ns(), (comm.agreement_ns(), comm.exchange_ns(), _KERNEL_NS[0])
        result = fn(*args)
        op: OpCall = args[-1]
        fresh: list[bool] = []  # the layout is found without a read: the call looked it up
        get_layout(op.cu_seqlens, op.seq_len).derived(
            ("cp_called", op.cp_group, fn.__name__), lambda: fresh.append(True)
        )
        slot = _CALL_NS["first" if fresh else "other"]
        slot[0] += 1
        slot[1] += time.perf_counter_ns() - t0
        slot[2] += comm.agreement_ns() - starts[0]
        slot[3] += comm.exchange_ns() - starts[1]
        slot[4] += _KERNEL_NS[0] - starts[2]
        return result

    return timed


def _check_backend(
    layout: DocLayout, key: tuple, schedule: RankSchedule, backend: str, q: torch.Tensor, Hkv: int
) -> None:
    """A forced backend must take every kernel call of this rank's schedule (the calls differ by
    rank, so this is checked before the agreement, not inside the exchange)."""
    why = layout.derived(
        ("cp_backend", *key, Hkv, backend, q.dtype, q.shape[-1]), lambda: _backend_refusal(schedule, backend, q, Hkv)
    )
    if why:
        raise ValueError(why)


def _backend_refusal(schedule: RankSchedule, backend: str, q: torch.Tensor, Hkv: int) -> str:
    flat = q.reshape(-1, *q.shape[2:])
    for call in (*schedule.stage_a, *schedule.stage_b):
        try:
            kernels.choose(backend, call.spec, flat, Hkv)
        except ValueError as e:
            return f"{e} (a kernel call of this rank's context-parallel schedule)"
    return ""


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _rows(x: torch.Tensor, a: int, b: int, dim: int = 0) -> torch.Tensor:
    """Rows ``[a, b)`` of ``x`` along ``dim``; ``x`` itself when that is all of it (stage A's
    calls span the local tensors: a slice would be one more dispatched op)."""
    if a == 0 and b == x.shape[dim]:
        return x
    return x[a:b] if dim == 0 else x[:, a:b]


# ----------------------------------------------------------------------------- data movement


def _kv_fields(sch: RankSchedule, kf: torch.Tensor, vf: torch.Tensor) -> list[comm.Field]:
    """The exchange's K and V fields: the runs of local rows peers need, sent where they are."""
    return [comm.Field(x, sch.kv_send_runs, sch.kv_recv_runs) for x in (kf, vf)]


def _moved(sch: RankSchedule, *rows: torch.Tensor) -> list[comm.Field]:
    """One exchange field per tensor of ``rows`` (``[rows, ...]``): the runs of rows the plan
    moves, sent where they are."""
    return [comm.Field(x, sch.q_send_runs, sch.q_recv_runs) for x in rows]


def _home(sch: RankSchedule, moved_in: torch.Tensor, into: torch.Tensor) -> comm.Field:
    """The field that takes rows computed for moved-in queries (``moved_in``, in the order they
    came) home, straight into their owners' rows of ``into`` (where the owners sent them from;
    contiguous: transfers land in row ranges)."""
    return comm.Field(moved_in, sch.q_recv_runs, sch.q_send_runs, into)


# ----------------------------------------------------------------------------- merging


class _Rows:
    """Output and lse of one query buffer, merged by log-sum-exp over the calls that touch it."""

    def __init__(self, n: int, Hq: int, D: int, dtype: torch.dtype, device: torch.device):
        self.n, self.shape, self.dtype, self.device = n, (Hq, D), dtype, device
        self.out: torch.Tensor | None = None
        self.lse: torch.Tensor | None = None  # [H_q, n]

    def _init(self):
        acc = kernels.lse_dtype(self.dtype)
        self.out = torch.zeros((self.n, *self.shape), dtype=self.dtype, device=self.device)
        self.lse = torch.full((self.shape[0], self.n), float("-inf"), dtype=acc, device=self.device)

    def write(self, call: Call, o: torch.Tensor, l: torch.Tensor) -> None:
        """Copy the rows ``call`` computed, or merge them in (``call.merge``: an earlier call
        computed some of them too)."""
        if self.out is None and call.q0 == 0 and call.q1 == self.n:
            # the first call spans every row (rows it does not compute hold out 0, lse -inf):
            # use its buffers as they are
            self.out, self.lse = o, l
            return
        if self.out is None:
            self._init()
        assert self.out is not None and self.lse is not None
        # most calls compute every row of their slice (``call.rows`` None): read and write it as
        # a slice, no index kernels
        sl = slice(call.q0, call.q1)
        rows = None if call.rows is None else call.rows + call.q0
        o_new, l_new = (o, l) if call.rows is None else (o.index_select(0, call.rows), l.index_select(1, call.rows))
        if not call.merge:
            self._put(sl, rows, o_new, l_new)
            return
        # on a slice the merge writes into the result buffers in place; on indexed rows into
        # copies, put back after
        l_old = self.lse[:, sl] if rows is None else self.lse.index_select(1, rows)
        o_old = self.out[sl] if rows is None else self.out.index_select(0, rows)
        merge_(o_old, l_old, o_new, l_new)
        if rows is not None:
            self._put(sl, rows, o_old, l_old)

    def _put(self, sl: slice, rows: torch.Tensor | None, o: torch.Tensor, l: torch.Tensor) -> None:
        assert self.out is not None and self.lse is not None
        if rows is None:
            self.out[sl] = o
            self.lse[:, sl] = l
        else:
            self.out.index_copy_(0, rows, o)
            self.lse.index_copy_(1, rows, l)

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.out is None:
            self._init()
        assert self.out is not None and self.lse is not None
        return self.out, self.lse


class _Grad:
    """Gradient rows of one buffer, summed over the calls that touch them (float32 adds)."""

    def __init__(self, n: int, tail: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        self.n, self.tail, self.dtype, self.device = n, tail, dtype, device
        self.t: torch.Tensor | None = None

    def add(self, r0: int, part: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Add ``part`` (rows ``r0 ..``; only ``rows`` of it, relative, when given)."""
        if self.t is None and r0 == 0 and part.shape[0] == self.n:
            self.t = part.to(self.dtype)  # rows a call does not compute hold exact zeros
            return
        if self.t is None:
            self.t = torch.zeros((self.n, *self.tail), dtype=self.dtype, device=self.device)
        part = part.to(self.dtype)
        # one add per element and call (the rows are distinct), so adding in the gradient's dtype
        # rounds exactly as a float32 sum cast back would; few ops: the rank is host-bound
        if rows is None or rows.numel() == part.shape[0]:  # every row of the part: a slice
            self.t[r0 : r0 + part.shape[0]].add_(part)  # (not +=: that copies the slice onto itself)
        else:
            self.t.index_add_(0, rows + r0, part.index_select(0, rows))

    def result(self) -> torch.Tensor:
        if self.t is None:
            return torch.zeros((self.n, *self.tail), dtype=self.dtype, device=self.device)
        return self.t


# ----------------------------------------------------------------------------- forward


def _forward_calls(calls, qs, kvs, rows: dict[str, _Rows], op: OpCall) -> None:
    """Run the schedule's kernel ``calls`` on the query buffers ``qs`` and K/V buffers ``kvs``,
    each call's output merged into ``rows`` of its query buffer."""
    for call in calls:
        k, v = kvs[call.k_buf]
        t0 = time.perf_counter_ns()
        o, l = kernels.forward(
            call.spec,
            _rows(qs[call.q_buf], call.q0, call.q1),
            _rows(k, call.k0, call.k1),
            _rows(v, call.k0, call.k1),
            op.scale,
            op.backend,
            op.softcap,
        )
        _KERNEL_NS[0] += time.perf_counter_ns() - t0
        rows[call.q_buf].write(call, o, l)


def _group(op: OpCall) -> str:
    assert op.cp_group is not None, "a context-parallel call names its group"
    return op.cp_group


def _call_schedule(q: torch.Tensor, k: torch.Tensor, op: OpCall, pass_: str) -> RankSchedule:
    """:func:`get_schedule` for the op's call ``op``."""
    return get_schedule(
        q,
        k,
        op.cu_seqlens,
        op.seq_len,
        op.causal,
        op.window_left,
        op.window_right,
        _group(op),
        scale=op.scale,
        backend=op.backend,
        pass_=pass_,
        softcap=op.softcap,
        prefix_lens=op.prefix_lens,
    )


@_host_timed
def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, op: OpCall) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of this rank's queries (``op.cp_group`` holds the other chunks); sinks
    are the caller's (:func:`doc_packed.ops.add_sinks`, after the merge)."""
    sch = _call_schedule(q, k, op, "forward")
    group_name = _group(op)
    # FA4's kernels of every kind, once
    warmup(q, k, v, op.causal, op.window_left, op.window_right, op.backend, op.softcap)
    B, L, Hq, D = q.shape
    qf, kf, vf = _flat(q), _flat(k), _flat(v)
    # one exchange out: K|V rows peers need, and the queries the plan moves
    fields = (_kv_fields(sch, kf, vf) if sch.kv_traffic else []) + (_moved(sch, qf) if sch.q_traffic else [])
    pending = comm.start_exchange(fields, group_name) if fields else None
    n_moved = sum(sch.q_recv_splits)
    rows = {LOCAL: _Rows(sch.local_rows, Hq, D, q.dtype, q.device), RECV: _Rows(n_moved, Hq, D, q.dtype, q.device)}
    kvs = {LOCAL: (kf, vf)}
    # stage A: own queries x own keys while the exchange is in flight
    _forward_calls(sch.stage_a, {LOCAL: qf}, kvs, rows, op)
    # stage B: everything that reads a received buffer
    got = comm.wait_exchange(pending) if pending is not None else []
    kvs[RECV] = (got[0], got[1]) if sch.kv_traffic else (kf[:0], vf[:0])
    q_recv = got[-1] if sch.q_traffic else qf[:0]
    _forward_calls(sch.stage_b, {LOCAL: qf, RECV: q_recv}, kvs, rows, op)
    out, lse = rows[LOCAL].result()
    if sch.q_traffic:  # moved-in rows' output and lse go home, in one exchange
        out = out.contiguous()  # (a kernel's output, as a rule already)
        o_moved, l_moved = rows[RECV].result()
        home = [
            _home(sch, o_moved, into=out),  # lands in the owners' output rows
            comm.by_splits(l_moved.t().contiguous(), sch.q_recv_splits, sch.q_send_splits),
        ]
        _, l_home = comm.exchange(home, group_name)
        lse.index_copy_(1, sch.q_send_index, l_home.t())  # lse rows are columns: one small copy
    return out.reshape(B, L, Hq, D).contiguous(), lse.reshape(Hq, B, L).transpose(0, 1).contiguous()


# ----------------------------------------------------------------------------- backward


class _Grads:
    """dQ, dK and dV of both buffers (:data:`LOCAL` and :data:`RECV`), summed over the calls."""

    def __init__(self, sch: RankSchedule, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        n_moved, n_kv = sum(sch.q_recv_splits), sum(sch.kv_recv_splits)
        (Hq, D), Hkv = q.shape[2:], k.shape[2]
        self.dq = {buf: _Grad(n, (Hq, D), q.dtype, q.device) for buf, n in ((LOCAL, sch.local_rows), (RECV, n_moved))}
        self.dk = {buf: _Grad(n, (Hkv, D), k.dtype, k.device) for buf, n in ((LOCAL, sch.local_rows), (RECV, n_kv))}
        self.dv = {buf: _Grad(n, (Hkv, D), v.dtype, v.device) for buf, n in ((LOCAL, sch.local_rows), (RECV, n_kv))}

    def add(self, call: Call, g_q: torch.Tensor, g_k: torch.Tensor, g_v: torch.Tensor) -> None:
        """The gradients one kernel call computed, into the rows it computed them for."""
        self.dq[call.q_buf].add(call.q0, g_q, call.rows)
        self.dk[call.k_buf].add(call.k0, g_k, call.k_rows)
        self.dv[call.k_buf].add(call.k0, g_v, call.k_rows)


def _backward_calls(calls, saved, kvs, grads: _Grads, op: OpCall) -> None:
    """Run the schedule's kernel ``calls`` backward on the saved query-side buffers ``saved``
    (q, out, dout, lse rows) and K/V buffers ``kvs``, summing their gradients into ``grads``."""
    for call in calls:
        qb, ob, dob, lb = saved[call.q_buf]
        kb, vb = kvs[call.k_buf]
        q0, q1, k0, k1 = call.q0, call.q1, call.k0, call.k1
        t0 = time.perf_counter_ns()
        g_q, g_k, g_v = kernels.backward(
            call.spec,
            _rows(dob, q0, q1),
            _rows(qb, q0, q1),
            _rows(kb, k0, k1),
            _rows(vb, k0, k1),
            _rows(ob, q0, q1),
            _rows(lb, q0, q1, dim=1).contiguous(),
            op.scale,
            op.backend,
            op.softcap,
        )
        _KERNEL_NS[0] += time.perf_counter_ns() - t0
        grads.add(call, g_q, g_k, g_v)


def _backward_fields(sch: RankSchedule, qf, kf, vf, of, dof, lse_rows) -> list[comm.Field]:
    """The backward's exchange out: K|V rows peers need, and moved rows with their output,
    output gradient and lse."""
    fields = _kv_fields(sch, kf, vf) if sch.kv_traffic else []
    if sch.q_traffic:  # lse rows are columns of [H_q, rows]: gathered into rows first (small)
        l_send = lse_rows.t().index_select(0, sch.q_send_index)
        fields += _moved(sch, qf, of, dof) + [comm.by_splits(l_send, sch.q_send_splits, sch.q_recv_splits)]
    return fields


def _grads_home(sch: RankSchedule, grads: _Grads, group_name: str) -> tuple[torch.Tensor, ...]:
    """This rank's ``(dq, dk, dv)`` rows: its own, plus what comes home in one exchange (dQ of
    its moved rows, and the partial dK|dV peers computed for its keys, summed in float32)."""
    dq = grads.dq[LOCAL].result().contiguous()  # (a kernel's output, as a rule already)
    dk, dv = grads.dk[LOCAL].result(), grads.dv[LOCAL].result()
    home = [_home(sch, grads.dq[RECV].result(), into=dq)] if sch.q_traffic else []  # lands in dQ's rows
    if sch.kv_traffic:  # land in the layout add_partials_ sums (cells no partial reaches zeroed)
        partial = torch.stack([grads.dk[RECV].result(), grads.dv[RECV].result()], 1)
        grid = partial.new_empty((sch.kv_back_rows, *partial.shape[1:]))
        if sch.kv_back_gaps.numel():
            grid.index_fill_(0, sch.kv_back_gaps, 0)
        home.append(comm.Field(partial, sch.kv_recv_runs, sch.kv_back_recv, grid))
    landed = comm.exchange(home, group_name) if home else []
    if sch.kv_traffic:
        add_partials_(dk, dv, landed[-1], sch.kv_back_sums)
    return dq, dk, dv


@_host_timed
def backward(dout, q, k, v, out, lse, op: OpCall) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of this rank's chunk: partial dK/dV of received keys are summed home."""
    sch = _call_schedule(q, k, op, "backward")
    group_name = _group(op)
    B, L, Hq, D = q.shape
    qf, kf, vf = _flat(q), _flat(k), _flat(v)
    of, dof = _flat(out.contiguous()), _flat(dout.contiguous())
    lse_rows = lse.transpose(0, 1).reshape(Hq, B * L)  # [H_q, rows]
    fields = _backward_fields(sch, qf, kf, vf, of, dof, lse_rows)
    pending = comm.start_exchange(fields, group_name) if fields else None
    grads = _Grads(sch, q, k, v)
    saved = {LOCAL: (qf, of, dof, lse_rows)}
    kvs = {LOCAL: (kf, vf)}
    # stage A: own queries x own keys while the exchange is in flight
    _backward_calls(sch.stage_a, saved, kvs, grads, op)
    # stage B: everything that reads a received buffer
    got = comm.wait_exchange(pending) if pending is not None else []
    kvs[RECV] = (got[0], got[1]) if sch.kv_traffic else (kf[:0], vf[:0])
    if sch.q_traffic:
        q_m, o_m, do_m, l_m = got[-4:]
        saved[RECV] = (q_m, o_m, do_m, l_m.t().contiguous())
    _backward_calls(sch.stage_b, saved, kvs, grads, op)
    dq, dk, dv = _grads_home(sch, grads, group_name)
    return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape)
