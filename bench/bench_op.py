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
``python -m bench.bench_op [--sizes 16384,65536] [--layouts ...] [--json out.json]``.
``--dry-run``: ours alone, one 256-token document on CPU (float32, small heads).

``--fa4`` runs the FlashAttention-4 grid instead (see :func:`fa4_cells`): raw FA4
(``flash_attn.cute.flash_attn_varlen_func`` on ``[B*S, H, D]`` views of the same tensors, offsets
and max length computed outside the timed region; ``fa4-lse`` also returns lse, as our op always
does) against ``ours`` (``backend="auto"``, which
runs fa4 where FA4 is usable; the backend it ran is recorded), forward and forward+backward,
**synchronised after every call** (so host cost per call counts), plus the host cost per call
at S = 1024 (a launch loop, one sync at the end). Ratio = raw FA4 time / ours.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import time

import torch

import doc_packed as dp
from bench import _harness
from bench._harness import add_dry_run, device_name, timed_ms
from doc_packed_examples.model import random_attention_problem
from doc_packed.data import lognormal_lengths
from doc_packed._mask import doc_pairs


LAYOUTS = {
    "one doc": lambda S: [S],
    "uniform 512": lambda S: [512] * (S // 512),
    "uniform 2k": lambda S: [2048] * (S // 2048),
    "uniform 8k": lambda S: [8192] * (S // 8192),
    "lognormal 1.4k": lambda S: lognormal_lengths(S, 1400),
}
DEFAULT_LAYOUTS = ("one doc", "uniform 2k", "lognormal 1.4k")


def bench(fn, warmup=5, iters=20, sync=False) -> float:
    """Median milliseconds of ``fn`` on the GPU, the host running ahead (as in training).

    Each call is bracketed by CUDA events but nothing synchronises between calls (triton's
    ``do_bench`` method), so host work overlaps the previous call's kernels and shows only
    where the host cannot keep up. Host cost per call is measured by bench_overhead.py.
    ``sync=True`` synchronises after every call: the time then includes the host's launch work.
    """
    return timed_ms(fn, warmup=warmup, iters=iters, sync_each=sync)


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

    _harness.sync(device)
    t0 = time.perf_counter()
    block_mask = create_block_mask(mask_mod, None, None, S, S, device=device)
    _harness.sync(device)
    build_ms = (time.perf_counter() - t0) * 1e3
    compiled = torch.compile(flex_attention, dynamic=False)  # one static graph per size
    return compiled, block_mask, build_ms


def run(S: int, name: str, lengths: list[int], Hq=32, Hkv=8, D=128, dtype=torch.bfloat16, dev="cuda", labels=None):
    """Every variant (``labels``: those only) on one layout."""
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
        return lambda a, b, c: (lambda: dp.doc_packed_attn(a, b, c, cu, backend=backend, causal=True))
    compiled = block_mask = None
    if labels is None or "flex" in labels:
        compiled, block_mask, build_ms = flex_setup(S, lengths, dev)
        res["blockmask_build_ms"] = build_ms
    mk_flex = lambda a, b, c: (  # noqa: E731
        lambda: compiled(a.transpose(1, 2), b.transpose(1, 2), c.transpose(1, 2), block_mask=block_mask, enable_gqa=True)
    )
    variants = (
        ("varlen", mk_raw), ("flex", mk_flex), ("ours", mk_ours("auto")),
        ("ours-flash", mk_ours("flash")), ("ours-flex", mk_ours("flex")),
    )
    variants = tuple(v for v in variants if labels is None or v[0] in labels)
    for label, mk in variants * REPEATS:  # each variant timed REPEATS times, best kept
        try:
            f_ms = timed(mk, False)
            fb_ms = timed(mk, True)
        except Exception as e:  # report, keep going (a dry run fails)
            if dev == "cpu":
                raise
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


# ----------------------------------------------------------------------------- FA4 grid


def fa4_cells(sizes: list[int]) -> list[dict]:
    """The FA4 grid: causal GQA 4:1 D 128 over sizes and layouts, then at 16k one document and
    lognormal mean 2k: full (non-causal), a (1024, 0) window, GQA 1:1, D 64."""
    base = dict(causal=True, window=(-1, -1), heads=(32, 8), D=128)
    layouts = ("one doc", "uniform 2k", "lognormal 2k", "lognormal 512")
    cells = [dict(base, S=S, layout=name) for S in sizes for name in layouts]
    for S in [x for x in sizes if x > 65536]:  # long rows: packed layouts only (one doc: minutes)
        cells = [c for c in cells if not (c["S"] == S and c["layout"] == "one doc")]
    for change in (dict(causal=False), dict(window=(1024, 0)), dict(heads=(32, 32)), dict(D=64)):
        cells += [dict(base, S=16384, layout=name, **change) for name in ("one doc", "lognormal 2k")]
    return cells


FA4_LAYOUTS = {
    "one doc": lambda S: [S],
    "uniform 2k": lambda S: [2048] * (S // 2048),
    "lognormal 2k": lambda S: lognormal_lengths(S, 2048),
    "lognormal 512": lambda S: lognormal_lengths(S, 512),
}


def _raw_fa4(q, k, v, cu, max_len, causal, window, return_lse=False):
    from flash_attn.cute import flash_attn_varlen_func

    win = tuple(None if w < 0 else w for w in window)
    return lambda: flash_attn_varlen_func(
        q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len, max_seqlen_k=max_len,
        causal=causal, window_size=win, return_lse=return_lse,
    )


def run_fa4(cell: dict) -> dict:
    """Raw FA4 and ours on one cell, forward and forward+backward, synchronised per call."""
    from doc_packed import env

    S, (Hq, Hkv), D, causal, window = cell["S"], cell["heads"], cell["D"], cell["causal"], cell["window"]
    lengths = FA4_LAYOUTS[cell["layout"]](S)
    q, k, v, dout, cu = random_attention_problem(lengths, S, (Hq, Hkv), D, torch.bfloat16, "cuda", seed=0)
    flat_cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    left, right = window[0], (0 if causal else window[1])
    pairs = sum(doc_pairs(n, causal, left, right) for n in lengths)
    fwd_flop = 4 * pairs * Hq * D
    res = dict(cell, docs=len(lengths), ran=env.backend_for(q, k, cu, causal=causal, window_size=window))

    def flat(t):
        return t.view(S, *t.shape[2:])

    makers = {
        "fa4": lambda a, b, c: _raw_fa4(flat(a), flat(b), flat(c), flat_cu, max(lengths), causal, window),
        # like-for-like: our op always computes lse (its backward needs it)
        "fa4-lse": lambda a, b, c: _raw_fa4(
            flat(a), flat(b), flat(c), flat_cu, max(lengths), causal, window, return_lse=True
        ),
        "ours": lambda a, b, c: (
            lambda: dp.doc_packed_attn(a, b, c, cu, causal=causal, window_size=window)
        ),
    }
    # synchronised per call (the goal's method), then the host running ahead (GPU time alone)
    variants = [(name, mk, True) for name, mk in makers.items()]
    variants += [(f"{name}-nosync", makers[name], False) for name in ("fa4", "ours")]
    # the variants' order rotates between repeats: a long cell slows the GPU as it runs, which
    # would otherwise favour whichever variant is timed first
    rotated = [v for rep in range(REPEATS) for v in variants[rep % len(variants):] + variants[: rep % len(variants)]]
    for label, mk, sync in rotated:
        try:
            with torch.no_grad():
                f_ms = bench(mk(q, k, v), sync=sync)
            qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
            f = mk(qq, kk, vv)

            def step():
                out = f()
                out = out[0] if isinstance(out, tuple) else out
                torch.autograd.backward(out, dout.view_as(out))

            fb_ms = bench(step, sync=sync)
        except Exception as e:  # report, keep going
            res[label] = {"error": f"{type(e).__name__}: {e}"[:300]}
            continue
        prev = res.get(label, {})
        f_ms, fb_ms = min(f_ms, prev.get("fwd_ms", math.inf)), min(fb_ms, prev.get("fwdbwd_ms", math.inf))
        res[label] = {
            "fwd_ms": f_ms, "fwdbwd_ms": fb_ms,
            "fwd_tflops": fwd_flop / f_ms / 1e9, "fwdbwd_tflops": 3.5 * fwd_flop / fb_ms / 1e9,
        }
    return res


def per_call_us(fn, iters: int = 300, warmup: int = 20) -> float:
    """Host microseconds per call: ``iters`` calls launched back to back, one sync at the end."""
    return timed_ms(fn, warmup=warmup, iters=1, calls=iters, clock="wall") * 1e3


def fa4_host_cost(calls: int = 200) -> dict:
    """Host microseconds per call at S = 1024 (GPU work negligible): a launch loop of
    ``calls`` calls with one sync at the end, raw FA4 vs ours, forward and forward+backward."""
    S, lengths = 1024, [1024]
    q, k, v, dout, cu = random_attention_problem(lengths, S, (32, 8), 128, torch.bfloat16, "cuda", seed=0)
    flat_cu = torch.tensor([0, S], device="cuda", dtype=torch.int32)
    out = {}
    for label in ("fa4", "ours") * REPEATS:
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        if label == "fa4":
            f = _raw_fa4(qq.view(S, 32, 128), kk.view(S, 8, 128), vv.view(S, 8, 128), flat_cu, S, True, (-1, -1))
        else:
            f = lambda: dp.doc_packed_attn(qq, kk, vv, cu, causal=True)  # noqa: E731

        def fwd():
            with torch.no_grad():
                f()

        def fwdbwd():
            o = f()
            o = o[0] if isinstance(o, tuple) else o
            torch.autograd.backward(o, dout.view_as(o))

        for name, fn in (("fwd_us", fwd), ("fwdbwd_us", fwdbwd)):
            us = per_call_us(fn, calls, warmup=10)
            out.setdefault(label, {})[name] = min(us, out.get(label, {}).get(name, math.inf))
    return out


def fa4_table(rows, host) -> str:
    """Per cell and pass: raw FA4, raw FA4 returning lse, ours (ms, synchronised per call), ours
    over each (raw ms / our ms), ours/FA4 with the host running ahead, our TFLOP/s (synced)."""
    lines = []
    for pass_, title in (("fwd", "forward"), ("fwdbwd", "forward+backward")):
        lines += [
            f"\n{title} (ms per call, synchronised after every call)\n",
            "| S | layout | docs | mask | Hq/Hkv | D | ran | FA4 | FA4+lse | ours | ours/FA4 "
            "| ours/FA4+lse | ours/FA4 no sync | ours TFLOP/s |",
            "|" + "---|" * 14,
        ]
        key = f"{pass_}_ms"
        for r in rows:
            v = {lbl: r.get(lbl, {}).get(key, math.nan) for lbl in ("fa4", "fa4-lse", "ours", "fa4-nosync", "ours-nosync")}
            mask = ("causal" if r["causal"] else "full") + ("" if tuple(r["window"]) == (-1, -1) else f" {tuple(r['window'])}")
            cells = [
                f"{r['S'] // 1024}k", r["layout"], str(r["docs"]), mask, f"{r['heads'][0]}/{r['heads'][1]}",
                str(r["D"]), r["ran"], f"{v['fa4']:.3f}", f"{v['fa4-lse']:.3f}", f"{v['ours']:.3f}",
                f"{v['fa4'] / v['ours']:.3f}x", f"{v['fa4-lse'] / v['ours']:.3f}x",
                f"{v['fa4-nosync'] / v['ours-nosync']:.3f}x",
                f"{r.get('ours', {}).get(pass_ + '_tflops', math.nan):.0f}",
            ]
            lines.append("| " + " | ".join(cells) + " |")
    if host:
        lines += [
            "\nhost us per call at S=1024 (launch loop, one sync at the end)\n",
            "| variant | fwd us | f+b us |", "|---|---|---|",
            *(f"| {k} | {v['fwd_us']:.0f} | {v['fwdbwd_us']:.0f} |" for k, v in host.items()),
        ]
    return "\n".join(lines)


def main_fa4(args) -> None:
    import importlib.metadata

    version = importlib.metadata.version("flash-attn-4")
    rows = []
    for cell in fa4_cells([int(x) for x in args.sizes.split(",")]):
        rows.append(run_fa4(cell))
        print(json.dumps(rows[-1]), flush=True)
    host = fa4_host_cost()
    print(json.dumps({"host": host}), flush=True)
    print(f"\ndevice: {torch.cuda.get_device_name()}  torch {torch.__version__}  flash-attn-4 {version}  bf16 B=1")
    print("synchronised after every call; TFLOP/s count visible pairs (fwd x1, f+b x3.5); ratio = raw FA4 ms / ours ms\n")
    print(fa4_table(rows, host))
    if args.json:
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "flash_attn_4": version}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows, "host_us": host}, f, indent=1)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="16384,65536", help="comma-separated row lengths")
    ap.add_argument("--layouts", default=",".join(DEFAULT_LAYOUTS), help=f"comma-separated, of {list(LAYOUTS)}")
    ap.add_argument("--json", default=None, help="write raw results here")
    ap.add_argument("--fa4", action="store_true", help="the FlashAttention-4 grid (see fa4_cells)")
    add_dry_run(ap)
    args = ap.parse_args(argv)
    if args.fa4:
        return main_fa4(args)
    rows = []
    if args.dry_run:
        rows.append(run(256, "one doc", [256], Hq=4, Hkv=2, D=16, dtype=torch.float32, dev="cpu", labels=("ours",)))
        print(json.dumps(rows[-1]), flush=True)
    for S in () if args.dry_run else (int(x) for x in args.sizes.split(",")):
        for name in args.layouts.split(","):
            rows.append(run(S, name, LAYOUTS[name](S)))
            print(json.dumps(rows[-1]), flush=True)
    print(f"\ndevice: {device_name('cpu' if args.dry_run else 'cuda')}  torch {torch.__version__}  bf16 Hq=32 Hkv=8 D=128 B=1")
    print("TFLOP/s (causal FLOPs); ours/best = ours over the faster of varlen and flex\n")
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
