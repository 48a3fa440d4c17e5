"""Measure one GPU's rates for the step-time model and write the rates file.

What :mod:`shardings.step_model` prices with (``shardings/h200_rates.json``'s schema):
- attention TFLOP/s per backend, forward and forward+backward, at 16k-128k tokens, one
  document and lognormal documents of mean 2048 and 512 (``doc_packed_attn`` with that
  backend forced; Hq 32 / Hkv 8, D 128, bf16, causal; pairs counted exactly);
- the op's host cost per call (S = 1024, GPU work negligible);
- matmul TFLOP/s at the sharded shapes of the project's models (``bench/ap_scenarios.py``'s
  ``e2e`` and ``narrow``): each Linear's forward ``[T, in] @ [in, out]`` and its two backward
  matmuls, whole and column/row-sharded 2, 4 and 8 ways, for T = 8k-64k tokens per rank;
- memory bandwidth (a large copy).
Collective bandwidths and the fixed per-exchange cost of context parallelism need several GPUs:
they are carried over from the existing file (``--base``).

CUDA events around each call, median of ``--iters`` after warm-ups, no sync between calls.
Usage: ``python -m bench.measure_rates --out shardings/h200_rates.json [--quick]``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys

import torch

import doc_packed as dp
from bench._harness import timed_ms
from doc_packed_examples.model import random_attention_problem
from doc_packed.flops import total_pairs
from doc_packed.data import lognormal_lengths


def attention_points(backend: str, sizes, iters: int) -> list[dict]:
    out = []
    for S in sizes:
        for doc in (0, 2048, 512):
            lengths = [S] if doc == 0 else lognormal_lengths(S, doc, 0)
            q, k, v, dout, cu = random_attention_problem(lengths, S, (32, 8), 128, torch.bfloat16, "cuda", 0)
            q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True)
            pairs = total_pairs(cu.cpu(), S, True, -1, 0)
            fwd_flops = 4 * pairs * 32 * 128

            def fwd():
                with torch.no_grad():
                    dp.doc_packed_attn(q, k, v, cu, backend=backend, causal=True)

            def fwd_bwd():
                out = dp.doc_packed_attn(q, k, v, cu, backend=backend, causal=True)
                out.backward(dout)

            try:
                t_f = timed_ms(fwd, iters=iters)
                t_fb = timed_ms(fwd_bwd, iters=iters)
            except Exception as err:  # backend cannot run this problem here
                print(f"  {backend} S={S} doc={doc}: {type(err).__name__}: {str(err)[:100]}", file=sys.stderr)
                continue
            mean_doc = S / len(lengths)
            p = dict(seq_len=S, doc_len=round(mean_doc), fwd=round(fwd_flops / t_f / 1e9, 1),
                     fwd_bwd=round(3.5 * fwd_flops / t_fb / 1e9, 1), fwd_ms=round(t_f, 4), fwd_bwd_ms=round(t_fb, 4))
            print(backend, p, flush=True)
            out.append(p)
            torch.cuda.empty_cache()
    return out


def call_cost_us(backend: str) -> dict:
    S = 1024
    q, k, v, dout, cu = random_attention_problem([S], S, (32, 8), 128, torch.bfloat16, "cuda", 0)
    q.requires_grad_(True)

    def loop(n, bwd):
        for _ in range(n):
            o = dp.doc_packed_attn(q, k, v, cu, backend=backend, causal=True)
            if bwd:
                o.backward(dout)

    res = {}
    for name, bwd in (("forward", False), ("fwd_bwd", True)):
        loop(5, bwd)
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        loop(200, bwd)
        b.record()
        torch.cuda.synchronize()
        res[name] = a.elapsed_time(b) / 200 * 1e3
    return dict(forward=round(res["forward"]), backward=round(res["fwd_bwd"] - res["forward"]))


MODELS = {"e2e": (2048, 16, 4), "narrow": (1024, 8, 2)}  # dim, heads, kv heads


def matmul_points(tokens, iters: int) -> list[dict]:
    shapes = set()
    for dim, h, hkv in MODELS.values():
        kv = dim // h * hkv
        for fin, fout in ((dim, dim), (dim, kv), (dim, 4 * dim), (4 * dim, dim), (dim, 8192)):
            for tp in (1, 2, 4, 8):
                for T in tokens:
                    for i, o in ((fin, fout // tp), (fin // tp, fout)):
                        if i and o:
                            shapes |= {(T, o, i), (T, i, o), (i, o, T)}  # fwd, dX, dW as (m, n, k)
    out = []
    for m, n, k in sorted(shapes):
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        t = timed_ms(lambda: a @ b, iters=iters)
        out.append(dict(m=m, n=n, k=k, tflops=round(2 * m * n * k / t / 1e9, 1)))
    print(f"{len(out)} matmul shapes, median {statistics.median(p['tflops'] for p in out):.0f} TFLOP/s", flush=True)
    return out


def hbm_gbps() -> float:
    x = torch.empty(2**28, device="cuda", dtype=torch.float32)  # 1 GiB
    y = torch.empty_like(x)
    t = timed_ms(lambda: y.copy_(x))
    return round(2 * x.numel() * 4 / t / 1e6)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--base", default="shardings/h200_rates.json", help="file whose collectives / CP fixed cost are kept")
    ap.add_argument("--backends", default="fa4,flex,flash")
    ap.add_argument("--sizes", default="16384,32768,65536,131072")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="16k and 64k only, fewer matmul token counts")
    args = ap.parse_args(argv)
    with open(args.base) as f:
        base = json.load(f)
    sizes = [16384, 65536] if args.quick else [int(s) for s in args.sizes.split(",")]
    tokens = [16384, 65536] if args.quick else [8192, 16384, 32768, 65536]
    # backends not measured in this run keep the base file's points (split a long run by backend)
    attention, calls = dict(base["attention"]), dict(base["attention_call_us"].get("per_backend", {}))
    measured = []
    for backend in args.backends.split(","):
        pts = attention_points(backend, sizes, args.iters)
        if pts:
            attention[backend] = pts
            calls[backend] = call_cost_us(backend)
            measured.append(backend)
    first = next((b for b in base.get("backend_order", []) if b in calls), next(iter(calls), None))
    data = dict(base)
    data.update(
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        date=datetime.date.today().isoformat(),
        source=f"bench/measure_rates.py {' '.join(sys.argv[1:])} (measured: {', '.join(measured)}); other backends,"
        f" collectives and cp_exchange_fixed_us from {args.base}",
        attention=attention,
        attention_call_us=dict(calls[first], per_backend=calls) if first in calls else base["attention_call_us"],
        backend_order=[b for b in base.get("backend_order", []) if b in attention] or list(attention),
        matmul=dict(default_tflops=None, points=matmul_points(tokens, args.iters), note="measured: [m, k] @ [k, n]"),
        hbm_gbps=hbm_gbps(),
        hbm_note="measured: 1 GiB copy, read + write",
    )
    pts = data["matmul"]["points"]
    data["matmul"]["default_tflops"] = statistics.median(p["tflops"] for p in pts) if pts else base["matmul"]["default_tflops"]
    with open(args.out, "w") as f:
        json.dump(data, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
