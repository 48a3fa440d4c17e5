"""AutoParallel's free choice vs every forced attention layout, priced by the step-time model.

For each case (mesh, batch, row length, documents, model) one trace: the solver's free
solution, then every attention layout the strategies offer forced in turn (constraints added,
re-solved, removed: no re-tracing). Each solution is priced by :mod:`shardings.step_model`
(what the GPUs would take) and by AutoParallel's own objective. Runs on CPU with AutoParallel's
fake process group; the solver is told the real topology (``cost_model_for``) and the measured
rates (``shardings.costs.pricing``).

Usage::

    python -m bench.ap_scenarios                       # the matrix, markdown table
    python -m bench.ap_scenarios --root-cause          # the (cp 2, tp 2) case term by term
    python -m bench.ap_scenarios --cases cp2tp2-64k --json out.json
    python -m bench.ap_scenarios --profile             # where planning time goes (one case)
    python -m bench.ap_scenarios --dry-run             # the first case, one forced layout (needs AutoParallel)
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import doc_packed as dp
from bench._harness import add_dry_run
from doc_packed_examples.model import Transformer, training_flops

# the project's e2e model (bench/bench_e2e.py) and a narrower, deeper one; layers are few so a
# CPU solve stays short (AutoParallel solves repeated layers once; the choice is per layer)
E2E = dict(vocab=8192, dim=2048, n_heads=16, n_kv_heads=4, n_layers=1)
NARROW = dict(vocab=8192, dim=1024, n_heads=8, n_kv_heads=2, n_layers=2)
BIG = dict(vocab=32000, dim=4096, n_heads=32, n_kv_heads=8, n_layers=1)  # tests/test_autoparallel.py's
MODELS = {
    "e2e": E2E,
    "narrow": NARROW,
    "e2e4": dict(E2E, n_layers=4),
    "big": BIG,
    "big12": dict(BIG, dim=1536, n_heads=12, n_kv_heads=3),
}


@dataclass(frozen=True)
class Case:
    name: str
    mesh: tuple[int, ...]
    names: tuple[str, ...]
    B: int
    S: int
    doc_len: int  # 0: one document per row
    model: str = "e2e"
    inputs: str | None = None  # per mesh dim, tokens: B(atch) / S(equence) / R(eplicate); None: free
    gpus_per_host: int = 8


def _case(name, mesh, names, B, S, doc, model="e2e", inputs=None):
    return Case(name, tuple(mesh), tuple(names), B, S, doc, model, inputs)


K = 1024
CASES = [
    # the issue's case: (cp 2, tp 2), B 1, 64k lognormal 2k, inputs (Shard(1), Replicate)
    # (order: as run for docs/scenarios.md)
    _case("cp2tp2-64k", (2, 2), ("cp", "tp"), 1, 64 * K, 2048, inputs="SR"),
    _case("cp2tp2-64k-free-inputs", (2, 2), ("cp", "tp"), 1, 64 * K, 2048),
    _case("cp2tp2-16k-narrow", (2, 2), ("cp", "tp"), 1, 16 * K, 2048, "narrow", inputs="SR"),
    _case("cp4tp2-64k", (4, 2), ("cp", "tp"), 1, 64 * K, 2048, inputs="SR"),
    _case("dp2cp2-64k", (2, 2), ("dp", "cp"), 2, 64 * K, 2048, inputs="BS"),
    _case("dp2cp2-32k-onedoc", (2, 2), ("dp", "cp"), 2, 32 * K, 0, inputs="BS"),
    _case("dp2tp2-16k", (2, 2), ("dp", "tp"), 2, 16 * K, 2048, inputs="BR"),
    _case("dp4tp2-32k-narrow", (4, 2), ("dp", "tp"), 4, 32 * K, 2048, "narrow", inputs="BR"),
    _case("x2-b2-32k", (2,), ("x",), 2, 32 * K, 2048),
    _case("x2-b1-64k", (2,), ("x",), 1, 64 * K, 2048),
    _case("x4-b1-128k-onedoc", (4,), ("x",), 1, 128 * K, 0),
    _case("x4-b4-16k-narrow", (4,), ("x",), 4, 16 * K, 2048, "narrow"),
    _case("x8-b1-128k", (8,), ("x",), 1, 128 * K, 2048),
    _case("x8-b2-64k-narrow", (8,), ("x",), 2, 64 * K, 512, "narrow"),
]
BY_NAME = {c.name: c for c in CASES}


@dataclass
class Solved:
    """One solution of a case: the attention layout (fwd), the step model's estimate and
    AutoParallel's objective (us)."""

    forced: dict | None
    layout: dict
    step: object  # shardings.step_model.StepEstimate
    objective: dict
    solve_s: float


@dataclass
class CaseResult:
    case: Case
    free: Solved
    forced: list[Solved] = field(default_factory=list)
    trace_s: float = 0.0
    model_flops: float = 0.0

    @property
    def best(self) -> Solved:
        return min(self.forced, key=lambda s: s.step.total_us)

    @property
    def free_vs_best(self) -> float:
        """Predicted step of the best forced layout / the free one's (1.0: as fast)."""
        return self.best.step.total_us / self.free.step.total_us


def fake_world(size: int = 64) -> None:
    """AutoParallel's fake process group (once per process)."""
    if not dist.is_initialized():
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)


def _input_constraints(autop, case: Case):
    from torch.distributed.tensor import Replicate, Shard

    if case.inputs is None:
        return
    pl = {"R": Replicate(), "B": Shard(0), "S": Shard(1)}
    tok = tuple(pl[c] for c in case.inputs)
    cu = tuple(Shard(0) if p == Shard(0) else Replicate() for p in tok)
    autop.add_input_constraints([tok, cu])
    autop.add_output_constraints([tok])


def offered_layouts(case: Case) -> list[dict]:
    """Every attention layout the strategies offer this case (one kind per mesh dim)."""
    from shardings.strategies import offered_kinds

    cfg = MODELS[case.model]
    kinds = offered_kinds(case.mesh, case.B, case.S, cfg["n_heads"], cfg["n_kv_heads"])
    return [dict(zip(case.names, k)) for k in kinds]


def solve_case(
    case: Case,
    *,
    layouts: list[dict] | None = None,
    root_cause: bool = False,
    our_pricing: bool = True,
    topology: bool = True,
) -> CaseResult:
    """Trace once, solve free, then each forced layout (all offered ones by default).
    ``our_pricing=False``: no pricing hook (AutoParallel rates our plain FLOP count at its one
    efficiency); ``topology=False``: AutoParallel detects the topology itself (on CPU: its
    fallback, torch's 87.7 GB/s link model)."""
    from doc_packed_testing.ap_compat import device_name_for_cost_model
    from autoparallel.api import AutoParallel
    from autoparallel.shardings.placement_options import reset_placement_options_cache
    from torch.distributed.device_mesh import init_device_mesh

    from shardings._ap_compat import solution_cost
    from shardings.autoparallel import cost_model_for, describe_attention, force_attention_layout
    from shardings.costs import pricing
    from shardings.step_model import Layout, Rates, Topology, price_placement

    fake_world()
    reset_placement_options_cache()
    cfg = MODELS[case.model]
    mesh = init_device_mesh("cpu", case.mesh, mesh_dim_names=case.names)
    with torch.device("meta"):
        model = Transformer(**cfg).to(torch.bfloat16)
    max_docs = case.S // 8

    def input_fn():
        return torch.randint(0, cfg["vocab"], (case.B, case.S)), torch.zeros(case.B, max_docs + 1, dtype=torch.int32)

    rates = Rates.load()
    topo = Topology(case.gpus_per_host)
    layout = Layout(case.doc_len)
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        stack.enter_context(device_name_for_cost_model())
        stack.enter_context(dp.planning(doc_len=case.doc_len or None))  # None: one document per row
        if our_pricing:
            stack.enter_context(pricing(mesh, rates=rates, gpus_per_host=case.gpus_per_host))
        else:
            stack.enter_context(_no_pricing_hook())
        if topology:
            cost_model = cost_model_for(mesh, case.gpus_per_host)
        else:  # what a 4-GPU host gets: no NCCL config, torch's model with every dim inside a host
            from doc_packed_testing.ap_compat import gpus_per_host

            cost_model = "nccl"
            stack.enter_context(gpus_per_host(case.gpus_per_host))
        autop = stack.enter_context(AutoParallel(model, input_fn, mesh, cost_model=cost_model))
        trace_s = time.perf_counter() - t0
        _input_constraints(autop, case)
        opt = autop.sharding_optimizer

        def solved(forced, placement, t):
            ch = describe_attention(autop, placement, print_report=False)
            fwd = next(c.layout for c in ch if c.role == "forward")
            step = price_placement(autop.gm.graph.nodes, placement, rates=rates, topology=topo, layout=layout)
            if root_cause:
                _print_terms(forced, opt, placement, step)
            return Solved(forced, fwd, step, solution_cost(opt, placement), t)

        t1 = time.perf_counter()
        placement = autop.optimize_placement()
        free = solved(None, placement, time.perf_counter() - t1)
        result = CaseResult(case, free, trace_s=trace_s)
        for lay in layouts if layouts is not None else offered_layouts(case):
            names = force_attention_layout(autop, lay)
            t1 = time.perf_counter()
            try:
                placement = opt.resolve()
            except Exception as err:  # infeasible with the input constraints
                print(f"  {case.name} {lay}: {type(err).__name__}: {str(err)[:120]}", file=sys.stderr)
                opt.remove_constraints(names)
                continue
            result.forced.append(solved(lay, placement, time.perf_counter() - t1))
            opt.remove_constraints(names)
    with torch.device("meta"):
        m = Transformer(**cfg)
    from doc_packed.flops import representative_bounds

    b = representative_bounds(case.S, case.doc_len)
    cu = dp.cu_seqlens_from_lengths([[e - s for s, e in zip(b, b[1:])]] * case.B, case.S)
    result.model_flops = training_flops(m, cu, case.S)
    for s in [result.free, *result.forced]:
        s.step.model_flops = result.model_flops
    return result


@contextlib.contextmanager
def _no_pricing_hook():
    from shardings._ap_compat import reset_compute_cost_cache
    from shardings.costs import register

    from doc_packed import flops

    flops.set_planning_cost(None)
    reset_compute_cost_cache()
    try:
        yield
    finally:
        register()
        reset_compute_cost_cache()


def _cls(node) -> str:
    t = str(node.target)
    if "doc_packed" in t:
        return t.split(".")[1]
    if any(k in t for k in ("aten.mm", "aten.addmm", "aten.bmm", "einsum")):
        return "matmul"
    return "other"


def _print_terms(forced, opt, placement, step) -> None:
    """AutoParallel's costs of one solution by class of node (compute and incoming comm, us),
    next to the step model's."""
    from shardings._ap_compat import chosen_decisions

    chosen, _ = chosen_decisions(opt)
    comp: collections.Counter = collections.Counter()
    comm: collections.Counter = collections.Counter()
    for node, dvs in chosen.items():
        c = _cls(node)
        comp[c] += sum(d.compute_cost for d in dvs)
        comm[c] += sum(d.comm_cost for d in dvs)
    print(f"--- {'free' if forced is None else 'forced ' + str(forced)}: attention {placement_words(opt, placement)}")
    print("  AutoParallel compute us:", {k: round(v) for k, v in sorted(comp.items())})
    print("  AutoParallel comm us (edges into):", {k: round(v) for k, v in sorted(comm.items())})
    print("  step model:", step, {k: round(v) for k, v in step.by_collective.items()})


def placement_words(opt, placement) -> str:
    from shardings.strategies import kind_of

    for node, spec in placement.items():
        if getattr(node, "target", None) is torch.ops.doc_packed.attn_fwd.default:
            return " x ".join(kind_of(spec.input_specs[0].placements))
    return "?"


def _words(layout: dict) -> str:
    return " x ".join(layout.values())


def table(results: list[CaseResult], peak: float) -> str:
    rows = [
        "| case | mesh | B x S | docs | model | free choice | free ms | best forced | best ms | free/best | "
        "predicted MFU (free) | AP objective per layout (ms) | step model per layout (ms) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        c = r.case
        objs = "; ".join(f"{_words(s.forced)} {s.objective['total'] / 1e3:.1f}" for s in r.forced)
        steps = "; ".join(f"{_words(s.forced)} {s.step.ms:.1f}" for s in r.forced)
        mesh = " x ".join(f"{n} {s}" for n, s in zip(c.names, c.mesh))
        rows.append(
            f"| {c.name} | {mesh} | {c.B} x {c.S // 1024}k | {c.doc_len or 'one'} | {c.model} | {_words(r.free.layout)} "
            f"| {r.free.step.ms:.1f} | {_words(r.best.forced)} | {r.best.step.ms:.1f} | {r.free_vs_best:.3f} "
            f"| {r.free.step.mfu(peak):.2f} | free {r.free.objective['total'] / 1e3:.1f}; {objs} | {steps} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=None, help=f"comma-separated, of {', '.join(BY_NAME)}")
    ap.add_argument("--root-cause", action="store_true", help="the (cp 2, tp 2) case, AutoParallel's terms")
    ap.add_argument("--profile", action="store_true", help="cProfile one case's trace and solves")
    ap.add_argument("--json", default=None)
    add_dry_run(ap, "the first case (or --cases'), free and one forced layout: checks the script runs")
    args = ap.parse_args(argv)
    from doc_packed_testing.ap_compat import patch_autoparallel_for_torch

    patch_autoparallel_for_torch()
    from shardings.step_model import Rates

    peak = Rates.load().peak_tflops
    if args.root_cause:
        # the issue's model: 4 layers
        case = Case("cp2tp2-64k-4layers", (2, 2), ("cp", "tp"), 1, 64 * K, 2048, "e2e4", "SR")
        for ours, topo in ((False, False), (True, False), (False, True), (True, True)):
            print(f"=== our attention pricing {'on' if ours else 'off'}, explicit topology {'on' if topo else 'off'}")
            r = solve_case(case, layouts=[{"cp": "sequence", "tp": "heads"}], root_cause=True, our_pricing=ours,
                           topology=topo)
            for s in (r.free, *r.forced):
                print(f"  {'free' if s.forced is None else 'forced'} {_words(s.layout)}: AutoParallel objective "
                      f"{ {k: round(v) for k, v in s.objective.items()} }, step model {s.step.ms:.1f} ms")
        return
    cases = [BY_NAME[n] for n in args.cases.split(",")] if args.cases else CASES
    if args.profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        solve_case(cases[0], layouts=[])
        prof.disable()
        stats = pstats.Stats(prof).sort_stats("cumulative")
        stats.print_stats(40)
        stats.print_stats(r"(shardings|doc_packed)/", 30)  # ours: strategies, pricing, planner
        return
    results = []
    if args.dry_run:
        cases = cases[:1]
    for c in cases:
        t0 = time.perf_counter()
        r = solve_case(c, layouts=offered_layouts(c)[:1] if args.dry_run else None)
        results.append(r)
        print(
            f"{c.name}: free {_words(r.free.layout)} {r.free.step.ms:.1f} ms, best forced {_words(r.best.forced)} "
            f"{r.best.step.ms:.1f} ms, ratio {r.free_vs_best:.3f} (trace {r.trace_s:.0f} s, all {time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
        if args.json:  # after every case: a long matrix keeps what it finished
            _write_json(args.json, results, peak)
    print(table(results, peak))


def _write_json(path: str, results: list[CaseResult], peak: float) -> None:
    def solved(s: Solved) -> dict:
        return dict(
            forced=s.forced, layout=s.layout, ms=s.step.ms, step=str(s.step), objective=s.objective, solve_s=s.solve_s
        )

    rows = [
        dict(
            case=r.case.__dict__,
            free=solved(r.free),
            forced=[solved(s) for s in r.forced],
            free_vs_best=r.free_vs_best,
            mfu=r.free.step.mfu(peak),
            trace_s=r.trace_s,
        )
        for r in results
    ]
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
