"""doc_packed_attn against the raw kernels it competes with, on one GPU.

For each layout, times forward and forward+backward of:
- ``varlen``: torch.nn.attention.varlen.varlen_attn on pre-flattened tensors with offsets and
  max length computed outside the timed region (the raw kernel, no wrapper);
- ``flex``: torch.compile(flex_attention) with a document-causal BlockMask built outside the
  timed region (its build time is reported separately);
- ``ours``: doc_packed.doc_packed_attn on [B, S, H, D] with the [B, MAX_DOCS + 1] cu_seqlens,
  with ``backend="auto"`` (what users get) and forced to each of its CUDA backends
  (``ours-flash``, ``ours-flex``).

Timing: CUDA events around each call, no synchronisation between calls (see :func:`bench`),
median of 20 calls after 5 warm-up calls; the variants run in turn and the whole round twice,
keeping each variant's better median (one run showed 15% between two rounds of the same
kernel).

TFLOP/s use causal FLOPs: forward ``4 * pairs * Hq * D``, forward+backward 3.5x that
(flash-attention's convention), pairs = visible (query, key) pairs. The last column is ours
over the faster raw kernel. Usage:
``python bench/bench_op.py [--sizes 16384,65536] [--layouts ...] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import time

import torch

import doc_packed as dp
from doc_packed.examples import lognormal_lengths, random_attention_problem
from doc_packed._mask import doc_pairs


LAYOUTS = {
    "one doc": lambda S: [S],
    "uniform 512": lambda S: [512] * (S // 512),
    "uniform 2k": lambda S: [2048] * (S // 2048),
    "uniform 8k": lambda S: [8192] * (S // 8192),
    "lognormal 1.4k": lambda S: lognormal_lengths(S, 1400),
}
DEFAULT_LAYOUTS = ("one doc", "uniform 2k", "lognormal 1.4k")


def bench(fn, warmup=5, iters=20) -> float:
    """Median milliseconds of ``fn`` on the GPU, the host running ahead (as in training).

    Each call is bracketed by CUDA events but nothing synchronises between calls (triton's
    ``do_bench`` method), so host work overlaps the previous call's kernels and shows only
    where the host cannot keep up. Host cost per call is measured by bench_overhead.py.
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(iters)
    ]
    for a, b in events:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    times = sorted(a.elapsed_time(b) for a, b in events)
    return times[len(times) // 2]


def raw_varlen(q, k, v, cu, max_len):
    from torch.nn.attention.varlen import varlen_attn

    kw = {"window_size": (-1, 0)}
    if "enable_gqa" in inspect.signature(varlen_attn).parameters:
        kw["enable_gqa"] = q.shape[1] != k.shape[1]
    return lambda: varlen_attn(q, k, v, cu, cu, max_len, max_len, **kw)


def flex_setup(S, lengths, device):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    doc = torch.repeat_interleave(
        torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device)
    )

    def mask_mod(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    block_mask = create_block_mask(mask_mod, None, None, S, S, device=device)
    torch.cuda.synchronize()
    build_ms = (time.perf_counter() - t0) * 1e3
    compiled = torch.compile(flex_attention, dynamic=False)  # one static graph per size
    return compiled, block_mask, build_ms


def run(S: int, name: str, lengths: list[int], Hq=32, Hkv=8, D=128, dtype=torch.bfloat16):
    dev = "cuda"
    q, k, v, dout, cu = random_attention_problem(lengths, S, (Hq, Hkv), D, dtype, dev, seed=0)
    flat_cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), device=dev, dtype=torch.int32)
    pairs = sum(doc_pairs(n, True, -1, 0) for n in lengths)
    fwd_flop = 4 * pairs * Hq * D
    res = {"S": S, "layout": name, "docs": len(lengths)}

    def timed(make, grad: bool):
        if not grad:
            with torch.no_grad():
                f = make(q, k, v)
                return bench(f)
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        f = make(qq, kk, vv)

        def step():
            out = f()
            torch.autograd.backward(out, dout.view_as(out))

        return bench(step)

    # raw varlen on [T, H, D]
    mk_raw = lambda a, b, c: raw_varlen(a.view(S, Hq, D), b.view(S, Hkv, D), c.view(S, Hkv, D), flat_cu, max(lengths))  # noqa: E731
    def mk_ours(backend):
        return lambda a, b, c: (lambda: dp.doc_packed_attn(a, b, c, cu, backend=backend))
    compiled, block_mask, build_ms = flex_setup(S, lengths, dev)
    res["blockmask_build_ms"] = build_ms
    mk_flex = lambda a, b, c: (  # noqa: E731
        lambda: compiled(a.transpose(1, 2), b.transpose(1, 2), c.transpose(1, 2), block_mask=block_mask, enable_gqa=True)
    )
    variants = (
        ("varlen", mk_raw), ("flex", mk_flex), ("ours", mk_ours("auto")),
        ("ours-flash", mk_ours("flash")), ("ours-flex", mk_ours("flex")),
    )
    for label, mk in variants * REPEATS:  # each variant timed REPEATS times, best kept
        try:
            f_ms = timed(mk, False)
            fb_ms = timed(mk, True)
        except Exception as e:  # report, keep going
            res[label] = {"error": f"{type(e).__name__}: {e}"[:300]}
            continue
        if label in res and res[label].get("fwdbwd_ms", math.inf) <= fb_ms:
            f_ms, fb_ms = min(f_ms, res[label]["fwd_ms"]), res[label]["fwdbwd_ms"]
        elif label in res:
            f_ms = min(f_ms, res[label]["fwd_ms"])
        res[label] = {
            "fwd_ms": f_ms,
            "fwdbwd_ms": fb_ms,
            "fwd_tflops": fwd_flop / f_ms / 1e9,
            "fwdbwd_tflops": 3.5 * fwd_flop / fb_ms / 1e9,
        }
    return res


REPEATS = 2  # all variants in turn, twice: order and clock effects show as spread, not bias
LABELS = ("varlen", "flex", "ours", "ours-flash", "ours-flex")


def table(rows) -> str:
    """TFLOP/s per variant and pass; ``ours/best`` = ours (auto) over the faster raw kernel."""
    lines = []
    for key, title in (("fwd_tflops", "forward"), ("fwdbwd_tflops", "forward+backward")):
        lines += [
            f"\n{title} (TFLOP/s)\n",
            "| S | layout | " + " | ".join(LABELS) + " | ours/best |",
            "|" + "---|" * (len(LABELS) + 3),
        ]
        for r in rows:
            vals = [r.get(lbl, {}).get(key, float("nan")) for lbl in LABELS]
            raw = [x for x in vals[:2] if not math.isnan(x)]
            ratio = vals[2] / max(raw) if raw else float("nan")
            cells = [f"{r['S'] // 1024}k", r["layout"], *(f"{x:.0f}" for x in vals), f"{ratio:.2f}x"]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="16384,65536", help="comma-separated row lengths")
    ap.add_argument("--layouts", default=",".join(DEFAULT_LAYOUTS), help=f"comma-separated, of {list(LAYOUTS)}")
    ap.add_argument("--json", default=None, help="write raw results here")
    args = ap.parse_args()
    rows = []
    for S in (int(x) for x in args.sizes.split(",")):
        for name in args.layouts.split(","):
            rows.append(run(S, name, LAYOUTS[name](S)))
            print(json.dumps(rows[-1]), flush=True)
    print(f"\ndevice: {torch.cuda.get_device_name()}  torch {torch.__version__}  bf16 Hq=32 Hkv=8 D=128 B=1")
    print("TFLOP/s (causal FLOPs); ours/best = ours over the faster of varlen and flex\n")
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
