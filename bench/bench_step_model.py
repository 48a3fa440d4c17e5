"""The step model against measured training steps: per op (eager) and fused (compiled).

For each recorded ``bench.bench_e2e`` run (``docs/results/*.json``: mesh, batch, row length,
forced attention layout, measured step), the same model (``doc_packed_examples.model.Transformer``, 4
layers, dim 2048, 16/4 heads, vocab 8192, bf16) is traced and solved again on CPU with
AutoParallel's fake process group and the same constraints, and the solution is priced by
:func:`shardings.step_model.price_placement` both ways. The anchor is the measured step (mean
and median of the run's timed steps): measured / model within 15% is the goal
(docs/scenarios.md, "The step model against measured steps"). Needs AutoParallel. The documents are priced at their mean length (2k),
not the run's own first layout.

    python -m bench.bench_step_model [--runs 2x-128k-cp 2x-32k-dp ...]   # --dry-run: the first run only
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

import torch

import doc_packed as dp
from bench._harness import add_dry_run

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "results")
K = 1024
# name: (results file, mode, mesh, dim names, B, S, input placements per dim, forced layout)
RUNS = {
    "2x-128k-cp": ("s14_e2e_2xh200_128k.json", "cp", (2,), ("x",), 1, 128 * K, "S", {"x": "sequence"}),
    "2x-32k-dp": ("s14_e2e_2xh200_32k.json", "dp", (2,), ("x",), 2, 32 * K, "B", {"x": "batch"}),
    "2x-32k-cp": ("s14_e2e_2xh200_32k.json", "cp", (2,), ("x",), 2, 32 * K, "S", {"x": "sequence"}),
    "4x-128k-cp": ("s14_e2e4_128k_flash_allpairs.json", "cp", (4,), ("x",), 1, 128 * K, "S", {"x": "sequence"}),
    "4x-64k-dp_cp": (
        "s14_e2e4_dpcp.json", "dp_cp", (2, 2), ("dp", "cp"), 2, 64 * K, "BS", {"dp": "batch", "cp": "sequence"},
    ),
}  # fmt: skip


def measured(file: str, mode: str) -> tuple[float, float, str]:
    """(mean, median) step ms of ``mode`` in a bench_e2e JSON, and the device line."""
    with open(os.path.join(RESULTS, file)) as f:
        rows = json.load(f)
    run = next(r for r in rows[1:] if r.get("mode") == mode)
    return 1e3 * run["step_s"], 1e3 * statistics.median(run["step_times_s"]), run.get("compile", "")


def priced(mesh_shape, names, B, S, inputs, forced):
    """(per-op, fused) StepEstimate of the solved placement."""
    from bench import ap_scenarios as scen
    from doc_packed_testing.ap_compat import device_name_for_cost_model
    from autoparallel.api import AutoParallel
    from autoparallel.shardings.placement_options import reset_placement_options_cache
    from torch.distributed.device_mesh import init_device_mesh

    from doc_packed_examples.model import Transformer
    from shardings.autoparallel import cost_model_for, force_attention_layout
    from shardings.costs import pricing
    from shardings.step_model import Layout, Rates, Topology, price_placement

    scen.fake_world()
    reset_placement_options_cache()
    cfg = scen.MODELS["e2e4"]
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    with torch.device("meta"):
        model = Transformer(**cfg).to(torch.bfloat16)

    def input_fn():
        return torch.randint(0, cfg["vocab"], (B, S)), torch.zeros(B, S // 8 + 1, dtype=torch.int32)

    rates, topo, layout = Rates.load(), Topology(8), Layout(2048)
    with contextlib.ExitStack() as stack:
        stack.enter_context(device_name_for_cost_model())
        stack.enter_context(dp.planning(doc_len=2048))
        stack.enter_context(pricing(mesh, rates=rates, gpus_per_host=8))
        autop = stack.enter_context(AutoParallel(model, input_fn, mesh, cost_model=cost_model_for(mesh, 8)))
        scen._input_constraints(autop, scen.Case("run", mesh_shape, names, B, S, 2048, "e2e4", inputs))
        force_attention_layout(autop, forced)
        placement = autop.optimize_placement()
        nodes = autop.gm.graph.nodes
        return tuple(
            price_placement(nodes, placement, rates=rates, topology=topo, layout=layout, fused=f) for f in (False, True)
        )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    add_dry_run(ap, "the first run only (a CPU solve, as always): checks the script runs")
    args = ap.parse_args(argv)
    if args.dry_run:
        args.runs = args.runs[:1]
    print(f"torch {torch.__version__}; measured: docs/results (H200s, torch 2.11.0+cu130); model re-solved here")
    print(
        "| run | measured ms (mean / median) | per-op model ms | measured / per-op | fused model ms | measured / fused (mean / median) |"
    )
    print("|---|---|---|---|---|---|")
    for name in args.runs:
        file, mode, mesh_shape, names, B, S, inputs, forced = RUNS[name]
        mean, med, _ = measured(file, mode)
        t0 = time.perf_counter()
        per_op, fused = priced(mesh_shape, names, B, S, inputs, forced)
        print(
            f"| {name} | {mean:.1f} / {med:.1f} | {per_op.ms:.1f} | {mean / per_op.ms:.2f} | {fused.ms:.1f} "
            f"| {mean / fused.ms:.2f} / {med / fused.ms:.2f} |",
            flush=True,
        )
        print(f"  per op: {per_op}\n  fused:  {fused}  ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
