"""Rank bodies for the context-parallel tests (module level so spawn can import them)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import doc_packed as dp
from oracle import reference


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
        report.append(err)
    return report
