"""Rank bodies for tests/test_cp_variants.py (module level so spawn can import them)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import doc_packed as dp
from doc_packed_testing.oracle import reference


def cp_variant_parity(rank, world, cases):
    """Per case: context-parallel doc_packed_attn with sinks and/or softcap against the oracle;
    this rank's out, lse, dq/dk/dv and its share of dsinks (the ranks' shares sum to the
    oracle's dsinks: each rank holds its own queries)."""
    group = dist.group.WORLD
    report = []
    for case in cases:
        lengths, S, Hq, Hkv, D = case["lengths"], case["S"], case["Hq"], case["Hkv"], case["D"]
        window, softcap = case["window"], case.get("softcap")
        B = len(lengths)
        cu = dp.cu_seqlens_from_lengths(lengths, S, max_docs=case.get("max_docs"))
        g = torch.Generator().manual_seed(case.get("seed", 0))
        Dv = case.get("Dv", D)
        q, k = (torch.randn(B, S, h, D, generator=g, dtype=torch.float64) for h in (Hq, Hkv))
        v, dout = (torch.randn(B, S, h, Dv, generator=g, dtype=torch.float64) for h in (Hkv, Hq))
        sinks = torch.randn(Hq, generator=g, dtype=torch.float64) if case.get("sinks") else None
        prefix = None
        if case.get("prefix"):  # a random bidirectional prefix per document slot (0 for empty ones)
            gaps = cu.diff(dim=1)
            prefix = (torch.rand(gaps.shape, generator=g) * (gaps + 1)).floor().to(torch.int32)
        rq, rk, rv = (t.clone().requires_grad_() for t in (q, k, v))
        rs = None if sinks is None else sinks.clone().requires_grad_()
        ref_out, ref_lse, ref_max = reference(
            rq, rk, rv, cu, True, window, sinks=rs, softcap=softcap, prefix_lens=prefix, max_logits=True
        )
        wrt = (rq, rk, rv) + (() if rs is None else (rs,))
        wl = torch.randn(ref_lse.shape, generator=g, dtype=torch.float64) if case.get("lse_loss") else None
        ref_loss = (ref_out * dout).sum() + (0 if wl is None else (ref_lse * wl).sum())
        ref_grads = torch.autograd.grad(ref_loss, wrt)

        def chunk(t):
            parts = t.chunk(world, dim=1)
            return parts[rank] if rank < len(parts) else t[:, :0]

        lq, lk, lv = (chunk(t).clone().requires_grad_() for t in (q, k, v))
        ls = None if sinks is None else sinks.clone().requires_grad_()
        out, lse, mx = dp.doc_packed_attn(
            lq,
            lk,
            lv,
            cu,
            window_size=window,
            return_lse=True,
            cp_group=group,
            seq_len=S,
            sinks=ls,
            softcap=softcap,
            prefix_lens=prefix,
            return_max_logits=True, causal=True,
        )
        loss = (out * chunk(dout)).sum() + (0 if wl is None else (lse * wl.chunk(world, dim=2)[rank]).sum())
        grads = torch.autograd.grad(loss, (lq, lk, lv) + (() if ls is None else (ls,)))
        err = max(
            (out - chunk(ref_out)).abs().max().item(),
            (lse - ref_lse.chunk(world, dim=2)[rank]).abs().max().item(),
            (mx - ref_max).abs().max().item(),
            *[(a - chunk(b)).abs().max().item() for a, b in zip(grads[:3], ref_grads[:3])],
        )
        dsinks = grads[3].clone() if ls is not None else torch.zeros(0, dtype=torch.float64)
        dist.all_reduce(dsinks)  # the ranks' shares: a replicated parameter's gradient is reduced
        if ls is not None:
            err = max(err, (dsinks - ref_grads[3]).abs().max().item())
        report.append(err)
    return report


def dtensor_variant_parity(rank, world, cases):
    """doc_packed_attn on DTensors with sinks / softcap / prefix_lens (given as plain tensors:
    replicated beside the DTensors) for each placement of q, k, v against the oracle: the largest
    error over out, lse and the gradients of q, k, v and sinks, and out's placements."""
    import shardings  # noqa: F401  (DTensor rules)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("x",))
    report = []
    for case in cases:
        lengths, S, Hq, Hkv, D, Dv = case["lengths"], case["S"], case["Hq"], case["Hkv"], case["D"], case["Dv"]
        placements = case["placements"]
        B = len(lengths)
        cu = torch.tensor(case["cu"], dtype=torch.int32)
        prefix = torch.tensor(case["prefix"], dtype=torch.int32) if case.get("prefix") else None
        g = torch.Generator().manual_seed(3)
        q, k = (torch.randn(B, S, h, D, generator=g, dtype=torch.float64) for h in (Hq, Hkv))
        v = torch.randn(B, S, Hkv, Dv, generator=g, dtype=torch.float64)
        dout = torch.randn(B, S, Hq, Dv, generator=g, dtype=torch.float64)
        sinks = torch.randn(Hq, generator=g, dtype=torch.float64)
        softcap = case.get("softcap")
        rq, rk, rv, rs = (t.clone().requires_grad_() for t in (q, k, v, sinks))
        ref_out, ref_lse, ref_max = reference(
            rq, rk, rv, cu, True, (-1, -1), sinks=rs, softcap=softcap, prefix_lens=prefix, max_logits=True
        )
        ref_grads = torch.autograd.grad(ref_out, (rq, rk, rv, rs), dout)
        dq_, dk_, dv_ = (distribute_tensor(t, mesh, placements).requires_grad_() for t in (q, k, v))
        ls = sinks.clone().requires_grad_()
        dcu = distribute_tensor(cu, mesh, [Shard(0) if p == Shard(0) else Replicate() for p in placements])
        out, lse, mx = dp.doc_packed_attn(
            dq_, dk_, dv_, dcu, return_lse=True, sinks=ls, softcap=softcap, prefix_lens=prefix, return_max_logits=True, causal=True
        )
        assert isinstance(out, DTensor)
        grads = torch.autograd.grad(out, (dq_, dk_, dv_, ls), distribute_tensor(dout, mesh, out.placements))
        full = [t.full_tensor() if isinstance(t, DTensor) else t for t in grads]
        err = max(
            (out.full_tensor() - ref_out).abs().max().item(),
            (lse.full_tensor() - ref_lse).abs().max().item(),
            (mx.full_tensor() - ref_max).abs().max().item(),
            *[(a - b).abs().max().item() for a, b in zip(full, ref_grads)],
        )
        report.append((err, tuple(out.placements)))
    return report
