"""Host (CPU) time per call of doc_packed_attn against the raw kernels, on one GPU.

At a size where the GPU work is tiny (default S = 1024, one document), a loop of calls is
launch-bound, so wall time per call is the host cost: Python, dispatch, checks, launches. This
is what our wrapper adds on top of a raw kernel when kernels are short (packed layouts at
S <= 16k run 1-4 ms per call). Prints microseconds per call and ours minus the raw anchor.
``--profile`` also prints the top functions of one backend's forward+backward (cProfile).
Usage: ``python -m bench.bench_overhead [--seq 1024] [--profile flex]``. ``--dry-run``: our call
alone (``auto``) on CPU, 128 tokens, a few calls.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats

import torch

import doc_packed as dp
from bench._harness import add_dry_run, device_name, sync
from bench.bench_op import flex_setup, per_call_us, raw_varlen


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--profile", default=None, help="flash or flex: profile ours with it")
    add_dry_run(ap)
    args = ap.parse_args(argv)
    S, Hq, Hkv, D, dev, dt = args.seq, 32, 8, 128, "cuda", torch.bfloat16
    if args.dry_run:
        S, Hq, Hkv, D, dev, dt = 128, 4, 2, 16, "cpu", torch.float32
    q = torch.randn(1, S, Hq, D, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(1, S, Hkv, D, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn(1, S, Hkv, D, device=dev, dtype=dt, requires_grad=True)
    dout = torch.randn_like(q)
    cu = dp.cu_seqlens_from_lengths([[S]], S, max_docs=8).to(dev)
    flat_cu = torch.tensor([0, S], device=dev, dtype=torch.int32)
    grads = (q, k, v)
    iters, warmup = (3, 1) if args.dry_run else (300, 20)
    if args.dry_run:  # no CUDA kernels: our call alone
        variants = {"ours-auto": lambda: dp.doc_packed_attn(q, k, v, cu, causal=True)}
    else:
        compiled, block_mask, _ = flex_setup(S, [S], dev)
        varlen = raw_varlen(q.view(S, Hq, D), k.view(S, Hkv, D), v.view(S, Hkv, D), flat_cu, S)
        variants = {  # the anchors' set-up (signature probe, views) stays outside the timed calls
            "varlen": varlen,
            "flex": lambda: compiled(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=block_mask, enable_gqa=True
            ),
            "ours-flash": lambda: dp.doc_packed_attn(q, k, v, cu, backend="flash", causal=True),
            "ours-flex": lambda: dp.doc_packed_attn(q, k, v, cu, backend="flex", causal=True),
        }
    rows = {}
    for name, f in variants.items():
        with torch.no_grad():
            fwd = per_call_us(f, iters, warmup)
        out_shape = f().shape

        def step(f=f, shape=out_shape):
            torch.autograd.grad(f(), grads, dout.view(shape))

        rows[name] = (fwd, per_call_us(step, iters, warmup))
    print(f"\ndevice: {device_name(dev)}  torch {torch.__version__}  {dt} S={S} Hq={Hq} Hkv={Hkv} D={D}")
    print("host-bound microseconds per call (launch loop, one sync at the end)\n")
    print("| variant | fwd us | fwd+bwd us | ours - raw fwd | ours - raw f+b |\n|---|---|---|---|---|")
    for name, (f, b) in rows.items():
        anchor = {"ours-flash": "varlen", "ours-flex": "flex"}.get(name)
        extra = (
            f"{f - rows[anchor][0]:+.0f} | {b - rows[anchor][1]:+.0f}" if anchor else "- | -"
        )
        print(f"| {name} | {f:.0f} | {b:.0f} | {extra} |")
    if args.profile:
        f = variants[f"ours-{args.profile}"]
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            torch.autograd.grad(f(), grads, dout)
        sync(dev)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
