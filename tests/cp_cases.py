"""Rank bodies for the context-parallel tests (module level so spawn can import them)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import doc_packed as dp
import shardings  # noqa: F401  (DTensor rules)
from doc_packed_testing.oracle import reference


def _data(seed, B, S, Hq, Hkv, D, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, Hq, D, generator=g, dtype=dtype)
    k = torch.randn(B, S, Hkv, D, generator=g, dtype=dtype)
    v = torch.randn(B, S, Hkv, D, generator=g, dtype=dtype)
    dout = torch.randn(B, S, Hq, D, generator=g, dtype=dtype)
    return q, k, v, dout


def cp_parity(rank, world, cases):
    """For each case, run doc_packed_attn context-parallel and compare with the oracle."""
    group = dist.group.WORLD
    report = []
    for case in cases:
        lengths, S, Hq, Hkv, D, causal, window = (
            case["lengths"], case["S"], case["Hq"], case["Hkv"], case["D"], case["causal"], case["window"],
        )
        B = len(lengths)
        cu = dp.cu_seqlens_from_lengths(lengths, S, max_docs=case.get("max_docs"))
        q, k, v, dout = _data(case.get("seed", 0), B, S, Hq, Hkv, D)
        ref_q, ref_k, ref_v = (t.clone().requires_grad_() for t in (q, k, v))
        ref_out, ref_lse = reference(ref_q, ref_k, ref_v, cu, causal, window)
        ref_grads = torch.autograd.grad(ref_out, (ref_q, ref_k, ref_v), dout)
        chunks = lambda t: t.chunk(world, dim=1)[rank] if rank < len(t.chunk(world, dim=1)) else t[:, :0]  # noqa: E731
        lq, lk, lv = (chunks(t).clone().requires_grad_() for t in (q, k, v))
        out, lse = dp.doc_packed_attn(
            lq, lk, lv, cu, causal=causal, window_size=window, return_lse=True, cp_group=group, seq_len=S,
        )
        grads = torch.autograd.grad(out, (lq, lk, lv), chunks(dout))
        err = max(
            (out - chunks(ref_out)).abs().max().item(),
            (lse - ref_lse.chunk(world, dim=2)[rank]).abs().max().item(),
            *[(a - chunks(b)).abs().max().item() for a, b in zip(grads, ref_grads)],
        )
        from doc_packed.cp.attention import get_schedule

        left, right = (window[0], 0 if causal else window[1])
        sch = get_schedule(lq, lk, cu, S, causal, left, right, group.group_name)
        report.append((err, (sch.kv_traffic, sch.q_traffic, sch.kv_shared)))  # which exchange paths ran
    return report


def dtensor_parity(rank, world, mesh_shape, names, cases):
    """doc_packed_attn on DTensors for each (placements per tensor) case vs the oracle."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    report = []
    for case in cases:
        lengths, S, Hq, Hkv, D = case["lengths"], case["S"], case["Hq"], case["Hkv"], case["D"]
        causal, window, placements = case["causal"], case["window"], case["placements"]
        B = len(lengths)
        cu = dp.cu_seqlens_from_lengths(lengths, S)
        q, k, v, dout = _data(case.get("seed", 1), B, S, Hq, Hkv, D)
        rq, rk, rv = (t.clone().requires_grad_() for t in (q, k, v))
        ref_out, ref_lse = reference(rq, rk, rv, cu, causal, window)
        ref_grads = torch.autograd.grad(ref_out, (rq, rk, rv), dout)
        dq_, dk_, dv_ = (distribute_tensor(t, mesh, placements).requires_grad_() for t in (q, k, v))
        cu_pl = [Shard(0) if p == Shard(0) else Replicate() for p in placements]
        dcu = distribute_tensor(cu, mesh, cu_pl)
        out, lse = dp.doc_packed_attn(dq_, dk_, dv_, dcu, causal=causal, window_size=window, return_lse=True)
        assert isinstance(out, DTensor)
        out_placements = tuple(out.placements)
        grads = torch.autograd.grad(out, (dq_, dk_, dv_), distribute_tensor(dout, mesh, out.placements))
        err = max(
            (out.full_tensor() - ref_out).abs().max().item(),
            (lse.full_tensor() - ref_lse).abs().max().item(),
            *[(g.full_tensor() - r).abs().max().item() for g, r in zip(grads, ref_grads)],
        )
        report.append((err, out_placements, tuple(grads[0].placements)))
    return report


def mismatch(rank, world, kind):
    """Each rank passes inputs that disagree in ``kind``; return the error each rank saw."""
    S = 32
    lengths = [[10, 22]] if (kind != "cu_seqlens" or rank == 0) else [[12, 20]]
    cu = dp.cu_seqlens_from_lengths(lengths, S)
    if kind == "invalid_on_one_rank" and rank == 1:
        cu = cu.clone()
        cu[0, 1] = 40
    q, k, v, _ = _data(0, 1, S, 2, 2, 8)
    causal = not (kind == "mask" and rank == 1)
    local = S // world
    sl = slice(rank * local, (rank + 1) * local)
    if kind == "shard_length" and rank == 0:
        sl = slice(0, local - 1)
    try:
        dp.doc_packed_attn(q[:, sl], k[:, sl], v[:, sl], cu, causal=causal, cp_group=dist.group.WORLD, seq_len=S)
    except ValueError as e:
        return str(e)
    return None


def compiled_cp(rank, world):
    """``doc_packed_attn(..., cp_group=...)`` under ``torch.compile(fullgraph=True)``, with the
    group given by name and as a ProcessGroup: same output and gradients as the eager call."""
    import torch.distributed as dist

    torch.manual_seed(0)
    S = 64
    cu = dp.cu_seqlens_from_lengths([[20, 30, 14]], S)
    q, k, v = (torch.randn(1, S, h, 8, dtype=torch.float64) for h in (4, 2, 2))
    shard = [t.chunk(world, 1)[rank].contiguous().requires_grad_() for t in (q, k, v)]
    errors = []
    for group in (dist.group.WORLD.group_name, dist.group.WORLD):
        def attn(q, k, v, cu):
            return dp.doc_packed_attn(q, k, v, cu, cp_group=group, causal=True)

        torch._dynamo.reset()
        ref = attn(*shard, cu)
        (gq, gk, gv) = torch.autograd.grad(ref.sum(), shard)
        out = torch.compile(attn, fullgraph=True, backend="aot_eager")(*shard, cu)
        grads = torch.autograd.grad(out.sum(), shard)
        errors.append(max((a - b).abs().max().item() for a, b in zip((out, *grads), (ref, gq, gk, gv))))
    return errors


def _lazy_group():
    """A new group of every rank that no collective has run on yet. A group inherits the default
    group's bound device, and with it an eager NCCL communicator: unbind it for the call, so the
    group is made as under a user's ``init_process_group`` without ``device_id``."""
    default = dist.distributed_c10d._get_default_group()
    bound = default.bound_device_id
    default.bound_device_id = None
    try:
        return dist.new_group()
    finally:
        default.bound_device_id = bound


def _field_rows(src, tag, tail, dtype, n=12):
    """Rank ``src``'s rows of field ``tag``: values that name the sender, field and row."""
    base = torch.arange(n, dtype=torch.float64).reshape(n, *([1] * len(tail)))
    within = torch.arange(torch.Size(tail).numel(), dtype=torch.float64).reshape(1, *tail)
    return (1000 * src + 100 * tag + base + within / 64).to(dtype)


def _field_runs(src, dst, tag):
    """The runs ``(first row, rows)`` rank ``src`` sends rank ``dst`` in field ``tag``: none,
    one, or two apart (overlapping other peers' runs, and rows kept for itself among them)."""
    k = (3 * src + 5 * dst + 2 * tag) % 4
    return [] if k == 0 else [(dst, k)] if k < 3 else [(2 * dst, 1), (7 + dst % 3, k - 1)]


def exchange_fields(rank, world, new_group=False):
    """Fields of different dtypes and row shapes in one ``comm.start_exchange``, sent as runs
    of rows (several per peer, overlapping across peers, kept rows among them) or by splits,
    landing consecutively, or at chosen rows of a given buffer whose other rows stay as they
    were: each rank returns what landed and what it should be (on the CPU), built from the
    senders' formula (not from the exchange). The fields live on the rank's device
    (``dist_utils.DEVICE``); ``new_group``: exchange over a group made here, whose NCCL
    communicator nothing has created yet (the exchange's warm-up must)."""
    import dist_utils
    from doc_packed.cp import comm

    dev = dist_utils.DEVICE

    specs = [((2, 3), torch.float64), ((5,), torch.float32), ((), torch.int64), ((4, 2), torch.bfloat16)]
    fields, want = [], []
    for tag, (tail, dtype) in enumerate(specs):
        send = [_field_runs(rank, p, tag) for p in range(world)]
        counts = [[n for _, n in _field_runs(p, rank, tag)] for p in range(world)]
        came = [_field_rows(p, tag, tail, dtype)[r0 : r0 + n] for p in range(world) for r0, n in _field_runs(p, rank, tag)]
        if tag < 2:  # consecutively, in a new buffer
            at, recv = 0, []
            for ns in counts:
                recv.append([(at + sum(ns[:j]), n) for j, n in enumerate(ns)])
                at += sum(ns)
            fields.append(comm.Field(_field_rows(rank, tag, tail, dtype).to(dev), send, recv))
            want.append(torch.cat(came))
        else:  # into a given buffer of -1s, each run one row after the last one's end plus a gap
            at, lands = 0, []
            for ns in counts:
                lands.append([])
                for n in ns:
                    lands[-1].append((at + 1, n))
                    at += n + 2
            into = torch.full((at + 1, *tail), -1).to(dtype)
            expect = into.clone()
            for (a, n), rows in zip((run for runs in lands for run in runs), came):
                expect[a : a + n] = rows
            fields.append(comm.Field(_field_rows(rank, tag, tail, dtype).to(dev), send, lands, into.to(dev)))
            want.append(expect)
    name = (_lazy_group() if new_group else dist.group.WORLD).group_name
    got = comm.wait_exchange(comm.start_exchange(fields, name))
    assert got[2] is fields[2].into and got[3] is fields[3].into
    # by splits, waited: rank r sends r + p + 1 rows to peer p
    rows = _field_rows(rank, 9, (3,), torch.float32)[: sum(rank + p + 1 for p in range(world))].to(dev)
    split = comm.exchange([comm.by_splits(rows, [rank + p + 1 for p in range(world)], [p + rank + 1 for p in range(world)])], name)
    at = lambda p: sum(p + q + 1 for q in range(rank))  # noqa: E731  (where p's rows for this rank start)
    want_split = torch.cat([_field_rows(p, 9, (3,), torch.float32)[at(p) : at(p) + p + rank + 1] for p in range(world)])
    got = [g.cpu() for g in got]
    return got, want, [t.cpu() for t in split], want_split, comm.exchange([], name)
