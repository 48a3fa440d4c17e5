"""What a kernel call costs per segment shape: the data behind the planner's tile cost model.

The context-parallel planner balances work across ranks. Counting exact (query, key) pairs
misses what tiled kernels pay on top: the padded part of each diagonal tile, whole tiles for
documents shorter than one, and per-row passes (FA4's backward pre/post-processing). This
script times one varlen call (forward + backward, ``doc_packed.kernels`` with the backend
forced) over ``--tokens`` query rows cut into equal segments, for each segment shape:

- causal documents of length ``n`` (the shape of packed rows);
- non-causal blocks of ``nq`` queries x ``nk`` keys (a context-parallel stage B piece: every
  received key precedes the queries).

It prints ms per call (forward, forward + backward), exact pairs, picoseconds per pair and that
cost per pair against the anchor measured in the same run (one causal document filling the
call), then a least-squares fit of the forward + backward times to
``a * padded pairs + b * (segment, key block) + c``, with 128 x 128 tiles (a tiled kernel's
work on the staircase of each causal segment, whole tiles for short ones, and a fixed cost per
block of keys of each segment, which FA4's backward loops over). Run it on the GPU to fit:

    python -m bench.measure_doc_cost --backend fa4 --json out.json
"""

from __future__ import annotations

import argparse
import json
from math import ceil

import torch

from doc_packed import kernels
from doc_packed.kernels import VarlenSpec
from bench._harness import add_dry_run, device_name, timed_ms


def _call(nq: int, nk: int, causal: bool, tokens: int, Hq: int, Hkv: int, D: int, backend: str, iters: int,
          device: str = "cuda"):
    segs = max(1, tokens // nq)
    cu_q = [i * nq for i in range(segs + 1)]
    cu_k = [i * nk for i in range(segs + 1)]
    spec = VarlenSpec(cu_q, cu_k, causal, -1, 0 if causal else -1)
    g = torch.Generator(device=device).manual_seed(0)
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    q = torch.randn(segs * nq, Hq, D, device=device, dtype=dt, generator=g)
    k = torch.randn(segs * nk, Hkv, D, device=device, dtype=dt, generator=g)
    v = torch.randn(segs * nk, Hkv, D, device=device, dtype=dt, generator=g)
    do = torch.randn_like(q)
    scale = D**-0.5
    def fwd():
        kernels.forward(spec, q, k, v, scale, backend)

    def fb():
        o, l = kernels.forward(spec, q, k, v, scale, backend)
        kernels.backward(spec, do, q, k, v, o, l, scale, backend)

    pairs = segs * (nq * (nq + 1) // 2 if causal and nq == nk else nq * nk)
    return dict(
        nq=nq, nk=nk, causal=causal, segments=segs, rows=segs * nq, pairs=pairs,
        fwd_ms=round(timed_ms(fwd, iters=iters), 4), fb_ms=round(timed_ms(fb, iters=iters), 4),
    )


def _tiles(nq: int, nk: int, causal: bool, block: int = 128) -> tuple[int, int]:
    """(tiles, key blocks) of one segment: a causal one is bottom-right aligned."""
    mq, nb = ceil(nq / block), ceil(nk / block)
    if not causal:
        return mq * nb, nb
    shift = nk - nq
    return sum(max(0, min(nb, ceil((min((i + 1) * block, nq) + shift) / block))) for i in range(mq)), nb


def _fit(rows: list[dict]) -> dict:
    """Least squares of f+b ms on padded pairs, (segment, key block)s and a per-call constant."""
    import numpy as np

    feats = []
    for r in rows:
        tiles, nb = _tiles(r["nq"], r["nk"], r["causal"])
        feats.append([r["segments"] * tiles * 128 * 128 / 1e6, r["segments"] * nb, 1.0])
    A, y = np.asarray(feats), np.asarray([r["fb_ms"] for r in rows])
    coef = np.linalg.lstsq(A, y, rcond=None)[0]
    err = np.abs(A @ coef / y - 1)
    return dict(
        ms_per_M_padded_pairs=float(coef[0]), us_per_key_block=float(coef[1] * 1e3), ms_per_call=float(coef[2]),
        mean_rel_err=float(err.mean()), max_rel_err=float(err.max()),
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="fa4")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--heads", type=int, nargs=2, default=[32, 8])
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", default=None)
    add_dry_run(ap, "CPU, math kernel, float32, 512 tokens, 4 / 2 heads of 16, six shapes, one timing each")
    args = ap.parse_args(argv)
    device = "cpu" if args.dry_run else "cuda"
    if args.dry_run:
        args.backend, args.tokens, args.heads, args.head_dim, args.iters = "math", 512, [4, 2], 16, 1
    Hq, Hkv = args.heads
    shapes = [(n, n, True) for n in (16, 32, 64, 96, 128, 160, 192, 256, 320, 384, 512, 768, 1024, 1536, 2048,
                                     3072, 4096, 8192, 16384, 32768)]
    shapes += [(nq, nk, False) for nq, nk in ((64, 1024), (128, 1024), (256, 1024), (1024, 1024), (128, 4096),
                                              (512, 4096), (2048, 4096), (4096, 4096), (64, 64), (256, 256),
                                              (100, 3000), (1000, 3000), (3000, 3000))]
    if args.dry_run:
        shapes = [(64, 64, True), (256, 256, True), (512, 512, True), (64, 128, False), (128, 128, False),
                  (256, 512, False)]
    print(f"device {device_name(device)} torch {torch.__version__} backend {args.backend}")
    print(f"{'nq':>6} {'nk':>6} {'causal':>6} {'segs':>5} {'pairs M':>9} {'fwd ms':>8} {'f+b ms':>8} {'ps/pair f+b':>12}")
    rows = []
    for nq, nk, causal in shapes:
        r = _call(nq, nk, causal, args.tokens, Hq, Hkv, args.head_dim, args.backend, args.iters, device)
        rows.append(r)
        print(
            f"{nq:>6} {nk:>6} {causal!s:>6} {r['segments']:>5} {r['pairs'] / 1e6:>9.2f} {r['fwd_ms']:>8.3f} "
            f"{r['fb_ms']:>8.3f} {1e9 * r['fb_ms'] / r['pairs']:>12.2f}",
            flush=True,
        )
    anchor = next(r for r in reversed(rows) if r["causal"] and r["nq"] >= args.tokens)
    per_pair = anchor["fb_ms"] / anchor["pairs"]
    print(f"\nps/pair against one document of {anchor['nq']} tokens (the anchor, same run):")
    print("  " + "  ".join(f"{r['nq']}x{r['nk']}{'c' if r['causal'] else ''}: {r['fb_ms'] / r['pairs'] / per_pair:.2f}" for r in rows))
    fit = _fit(rows)
    print(
        f"\nfit, forward + backward: {fit['ms_per_M_padded_pairs']:.4f} ms per M padded pairs + "
        f"{fit['us_per_key_block']:.2f} us per (segment, key block) + {fit['ms_per_call']:.3f} ms per call; "
        f"|error| mean {fit['mean_rel_err']:.1%}, max {fit['max_rel_err']:.1%}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=device_name(device), torch=torch.__version__, backend=args.backend,
                           tokens=args.tokens, heads=[Hq, Hkv], head_dim=args.head_dim, rows=rows, fit=fit), f, indent=1)


if __name__ == "__main__":
    main()
