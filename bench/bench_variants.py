"""Cost of each attention variant (issue 18) against plain causal on the same layout, and against
FA4's own variant (raw ``flash_attn.cute.flash_attn_varlen_func``) where FA4 has one.

One packed row of ``S`` tokens (``--layout``: lognormal documents of mean 2k by default),
``H_q / H_kv = 32 / 8``, ``D = 128``, bf16. For each variant: the backend ``auto`` runs it on,
forward and forward+backward median ms (CUDA events, no sync between calls; bench_op.bench),
the ratio to our plain causal call (same layout, same run), and raw FA4's time for the same
variant with ratio raw / ours (1.0 = parity; only where FA4 has the variant: sinks, softcap,
192/128 head dims). Prefix-bidirectional documents run on flex (FA4 has no per-query key
intervals); their plain-causal anchor on flex is printed too, so the prefix's own cost is
separated from the backend change. ``max logits`` is the extra Q K^T pass of return_max_logits.

Usage: ``python -m bench.bench_variants [--sizes 16384,65536] [--layout lognormal|uniform]
[--json out.json]``. ``--dry-run``: 128 tokens on CPU, one timed call each, the variants that run there.
"""

from __future__ import annotations

import argparse
import json

import torch

import doc_packed as dp
from bench._harness import add_dry_run, device_name
from bench.bench_op import bench
from doc_packed import kernels, ops
from doc_packed._doc_layout import get_layout
from doc_packed._variants import prefixes
from doc_packed.data import lognormal_lengths

HQ, HKV, D = 32, 8, 128
SOFTCAP = 30.0  # Gemma 2's attention softcap


def _lengths(S: int, layout: str) -> list[int]:
    if layout == "uniform":
        return [2048] * (S // 2048)
    return lognormal_lengths(S, 2048, seed=0)


def _problem(S, lengths, d, dv, seed=0, device="cuda"):
    g = torch.Generator(device=device).manual_seed(seed)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    mk = lambda h, dim: torch.randn(1, S, h, dim, device=device, dtype=dtype, generator=g)  # noqa: E731
    q, k, v = mk(HQ, d), mk(HKV, d), mk(HKV, dv)
    dout = mk(HQ, dv)
    cu = dp.cu_seqlens_from_lengths([lengths], S, max_docs=len(lengths) + 8).to(device)
    prefix = torch.tensor([[n // 4 for n in lengths] + [0] * 8], dtype=torch.int32, device=device)
    return q, k, v, dout, cu, prefix


def _timed(call, q, k, v, dout, extra=(), iters=20):
    """``(fwd ms, fwd+bwd ms)`` of ``call(q, k, v, *extra)`` returning ``out``."""
    warmup = min(5, iters)
    with torch.no_grad():
        fwd = bench(lambda: call(q, k, v, *extra), warmup, iters)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    extra = [t.detach().requires_grad_() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in extra]

    def step():
        out = call(*leaves, *extra)
        torch.autograd.backward(out, dout.view_as(out))

    return fwd, bench(step, warmup, iters)


def _fa4():
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except Exception as err:  # not installed, or the CuTe runtime failed to load
        print(f"raw FA4 unavailable: {type(err).__name__}: {err}")
        return None
    return flash_attn_varlen_func


def run(S: int, layout: str, device: str = "cuda", iters: int = 20) -> list[dict]:
    lengths = _lengths(S, layout)
    flat_cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device)
    fa4 = _fa4() if device == "cuda" else None
    rows = []
    variants = [
        # name, head dims, doc_packed_attn kwargs, raw FA4 kwargs (None: FA4 has no such variant)
        ("plain causal", (D, D), {}, {}),
        ("sinks", (D, D), {"sinks": True}, {"learnable_sink": True}),
        ("softcap", (D, D), {"softcap": SOFTCAP}, {"softcap": SOFTCAP}),
        ("sinks+softcap", (D, D), {"sinks": True, "softcap": SOFTCAP}, {"learnable_sink": True, "softcap": SOFTCAP}),
        ("D 192 / Dv 128", (192, 128), {}, {}),
        ("plain causal (flex)", (D, D), {"backend": "flex"}, None),
        ("prefix 25% (flex)", (D, D), {"prefix": True}, None),
        ("max logits", (D, D), {"return_max_logits": True}, None),
    ]
    if device != "cuda":  # flex has no CPU backward
        variants = [x for x in variants if "flex" not in x[0]]
    anchor = None
    for name, (d, dv), kw, fa4_kw in variants:
        q, k, v, dout, cu, prefix = _problem(S, lengths, d, dv, device=device)
        sinks = torch.randn(HQ, device=device) if kw.get("sinks") else None
        args = {
            "softcap": kw.get("softcap"),
            "prefix_lens": prefix if kw.get("prefix") else None,
            "backend": kw.get("backend", "auto"),
        }
        want_max = kw.get("return_max_logits", False)

        def ours(q, k, v, s=None, args=args, want_max=want_max):
            r = dp.doc_packed_attn(q, k, v, cu, sinks=s, return_max_logits=want_max, **{"causal": True, **args})
            return r[0] if want_max else r

        spec = ops.local_spec(get_layout(cu, S), True, -1, 0, prefixes(cu, prefix) if kw.get("prefix") else None)
        backend = kernels.choose(
            args["backend"], spec, q.view(S, HQ, d), HKV, kernels.Variant.of(q, v, args["softcap"] or 0.0)
        )
        fwd, fb = _timed(ours, q, k, v, dout, (sinks,) if sinks is not None else (), iters)
        if want_max:  # the extra pass alone
            with torch.no_grad():
                fwd_only = bench(lambda: dp.doc_packed_attn(q, k, v, cu, causal=True), min(5, iters), iters)
            fwd = fwd - fwd_only
            fb = float("nan")
        row = {"S": S, "layout": layout, "variant": name, "backend": backend, "fwd_ms": fwd, "fwd_bwd_ms": fb}
        if anchor is None:
            anchor = row
        row["fwd_vs_plain"] = fwd / anchor["fwd_ms"]
        row["fwd_bwd_vs_plain"] = fb / anchor["fwd_bwd_ms"]
        if fa4 is not None and fa4_kw is not None:
            raw_kw = dict(fa4_kw)
            if raw_kw.pop("learnable_sink", False):
                raw_kw["learnable_sink"] = sinks

            def raw(q, k, v, s=None, raw_kw=raw_kw, d=d, dv=dv):
                kw2 = dict(raw_kw)
                if s is not None:
                    kw2["learnable_sink"] = s
                out = fa4(
                    q.view(S, HQ, d),
                    k.view(S, HKV, d),
                    v.view(S, HKV, dv),
                    cu_seqlens_q=flat_cu,
                    cu_seqlens_k=flat_cu,
                    max_seqlen_q=max(lengths),
                    max_seqlen_k=max(lengths),
                    causal=True,
                    softmax_scale=d**-0.5,
                    **kw2,
                )
                return out[0] if isinstance(out, tuple) else out

            try:
                rf, rfb = _timed(raw, q, k, v, dout, (sinks,) if sinks is not None else ())
                row.update(
                    fa4_fwd_ms=rf, fa4_fwd_bwd_ms=rfb, fwd_fa4_over_ours=rf / fwd, fwd_bwd_fa4_over_ours=rfb / fb
                )
            except Exception as err:  # FA4 cannot run this variant here: say so
                row["fa4_error"] = f"{type(err).__name__}: {str(err)[:120]}"
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="16384,65536")
    p.add_argument("--layout", default="lognormal", choices=("lognormal", "uniform"))
    p.add_argument("--json")
    add_dry_run(p)
    a = p.parse_args(argv)
    device = "cpu" if a.dry_run else "cuda"
    print(device_name(device), torch.__version__)
    rows = []
    for S in [128] if a.dry_run else (int(x) for x in a.sizes.split(",")):
        rows += run(S, a.layout, device, 1 if a.dry_run else 20)
    head = "| S | variant | backend | fwd ms | fwd+bwd ms | fwd / plain | f+b / plain | FA4 fwd ms | FA4 f+b ms | FA4/ours fwd | FA4/ours f+b |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for r in rows:
        fa = (
            f"{r['fa4_fwd_ms']:.3f} | {r['fa4_fwd_bwd_ms']:.3f} | {r['fwd_fa4_over_ours']:.2f} | {r['fwd_bwd_fa4_over_ours']:.2f}"
            if "fa4_fwd_ms" in r
            else (r.get("fa4_error", "-") + " | - | - | -")
        )
        print(
            f"| {r['S']} | {r['variant']} | {r['backend']} | {r['fwd_ms']:.3f} | {r['fwd_bwd_ms']:.3f} | "
            f"{r['fwd_vs_plain']:.2f} | {r['fwd_bwd_vs_plain']:.2f} | {fa} |"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
