"""doc_packed_attn on CUDA against the float64 oracle: the errors the GPU tests bound.

Shared by tests/test_gpu.py (which asserts tolerances on them) and ``bench.accuracy`` (which
reports the worst values over the same grid).
"""

from __future__ import annotations

import random

import torch

import doc_packed as dp
from doc_packed_testing.oracle import random_lengths
from doc_packed_testing.oracle import reference

MASKS = [(True, (-1, -1)), (False, (-1, -1)), (True, (64, 0)), (False, (32, 16))]
HEADS = [(8, 8), (8, 2), (4, 1)]
HEAD_DIM = 64


def rel(a, b) -> float:
    """Relative Frobenius error ``||a - b|| / ||b||``, in float64."""
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def layouts(rng: random.Random, S: int) -> list[list[list[int]]]:
    """Two batches of two rows: one document and a random layout; 1-token and empty documents."""
    return [
        [[S], random_lengths(rng, S)],
        [[1] * 7 + [0, S - 7], [S // 3, 0, S - S // 3]],
    ]


def parity_errors(lengths, S, heads, causal, window, dtype, backend, seed, head_dim=HEAD_DIM, device="cuda") -> dict:
    """Errors of one forward+backward on ``device`` (CUDA; the benchmark's dry run: CPU):
    ``out``, ``dq``, ``dk``, ``dv`` (relative), ``lse`` (max abs), plus ``finite`` (no inf/NaN in
    out or grads) and ``out_dtype``."""
    cu = dp.cu_seqlens_from_lengths(lengths, S, max_docs=S)
    Hq, Hkv = heads
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(len(lengths), S, h, head_dim, generator=g) for h in (Hq, Hkv, Hkv))
    dout = torch.randn(len(lengths), S, Hq, head_dim, generator=g)
    rq, rk, rv = (t.double().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = reference(rq, rk, rv, cu, causal, window)
    ref_grads = torch.autograd.grad(ref_out, (rq, rk, rv), dout.double())
    cq, ck, cv = (t.to(device, dtype).requires_grad_() for t in (q, k, v))
    out, lse = dp.doc_packed_attn(
        cq, ck, cv, cu.to(device), causal=causal, window_size=window, return_lse=True, backend=backend
    )
    grads = torch.autograd.grad(out, (cq, ck, cv), dout.to(device, dtype))
    errs = {
        "out": rel(out.cpu(), ref_out),
        "lse": (lse.cpu().double() - ref_lse).abs().max().item(),
        **{name: rel(got.cpu(), want) for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads)},
    }
    errs["finite"] = all(bool(torch.isfinite(x).all()) for x in (out, *grads))
    errs["out_dtype"] = out.dtype
    return errs


def cuda_packed(dtype=torch.bfloat16):
    """A packed ``[T, H, D]`` problem on CUDA as the peers' varlen entries take it: q (8 heads),
    k, v (2 heads), 1024 tokens, head dim 64, and a 1-D int32 ``cu_seqlens`` with an empty
    document and a one-token one."""
    g = torch.Generator(device="cuda").manual_seed(0)
    cu = torch.tensor([0, 100, 100, 700, 701, 1024], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(1024, h, 64, generator=g, device="cuda", dtype=dtype) for h in (8, 2, 2))
    return q, k, v, cu
