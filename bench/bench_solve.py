"""Where AutoParallel's planning time goes for a Llama-shaped model: doc_packed vs SDPA.

For each (layers, mesh) the same model is planned twice on AutoParallel's fake process group
(CPU, meta parameters, fake tensors: nothing big is allocated): with ``doc_packed_attn`` and,
as the anchor, with the attention AutoParallel and DTensor rule themselves (SDPA: the aten
flash op ``F.scaled_dot_product_attention`` dispatches to for bf16 on Hopper, K/V repeated to
the query heads as torchtitan's Llama does; called directly because a CPU mesh would pick the
CPU kernel, which DTensor only replicates). Printed per run:

- trace: AutoParallel's joint-graph trace (``__enter__`` up to the optimizer);
- options / costs: building every node's strategies (its placement options) and pricing every
  decision variable (compute estimates and redistribution edges);
- ILP: the PuLP/CBC solve (``optimize_placement``), wall and the solver's CPU seconds;
- attention: what the attention ops themselves cost in the above (their strategies, their
  compute estimates, their edges) and the ILP variables they contribute;
- vars: the ILP's unique variables and constraints.

Each run is a fresh subprocess (AutoParallel caches strategies and costs per process), repeated
``--repeat`` times; medians are printed. The machine is whatever runs this: on a shared host,
repeat and read medians.

Usage::

    python -m bench.bench_solve                      # 4, 16, 32 layers x meshes (8,) and (2, 4)
    python -m bench.bench_solve --layers 4 --meshes 2x4 --repeat 3
    python -m bench.bench_solve --tiny               # 1 small layer on a (2,) mesh: CI, < 60 s
    python -m bench.bench_solve --strategies         # our strategies alone: torch's cost rows vs remembered
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

from bench._harness import add_dry_run
from doc_packed_examples import model as examples  # the example model's attention

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout: subprocesses run from it

LLAMA_8B = dict(vocab=128256, dim=4096, n_heads=32, n_kv_heads=8, hidden=14336)
TINY = dict(vocab=1024, dim=256, n_heads=4, n_kv_heads=2, hidden=512)
ATTENTIONS = ("doc_packed", "sdpa")


class Attention(examples.Attention):
    """The example model's attention (doc_packed), or with ``kind="sdpa"`` the anchor: the same
    projections into aten's flash SDPA, one causal sequence per row."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, kind: str):
        super().__init__(dim, n_heads, n_kv_heads)
        self.kind = kind

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        if self.kind == "doc_packed":
            return super().forward(x, cu_seqlens)
        B, S, _ = x.shape
        q = self.wq(x).view(B, S, self.n_heads, self.head_dim)
        k = self.wk(x).view(B, S, self.n_kv, self.head_dim)
        v = self.wv(x).view(B, S, self.n_kv, self.head_dim)
        # K/V repeated to the query heads (torchtitan's repeat_kv)
        r = self.n_heads // self.n_kv
        k = k.unsqueeze(3).expand(B, S, self.n_kv, r, self.head_dim).reshape(B, S, self.n_heads, self.head_dim)
        v = v.unsqueeze(3).expand(B, S, self.n_kv, r, self.head_dim).reshape(B, S, self.n_heads, self.head_dim)
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        o = torch.ops.aten._scaled_dot_product_flash_attention(qt, kt, vt, 0.0, True)[0].transpose(1, 2)
        return self.wo(o.reshape(B, S, -1))


class Block(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, hidden: int, kind: str):
        super().__init__()
        self.attn = Attention(dim, n_heads, n_kv_heads, kind)
        self.n1, self.n2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x, cu_seqlens):
        x = x + self.attn(self.n1(x), cu_seqlens)
        h = self.n2(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Llama(nn.Module):
    """Llama-3-shaped (RMSNorm, GQA attention, SwiGLU), no RoPE (it adds elementwise nodes
    to both variants alike)."""

    def __init__(self, n_layers: int, kind: str, vocab: int, dim: int, n_heads: int, n_kv_heads: int, hidden: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([Block(dim, n_heads, n_kv_heads, hidden, kind) for _ in range(n_layers)])
        self.norm = nn.RMSNorm(dim)
        self.out = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens, cu_seqlens):
        x = self.emb(tokens)
        for layer in self.layers:
            x = layer(x, cu_seqlens)
        return self.out(self.norm(x))


_ATTENTION_OPS = {
    "doc_packed": ("doc_packed.attn_fwd", "doc_packed.attn_bwd"),
    "sdpa": ("aten._scaled_dot_product_flash_attention", "aten._scaled_dot_product_flash_attention_backward"),
}


def _is_attention(kind: str, target) -> bool:
    name = str(target)
    return any(name.startswith(p + ".") for p in _ATTENTION_OPS[kind])


_TIMERS: Counter = Counter()
_KIND: list[str] = []


def _instrument(kind: str) -> Counter:
    """Wrap AutoParallel's module-level names for timing (bench only; once per process), and
    start a fresh count for ``kind``'s attention ops."""
    import autoparallel.api as ap_api
    import autoparallel.optimize_sharding as ap_opt
    from autoparallel.shardings import placement_options as ap_po

    _TIMERS.clear()
    if _KIND:
        _KIND[0] = kind
        return _TIMERS
    _KIND.append(kind)

    def timed(name, fn, node_of=None):
        def wrapper(*args, **kwargs):
            t = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.process_time() - t
                _TIMERS[name] += dt
                if node_of is not None and _is_attention(_KIND[0], node_of(*args).target):
                    _TIMERS[name + "_attention"] += dt
                    _TIMERS[name + "_attention_calls"] += 1

        return wrapper

    ap_api.build_joint_graph = timed("trace", ap_api.build_joint_graph)
    ap_opt.estimate_strategy_runtime_cost = timed("compute_cost", ap_opt.estimate_strategy_runtime_cost, lambda n, s: n)
    edge = ap_opt.ShardingOptimizer._compute_edge_costs
    ap_opt.ShardingOptimizer._compute_edge_costs = timed("edges", edge, lambda self, n, *a: n)

    class _Op:  # get_placement_options(mesh, op, ...) takes the op, not the node
        def __init__(self, op):
            self.target = op

    ap_po.get_placement_options = timed("options", ap_po.get_placement_options, lambda mesh, op, *a: _Op(op))
    return _TIMERS


def _reset_autoparallel_caches() -> None:
    """Forget what an earlier plan in this process cached (strategies per op and placements,
    compute costs), so a second run pays what a first one does."""
    from autoparallel.cost_models.compute_estimation import reset_compute_cost_cache
    from autoparallel.shardings.placement_options import reset_placement_options_cache

    reset_placement_options_cache()
    reset_compute_cost_cache()


def run_one(
    layers: int, mesh_shape: tuple[int, ...], kind: str, cfg: dict, batch: int, seq_len: int, solve: bool = True
) -> dict:
    """Trace and solve once in this process; the figures of one row (CPU seconds of this
    process, plus the solver's for the ILP; counts)."""
    import torch.distributed as dist
    from doc_packed_testing.ap_compat import device_name_for_cost_model, patch_autoparallel_for_torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import doc_packed as dp
    from shardings.autoparallel import cost_model_for
    from shardings.costs import pricing

    patch_autoparallel_for_torch()
    import autoparallel.api as ap_api

    timers = _instrument(kind)
    _reset_autoparallel_caches()

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=max(64, *mesh_shape))
    names = ("dp", "tp", "cp")[: len(mesh_shape)] if len(mesh_shape) > 1 else ("dp",)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    with torch.device("meta"):
        model = Llama(layers, kind, **cfg).to(torch.bfloat16)
    max_docs = seq_len // 8

    def input_fn():
        return torch.randint(0, cfg["vocab"], (batch, seq_len)), torch.zeros(batch, max_docs + 1, dtype=torch.int32)

    torch.set_num_threads(1)  # the work is Python-bound; CPU seconds are what is compared
    t0, c0 = time.perf_counter(), time.process_time()
    with device_name_for_cost_model(), dp.planning(doc_len=2048), pricing(mesh, gpus_per_host=8):
        with ap_api.AutoParallel(model, input_fn, mesh, cost_model=cost_model_for(mesh, 8)) as autop:
            t_enter, c_enter = time.perf_counter() - t0, time.process_time() - c0
            cbc0 = resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime
            t1, c1 = time.perf_counter(), time.process_time()
            if solve:
                autop.optimize_placement()
            t_ilp = time.perf_counter() - t1
            c_ilp = time.process_time() - c1 + resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime - cbc0
            opt = autop.sharding_optimizer
            attention_nodes = {n for n in opt.strats if _is_attention(kind, getattr(n, "target", None))}
            keys = list(opt.pulp_variables)
            linked = list(opt.cluster_links)
            ours = sum(1 for k in keys if opt.nodes[k[0]] in attention_nodes)
            ours_linked = sum(1 for k in linked if opt.nodes[k[0]] in attention_nodes)
            strategies = sorted({len(opt.strats[n].strategies) for n in attention_nodes})
            n_constraints = len(opt.prob.constraints)
    dist.destroy_process_group()
    return dict(
        layers=layers,
        mesh=list(mesh_shape),
        attention=kind,
        trace_s=timers["trace"],
        enter_wall_s=t_enter,
        ilp_wall_s=t_ilp,
        enter_s=c_enter,
        options_s=timers["options"],
        compute_cost_s=timers["compute_cost"],
        edges_s=timers["edges"],
        ilp_s=c_ilp if solve else float("nan"),
        total_s=c_enter + c_ilp if solve else float("nan"),
        solved=solve,
        attention_options_s=timers["options_attention"],
        attention_cost_s=timers["compute_cost_attention"],
        attention_edges_s=timers["edges_attention"],
        vars=len(keys),
        vars_linked=len(linked),
        attention_vars=ours,
        attention_vars_linked=ours_linked,
        constraints=n_constraints,
        attention_strategies=strategies,
    )


def _subprocess_run(layers, mesh, kind, args) -> dict:
    cmd = [sys.executable, "-m", "bench.bench_solve", "--one", f"{layers}:{'x'.join(map(str, mesh))}:{kind}"]
    cmd += ["--batch", str(args.batch), "--seq", str(args.seq)]
    cmd += (["--tiny"] if args.tiny else []) + (["--no-ilp"] if args.no_ilp else [])
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    if out.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _median(runs: list[dict]) -> dict:
    row = dict(runs[0])
    for k, v in runs[0].items():
        if isinstance(v, float):
            row[k] = statistics.median(r[k] for r in runs)
    row["runs"] = len(runs)
    return row


def _attention_s(r: dict) -> float:
    return r["attention_options_s"] + r["attention_cost_s"] + r["attention_edges_s"]


def table(rows: list[dict]) -> str:
    """One line per (layers, mesh, attention), then ours / SDPA on the totals."""
    lines = [
        "| layers | mesh | attention | trace s | options s | costs s | ILP s | total s | attention's options + "
        "costs + edges s | ILP vars (linked) | attention's vars (linked) | constraints |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    by_key = {(r["layers"], tuple(r["mesh"]), r["attention"]): r for r in rows}
    for r in rows:
        att = _attention_s(r)
        lines.append(
            f"| {r['layers']} | {tuple(r['mesh'])} | {r['attention']} | {r['trace_s']:.1f} | {r['options_s']:.1f} "
            f"| {r['compute_cost_s'] + r['edges_s']:.1f} | {r['ilp_s']:.1f} | {r['total_s']:.1f} "
            f"| {att:.2f} | {r['vars']} ({r['vars_linked']}) | {r['attention_vars']} ({r['attention_vars_linked']}) "
            f"| {r['constraints']} |"
        )
    ratios = []
    for (layers, mesh, kind), r in by_key.items():
        anchor = by_key.get((layers, mesh, "sdpa"))
        if kind == "doc_packed" and anchor:
            what = "total" if r["solved"] and anchor["solved"] else "before the ILP (not solved)"
            key = "total_s" if r["solved"] and anchor["solved"] else "enter_s"
            ratios.append(
                f"{layers} layers {mesh}: {what} doc_packed / SDPA = {r[key] / anchor[key]:.2f}, "
                f"ILP vars {r['vars'] / anchor['vars']:.3f}; attention's own work "
                f"{_attention_s(r):.2f} s vs SDPA's {_attention_s(anchor):.2f} s"
            )
    return "\n".join(lines + [""] + ratios)


def strategy_rows(repeat: int = 3) -> str:
    """Our forward + backward strategies on a (2, 4) mesh for producers with a solver's 36
    candidate placements each (Llama-8B shapes, under fake tensors as AutoParallel builds them):
    torch's cost rows as they were (the anchor, same run) vs the remembered rows. CPU s, medians."""
    import itertools

    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy
    from torch.distributed.tensor._ops.utils import generate_redistribute_costs
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import shardings  # noqa: F401  (registers the strategies)
    from shardings import strategies

    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    mesh = init_device_mesh("cpu", (2, 4))
    options = (Replicate(), Shard(0), Shard(1), Shard(2), Shard(3), Partial())

    def candidates(shape, dtype=torch.bfloat16, transposed=False):
        t = torch.empty(shape, device="meta", dtype=dtype)
        if transposed:  # a producer of the same shape with other strides (dout)
            t = torch.empty((shape[0], shape[2], shape[1], shape[3]), device="meta", dtype=dtype).transpose(1, 2)
        meta = TensorMeta(t.shape, t.stride(), dtype)
        valid = [p for p in options if not p.is_shard() or p.dim < len(shape)]
        return OpStrategy([OpSpec(DTensorSpec(mesh, p, tensor_meta=meta)) for p in itertools.product(valid, repeat=2)])

    B, S, Hq, Hkv, D = 8, 8192, 32, 8, 128
    q, kv, cu = candidates((B, S, Hq, D)), candidates((B, S, Hkv, D)), candidates((B, S // 8 + 1), torch.int32)
    dout, out, lse = candidates((B, S, Hq, D), transposed=True), candidates((B, S, Hq, D)), candidates((B, Hq, S))
    flags = (True, -1, 0, 1.0, "auto", None, 0, None)
    fwd, bwd = torch.ops.doc_packed.attn_fwd.default, torch.ops.doc_packed.attn_bwd.default
    funcs = DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs
    remembered = strategies._redistribute_costs
    medians = {}
    try:
        for name, rows in (("torch's rows (before)", generate_redistribute_costs), ("remembered rows", remembered)):
            strategies._redistribute_costs = rows
            times = []
            for _ in range(repeat):
                strategies._COSTS.clear()
                with FakeTensorMode():
                    t = time.process_time()
                    funcs[fwd](OpSchema(fwd, (q, kv, kv, cu, S, *flags), {}))
                    funcs[bwd](OpSchema(bwd, (dout, q, kv, kv, out, lse, cu, S, *flags), {}))
                    times.append(time.process_time() - t)
            medians[name] = statistics.median(times)
    finally:
        strategies._redistribute_costs = remembered
        dist.destroy_process_group()
    lines = ["| our strategies, fwd + bwd, (2, 4) mesh | CPU s (median) |", "|---|---|"]
    lines += [f"| {k} | {v:.3f} |" for k, v in medians.items()]
    before, after = medians.values()
    return "\n".join(lines + [f"\nbefore / after: {before / after:.2f}"])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default="4,16,32", help="comma-separated layer counts")
    ap.add_argument("--meshes", default="8,2x4", help="comma-separated mesh shapes, e.g. 8,2x4")
    ap.add_argument("--attention", default=",".join(ATTENTIONS), help="doc_packed,sdpa")
    ap.add_argument("--repeat", type=int, default=1, help="runs per row (fresh processes); medians printed")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--tiny", action="store_true", help="1 layer of a small model on a (2,) mesh (CI: < 60 s)")
    ap.add_argument("--strategies", action="store_true", help="only time our strategies' cost rows, before vs after")
    ap.add_argument("--no-ilp", action="store_true", help="stop before the ILP solve (its size is still counted)")
    ap.add_argument("--json", default=None, help="write the rows (medians) here")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # layers:mesh:attention, in this process
    add_dry_run(ap, "--tiny without the ILP solve: checks the script runs")
    args = ap.parse_args(argv)
    if args.dry_run:
        args.tiny, args.no_ilp = True, True
    cfg = TINY if args.tiny else LLAMA_8B
    if args.strategies:
        print(strategy_rows(args.repeat if args.repeat > 1 else 3))
        return
    if args.one:
        layers, mesh, kind = args.one.split(":")
        mesh_shape = tuple(int(x) for x in mesh.split("x"))
        row = run_one(int(layers), mesh_shape, kind, cfg, args.batch, args.seq, solve=not args.no_ilp)
        print(json.dumps(row))
        return
    if args.tiny:  # one process (imports cost ~10-20 s on a busy 2-core host): the second run is warmer
        args.layers, args.meshes, args.batch, args.seq = "1", "2", 2, 1024
    rows = []
    for layers in (int(x) for x in args.layers.split(",")):
        for mesh in (tuple(int(x) for x in m.split("x")) for m in args.meshes.split(",")):
            for kind in args.attention.split(","):
                if args.tiny:
                    runs = [run_one(layers, mesh, kind, cfg, args.batch, args.seq, solve=not args.no_ilp)]
                else:
                    runs = [_subprocess_run(layers, mesh, kind, args) for _ in range(args.repeat)]
                rows.append(_median(runs))
                r = rows[-1]
                print(
                    f"{layers} layers {mesh} {kind}: total {r['total_s']:.1f} s (trace {r['trace_s']:.1f}, before "
                    f"the ILP {r['enter_s']:.1f}, ILP {r['ilp_s']:.1f}; wall {r['enter_wall_s'] + r['ilp_wall_s']:.1f}), "
                    f"vars {r['vars']}, attention's {r['attention_vars']} (own work {_attention_s(r):.2f} s)",
                    flush=True,
                )
                if args.json:
                    with open(args.json, "w") as f:
                        json.dump(rows, f, indent=1)
    print(
        f"\nCPU seconds (process + solver); torch {torch.__version__}, {os.cpu_count()} CPUs, B x S = "
        f"{args.batch} x {args.seq}, {'tiny' if args.tiny else 'Llama-8B-shaped'} model, medians of {args.repeat}"
    )
    print(table(rows))
    if args.tiny:
        print("(--tiny runs both in one process: the first row also pays the process's warm-up; a smoke, not a ratio)")


if __name__ == "__main__":
    main()
