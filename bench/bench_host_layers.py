"""Where the host time of one attention call goes, layer by layer, on one GPU with FA4.

At S = 1024 (one document, GPU work negligible) a launch loop is host-bound, so microseconds
per call are host cost. Each row adds one layer on top of the previous one, from FA4's own
entry points up to ``doc_packed_attn`` with autograd, so the difference between two rows is
what that layer costs. The anchor is FA4's public ``flash_attn_varlen_func`` measured in the
same run. ``--profile`` prints cProfile's top functions of our forward+backward.
Usage: ``python -m bench.bench_host_layers [--seq 1024] [--profile]``.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats

import torch

import doc_packed as dp
from bench.bench_op import per_call_us
from doc_packed import kernels
from doc_packed.ops import _local_problem


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--breakdown", action="store_true", help="time each layer inside our forward+backward")
    args = ap.parse_args(argv)
    from flash_attn.cute import flash_attn_varlen_func
    from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd

    S, Hq, Hkv, D, dev, dt = args.seq, 32, 8, 128, "cuda", torch.bfloat16
    q, k, v = (torch.randn(1, S, h, D, device=dev, dtype=dt, requires_grad=True) for h in (Hq, Hkv, Hkv))
    dout = torch.randn_like(q)
    cu = dp.cu_seqlens_from_lengths([[S]], S, max_docs=8).to(dev)
    flat_cu = torch.tensor([0, S], device=dev, dtype=torch.int32)
    scale = D**-0.5
    qf, kf, vf, df = (t.detach().view(S, *t.shape[2:]) for t in (q, k, v, dout))
    spec = _local_problem(cu, S, True, -1, 0)
    fa = dict(cu_seqlens_q=flat_cu, cu_seqlens_k=flat_cu, max_seqlen_q=S, max_seqlen_k=S, softmax_scale=scale,
              causal=True, window_size_left=None, window_size_right=None)
    with torch.no_grad():
        out_f, lse_f = _flash_attn_fwd(qf, kf, vf, return_lse=True, **fa)[:2]
        out4, lse4 = torch.ops.doc_packed.attn_fwd(q, k, v, cu, S, True, -1, 0, scale, "auto", None, 0, None)
    op_args = (cu, S, True, -1, 0, scale, "auto", None, 0, None)
    qv, kv_, vv = (t.view(S, *t.shape[2:]) for t in (q, k, v))

    def public_fb():
        o = flash_attn_varlen_func(qv, kv_, vv, cu_seqlens_q=flat_cu, cu_seqlens_k=flat_cu, max_seqlen_q=S,
                                   max_seqlen_k=S, causal=True, return_lse=True)[0]
        torch.autograd.backward(o, df)

    def ours_fb():
        torch.autograd.backward(dp.doc_packed_attn(q, k, v, cu, causal=True), dout)

    def op_fb():  # the custom op with its registered autograd (the path under compile/DTensor/modes)
        torch.autograd.backward(torch.ops.doc_packed.attn_fwd(q, k, v, *op_args)[0], dout)

    def nograd(f):
        def g():
            with torch.no_grad():
                f()
        return g

    rows = [
        ("fwd", "FA4 _flash_attn_fwd (what our kernel layer calls)",
         nograd(lambda: _flash_attn_fwd(qf, kf, vf, return_lse=True, **fa))),
        ("fwd", "FA4 flash_attn_varlen_func, no grad (anchor)",
         nograd(lambda: flash_attn_varlen_func(qv, kv_, vv, cu_seqlens_q=flat_cu, cu_seqlens_k=flat_cu,
                                               max_seqlen_q=S, max_seqlen_k=S, causal=True, return_lse=True))),
        ("fwd", "kernels.forward(spec, ...)", nograd(lambda: kernels.forward(spec, qf, kf, vf, scale, "auto"))),
        ("fwd", "torch.ops.doc_packed.attn_fwd, no grad",
         nograd(lambda: torch.ops.doc_packed.attn_fwd(q, k, v, *op_args))),
        ("fwd", "doc_packed_attn, no grad", nograd(lambda: dp.doc_packed_attn(q, k, v, cu, causal=True))),
        ("fwd", "FA4 flash_attn_varlen_func, grad on",
         lambda: flash_attn_varlen_func(qv, kv_, vv, cu_seqlens_q=flat_cu, cu_seqlens_k=flat_cu,
                                        max_seqlen_q=S, max_seqlen_k=S, causal=True, return_lse=True)),
        ("fwd", "doc_packed_attn, grad on", lambda: dp.doc_packed_attn(q, k, v, cu, causal=True)),
        ("bwd", "FA4 _flash_attn_bwd (what our kernel layer calls)",
         nograd(lambda: _flash_attn_bwd(qf, kf, vf, out_f, df, lse_f, **fa))),
        ("bwd", "kernels.backward(spec, ...)",
         nograd(lambda: kernels.backward(spec, df, qf, kf, vf, out_f, lse_f, scale, "auto"))),
        ("bwd", "torch.ops.doc_packed.attn_bwd, no grad",
         nograd(lambda: torch.ops.doc_packed.attn_bwd(dout, q, k, v, out4, lse4, *op_args))),
        ("f+b", "FA4 flash_attn_varlen_func + backward (anchor)", public_fb),
        ("f+b", "torch.ops.doc_packed.attn_fwd + backward (the custom op's autograd)", op_fb),
        ("f+b", "doc_packed_attn + backward", ours_fb),
    ]
    res = [(p, name, per_call_us(f, args.iters)) for p, name, f in rows]
    print(f"\ndevice: {torch.cuda.get_device_name()}  torch {torch.__version__}  bf16 S={S} Hq={Hq} Hkv={Hkv} D={D}")
    print("host-bound microseconds per call (launch loop of", args.iters, "calls, one sync at the end)\n")
    print("| pass | layer | us/call |\n|---|---|---|")
    for p, name, us in res:
        print(f"| {p} | {name} | {us:.1f} |")
    anchor = {p: us for p, name, us in res if "anchor" in name}
    ours = {p: us for p, name, us in res if name.startswith("doc_packed_attn") and ("no grad" in name or p == "f+b")}
    print("\n| pass | FA4 anchor us | ours us | ours - anchor | anchor / ours |\n|---|---|---|---|---|")
    for p in ("fwd", "f+b"):
        print(f"| {p} | {anchor[p]:.1f} | {ours[p]:.1f} | {ours[p] - anchor[p]:+.1f} | {anchor[p] / ours[p]:.3f}x |")
    if args.breakdown:
        breakdown(ours_fb, args.iters)
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            ours_fb()
        torch.cuda.synchronize()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)
        pstats.Stats(prof).sort_stats("cumtime").print_stats(40)


def breakdown(step, iters: int) -> None:
    """Host us per forward+backward spent in (and under) each layer, timed inside the calls;
    the backward runs on the autograd engine's device thread, which cProfile does not see."""
    import time

    from doc_packed import _eager, api, ops
    from doc_packed.kernels import fa4

    spent: dict[str, float] = {}  # label -> seconds, in the order the layers are listed
    patched = []

    def timed(fn, label):
        spent[label] = 0.0

        def run(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[label] += time.perf_counter() - t0

        return run

    def wrap(owner, name, value):
        patched.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    for owner, name, label in (
        (api, "_validated", "api._validated (checks)"),
        (_eager, "attention", "_eager.attention (fwd, whole)"),
        (ops, "forward_impl", "ops.forward_impl"),
        (kernels, "forward", "kernels.forward"),
        (ops, "input_grads", "ops.input_grads (bwd, whole)"),
        (ops, "backward_impl", "ops.backward_impl"),
        (kernels, "backward", "kernels.backward"),
    ):
        wrap(owner, name, timed(getattr(owner, name), label))
    fwd, bwd = fa4._interface()
    fa4_fns = (timed(fwd, "FA4 _flash_attn_fwd"), timed(bwd, "FA4 _flash_attn_bwd"))
    wrap(fa4, "_interface", lambda: fa4_fns)
    for _ in range(20):
        step()
    torch.cuda.synchronize()
    spent.update(dict.fromkeys(spent, 0.0))
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    torch.cuda.synchronize()
    total = time.perf_counter() - t0
    print("\nours, forward+backward: host us per call spent in each layer (and what it calls)\n")
    print("| layer | us/call |\n|---|---|")
    print(f"| whole step (doc_packed_attn + torch.autograd.backward) | {total / iters * 1e6:.1f} |")
    for label, sec in spent.items():
        print(f"| {label} | {sec / iters * 1e6:.1f} |")
    for owner, name, fn in patched:
        setattr(owner, name, fn)


if __name__ == "__main__":
    main()
