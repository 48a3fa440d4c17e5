"""Context-parallel attention on 2+ GPUs against one GPU and an all-gather-K/V baseline.

Spawns one process per GPU (NCCL). For each layout and sequence length it times attention
forward+backward (and forward alone) of:
- ``1 GPU``: doc_packed_attn on the whole rows, on one GPU;
- ``ours``: doc_packed_attn with ``cp_group`` (plan + AllToAll-V exchange), each rank holding
  its torch.chunk of the sequence;
- ``all-gather``: the common baseline (torch CP / torchtitan style): head-tail (zigzag)
  sharding of each row into 2c chunks for balance, K and V all-gathered before the local flash
  call, dK/dV reduce-scattered after; written in this script.
It reports per-rank bytes received per layer (forward), speedups over one GPU and per-GPU
efficiency (one GPU / (c x ours)), the plan's balance, bf16 parity of our CP output and
gradients against the one-GPU op, which kernel the one-GPU op ran, and (``--profile``) a
torch.profiler split of each rank's forward+backward: attention kernels, copies, communication,
other, and how much of the communication ran while no compute kernel did (exposed).

Usage: ``python -m bench.bench_cp [--gpus 2] [--sizes 65536,131072,262144] [--json f]
[--packing greedy|cp|both] [--means 2048,512] [--one-doc-max 262144] [--profile]`` (``cp``: the
same lognormal documents in CP-aware order, ``doc_packed.data.pack_order``; the layout is then named
"lognormal 2k cp-packed"). The all-gather baseline runs on the kernel ``backend="auto"`` picks
for its (non-local) calls: FA4 on Hopper where installed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import doc_packed as dp
from doc_packed_examples.model import random_attention_problem
from doc_packed.data import lognormal_lengths
from doc_packed import kernels
from doc_packed.env import backend_for
from doc_packed.kernels import VarlenSpec

HQ, HKV, D = 32, 8, 128
DTYPE = torch.bfloat16
BACKEND = "auto"  # --dry-run switches to the exact CPU kernel, gloo and float32


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_ms(fn, warmup: int, iters: int) -> float:
    """Mean wall milliseconds per call, all ranks in step (barrier + sync around)."""
    for _ in range(warmup):
        fn()
    _sync()
    if dist.is_initialized():
        dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync()
    if dist.is_initialized():
        dist.barrier()
    return (time.perf_counter() - t0) * 1e3 / iters


# ----------------------------------------------------------------------- all-gather baseline


def zigzag_ranges(S: int, c: int, r: int) -> list[tuple[int, int]]:
    n = S // (2 * c)
    return [(r * n, (r + 1) * n), ((2 * c - 1 - r) * n, (2 * c - r) * n)]


def allgather_spec(lengths: list[int], S: int, c: int, r: int) -> tuple[VarlenSpec, torch.Tensor]:
    """Segments of this rank's zigzag chunks against their causal doc prefixes in the full row."""
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    cu_q, cu_k, kidx = [0], [0], []
    for a, e in zigzag_ranges(S, c, r):
        for ds, de in zip(bounds[:-1], bounds[1:]):
            s, t = max(a, ds), min(e, de)
            if s < t:
                cu_q.append(cu_q[-1] + t - s)
                cu_k.append(cu_k[-1] + t - ds)
                kidx.append(torch.arange(ds, t))
    return VarlenSpec(cu_q, cu_k, True, -1, 0), torch.cat(kidx)


class AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, spec, kidx, order):
        c = dist.get_world_size()
        kv = torch.cat([k, v], -1)
        full = torch.empty((c * kv.shape[0], *kv.shape[1:]), dtype=kv.dtype, device=kv.device)
        dist.all_gather_into_tensor(full, kv)
        full = full[order]  # zigzag chunks back into sequence order
        kb, vb = full[kidx, :, :D], full[kidx, :, D:]
        out, lse = kernels.forward(spec, q, kb.contiguous(), vb.contiguous(), D**-0.5, BACKEND)
        ctx.save_for_backward(q, k, v, out, lse, kidx, order)
        ctx.spec = spec
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, kidx, order = ctx.saved_tensors
        c = dist.get_world_size()
        kv = torch.cat([k, v], -1)
        full = torch.empty((c * kv.shape[0], *kv.shape[1:]), dtype=kv.dtype, device=kv.device)
        dist.all_gather_into_tensor(full, kv)  # fetched again, as the CP op does
        full = full[order]
        kb, vb = full[kidx, :, :D].contiguous(), full[kidx, :, D:].contiguous()
        dq, dk, dv = kernels.backward(ctx.spec, dout.contiguous(), q, kb, vb, out, lse, D**-0.5, BACKEND)
        dfull = torch.zeros(full.shape, dtype=torch.float32, device=q.device)
        dfull.index_add_(0, kidx, torch.cat([dk, dv], -1).float())
        inv = torch.empty_like(order)
        inv[order] = torch.arange(order.numel(), device=order.device)
        dfull = dfull[inv].to(q.dtype)  # back to the gathered (rank-major) order
        mine = torch.empty_like(kv)
        dist.reduce_scatter_tensor(mine, dfull)
        return dq, mine[..., :D].contiguous(), mine[..., D:].contiguous(), None, None, None


def _recv_bytes(plan, r: int, kv_bytes: int) -> int:
    """Bytes rank ``r`` receives in one forward: K/V rows, queries moved to it, and the
    outputs (+ lse) of its own queries that other ranks computed."""
    start, end = plan.owners[r]
    computed_here = sum(max(0, min(e, end) - max(s, start)) for _, s, e in plan.q_ranges[r])
    returned = plan.batch * (end - start) - computed_here
    q_row = HQ * D * 2
    return plan.kv_recv_tokens[r] * kv_bytes + plan.q_moved_tokens[r] * q_row + returned * (q_row + HQ * 4)


# ----------------------------------------------------------------------------- worker


def layouts(
    S: int, world: int, packing: str, means: list[int], one_doc_max: int, draw: int = 0
) -> list[tuple[str, list[int]]]:
    """(name, segment lengths of the row) to time: one document (up to ``one_doc_max``), then
    lognormal documents of each mean in ``means``. ``packing``: ``greedy`` keeps the drawn
    order (first-fit of one row), ``cp`` reorders the same documents with
    ``doc_packed.data.pack_order(..., cp_size=world)``, ``both`` times each. ``draw``: another draw
    of the same distributions (a new layout; one document stays one document)."""
    out = [("one doc", [S])] if S <= one_doc_max else []
    for mean in means:
        drawn = lognormal_lengths(S, mean, seed=S + 7919 * draw)
        name = f"lognormal {mean // 1024}k" if mean % 1024 == 0 else f"lognormal {mean}"
        if packing in ("greedy", "both"):
            out.append((name, drawn))
        if packing in ("cp", "both"):
            order = dp.data.pack_order(drawn, S, cp_size=world)
            assert len(order.lengths) == 1, "one row of documents packs into one row"
            out.append((f"{name} cp-packed", order.lengths[0]))
    return out


_ATTN = re.compile(r"flash|fmha|attn|attention|cutlass|Sm90|Sm100", re.I)
_COMM = re.compile(r"nccl", re.I)
_COPY = re.compile(r"copy|cat|index|gather|scatter", re.I)


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _length(spans: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in spans)


def _minus(spans: list[tuple[float, float]], cover: list[tuple[float, float]]) -> float:
    """Length of ``spans`` (a union) not covered by ``cover`` (a union)."""
    left, j = 0.0, 0
    for a, b in spans:
        covered = 0.0
        while j < len(cover) and cover[j][1] <= a:
            j += 1
        k = j
        while k < len(cover) and cover[k][0] < b:
            covered += min(b, cover[k][1]) - max(a, cover[k][0])
            k += 1
        left += (b - a) - covered
    return left


def profile_split(fn, iters: int = 3) -> dict:
    """torch.profiler over ``iters`` calls of ``fn``: CUDA kernel ms per call by kind (attention,
    copies, communication, other), the GPU's busy span, and the communication that ran while no
    compute kernel did (exposed). NCCL kernels include the time they wait for peers."""
    from torch.profiler import ProfilerActivity, profile

    on = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU dry run profiles host ops
    _sync()
    with profile(activities=[ProfilerActivity.CUDA if on == "cuda" else ProfilerActivity.CPU]) as prof:
        for _ in range(iters):
            fn()
        _sync()
    kinds: dict[str, list[tuple[float, float]]] = {"attention": [], "copy": [], "comm": [], "other": []}
    for e in prof.events():
        if on not in str(getattr(e, "device_type", "")).lower() or e.time_range.elapsed_us() <= 0:
            continue
        span = (float(e.time_range.start), float(e.time_range.end))
        kind = "comm" if _COMM.search(e.name) else "attention" if _ATTN.search(e.name) else "copy" if _COPY.search(e.name) else "other"
        kinds[kind].append(span)
    out = {f"{k}_ms": round(sum(b - a for a, b in v) / 1e3 / iters, 3) for k, v in kinds.items()}
    compute = _union(kinds["attention"] + kinds["copy"] + kinds["other"])
    comm = _union(kinds["comm"])
    every = _union([s for v in kinds.values() for s in v])
    out["busy_ms"] = round(_length(every) / 1e3 / iters, 3)
    out["exposed_comm_ms"] = round(_minus(comm, compute) / 1e3 / iters, 3)
    return out


def worker(
    rank: int,
    world: int,
    port: int,
    sizes: list[int],
    out_path: str | None,
    quick: bool,
    dry: bool,
    packing: str = "greedy",
    means: tuple[int, ...] = (2048,),
    one_doc_max: int = 1 << 62,
    profiling: bool = False,
):
    global BACKEND, DTYPE, HQ, HKV, D
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if dry:
        BACKEND, DTYPE, HQ, HKV, D = "math", torch.float32, 4, 2, 16
        dev = torch.device("cpu")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    else:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        dev = torch.device("cuda", rank)
    group = dist.group.WORLD
    rows = []
    for S in sizes:
        for name, lengths in layouts(S, world, packing, list(means), one_doc_max):
            big = S >= 131072 and name == "one doc"
            warm, iters = (1, 2) if big or quick else (2, 5)
            q, k, v, dout, cu = random_attention_problem(lengths, S, (HQ, HKV), D, DTYPE, dev, seed=1)
            chunk = S // world
            sl = slice(rank * chunk, (rank + 1) * chunk)

            def one_gpu(grad=True):
                if not grad:
                    with torch.no_grad():
                        return dp.doc_packed_attn(q, k, v, cu, causal=True)
                qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
                o = dp.doc_packed_attn(qq, kk, vv, cu, causal=True)
                o.backward(dout)
                return o, qq.grad, kk.grad, vv.grad

            def ours(grad=True):
                lq, lk, lv = (t[:, sl].detach().requires_grad_(grad) for t in (q, k, v))
                if not grad:
                    with torch.no_grad():
                        return dp.doc_packed_attn(lq, lk, lv, cu, cp_group=group, causal=True)
                o = dp.doc_packed_attn(lq, lk, lv, cu, cp_group=group, causal=True)
                o.backward(dout[:, sl])
                return o, lq.grad, lk.grad, lv.grad

            spec, kidx = allgather_spec(lengths, S, world, rank)
            kidx = kidx.to(dev)
            zz = zigzag_ranges(S, world, rank)
            n = S // (2 * world)
            # gathered layout is rank-major [r: chunk r, chunk 2c-1-r]; map sequence pos -> row
            pos_of = torch.empty(S, dtype=torch.long)
            for r in range(world):
                for j, (a, e) in enumerate(zigzag_ranges(S, world, r)):
                    pos_of[a:e] = torch.arange(e - a) + r * 2 * n + j * n
            order = pos_of.to(dev)
            zq = torch.cat([q[0, a:e] for a, e in zz])
            zk = torch.cat([k[0, a:e] for a, e in zz])
            zv = torch.cat([v[0, a:e] for a, e in zz])
            zdout = torch.cat([dout[0, a:e] for a, e in zz])

            def allgather(grad=True):
                aq, ak, av = (t.detach().requires_grad_(grad) for t in (zq, zk, zv))
                if not grad:
                    with torch.no_grad():
                        return AllGatherAttention.apply(aq, ak, av, spec, kidx, order)
                o = AllGatherAttention.apply(aq, ak, av, spec, kidx, order)
                o.backward(zdout)
                return o

            res = {"S": S, "layout": name, "docs": len(lengths), "gpus": world, "packing": "cp" if "cp-packed" in name else "greedy"}
            # every rank times the whole problem on its own GPU (they run side by side)
            res["one_gpu"] = {"fwd_ms": time_ms(lambda: one_gpu(False), warm, iters), "fwdbwd_ms": time_ms(lambda: one_gpu(True), warm, iters)}
            res["one_gpu"]["kernel"] = backend_for(q, k, cu)
            res["ours"] = {"fwd_ms": time_ms(lambda: ours(False), warm, iters), "fwdbwd_ms": time_ms(lambda: ours(True), warm, iters)}
            # what training pays: a new layout every call, prepared a call ahead (as a data loader
            # would: doc_packed.cp.prepare) or planned in the call; the one-GPU op gets new
            # layouts too (its own per-layout work)
            draws = iter(range(1, 1 << 30))
            index = [i for i, (nm, _) in enumerate(layouts(S, world, packing, list(means), one_doc_max)) if nm == name][0]

            def new_layout(cp: bool, prepared: bool):
                # the layouts are drawn before timing (the data side's work, not ours)
                pool = iter([
                    dp.cu_seqlens_from_lengths(
                        [layouts(S, world, packing, list(means), one_doc_max, draw=next(draws))[index][1]], S, max_docs=S // 8
                    )
                    for _ in range(warm + iters + 2)
                ])

                def host_cu():
                    return next(pool)

                def ready(c):
                    if not prepared:
                        return c.to(dev)
                    return dp.cp.prepare(c, group if cp else None, num_heads=(HQ, HKV) if cp else None, device=dev)

                state = {"next": ready(host_cu())}

                def call():
                    c = state["next"]
                    if cp:
                        lq, lk, lv = (t[:, sl].detach().requires_grad_() for t in (q, k, v))
                        o = dp.doc_packed_attn(lq, lk, lv, c, causal=True, cp_group=group)
                        o.backward(dout[:, sl])
                    else:
                        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
                        dp.doc_packed_attn(qq, kk, vv, c, causal=True).backward(dout)
                    state["next"] = ready(host_cu())  # the next layout's host work, this one queued

                return call

            counts = dp.cp.runtime_counts()
            res["one_gpu"]["new_fwdbwd_ms"] = time_ms(new_layout(False, True), warm, iters)
            res["ours"]["new_fwdbwd_ms"] = time_ms(new_layout(True, True), warm, iters)
            res["ours"]["new_unprepared_fwdbwd_ms"] = time_ms(new_layout(True, False), warm, iters)
            after = dp.cp.runtime_counts()
            res["ours"]["new_host"] = {k: after[k] - counts[k] for k in after}
            res["allgather"] = {"fwd_ms": time_ms(lambda: allgather(False), warm, iters), "fwdbwd_ms": time_ms(lambda: allgather(True), warm, iters)}
            # keep-vs-refetch: what the backward's second exchange costs, and what keeping the
            # forward's buffers instead would hold per layer (K, V, moved q and out, lse)
            from doc_packed.cp import attention as cpa
            from doc_packed.cp import comm

            lq, lk, lv = (t[:, sl].contiguous() for t in (q, k, v))
            sch = cpa.get_schedule(lq, lk, cu, S, True, -1, 0, group.group_name)
            lo = dp.doc_packed_attn(lq, lk, lv, cu, cp_group=group, causal=True)

            def refetch():
                """The backward's second exchange: K|V, and moved rows' q|out (what keeping the
                forward's received buffers would hold instead)."""
                fields = cpa._kv_fields(sch, cpa._flat(lk), cpa._flat(lv)) if sch.kv_traffic else []
                if sch.q_traffic:
                    fields += cpa._moved(sch, cpa._flat(lq), cpa._flat(lo))
                got = comm.exchange(fields, group.group_name) if fields else []
                return got

            if profiling:
                split = profile_split(lambda: ours(True))
                every: list = [None] * world
                dist.all_gather_object(every, split)
                res["ours"]["profile"] = every
            res["ours"]["refetch_ms"] = time_ms(refetch, warm, iters)
            res["ours"]["keep_MB"] = sum(x.numel() * x.element_size() for x in refetch()) / 2**20

            plan = dp.plan_context_parallel(cu.cpu(), world, num_heads=(HQ, HKV))
            kv_bytes = 2 * HKV * D * 2
            res["ours"]["recv_MB_fwd"] = max(_recv_bytes(plan, r, kv_bytes) for r in range(world)) / 2**20
            res["allgather"]["recv_MB_fwd"] = (S - S // world) * kv_bytes / 2**20
            res["plan"] = {"imbalance": plan.imbalance, "kv_recv_tokens": list(plan.kv_recv_tokens), "q_moved_tokens": list(plan.q_moved_tokens)}
            # parity: our CP output and grads vs the one-GPU op (bf16 both)
            ref = one_gpu(True)
            got = ours(True)
            rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
            res["parity_rel"] = {
                "out": rel(got[0], ref[0][:, sl]),
                "dq": rel(got[1], ref[1][:, sl]),
                "dk": rel(got[2], ref[2][:, sl]),
                "dv": rel(got[3], ref[3][:, sl]),
            }
            # the all-gather baseline must agree with the one-GPU op too
            ag = allgather(True)
            full_out = torch.empty(S, HQ, D, dtype=ag.dtype, device=dev)
            for (a, e), piece in zip(zz, ag.detach().split(n)):
                full_out[a:e] = piece
            res["parity_rel"]["allgather_out"] = max(
                rel(full_out[a:e], ref[0][0, a:e]) for a, e in zz
            )
            del ref, got, ag
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            if rank == 0:
                print(json.dumps(res), flush=True)
                rows.append(res)
    if rank == 0:
        device = "CPU dry run" if dry else f"{world} x {torch.cuda.get_device_name()}"
        try:
            from importlib.metadata import version

            fa4 = f"  flash-attn-4 {version('flash-attn-4')}"
        except Exception:
            fa4 = "  flash-attn-4 absent"
        print(f"\ndevice: {device}  torch {torch.__version__}{fa4}  {DTYPE} Hq={HQ} Hkv={HKV} D={D} B=1")
        print("A new layout every call (what training pays; prepared a call ahead, or planned in the call) and one layout reused:")
        print("| S | layout | 1 GPU new f+b ms | ours new f+b ms | per GPU new | ours new, planned in call ms | per GPU | per GPU reused |")
        print("|" + "---|" * 8)
        for r in rows:
            o, s1, w = r["ours"], r["one_gpu"], r["gpus"]
            print(f"| {r['S'] // 1024}k | {r['layout']} | {s1['new_fwdbwd_ms']:.1f} | {o['new_fwdbwd_ms']:.1f} | "
                  f"{s1['new_fwdbwd_ms'] / (w * o['new_fwdbwd_ms']):.2f} | {o['new_unprepared_fwdbwd_ms']:.1f} | "
                  f"{s1['new_fwdbwd_ms'] / (w * o['new_unprepared_fwdbwd_ms']):.2f} | {s1['fwdbwd_ms'] / (w * o['fwdbwd_ms']):.2f} |")
        print("\nOne layout reused (planned once):")
        print("| S | layout | 1 GPU kernel | 1 GPU f+b ms | ours f+b ms | speedup | per GPU | all-gather f+b ms | per GPU | ours/all-gather | ours fwd per GPU | ours MB in | all-gather MB in | imbalance | max rel err | refetch ms | keep MB |")
        print("|" + "---|" * 17)
        for r in rows:
            o, a, s1 = r["ours"], r["allgather"], r["one_gpu"]
            print(
                f"| {r['S'] // 1024}k | {r['layout']} | {s1['kernel']} | {s1['fwdbwd_ms']:.1f} | {o['fwdbwd_ms']:.1f} | "
                f"{s1['fwdbwd_ms'] / o['fwdbwd_ms']:.2f}x | {s1['fwdbwd_ms'] / (world * o['fwdbwd_ms']):.3f} | "
                f"{a['fwdbwd_ms']:.1f} | {s1['fwdbwd_ms'] / (world * a['fwdbwd_ms']):.3f} | "
                f"{a['fwdbwd_ms'] / o['fwdbwd_ms']:.2f}x | {s1['fwd_ms'] / (world * o['fwd_ms']):.3f} | "
                f"{o['recv_MB_fwd']:.0f} | {a['recv_MB_fwd']:.0f} | "
                f"{r['plan']['imbalance']:.3f} | {max(r['parity_rel'].values()):.1e} | "
                f"{o['refetch_ms']:.2f} | {o['keep_MB']:.0f} |"
            )
        if any("profile" in r["ours"] for r in rows):
            print("\nours, forward+backward per rank (torch.profiler, CUDA kernels, ms per call; comm includes waiting for peers)")
            print("| S | layout | rank | wall ms | busy ms | attention | copies | comm | other | exposed comm | exposed / wall |")
            print("|" + "---|" * 11)
            for r in rows:
                for i, p in enumerate(r["ours"].get("profile") or []):
                    wall = r["ours"]["fwdbwd_ms"]
                    print(
                        f"| {r['S'] // 1024}k | {r['layout']} | {i} | {wall:.2f} | {p['busy_ms']:.2f} | {p['attention_ms']:.2f} | "
                        f"{p['copy_ms']:.2f} | {p['comm_ms']:.2f} | {p['other_ms']:.2f} | {p['exposed_comm_ms']:.2f} | "
                        f"{p['exposed_comm_ms'] / wall:.1%} |"
                    )
        if out_path:
            with open(out_path, "w") as f:
                json.dump(rows, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--sizes", default="65536,131072,262144")
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--dry-run", action="store_true", help="CPU/gloo, fp32, tiny heads: checks the script (pass small --sizes, e.g. 2048,4096)")
    ap.add_argument(
        "--packing", choices=["greedy", "cp", "both"], default="greedy",
        help="document order of the lognormal row: as drawn (greedy), CP-aware (doc_packed.data.pack_order with cp_size=--gpus), or both",
    )
    ap.add_argument("--means", default="2048", help="lognormal mean document lengths, e.g. 2048,512")
    ap.add_argument("--one-doc-max", type=int, default=1 << 62, help="time the one-document row only up to this S")
    ap.add_argument("--profile", action="store_true", help="torch.profiler split of our forward+backward on every rank")
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",")]
    means = tuple(int(x) for x in args.means.split(","))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(
        worker,
        args=(args.gpus, port, sizes, args.json, args.quick, args.dry_run, args.packing, means, args.one_doc_max, args.profile),
        nprocs=args.gpus,
    )


if __name__ == "__main__":
    main()
