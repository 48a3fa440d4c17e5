"""Rank bodies for test_varlen.py and the uneven-sequence DTensor tests (module level: spawn
imports them)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import doc_packed as dp
import shardings  # noqa: F401  (DTensor rules)
from doc_packed_testing.oracle import reference


def _packed(seed, T, Hq, Hkv, D):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(T, h, D, generator=g, dtype=torch.float64) for h in (Hq, Hkv, Hkv, Hq)]


def _oracle(q, k, v, dout, cu, causal, window):
    rq, rk, rv = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = reference(rq[None], rk[None], rv[None], cu[None], causal, window)
    grads = torch.autograd.grad(out, (rq, rk, rv), dout[None])
    return out[0], lse[0], grads


def varlen_cp(rank, world, cases):
    """doc_packed_attn_varlen with cp_group: this rank's torch.chunk of T (uneven T too)."""
    report = []
    for c in cases:
        cu = torch.tensor(c["cu"], dtype=c.get("dtype", torch.int32))
        T = int(c["cu"][-1])
        q, k, v, dout = _packed(0, T, c["Hq"], c["Hkv"], 8)
        ref_out, ref_lse, ref_grads = _oracle(q, k, v, dout, cu, c["causal"], c["window"])
        mine = lambda t, dim=0: t.chunk(world, dim=dim)[rank]  # noqa: E731
        lq, lk, lv = (mine(t).clone().requires_grad_() for t in (q, k, v))
        out, lse = dp.doc_packed_attn_varlen(
            lq,
            lk,
            lv,
            cu,
            c["max_seqlen"],
            causal=c["causal"],
            window_size=c["window"],
            return_lse=True,
            cp_group=dist.group.WORLD,
            seq_len=T,
        )
        grads = torch.autograd.grad(out, (lq, lk, lv), mine(dout))
        report.append(
            max(
                (out - mine(ref_out)).abs().max().item(),
                (lse - mine(ref_lse, 1)).abs().max().item(),
                *[(a - mine(b)).abs().max().item() for a, b in zip(grads, ref_grads)],
            )
        )
    return report


def varlen_dtensor(rank, world, cases):
    """doc_packed_attn_varlen on DTensors placed as each case says: (error, out and dq placements)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    report = []
    for c in cases:
        cu = torch.tensor(c["cu"], dtype=torch.int32)
        T = int(c["cu"][-1])
        q, k, v, dout = _packed(1, T, c["Hq"], c["Hkv"], 8)
        ref_out, ref_lse, ref_grads = _oracle(q, k, v, dout, cu, True, c["window"])
        pl = [Shard(c["dim"])] if c["dim"] is not None else [Replicate()]
        dq_, dk_, dv_ = (distribute_tensor(t, mesh, pl).requires_grad_() for t in (q, k, v))
        out, lse = dp.doc_packed_attn_varlen(dq_, dk_, dv_, cu, None, window_size=c["window"], return_lse=True, causal=True)
        grads = torch.autograd.grad(out, (dq_, dk_, dv_), distribute_tensor(dout, mesh, out.placements))
        err = max(
            (out.full_tensor() - ref_out).abs().max().item(),
            (lse.full_tensor() - ref_lse).abs().max().item(),
            *[(g.full_tensor() - r).abs().max().item() for g, r in zip(grads, ref_grads)],
        )
        report.append((err, tuple(out.placements), tuple(grads[0].placements), tuple(lse.placements)))
    return report


def uneven_sequence(rank, world, S, placements_names, mesh_shape):
    """A [B, S, H, D] DTensor Shard(1) with S not divisible by the mesh: the call must stay
    sequence-sharded (context parallel) or raise; returns (error, out placements, dq placements,
    local q length)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    names = {"R": Replicate(), "B": Shard(0), "S": Shard(1), "H": Shard(2)}
    placements = [names[n] for n in placements_names]
    mesh = init_device_mesh("cpu", mesh_shape)
    g = torch.Generator().manual_seed(5)
    B, Hq, Hkv, D = 2, 4, 2, 8
    q = torch.randn(B, S, Hq, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, S, Hkv, D, generator=g, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(B, S, Hq, D, generator=g, dtype=torch.float64)
    cu = dp.cu_seqlens_from_lengths([[S // 3, 1, S - S // 3 - 1], [S]], S).long()
    rq, rk, rv = (t.clone().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = reference(rq, rk, rv, cu, True, (5, 0))
    ref_grads = torch.autograd.grad(ref_out, (rq, rk, rv), dout)
    dq_, dk_, dv_ = (distribute_tensor(t, mesh, placements).requires_grad_() for t in (q, k, v))
    out, lse = dp.doc_packed_attn(dq_, dk_, dv_, cu, window_size=(5, 0), return_lse=True, causal=True)
    grads = torch.autograd.grad(out, (dq_, dk_, dv_), distribute_tensor(dout, mesh, out.placements))
    err = max(
        (out.full_tensor() - ref_out).abs().max().item(),
        (lse.full_tensor() - ref_lse).abs().max().item(),
        *[(a.full_tensor() - b).abs().max().item() for a, b in zip(grads, ref_grads)],
    )
    return err, tuple(out.placements), tuple(grads[0].placements), out.to_local().shape[1]


def sequence_not_kept(rank, world, two_dims=False):
    """q Shard(1) on a mesh dim that planning(cp_dim=...) rules out, or on two mesh dims at
    once: every rank raises."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    shape = (2, world // 2) if two_dims else (1, world)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("a", "b"))
    q = torch.randn(2, 16, 2, 8, dtype=torch.float64)
    cu = dp.cu_seqlens_from_lengths([[5, 11], [16]], 16)
    dq = distribute_tensor(q, mesh, [Shard(1), Shard(1)] if two_dims else [Shard(0), Shard(1)])
    try:
        with dp.planning(doc_len=None, cp_dim=None if two_dims else "a"):
            dp.doc_packed_attn(dq, dq, dq, cu, causal=True)
    except ValueError as e:
        return str(e)
    return None
