"""Context-parallel forward and backward over a process group (called by the custom ops).

Forward: GroupCast the key/value rows each rank needs and the queries the plan moves, run the
local kernel on contiguous per-segment buffers, send moved queries' outputs and lse back.
Backward: the adjoint. It fetches K/V (and the moved queries, outputs, output gradients and
lse) again rather than keeping them from the forward: the ops' saved tensors stay the local
shards, so memory per layer does not grow with the received K/V (see docs/context_parallel.md
for the measured trade); dQ goes back to its owners and partial dK/dV are summed into theirs
(GroupReduce) in float32. When every key row is used by one kernel segment (the usual case),
local gradients are taken straight from the kernel's output and only the rows that receive
remote partials are summed.
"""

from __future__ import annotations

import torch

from .. import kernels
from .._doc_layout import get_layout
from . import comm
from .exchange import RankExchange, assemble, assemble_or_zeros, build_exchange
from .plan import build_plan, owner_range

__all__ = ["backward", "forward", "get_exchange"]

# Allowed work imbalance over the mean. Plans weigh moving one query against fetching one
# key/value row by their sizes per token (q/out and gradients: H_q * D; k/v: H_kv * D).
TOLERANCE = 0.01


def get_exchange(
    q: torch.Tensor,
    k: torch.Tensor,
    cu_seqlens: torch.Tensor,
    seq_len: int,
    causal: bool,
    left: int,
    right: int,
    group_name: str,
) -> RankExchange:
    """This rank's exchange for the layout, built and cross-checked once per layout.

    Building is collective: every rank validates its inputs, then all ranks compare a
    fingerprint of them (one all-gather) before any data moves, so a bad or mismatched input on
    one rank raises ValueError on every rank instead of hanging or computing garbage.
    """
    rank, size = comm.group_info(group_name)
    B, local_len, Hq, D = q.shape
    Hkv = k.shape[2]
    key = ("cp_exchange", group_name, rank, causal, left, right, Hq, Hkv, q.device)
    error, layout = None, None
    start, end = owner_range(seq_len, size, rank)
    try:
        layout = get_layout(cu_seqlens, seq_len)
    except ValueError as e:
        error = e
    if layout is not None:
        if local_len != end - start:
            error = ValueError(
                f"rank {rank} of the context-parallel group holds {local_len} tokens per row, but "
                f"torch.chunk of seq_len={seq_len} over {size} ranks gives it {end - start}"
            )
        elif layout.batch != B:
            error = ValueError(f"cu_seqlens has {layout.batch} rows but q has batch size {B}")
        cached = layout.derived_get(key)
        if cached is not None:
            if error is not None:  # shapes changed on this rank after the plan was agreed
                raise error
            return cached
    comm.check_agreement(
        group_name,
        q.device,
        "the context-parallel plan's inputs",
        None if layout is None else layout.rows,
        seq_len,
        size,
        causal,
        left,
        right,
        Hq,
        Hkv,
        D,
        str(q.dtype),
        local_error=error,
    )
    assert layout is not None  # check_agreement raised every rank's error otherwise
    query_cost = Hq / Hkv
    plan = layout.derived(
        ("cp_plan", size, causal, left, right, query_cost, TOLERANCE),
        lambda: build_plan(layout, size, causal, left, right, query_cost=query_cost, tolerance=TOLERANCE),
    )
    return layout.derived(key, lambda: build_exchange(plan, rank, q.device))


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _cast(ex: RankExchange, rows: torch.Tensor, group_name: str) -> torch.Tensor:
    """The rows the plan moves here (only the moved rows travel)."""
    if not ex.q_traffic:
        return rows[:0]
    return comm.group_cast(rows, ex.q_send_index, ex.q_send_splits, ex.q_recv_splits, group_name)


def _return_rows(ex: RankExchange, rows: torch.Tensor, group_name: str) -> torch.Tensor:
    """This rank's rows from kernel rows: rows computed for other owners travel back first."""
    back = rows[:0]
    if ex.q_traffic:
        back = comm.all_to_all(rows.index_select(0, ex.return_index), ex.q_recv_splits, ex.q_send_splits, group_name)
    return assemble(ex.out_runs, rows, back)


def _kv_buffers(ex: RankExchange, kf: torch.Tensor, vf: torch.Tensor, group_name: str):
    D = kf.shape[-1]
    got = kf.new_empty((0, kf.shape[1], 2 * D))
    if ex.kv_traffic:
        send = torch.cat([kf.index_select(0, ex.kv_send_index), vf.index_select(0, ex.kv_send_index)], -1)
        got = comm.all_to_all(send, ex.kv_send_splits, ex.kv_recv_splits, group_name)
    return assemble(ex.k_runs, kf, got[..., :D]), assemble(ex.k_runs, vf, got[..., D:])


def _reduce_kv_grads(ex: RankExchange, dk_buf, dv_buf, T: int, group_name: str):
    """dK, dV of this rank's rows: its kernel's partial gradients plus those other ranks computed
    for its rows (GroupReduce). Sums run in float32 (float64 for float64 inputs)."""
    D = dk_buf.shape[-1]
    acc = kernels.lse_dtype(dk_buf.dtype)
    if ex.grad_runs is not None:  # each key row used at most once here: no accumulation buffer
        local_runs, recv_runs = ex.grad_runs
        dk, dv = assemble_or_zeros(local_runs, dk_buf), assemble_or_zeros(local_runs, dv_buf)
        if not ex.kv_traffic:
            return dk, dv
        partial = torch.cat([assemble_or_zeros(recv_runs, dk_buf), assemble_or_zeros(recv_runs, dv_buf)], -1)
        back = comm.all_to_all(partial, ex.kv_recv_splits, ex.kv_send_splits, group_name)
        rows = ex.kv_reduce_rows
        total = torch.cat([dk.index_select(0, rows), dv.index_select(0, rows)], -1).to(acc)
        total.index_add_(0, ex.kv_reduce_slot, back.to(acc))
        total = total.to(dk_buf.dtype)
        dk, dv = dk.index_copy(0, rows, total[..., :D]), dv.index_copy(0, rows, total[..., D:])
        return dk, dv
    n_src = T + (sum(ex.kv_recv_splits) if ex.kv_traffic else 0)
    dkv = torch.zeros(n_src, dk_buf.shape[1], 2 * D, dtype=acc, device=dk_buf.device)
    dkv[..., :D].index_add_(0, ex.k_index, dk_buf.to(acc))
    dkv[..., D:].index_add_(0, ex.k_index, dv_buf.to(acc))
    if ex.kv_traffic:
        comm.group_reduce(
            dkv[:T], dkv[T:].to(dk_buf.dtype), ex.kv_send_index, ex.kv_send_splits, ex.kv_recv_splits, group_name
        )
    dkv = dkv[:T].to(dk_buf.dtype)
    return dkv[..., :D].contiguous(), dkv[..., D:].contiguous()


def forward(q, k, v, cu_seqlens, seq_len, causal, left, right, scale, backend, group_name):
    ex = get_exchange(q, k, cu_seqlens, seq_len, causal, left, right, group_name)
    B, L, Hq, D = q.shape
    k_buf, v_buf = _kv_buffers(ex, _flat(k), _flat(v), group_name)
    qf = _flat(q)
    q_buf = assemble(ex.q_runs, qf, _cast(ex, qf, group_name))
    outs, lses = [], []
    for call in ex.calls:
        o, l = kernels.forward(
            call.spec, q_buf[call.q0 : call.q1], k_buf[call.k0 : call.k1], v_buf[call.k0 : call.k1], scale, backend
        )
        outs.append(o)
        lses.append(l.t())
    out_buf = torch.cat(outs) if len(outs) != 1 else outs[0]
    lse_buf = (torch.cat(lses) if len(lses) != 1 else lses[0]).contiguous()
    if not outs:
        out_buf, lse_buf = q.new_empty((0, Hq, D)), q.new_empty((0, Hq), dtype=kernels.lse_dtype(q.dtype))
    out = _return_rows(ex, out_buf, group_name).reshape(B, L, Hq, D)
    lse = _return_rows(ex, lse_buf, group_name).reshape(B, L, Hq)
    return out.contiguous(), lse.permute(0, 2, 1).contiguous()


def backward(dout, q, k, v, out, lse, cu_seqlens, seq_len, causal, left, right, scale, backend, group_name):
    ex = get_exchange(q, k, cu_seqlens, seq_len, causal, left, right, group_name)
    B, L, Hq, D = q.shape
    Hkv = k.shape[2]
    kf, vf = _flat(k), _flat(v)
    k_buf, v_buf = _kv_buffers(ex, kf, vf, group_name)
    qf, of, dof = _flat(q), _flat(out.contiguous()), _flat(dout.contiguous())
    # moved queries travel with their outputs and output gradients in one message
    got = qf.new_empty((0, 3, Hq, D))
    if ex.q_traffic:
        idx = ex.q_send_index
        moved = torch.stack([qf.index_select(0, idx), of.index_select(0, idx), dof.index_select(0, idx)], 1)
        got = comm.all_to_all(moved, ex.q_send_splits, ex.q_recv_splits, group_name)
    q_buf, o_buf, do_buf = (assemble(ex.q_runs, x, got[:, i]) for i, x in enumerate((qf, of, dof)))
    lse_rows = lse.permute(0, 2, 1).reshape(B * L, Hq)
    lse_buf = assemble(ex.q_runs, lse_rows, _cast(ex, lse_rows, group_name))
    dqs, dks, dvs = [], [], []
    for call in ex.calls:
        qs, ks = slice(call.q0, call.q1), slice(call.k0, call.k1)
        dq, dk, dv = kernels.backward(
            call.spec,
            do_buf[qs].contiguous(),
            q_buf[qs].contiguous(),
            k_buf[ks],
            v_buf[ks],
            o_buf[qs].contiguous(),
            lse_buf[qs].t().contiguous(),
            scale,
            backend,
        )
        dqs.append(dq)
        dks.append(dk)
        dvs.append(dv)
    dq_buf = torch.cat(dqs) if len(dqs) != 1 else dqs[0]
    if not dqs:
        dq_buf = q.new_empty((0, Hq, D))
    dq = _return_rows(ex, dq_buf, group_name).reshape(q.shape).contiguous()
    dk_buf = torch.cat(dks) if len(dks) != 1 else (dks[0] if dks else k.new_empty((0, Hkv, D)))
    dv_buf = torch.cat(dvs) if len(dvs) != 1 else (dvs[0] if dvs else v.new_empty((0, Hkv, D)))
    dk, dv = _reduce_kv_grads(ex, dk_buf, dv_buf, kf.shape[0], group_name)
    return dq, dk.reshape(k.shape).contiguous(), dv.reshape(v.shape).contiguous()
