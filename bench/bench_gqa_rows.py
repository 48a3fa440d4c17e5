"""FA4 with grouped-query heads folded into rows, against FA4 as it is, on non-causal calls.

Folding: with ``G = H_q / H_kv``, head ``h * G + g`` of query row ``t`` becomes head ``h`` of row
``t * G + g``; the problem is then multi-head with ``G`` times the query rows, which is exact when
no query's keys depend on its row (no causal mask, window or prefix: a stage B call on keys that
all precede its queries). FA4 4.0.0b36's backward runs one program per 128 keys and *query*
head and sums grouped dK/dV in float32 scratch (zeroed, accumulated, converted); folded, one
program per 128 keys and key/value head writes dK/dV directly. Its forward packs GQA itself.

Stage B calls of context parallelism (every query sees every key of its segment) in the shapes
the 128k CP 8 schedules make, plus a few controls. Per shape: FA4's backward as it is (the
anchor, measured in the same run) and on folded rows (the folding copies included), the same for the forward, the ratio, and the largest difference of
each gradient between the two relative to the float64 reference's largest value (and the error
of each against that reference, where the shape is small enough to compute it).

    python -m bench.bench_gqa_rows [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from doc_packed.kernels import VarlenSpec, fa4
from bench._harness import timed_ms

HQ, HKV, D = 32, 8, 128


def folded_spec(spec: VarlenSpec, group: int) -> VarlenSpec:
    """``spec`` with each segment's query rows multiplied by ``group`` (cached on ``spec``)."""
    return spec.cached(
        ("gqa-folded", group), lambda: VarlenSpec([c * group for c in spec.cu_q], spec.cu_k, False, -1, -1)
    )


def fold(x: torch.Tensor, group: int) -> torch.Tensor:
    """``[T, H_kv * group, ...]`` -> ``[T * group, H_kv, ...]`` (row ``t * group + g``, head
    ``h`` holds head ``h * group + g`` of row ``t``); one copy."""
    T, H = x.shape[:2]
    rest = x.shape[2:]
    return x.view(T, H // group, group, *rest).transpose(1, 2).reshape(T * group, H // group, *rest)


def unfold(x: torch.Tensor, group: int) -> torch.Tensor:
    """The inverse of :func:`fold`; one copy."""
    TG, Hkv = x.shape[:2]
    rest = x.shape[2:]
    return x.view(TG // group, group, Hkv, *rest).transpose(1, 2).reshape(TG // group, Hkv * group, *rest)


def fold_lse(lse: torch.Tensor, group: int) -> torch.Tensor:
    """``lse [H_q, T]`` -> ``[H_kv, T * group]``, matching :func:`fold` of its rows."""
    Hq, T = lse.shape
    return lse.view(Hq // group, group, T).transpose(1, 2).reshape(Hq // group, T * group)


def unfold_lse(lse: torch.Tensor, group: int) -> torch.Tensor:
    """The inverse of :func:`fold_lse`."""
    Hkv, TG = lse.shape
    return lse.view(Hkv, TG // group, group).transpose(1, 2).reshape(Hkv * group, TG // group)


G = HQ // HKV
# (label, [(queries, keys) per segment])
SHAPES = [
    ("moved run, long doc", [(600, 13000)]),
    ("moved run, mid doc", [(1200, 7000)]),
    ("three stage-B pieces", [(300, 6800), (500, 10300), (900, 2500)]),
    ("local q x remote keys", [(4000, 3000)]),
    ("tiny q, many keys", [(64, 8000), (100, 5000)]),
    ("many q, few keys", [(8000, 500)]),
    ("many q, fewer keys", [(12000, 128)]),
    ("square 8k", [(8192, 8192)]),
    ("32 small docs", [(256, 1024)] * 32),
    # the keys before a causal moved run (its split's non-causal part), and local q x remote keys
    ("split 1101", [(1101, 13115)]),
    ("split 1553", [(1553, 7950)]),
    ("split 2164", [(2164, 12052)]),
    ("split 413", [(413, 7963)]),
    ("local 944", [(944, 8085)]),
    ("local 1990", [(1990, 9033)]),
    ("local 2706", [(2706, 11213)]),
]
# causal moved-run calls of the 128k CP 8/4 schedules (queries, keys): the run's own keys last
SPLITS = [
    (1101, 14216),
    (861, 10364),
    (1179, 13115),
    (1553, 9503),
    (1295, 8085),
    (659, 10312),
    (413, 8376),
    (2164, 14216),
    (1796, 11213),
    (420, 7548),
    (1568, 9653),
    (970, 6466),
]
REF_LIMIT = 4e8  # float64 reference only below this many pairs x heads


def _reference(segs, q, k, v, dout, scale):
    """float64 dense attention per segment: (out, dq, dk, dv)."""
    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    outs, qo, ko = [], 0, 0
    for nq, nk in segs:
        qs = q64[qo : qo + nq].transpose(0, 1)  # [H, nq, D]
        ks = k64[ko : ko + nk].repeat_interleave(G, 1).transpose(0, 1)
        vs = v64[ko : ko + nk].repeat_interleave(G, 1).transpose(0, 1)
        p = torch.softmax((qs @ ks.transpose(1, 2)) * scale, -1)
        outs.append((p @ vs).transpose(0, 1))
        qo, ko = qo + nq, ko + nk
    out = torch.cat(outs)
    out.backward(dout.double())
    return out, q64.grad, k64.grad, v64.grad


def run(reps: int) -> list[dict]:
    torch.manual_seed(0)
    dev = torch.device("cuda")
    scale = 1 / math.sqrt(D)
    rows = []
    for label, segs in SHAPES:
        cu_q, cu_k = [0], [0]
        for nq, nk in segs:
            cu_q.append(cu_q[-1] + nq)
            cu_k.append(cu_k[-1] + nk)
        spec = VarlenSpec(cu_q, cu_k, False, -1, -1)
        fspec = folded_spec(spec, G)
        q = torch.randn(cu_q[-1], HQ, D, device=dev, dtype=torch.bfloat16)
        k = torch.randn(cu_k[-1], HKV, D, device=dev, dtype=torch.bfloat16)
        v = torch.randn(cu_k[-1], HKV, D, device=dev, dtype=torch.bfloat16)
        dout = torch.randn_like(q)
        out, lse = fa4.forward(spec, q, k, v, scale)

        def fwd_plain():
            return fa4.forward(spec, q, k, v, scale)

        def fwd_folded():
            o, l = fa4.forward(fspec, fold(q, G), k, v, scale)
            return unfold(o, G), unfold_lse(l, G)

        def bwd_plain():
            return fa4.backward(spec, dout, q, k, v, out, lse, scale)

        def bwd_folded():
            dq, dk, dv = fa4.backward(fspec, fold(dout, G), fold(q, G), k, v, fold(out, G), fold_lse(lse, G), scale)
            return unfold(dq, G), dk, dv

        row = {"label": label, "segments": segs, "q_rows": cu_q[-1], "k_rows": cu_k[-1]}
        row["fwd_plain_ms"] = timed_ms(fwd_plain, iters=reps)
        row["fwd_folded_ms"] = timed_ms(fwd_folded, iters=reps)
        row["bwd_plain_ms"] = timed_ms(bwd_plain, iters=reps)
        row["bwd_folded_ms"] = timed_ms(bwd_folded, iters=reps)
        plain, folded = bwd_plain(), bwd_folded()
        fo, fl = fwd_folded()
        pairs = sum(a * b for a, b in segs) * HQ
        ref = _reference(segs, q, k, v, dout, scale) if pairs <= REF_LIMIT else None
        names = ("dq", "dk", "dv")
        for name, a, b in zip(("out", *names), (out, *plain), (fo, *folded)):
            i = ("out", *names).index(name)
            scale_ = (ref[i] if ref is not None else a.float()).abs().max().item()
            row[f"{name}_diff"] = (a.float() - b.float()).abs().max().item() / scale_
            if ref is not None:
                row[f"{name}_err_plain"] = (a.double() - ref[i]).abs().max().item() / scale_
                row[f"{name}_err_folded"] = (b.double() - ref[i]).abs().max().item() / scale_
        row["lse_diff"] = (lse - fl).abs().max().item()
        rows.append(row)
        del ref
    return rows


def run_splits(reps: int) -> list[dict]:
    """A causal call of ``nq`` queries whose keys end at its last query, forward + backward as
    it is, against two calls: the keys before the run (non-causal, backward folded when
    ``--fold``) and the run's own causal square, merged by lse (forward) and dq added (backward)."""
    from doc_packed.cp.lse_merge import merge_

    torch.manual_seed(1)
    dev = torch.device("cuda")
    scale = 1 / math.sqrt(D)
    rows = []
    for nq, nk in SPLITS:
        whole = VarlenSpec([0, nq], [0, nk], True, -1, 0)
        pre = VarlenSpec([0, nq], [0, nk - nq], False, -1, -1)
        diag = VarlenSpec([0, nq], [0, nq], True, -1, 0)
        fpre = folded_spec(pre, G)
        q = torch.randn(nq, HQ, D, device=dev, dtype=torch.bfloat16)
        k = torch.randn(nk, HKV, D, device=dev, dtype=torch.bfloat16)
        v = torch.randn(nk, HKV, D, device=dev, dtype=torch.bfloat16)
        dout = torch.randn_like(q)
        kp, vp, kd, vd = k[: nk - nq], v[: nk - nq], k[nk - nq :], v[nk - nq :]

        def whole_fb():
            o, l = fa4.forward(whole, q, k, v, scale)
            return fa4.backward(whole, dout, q, k, v, o, l, scale)

        def split_fb(fold_bwd: bool):
            o, l = fa4.forward(pre, q, kp, vp, scale)
            od, ld = fa4.forward(diag, q, kd, vd, scale)
            merge_(o, l, od, ld)
            if fold_bwd:
                g = fa4.backward(fpre, fold(dout, G), fold(q, G), kp, vp, fold(o, G), fold_lse(l, G), scale)
                dq = unfold(g[0], G)
            else:
                g = fa4.backward(pre, dout, q, kp, vp, o, l, scale)
                dq = g[0]
            gd = fa4.backward(diag, dout, q, kd, vd, o, l, scale)
            dq = dq.float().add_(gd[0]).to(q.dtype)
            return dq, torch.cat([g[1], gd[1]]), torch.cat([g[2], gd[2]])

        row = {"nq": nq, "nk": nk, "whole_ms": timed_ms(whole_fb, iters=reps)}
        row["split_ms"] = timed_ms(lambda: split_fb(False), iters=reps)
        row["split_fold_ms"] = timed_ms(lambda: split_fb(True), iters=reps)
        a, b = whole_fb(), split_fb(True)
        row["diff"] = max(((x.float() - y.float()).abs().max() / x.float().abs().max()).item() for x, y in zip(a, b))
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = run(args.reps)
    splits = run_splits(args.reps)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, Hq {HQ} / Hkv {HKV} / D {D}, non-causal")
    hdr = "| shape | q rows | k rows | fwd ms as is | folded | ratio | bwd ms as is | folded | ratio | rel. diff dq/dk/dv |"
    print(hdr)
    print("|---" * (hdr.count("|") - 1) + "|")
    for r in rows:
        print(
            f"| {r['label']} | {r['q_rows']} | {r['k_rows']} | {r['fwd_plain_ms']:.3f} | {r['fwd_folded_ms']:.3f} | "
            f"{r['fwd_plain_ms'] / r['fwd_folded_ms']:.2f}x | {r['bwd_plain_ms']:.3f} | {r['bwd_folded_ms']:.3f} | "
            f"{r['bwd_plain_ms'] / r['bwd_folded_ms']:.2f}x | "
            f"{r['dq_diff']:.1e}/{r['dk_diff']:.1e}/{r['dv_diff']:.1e} |"
        )
    for r in rows:
        if "dq_err_plain" in r:
            errs = " ".join(
                f"{n} {r[f'{n}_err_plain']:.1e}->{r[f'{n}_err_folded']:.1e}" for n in ("out", "dq", "dk", "dv")
            )
            print(f"vs float64 ({r['label']}): as is -> folded: {errs}")
    print()
    print("causal moved-run calls, forward + backward: one call as is, or split (keys before the run + its diagonal)")
    print("| queries | keys | as is ms | split | ratio | split, backward folded | ratio | rel. diff |")
    print("|---|---|---|---|---|---|---|---|")
    for r in splits:
        print(
            f"| {r['nq']} | {r['nk']} | {r['whole_ms']:.3f} | {r['split_ms']:.3f} | {r['whole_ms'] / r['split_ms']:.2f}x | "
            f"{r['split_fold_ms']:.3f} | {r['whole_ms'] / r['split_fold_ms']:.2f}x | {r['diff']:.1e} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows, "splits": splits}
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
