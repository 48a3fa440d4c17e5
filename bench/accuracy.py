"""Worst errors of each CUDA backend against the float64 dense oracle, per dtype.

Runs the grid of tests/test_gpu.py (causal, full and two windows; GQA 1, 4 and 8; one document,
random layouts with zero-length and 1-token documents, two rows) and prints, per backend and
dtype, the largest relative Frobenius error of out, dq, dk, dv and the largest lse abs error:
the numbers behind the tolerances the tests assert. Usage: ``python bench/accuracy.py``.
"""

from __future__ import annotations

import os
import random
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import doc_packed as dp  # noqa: E402
from conftest import random_lengths  # noqa: E402
from oracle import reference  # noqa: E402

MASKS = [(True, (-1, -1)), (False, (-1, -1)), (True, (64, 0)), (False, (32, 16))]
HEADS = [(8, 8), (8, 2), (4, 1)]


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def main():
    S, D, B = 384, 64, 2
    rng = random.Random(7)
    layouts = [[[S], random_lengths(rng, S)], [[1] * 7 + [0, S - 7], [S // 3, 0, S - S // 3]]]
    runs = [("flash", torch.bfloat16), ("flash", torch.float16), ("flex", torch.bfloat16),
            ("flex", torch.float16), ("flex", torch.float32), ("math", torch.float32)]
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  S={S} D={D} B={B}\n")
    print("| backend | dtype | out | lse (abs) | dq | dk | dv |\n|---|---|---|---|---|---|---|")
    for backend, dtype in runs:
        worst = [0.0] * 5
        for causal, window in MASKS:
            for Hq, Hkv in HEADS:
                for lengths in layouts:
                    cu = dp.cu_seqlens_from_lengths(lengths, S, max_docs=S)
                    g = torch.Generator().manual_seed(1)
                    q, k, v = (torch.randn(B, S, h, D, generator=g) for h in (Hq, Hkv, Hkv))
                    dout = torch.randn(B, S, Hq, D, generator=g)
                    rq, rk, rv = (t.double().requires_grad_() for t in (q, k, v))
                    ref_out, ref_lse = reference(rq, rk, rv, cu, causal, window)
                    ref_g = torch.autograd.grad(ref_out, (rq, rk, rv), dout.double())
                    cq, ck, cv = (t.to("cuda", dtype).requires_grad_() for t in (q, k, v))
                    out, lse = dp.doc_packed_attn(
                        cq, ck, cv, cu.cuda(), causal=causal, window_size=window,
                        return_lse=True, backend=backend,
                    )
                    grads = torch.autograd.grad(out, (cq, ck, cv), dout.to("cuda", dtype))
                    errs = [rel(out.cpu(), ref_out),
                            (lse.cpu().double() - ref_lse).abs().max().item(),
                            *(rel(a.cpu(), b) for a, b in zip(grads, ref_g))]
                    worst = [max(w, e) for w, e in zip(worst, errs)]
        print(f"| {backend} | {str(dtype).removeprefix('torch.')} | " + " | ".join(f"{x:.1e}" for x in worst) + " |")


if __name__ == "__main__":
    main()
