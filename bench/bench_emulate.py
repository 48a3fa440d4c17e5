"""Rank 0 of a W-rank AutoParallel placement, emulated on ONE device: per-rank speed vs the plain model.

A fake process group of W ranks (torch's ``fake`` backend: collectives return at once and move
nothing) lets AutoParallel plan and place the example model for a W-rank mesh while this process
runs rank 0's share of the work for real: its local inputs are sliced from the global batch (not
scattered), every matmul, norm and attention kernel is the one rank 0 would run. What is NOT
real: communication (absent, so this measures compute and host overhead only), and the context-
parallel exchange, whose uneven AllToAll-V cannot run on a fake group: its receive buffers are
stubbed with empty tensors of the right size, and the plan's cross-rank agreement check is
skipped. Values are therefore garbage; times are rank 0's.

For each layout (dp, cp, (dp, cp), (cp, tp), (dp, tp)), row length and model, one run reports:
- the plain model (no AutoParallel) on this device, eager and compiled, at rank 0's local batch
  and at one whole row ``[1, S]`` (the one-GPU anchor);
- the placed module under AutoParallel's eager runner (the "before") and compiled with
  :func:`shardings.compile.compile_placed` (the default path now);
- kernel ms per step by category and the GPU busy fraction (torch.profiler, one compiled step);
- per-rank efficiency = (tokens/s per rank of the placed module) / (tokens/s of the plain model
  on one whole row), against both the eager and the compiled plain model;
- the cost of a new document layout per step: compiled steps with a fresh ``cu_seqlens`` each
  step minus steps that reuse one.

Usage (one GPU; needs AutoParallel and pulp)::

    python -m bench.bench_emulate --world 2 --layouts dp,cp --seq 32768 --docs one,lognormal
    python -m bench.bench_emulate --dry-run --seq 256 --steps 1 --warmup 1 --rounds 1   # CPU, checks the plumbing
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time

import torch
import torch.distributed as dist

import doc_packed as dp
from bench._harness import add_dry_run, device_name, sync, timed_ms
from doc_packed.data import lognormal_lengths
from doc_packed_examples.model import Transformer, training_flops
from doc_packed_testing.ap_compat import device_name_for_cost_model, patch_autoparallel_for_torch

# layout -> (mesh dim names, token placement letters, forced attention kinds, batch rows per dp rank)
LAYOUTS = {
    "dp": (("dp",), "B", {"dp": "batch"}),
    "cp": (("cp",), "S", {"cp": "sequence"}),
    "dp_cp": (("dp", "cp"), "BS", {"dp": "batch", "cp": "sequence"}),
    "cp_tp": (("cp", "tp"), "SR", {"cp": "sequence", "tp": "heads"}),
    "dp_tp": (("dp", "tp"), "BR", {"dp": "batch", "tp": "heads"}),
}
# layouts whose ranks each do exactly 1/W of the model's work (up to CP imbalance); the tp ones
# repeat norms, residuals, embedding and loss on every tp rank
NO_REDUNDANT_COMPUTE = {"dp", "cp", "dp_cp"}
CATEGORIES = ("attention", "gemm", "elementwise", "copy/cast", "comm", "other")


def mesh_shape(layout: str, world: int) -> tuple[int, ...]:
    names = LAYOUTS[layout][0]
    if len(names) == 1:
        return (world,)
    if world % 2:
        raise ValueError(f"layout {layout} needs an even world size, got {world}")
    return (2, world // 2) if names[0] == "dp" else (world // 2, 2)


@contextlib.contextmanager
def stubbed_cp_exchange():
    """Empty receive buffers for the CP exchange and no agreement check (fake groups move nothing)."""
    from doc_packed.cp import comm

    saved = comm.start_exchange, comm.wait_exchange, comm.exchange, comm.check_agreement

    def exchange(fields, group_name):
        return [comm.receive_buffer(f) for f in fields]

    comm.start_exchange, comm.wait_exchange, comm.exchange = exchange, (lambda got: got), exchange
    comm.check_agreement = lambda *a, **k: None
    try:
        yield
    finally:
        comm.start_exchange, comm.wait_exchange, comm.exchange, comm.check_agreement = saved


def make_layouts(n: int, B: int, S: int, docs: str, device, seed0: int = 0) -> list[torch.Tensor]:
    """``n`` cu_seqlens tensors on ``device``: one document per row, or lognormal mean 2k."""
    out = []
    for i in range(n):
        if docs == "one":
            lengths = [[S] for _ in range(B)]
        else:
            lengths = [lognormal_lengths(S, 2048, seed0 + 1000 * i + b) for b in range(B)]
        out.append(dp.cu_seqlens_from_lengths(lengths, S, max_docs=S // 8).to(device))
    return out


def time_steps(step, cus, device, warmup: int) -> float:
    """Mean seconds per step over ``cus[warmup:]`` (each step gets its own cu_seqlens)."""
    for cu in cus[:warmup]:
        step(cu)
    timed = iter(cus[warmup:])
    n = len(cus) - warmup
    return timed_ms(lambda: step(next(timed)), warmup=0, iters=1, calls=n, clock="wall", device=device) / 1e3


def gpu_warmup(device, seconds: float = 3.0) -> None:
    """Busy the GPU so clocks are up before the first measurement of the process."""
    if device.type != "cuda":
        return
    x = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(20):
            x @ x
        torch.cuda.synchronize()


def categorize(name: str) -> str:
    n = name.lower()
    # Inductor templates here are flex attention (matmuls stay extern cuBLAS calls)
    if any(s in n for s in ("flash", "flex", "attn", "attention", "fmha", "triton_tem")):
        return "attention"
    if any(s in n for s in ("gemm", "sm90_xmma", "cutlass", "nvjet", "matmul", "_mm_", "sgemm", "hgemm")):
        return "gemm"
    if any(s in n for s in ("nccl", "all_gather", "reduce_scatter", "all_reduce", "alltoall")):
        return "comm"
    if any(s in n for s in ("copy", "cat", "memcpy", "memset", "index", "gather", "scatter", "to_copy")):
        return "copy/cast"
    if any(s in n for s in ("elementwise", "vectorized", "reduce", "triton", "softmax", "norm")):
        return "elementwise"
    return "other"


def profile_step(step, cu, device) -> dict:
    """Kernel ms by category and the GPU busy fraction of one step (CUDA only)."""
    if device.type != "cuda":
        return {}
    from torch.profiler import ProfilerActivity, profile

    sync(device)
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step(cu)
        sync(device)
    wall = time.perf_counter() - t0
    cats = dict.fromkeys(CATEGORIES, 0.0)
    spans = []
    for e in prof.events():
        if e.device_type.name != "CUDA" or e.time_range.elapsed_us() <= 0:
            continue
        cats[categorize(e.name)] += e.time_range.elapsed_us() / 1e3
        spans.append((e.time_range.start, e.time_range.end))
    spans.sort()
    busy, end = 0.0, None
    for s, e in spans:  # union of kernel intervals (streams may overlap)
        if end is None or s > end:
            busy += e - s
            end = e
        elif e > end:
            busy += e - end
            end = e
    return dict(kernels_ms={k: round(v, 2) for k, v in cats.items()}, n_kernels=len(spans),
                busy=round(busy / 1e3 / (wall * 1e3), 3) if wall > 0 else None)


BACKWARD_THREADS = [True]  # --autograd-threads: False runs each backward on the calling thread
PHASES: list[tuple[float, float, float]] = []  # host seconds of each step's forward, loss + backward, optimizer


def train_step_fn(model, tokens, targets, opt):
    def step(cu):
        t0 = time.perf_counter()
        logits = model(tokens, cu)
        t1 = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        with torch.autograd.set_multithreading_enabled(BACKWARD_THREADS[0]):
            loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        PHASES.append((t1 - t0, t2 - t1, time.perf_counter() - t2))

    return step


def host_phases_ms(since: int) -> dict:
    """Median host ms of the steps recorded since ``PHASES[since]``: forward, loss + backward
    (returns once the backward is queued), optimizer, and their sum."""
    got = PHASES[since:]
    if not got:
        return {}
    med = lambda xs: round(1e3 * sorted(xs)[len(xs) // 2], 2)  # noqa: E731
    return dict(forward=med([g[0] for g in got]), backward=med([g[1] for g in got]),
                optimizer=med([g[2] for g in got]), total=med([sum(g) for g in got]))


def time_both_threads(step, cus, device, warmup: int, rounds: int) -> dict:
    """``--autograd-threads both``: best mean ms per step over ``rounds`` with autograd's device
    thread (default) and with every backward on the calling thread, alternating; with host phases."""
    out = {}
    for _ in range(rounds):
        for on in (True, False):
            BACKWARD_THREADS[0] = on
            since = len(PHASES)
            ms = 1e3 * time_steps(step, cus, device, warmup)
            key = "threads_on" if on else "threads_off"
            if key not in out or ms < out[key]["ms"]:
                out[key] = dict(ms=round(ms, 2), host=host_phases_ms(since + warmup))
    BACKWARD_THREADS[0] = True
    return out


def _plain_model(cfg, S, device, dtype):
    """The plain model (seed 0), its SGD and one row ``[1, S]`` of tokens and targets."""
    torch.manual_seed(0)
    model = Transformer(**cfg).to(device=device, dtype=dtype)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, cfg["vocab"], (1, S), device=device)
    targets = torch.randint(0, cfg["vocab"], (1, S), device=device)
    return model, opt, tokens, targets


def plain_both_threads(cfg, S, docs, device, dtype, args) -> dict:
    """The plain model compiled on one row, timed as :func:`time_both_threads` does."""
    model, opt, tokens, targets = _plain_model(cfg, S, device, dtype)
    step = train_step_fn(torch.compile(model, fullgraph=True), tokens, targets, opt)
    out = time_both_threads(step, make_layouts(args.warmup + args.steps, 1, S, docs, device), device, args.warmup,
                            args.rounds)
    del model, opt, step
    return out


def _print_host_profile(step, cu, device, top: int, title: str) -> None:
    """torch.profiler's CPU table (self time, ``top`` rows) of two steps, the device drained after."""
    from torch.profiler import ProfilerActivity, profile

    step(cu)
    sync(device)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            step(cu)
        sync(device)
    print(f"\n### host profile, 2 steps: {title}")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top))


def plain_runs(cfg, S, docs_kinds, device, dtype, args) -> dict:
    """The plain model (no AutoParallel) on this device, one row ``[1, S]``: eager and compiled ms
    per step for each document kind, and the model FLOPs of a step."""
    model, opt, tokens, targets = _plain_model(cfg, S, device, dtype)
    compiled = torch.compile(model, fullgraph=True)
    out = {}
    for docs in docs_kinds:
        cus = make_layouts(args.warmup + args.steps, 1, S, docs, device)
        eager, comp = train_step_fn(model, tokens, targets, opt), train_step_fn(compiled, tokens, targets, opt)
        out[docs] = {
            "eager_ms": min(1e3 * time_steps(eager, cus, device, args.warmup) for _ in range(args.rounds)),
            "compiled_ms": min(1e3 * time_steps(comp, cus, device, args.warmup) for _ in range(args.rounds)),
            "flops": sum(training_flops(model, cu, S) for cu in cus) / len(cus),
        }
    del model, compiled, opt
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def place(layout, world, cfg, B, S, device, dtype, compile_backend, overlap_scheduling=None, cuda_graphs=False):
    """AutoParallel plans the model for the layout's mesh (attention forced to the layout);
    returns (placed module, its compiled form, the compile choice, mesh, token placements)."""
    from autoparallel.cost_models.compute_estimation import reset_compute_cost_cache
    from autoparallel.shardings.placement_options import reset_placement_options_cache
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    from shardings import flow

    names, letters, force = LAYOUTS[layout]
    reset_placement_options_cache()  # AutoParallel caches by shapes, not by mesh
    reset_compute_cost_cache()
    mesh = init_device_mesh(device.type, mesh_shape(layout, world), mesh_dim_names=names)
    pl = {"R": Replicate(), "B": Shard(0), "S": Shard(1)}
    tok_pl = tuple(pl[c] for c in letters)
    cu_pl = tuple(Shard(0) if p == Shard(0) else Replicate() for p in tok_pl)

    def input_fn():
        return (torch.randint(0, cfg["vocab"], (B, S), device=device),
                torch.zeros(B, S // 8 + 1, dtype=torch.int32, device=device))

    with torch.device("meta"):
        model = Transformer(**cfg).to(dtype)
    # AutoParallel's own topology detection and the default attention pricing (gpus_per_host=None)
    with device_name_for_cost_model():
        placed = flow.place(model, input_fn, mesh, inputs=[tok_pl, cu_pl], outputs=[tok_pl], attention=force,
                            doc_len=2048, gpus_per_host=None, describe=False, compile_backend=compile_backend,
                            overlap_scheduling=overlap_scheduling, cuda_graphs=cuda_graphs)
    parallel = placed.parallel
    parallel.to_empty(device=device)
    with torch.no_grad():
        for p in parallel.parameters():
            p.to_local().normal_(0, 0.02)
    return parallel, placed.module, placed.compiled_with, mesh, tok_pl


def local_slice(t: torch.Tensor, mesh, placements) -> torch.Tensor:
    """Rank 0's local piece of a global tensor (sliced: a fake group cannot scatter)."""
    for d, p in enumerate(placements):
        if p.is_shard():
            t = t.chunk(mesh.size(d), p.dim)[0]
    return t.contiguous()


def emulate(layout, world, cfg, S, docs_kinds, device, dtype, args, plain) -> list[dict]:
    """Place once for (layout, S); time rank 0 on each document kind. ``plain``: plain_runs()."""
    names = LAYOUTS[layout][0]
    shape = mesh_shape(layout, world)
    dp_size = shape[names.index("dp")] if "dp" in names else 1
    B = dp_size  # one row per data-parallel rank
    t0 = time.perf_counter()
    parallel, compiled, choice, mesh, tok_pl = place(
        layout, world, cfg, B, S, device, dtype, args.compile, True if args.overlap else None, args.cuda_graphs
    )
    plan_s = time.perf_counter() - t0
    tokens = torch.randint(0, cfg["vocab"], (B, S), device=device)
    targets = torch.randint(0, cfg["vocab"], (B, S), device=device)
    lt, ltg = local_slice(tokens, mesh, tok_pl), local_slice(targets, mesh, tok_pl)
    opt = torch.optim.SGD(parallel.parameters(), lr=1e-3)
    step = train_step_fn(compiled, lt, ltg, opt)
    peak = args.peak_tflops * 1e12
    rows = []
    with stubbed_cp_exchange():
        for i, docs in enumerate(docs_kinds):
            # cu_seqlens: whole rows, sharded with the batch; the first layout pays the compile
            n = args.warmup + args.steps + 1
            cus = [c.chunk(dp_size, 0)[0].contiguous() for c in make_layouts(n, B, S, docs, device, seed0=7)]
            res = dict(layout=layout, mesh=dict(zip(names, shape)), docs=docs, local_tokens=list(lt.shape),
                       rank_tokens=B * S / world, compile=str(choice), plan_s=plan_s)
            if not args.skip_eager:
                eager_cus = cus[: args.warmup + 2]
                res["eager_ms"] = 1e3 * time_steps(train_step_fn(parallel, lt, ltg, opt), eager_cus, device, args.warmup)
            if device.type == "cuda":
                sync(device)
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
                before = torch.cuda.memory_reserved(device)
            t0 = time.perf_counter()
            step(cus[0])
            sync(device)
            res["first_step_s"] = time.perf_counter() - t0  # compiles, on the first kind
            # a new layout every step vs one layout reused, in alternating rounds (best of each)
            new, same = [], []
            since = len(PHASES)
            for _ in range(args.rounds):
                new.append(1e3 * time_steps(step, cus[1:], device, args.warmup - 1))
                same.append(1e3 * time_steps(step, [cus[1]] * (n - 1), device, 1))
            res["compiled_ms"], res["compiled_same_layout_ms"] = min(new), min(same)
            if device.type == "cuda":  # recorded CUDA graphs hold their pools in the reserved memory
                res["memory_gib"] = dict(
                    peak_allocated=torch.cuda.max_memory_allocated(device) / 2**30,
                    reserved=torch.cuda.memory_reserved(device) / 2**30,
                    reserved_before=before / 2**30,
                )
            res["host_ms"] = host_phases_ms(since)
            if args.autograd_threads == "both":
                res["backward_threads"] = time_both_threads(step, cus[1:], device, args.warmup - 1, args.rounds)
                res["plain_backward_threads"] = plain_both_threads(cfg, S, docs, device, dtype, args)
            if args.host_profile:
                _print_host_profile(step, cus[-1], device, args.host_profile, f"{layout} S={S} {docs}")
            res["new_layout_ms"] = res["compiled_ms"] - res["compiled_same_layout_ms"]
            res.update(profile_step(step, cus[-1], device))
            row = plain[docs]
            for kind in ("eager", "compiled"):
                # tokens/s per rank over the plain model's tokens/s on one whole row
                res[f"eff_vs_plain_{kind}"] = (row[f"{kind}_ms"] / S) / (res["compiled_ms"] / res["rank_tokens"])
            if "eager_ms" in res:
                res["eager_eff_vs_plain_eager"] = (row["eager_ms"] / S) / (res["eager_ms"] / res["rank_tokens"])
            # MFU of this rank: its share of the model FLOPs of the global batch (B rows)
            res["mfu"] = row["flops"] * B / world / (res["compiled_ms"] / 1e3) / peak
            res["plain_row"] = row
            rows.append(res)
    del parallel, compiled, opt, step
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def _memory(row: dict) -> str:
    m = row.get("memory_gib")
    return "-" if m is None else f"{m['peak_allocated']:.1f} / {m['reserved']:.1f} ({m['reserved_before']:.1f})"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2, help="ranks of the emulated mesh")
    ap.add_argument("--layouts", default="dp,cp", help=f"any of {sorted(LAYOUTS)}")
    ap.add_argument("--seq", default="32768", help="row lengths, comma separated")
    ap.add_argument("--docs", default="one,lognormal", help="one document per row, lognormal mean 2k")
    ap.add_argument("--dims", default="2048", help="model widths (heads of 128, kv heads dim/512)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2, help="at least 1")
    ap.add_argument("--rounds", type=int, default=2, help="timed rounds per variant; the best is kept")
    ap.add_argument("--compile", default="auto", help="compile_placed backend")
    ap.add_argument("--overlap", action="store_true", help="compile_placed(overlap_scheduling=True)")
    ap.add_argument("--cuda-graphs", action="store_true", help="compile_placed(cuda_graphs=True)")
    ap.add_argument("--one-doc-max", type=int, default=32768, help="one-document rows only up to this S")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak for MFU (H100/H200: 989)")
    ap.add_argument("--skip-eager", action="store_true", help="skip the eager placed module")
    ap.add_argument(
        "--autograd-threads",
        choices=["on", "off", "both"],
        default="on",
        help="off: every backward (anchor's and placed module's) on the calling thread, "
        "torch.autograd.set_multithreading_enabled(False), instead of autograd's device thread; "
        "both: the compiled steps timed both ways in one run (alternating rounds)",
    )
    ap.add_argument("--host-profile", type=int, default=0, help="print torch.profiler's top N host ops of 2 placed steps")
    ap.add_argument("--json", default=None)
    add_dry_run(ap, "a 2-layer model of width 64 on CPU, float32 (pass small sizes too: --seq 256 ...)")
    args = ap.parse_args(argv)
    BACKWARD_THREADS[0] = args.autograd_threads != "off"
    patch_autoparallel_for_torch()
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if args.dry_run:
        device, dtype = torch.device("cpu"), torch.float32
        cfgs = [dict(vocab=256, dim=64, n_heads=4, n_kv_heads=2, n_layers=2)]
    else:
        device, dtype = torch.device("cuda", 0), torch.bfloat16
        torch.cuda.set_device(0)
        cfgs = [dict(vocab=8192, dim=d, n_heads=d // 128, n_kv_heads=max(1, d // 512), n_layers=args.layers)
                for d in map(int, args.dims.split(","))]
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world)
    gpu_warmup(device)
    rows = []
    for cfg in cfgs:
        for S in map(int, args.seq.split(",")):
            kinds = [d for d in args.docs.split(",") if d != "one" or S <= args.one_doc_max]
            plain = plain_runs(cfg, S, kinds, device, dtype, args)
            print(json.dumps(dict(plain=plain, dim=cfg["dim"], S=S)), flush=True)
            for layout in args.layouts.split(","):
                try:
                    got = emulate(layout, args.world, cfg, S, kinds, device, dtype, args, plain)
                except Exception as e:  # report and go on (a dry run fails)
                    if args.dry_run:
                        raise
                    import traceback

                    got = [dict(layout=layout, docs=",".join(kinds), error=f"{type(e).__name__}: {e}"[:1500],
                                tb=traceback.format_exc()[-2500:])]
                for r in got:
                    r.update(dim=cfg["dim"], S=S)
                    print(json.dumps(r), flush=True)
                    rows.append(r)
    print(f"\ndevice: {device_name(device)}  torch {torch.__version__}  emulated world {args.world} (rank 0, fake group)")
    print("| dim | S | docs | layout | mesh | plain row ms (eager / compiled) | placed eager ms | placed compiled ms "
          "| eff vs plain eager | vs plain compiled | MFU | new layout ms | GPU busy | kernels ms (attn / gemm / elem / copy) "
          "| GiB: peak allocated / reserved (before the first step) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['dim']} | {r['S']} | {r['docs']} | {r['layout']} | error: {r['error'][:100]} |")
            continue
        k = r.get("kernels_ms", {})
        ks = " / ".join(f"{k.get(c, 0):.1f}" for c in ("attention", "gemm", "elementwise", "copy/cast")) if k else "-"
        eager = f"{r['eager_ms']:.1f}" if "eager_ms" in r else "-"
        mark = "" if r["layout"] in NO_REDUNDANT_COMPUTE else " (tp: redundant)"
        print(f"| {r['dim']} | {r['S']} | {r['docs']} | {r['layout']}{mark} | {r['mesh']} | "
              f"{r['plain_row']['eager_ms']:.1f} / {r['plain_row']['compiled_ms']:.1f} | {eager} | "
              f"{r['compiled_ms']:.1f} | {r['eff_vs_plain_eager']:.2f} | {r['eff_vs_plain_compiled']:.2f} | {r['mfu']:.2f} | "
              f"{r['new_layout_ms']:+.1f} | {r.get('busy', '-')} | {ks} | {_memory(r)} |")
    both = [r for r in rows if "backward_threads" in r]
    if both:
        print("\nbackward on autograd's device thread (on) or the calling thread (off): ms per step "
              "(host ms: forward / loss + backward / optimizer)")
        print("| S | docs | layout | placed on | placed off | off / on | plain row on | plain row off | off / on |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in both:
            p, q = r["backward_threads"], r["plain_backward_threads"]
            h = lambda x: " / ".join(f"{x['host'].get(k, 0):.1f}" for k in ("forward", "backward", "optimizer"))  # noqa: E731
            print(f"| {r['S']} | {r['docs']} | {r['layout']} | {p['threads_on']['ms']:.1f} ({h(p['threads_on'])}) | "
                  f"{p['threads_off']['ms']:.1f} ({h(p['threads_off'])}) | {p['threads_off']['ms'] / p['threads_on']['ms']:.3f} | "
                  f"{q['threads_on']['ms']:.1f} ({h(q['threads_on'])}) | {q['threads_off']['ms']:.1f} ({h(q['threads_off'])}) | "
                  f"{q['threads_off']['ms'] / q['threads_on']['ms']:.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
