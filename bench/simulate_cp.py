"""Context parallelism at scale, on paper: our real planner against analytical peer designs.

The command line of the simulation: it runs a grid of (distribution, tokens per CP group, CP
size) points, or with --validate the points of a measured bench/bench_cp.py run, through the
model in bench/cp_model.py (its docstring has every formula), prints the tables and, with --out,
writes the plots of bench/cp_plots.py.

Usage:
    python -m bench.simulate_cp --quick              # reduced grid, < 1 minute
    python -m bench.simulate_cp --out docs/          # full grid, tables + docs/sim_*.png
    python -m bench.simulate_cp --validate docs/results/bench_cp_2xh200.json --out docs/
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import numpy as np
import torch

from bench._harness import add_dry_run
from bench.cp_model import (
    A2A_GBPS,
    AG_GBPS,
    BF16,
    DISTS,
    HEAD_DIM,
    HKV,
    HQ,
    TFLOPS,
    TOLERANCE,
    Model,
    RowMask,
    evaluate,
    fit_exchange,
    make_layout,
    token_label,
    validate,
)

# ---- grid ------------------------------------------------------------------------------------
CP_SIZES = [8, 16, 32, 64, 128, 256, 512, 1024]
TOKENS = [1 << 17, 1 << 19, 1 << 21, 1 << 23]  # 128k, 512k, 2M, 8M
QUICK_CP = [8, 64, 256]
QUICK_TOKENS = [1 << 17, 1 << 19]
MIN_TOKENS_PER_RANK = 64
GOAL_CP = 64
SEED = 2026


def _run_grid(dists: list[str], tokens: list[int], cps: list[int], rows: int, seed: int, m: Model,
              repeats: int, call_cost=None) -> list[dict]:
    """:func:`evaluate` at every grid point with T/c >= 64; progress on stderr."""
    results = []
    for dist in dists:
        for T in tokens:
            layout = make_layout(dist, T, rows, seed)
            masks = [RowMask(docs) for docs in layout.rows]
            for c in cps:
                if T // c < MIN_TOKENS_PER_RANK:
                    continue
                t0 = time.perf_counter()
                results.append(evaluate(dist, T, c, layout, masks, m, repeats, call_cost))
                print(f"  {dist:14s} T={token_label(T):>5s} c={c:<5d} "
                      f"{time.perf_counter() - t0:6.2f}s", file=sys.stderr, flush=True)
    return results


# ---- reporting ------------------------------------------------------------------------------
def _mb(b: float) -> str:
    return "n/a" if math.isnan(b) else f"{b / 1e6:.1f}"


def markdown_table(headers: list[str], rows: list[list]) -> str:
    """A markdown table (also bench/bench_packing.py's)."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(x) for x in r) + " |" for r in rows]
    return "\n".join(lines)


def _traffic_table(res: list[dict]) -> str:
    rows = []
    for r in res:
        rows.append([
            r["dist"], token_label(r["T"]), r["docs"], r["c"], f"{r['imb']:.3f}", f"{r['heap_imb']:.3f}",
            r["kv_max"], f"{r['kv_mean']:.0f}", r["q_max"], r["heap_kv_max"], r["kv_lb"],
            _mb(r["ours_kv_bytes"]), _mb(r["ours_bytes"]), _mb(r["heap_bytes"]),
            _mb(r["ag_bytes"]), _mb(r["uly_bytes"]),
            f"{100 * r['ours_kv_bytes'] / r['ag_bytes']:.1f}%",
        ])
    return markdown_table(
        ["dist", "T", "docs", "cp", "imb ours", "imb heap", "kv max", "kv mean", "q moved max",
         "heap kv max", "kv LB", "ours K/V MB", "ours MB", "heap MB", "all-gather MB", "Ulysses MB",
         "ours K/V / AG"], rows)


def _summary_table(res: list[dict], c: int) -> str:
    """The goal's view: one row per (distribution, T) at one CP size."""
    rows = []
    for r in (r for r in res if r["c"] == c):
        kvb, heap = r["ours_kv_bytes"], r["heap_kv_bytes"]
        lb = f"{100 * r['kv_lb'] / r['kv_max']:.0f}%" if r["kv_max"] else "-"
        rows.append([
            r["dist"], token_label(r["T"]), _mb(kvb), _mb(heap), _mb(r["ag_bytes"]),
            f"{100 * kvb / r['ag_bytes']:.1f}%", lb, f"{kvb / heap:.2f}" if heap else "-",
            f"{r['imb']:.3f}", f"{r['heap_imb']:.3f}",
        ])
    return markdown_table(["dist", "T", "ours K/V MB", "min-heap K/V MB", "all-gather MB", "ours / AG",
                   "lower bound / ours", "ours / min-heap", "imb ours", "imb min-heap"], rows)


def _timing_table(res: list[dict], cps: list[int]) -> str:
    cell = {(r["dist"], r["T"], r["c"]): r["plan_s"] for r in res}
    keys = sorted({(r["dist"], r["T"]) for r in res}, key=lambda k: (DISTS.index(k[0]), k[1]))
    rows = []
    for dist, T in keys:
        row = [dist, token_label(T)]
        for c in cps:
            s = cell.get((dist, T, c))
            row.append("-" if s is None else f"{s * 1e3:.1f}")
        rows.append(row)
    return markdown_table(["dist", "T"] + [f"cp {c} (ms)" for c in cps], rows)


def _loglog_slope(xs, ys) -> float:
    if len(xs) < 2:
        return math.nan
    return float(np.polyfit(np.log(xs), np.log(ys), 1)[0])


def _slopes(res: list[dict]) -> tuple[list[list], list[list]]:
    """Growth exponents of planner time: vs tokens at fixed cp, vs cp at fixed tokens."""
    by_tokens, by_cp = [], []
    for dist in DISTS:
        mine = [r for r in res if r["dist"] == dist]
        for c in sorted({r["c"] for r in mine}):
            pts = sorted((r["T"], r["plan_s"]) for r in mine if r["c"] == c)
            if len(pts) >= 2:
                by_tokens.append([dist, c, _loglog_slope(*zip(*pts))])
        for T in sorted({r["T"] for r in mine}):
            pts = sorted((r["c"], r["plan_s"]) for r in mine if r["T"] == T)
            if len(pts) >= 2:
                by_cp.append([dist, T, _loglog_slope(*zip(*pts))])
    return by_tokens, by_cp


def _slope_table(by_tokens, by_cp) -> str:
    flag = lambda s: f"{s:.2f}" + (" **>1.2**" if s > 1.2 else "")  # noqa: E731
    a = markdown_table(["dist", "cp", "slope vs tokens"], [[d, c, flag(s)] for d, c, s in by_tokens])
    b = markdown_table(["dist", "T", "slope vs cp"], [[d, token_label(T), flag(s)] for d, T, s in by_cp])
    return a + "\n\n" + b


def _step_table(res: list[dict]) -> str:
    rows = []
    def ms(s):
        return "n/a" if math.isnan(s) else f"{s * 1e3:.2f}"

    def sp(r, k):
        return "n/a" if math.isnan(r["step"][k]) else f"{r['t1'] / r['step'][k]:.1f}"

    for r in res:
        st = r["step"]
        rows.append([
            r["dist"], token_label(r["T"]), r["c"], f"{r['ag_imb']:.2f}", ms(r["t1"]), ms(st["ours"]),
            ms(st["ours_overlap"]),
            ms(st["allgather"]), ms(st["allgather_ideal"]), ms(st["ulysses"]), ms(st["minheap"]),
            sp(r, "ours"), sp(r, "ours_overlap"), sp(r, "allgather"), sp(r, "allgather_ideal"),
            sp(r, "ulysses"), sp(r, "minheap"),
        ])
    return markdown_table(
        ["dist", "T", "cp", "AG head-tail imb", "1 GPU ms", "ours ms", "ours staged ms", "AG head-tail ms",
         "AG balanced ms", "Ulysses ms", "min-heap ms", "speedup ours", "speedup ours staged", "speedup AG head-tail",
         "speedup AG balanced", "speedup Ulysses", "speedup heap"], rows)


# ---- goals ----------------------------------------------------------------------------------
def _check_goals(res: list[dict], by_tokens, by_cp) -> list[tuple[bool | str, str]]:
    """(passed, line) per check; G3' lines are diagnostics ("info"), not counted."""
    out = []
    at = [r for r in res if r["c"] == GOAL_CP]
    for r in at:
        if r["dist"] in ("lognormal-512", "lognormal-2k"):
            ratio = r["ours_kv_bytes"] / r["ag_bytes"]
            tot = r["ours_bytes"] / r["ag_bytes"]
            lb = r["kv_lb"] * HKV * HEAD_DIM * 2 * BF16 / r["ag_bytes"]
            out.append((ratio <= 0.10,
                        f"G1 K/V bytes <= 10% of all-gather  {r['dist']} T={token_label(r['T'])} "
                        f"cp={GOAL_CP}: {100 * ratio:.1f}% (incl. moved queries {100 * tot:.1f}%; "
                        f"any plan >= {100 * lb:.1f}%)"))
    for r in at:
        out.append((r["imb"] <= 1.05,
                    f"G2 imbalance <= 1.05               {r['dist']} T={token_label(r['T'])} "
                    f"cp={GOAL_CP}: {r['imb']:.3f}"))
    for r in at:
        ok = r["kv_max"] < r["heap_kv_max"] and r["imb"] <= r["heap_imb"]
        out.append((ok,
                    f"G3 K/V < min-heap, balance <= heap {r['dist']} T={token_label(r['T'])} "
                    f"cp={GOAL_CP}: kv {r['kv_max']} vs {r['heap_kv_max']}, "
                    f"imb {r['imb']:.3f} vs {r['heap_imb']:.3f}"))
        if not ok and r["matched"] is not None:
            kv, imb = r["matched"]
            out.append(("info" if kv < r["heap_kv_max"] and imb <= r["heap_imb"] else "info-fail",
                        f"G3' same, tolerance = heap's       {r['dist']} T={token_label(r['T'])} "
                        f"cp={GOAL_CP}: kv {kv} vs {r['heap_kv_max']}, "
                        f"imb {imb:.4f} vs {r['heap_imb']:.4f}"))
    for r in res:
        if r["T"] == 1 << 17 and r["c"] == 16 and r["dist"] in ("lognormal-512", "lognormal-2k"):
            out.append((r["plan_s"] <= 0.010,
                        f"G4 planner <= 10 ms                {r['dist']} T=128k cp=16: "
                        f"{r['plan_s'] * 1e3:.2f} ms"))
    worst_t = max(by_tokens, key=lambda x: x[2], default=None)
    worst_c = max(by_cp, key=lambda x: x[2], default=None)
    if worst_t:
        out.append((worst_t[2] <= 1.2, f"G5 time vs tokens slope <= 1.2 (worst: {worst_t[0]} "
                                       f"cp={worst_t[1]}): {worst_t[2]:.2f}"))
    if worst_c:
        out.append((worst_c[2] <= 1.2, f"G5 time vs cp slope <= 1.2 (worst: {worst_c[0]} "
                                       f"T={token_label(worst_c[1])}): {worst_c[2]:.2f}"))
    return out


# ---- validation tables --------------------------------------------------------------------
def _err(pred: float, meas: float) -> str:
    return f"{100 * (pred - meas) / meas:+.1f}%"


def _validation_tables(res: list[dict]) -> str:
    main = []
    for r in res:
        main.append([
            token_label(r["S"]), r["layout"], f"{r['one_gpu_ms']:.1f}", f"{r['ours_ms']:.1f}",
            f"{r['ours_pred_ms']:.1f}", _err(r["ours_pred_ms"], r["ours_ms"]),
            f"{r['ours_overlap_ms']:.1f}", _err(r["ours_overlap_ms"], r["ours_ms"]), max(r["calls"]),
            f"{r['ag_ms']:.1f}", f"{r['ag_pred_ms']:.1f}", _err(r["ag_pred_ms"], r["ag_ms"]),
        ])
    cp = "CP=" + "/".join(str(c) for c in dict.fromkeys(r["c"] for r in res))  # the runs' "gpus"
    a = markdown_table(["S", "layout", "measured 1 GPU ms", f"measured {cp} ms", f"predicted {cp} ms",
                "error", "staged + overlap ms", "error", "kernel calls (max rank)",
                "measured all-gather ms", "predicted all-gather ms", "error"], main)
    diag = []
    for r in res:
        diag.append([
            token_label(r["S"]), r["layout"], r["docs"], "yes" if r["same_plan"] else "**NO**",
            f"{r['tflops']:.0f}", f"{r['imb']:.4f}", f"{r['ours_compute_ms']:.2f}",
            f"{r['ours_comm_ms']:.2f}", _mb(r["ours_bytes"]),
            f"{r['ours_ms'] - r['ours_pred_ms']:+.2f}",
            f"{r['refetch_pred_ms']:.2f}", f"{r['refetch_ms']:.2f}",
            f"{r['ag_imb']:.3f}", f"{r['ag_ms'] - r['ag_pred_ms']:+.2f}",
        ])
    b = markdown_table(["S", "layout", "docs", "plan = run's", "effective TFLOP/s (1 GPU)",
                "imb ours", "ours compute ms", "ours exchange ms", "ours MB fwd+bwd",
                "ours measured - predicted ms", "refetch predicted ms", "refetch measured ms",
                "AG head-tail imb", "AG measured - predicted ms"], diag)
    return a + "\n\n" + b


def _calls_table(res: list[dict]) -> str:
    """Per-GPU efficiency of our staged design priced call by call, one row per (dist, T)."""
    pts = [r for r in res if r["t1_calls"] is not None]
    cps = sorted({r["c"] for r in pts})
    lines = ["| distribution | T | " + " | ".join(f"CP {c}" for c in cps) + " |",
             "|---|---|" + "---|" * len(cps)]
    for dist in dict.fromkeys(r["dist"] for r in pts):
        for T in sorted({r["T"] for r in pts if r["dist"] == dist}):
            cells = []
            for c in cps:
                r = next((x for x in pts if (x["dist"], x["T"], x["c"]) == (dist, T, c)), None)
                cells.append("-" if r is None else f"{r['t1_calls'] / (c * r['step']['ours_calls']):.2f}")
            lines.append(f"| {dist} | {token_label(T)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---- main -----------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="reduced grid (< 1 minute)")
    add_dry_run(p, "two points (128k tokens, CP 8 and 16, one distribution), one timing each, no plots")
    p.add_argument("--rows", type=int, default=1, help="packed rows per CP group (B); S = T/B")
    p.add_argument("--cp", type=int, nargs="+", help="CP sizes (default: 8 .. 1024)")
    p.add_argument("--tokens", type=int, nargs="+", help="tokens per CP group")
    p.add_argument("--dists", nargs="+", choices=DISTS, help="distributions")
    p.add_argument("--repeats", type=int, default=5, help="build_plan timings per point (median)")
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--tflops", type=float, default=TFLOPS, help="attention fwd+bwd TFLOP/s")
    p.add_argument("--a2a-gbps", type=float, default=A2A_GBPS, help="all-to-all GB/s per rank")
    p.add_argument("--ag-gbps", type=float, default=AG_GBPS, help="all-gather GB/s per rank")
    p.add_argument("--a2a-fixed-ms", type=float, default=0.0,
                   help="fixed exchange cost per layer fwd+bwd of the all-to-all designs "
                        "(ours, min-heap, Ulysses); fit it with --validate")
    p.add_argument("--ag-fixed-ms", type=float, default=0.0,
                   help="fixed exchange cost per layer fwd+bwd of the all-gather designs")
    p.add_argument("--launch-us", type=float, default=0.0,
                   help="host cost per kernel call of ours in the staged model (--validate counts "
                        "each rank's calls from the runtime's schedule)")
    p.add_argument("--out", help="directory for sim_*.png plots (e.g. docs/)")
    p.add_argument("--plot-tokens", type=int, default=1 << 21, help="T shown in plots (a), (b)")
    p.add_argument("--call-cost", action="store_true",
                   help="also price our staged design call by call: each rank's stage A and B kernel calls at "
                   "the rates of bench/cp_call_cost.py (fitted to the one-GPU emulation; CP <= 64)")
    p.add_argument("--fit-calls", nargs="+", metavar="JSON",
                   help="--call-cost with rates fitted to these bench_cp_emulate.py JSONs (printed) instead")
    p.add_argument("--validate", metavar="JSON",
                   help="instead of the grid: predict the CP runs measured by bench/bench_cp.py "
                        "(e.g. docs/results/bench_cp_2xh200.json) and compare; with --out, "
                        "also writes sim_validation.png")
    return p.parse_args(argv)


def _fixed_note(m: Model) -> str:
    if not (m.a2a_fixed_ms or m.ag_fixed_ms):
        return ""
    return (f", fixed exchange cost per layer fwd+bwd {m.a2a_fixed_ms:g} ms (all-to-all designs) / "
            f"{m.ag_fixed_ms:g} ms (all-gather)")


def _main_validate(args, m: Model) -> int:
    res = validate(args.validate, m)
    print(f"# Step-time model vs measured CP runs ({args.validate})\n")
    print(f"Hq={m.hq}, Hkv={m.hkv}, D={m.d}, bf16, causal; planner query_cost={m.hq / m.hkv:g}, "
          f"tolerance={TOLERANCE}; compute rate per point = the measured one-GPU fwd+bwd of that "
          f"layout; all-to-all {m.a2a_gbps:g} GB/s (ours), all-gather {m.ag_gbps:g} GB/s"
          f"{_fixed_note(m)}; "
          "error = (predicted - measured) / measured; \"predicted\": compute + exchange, no overlap; "
          "\"staged + overlap\": stage A under the exchange, stage B after it, results home after "
          f"that (cp_model.Model.overlap_s), {m.launch_us:g} us per kernel call\n")
    print(_validation_tables(res))
    print("\nFit of the non-compute time (measured - compute at the one-GPU rate, ms, in the "
          "order of the table) as fixed + bytes / bandwidth:\n")
    print(markdown_table(["design", "points", "measured - compute ms", "fixed ms", "GB/s",
                  "max |residual| ms"], fit_exchange(res)))
    if args.out:
        from bench import cp_plots

        print(f"\nwrote {cp_plots.validation_plot(res, m, args.out)}")
    return 0 if all(r["same_plan"] for r in res) else 1


def main(argv: list[str] | None = None) -> int:
    """Run the grid (or --validate), print the tables, write the plots; the exit status."""
    args = parse_args(argv)
    torch.set_num_threads(1)
    cps = args.cp or (QUICK_CP if args.quick else CP_SIZES)
    tokens = args.tokens or (QUICK_TOKENS if args.quick else TOKENS)
    dists = args.dists or DISTS
    if args.dry_run:
        cps, tokens, dists, args.repeats, args.out = [8, 16], [1 << 17], dists[:1], 1, None
    m = Model(tflops=args.tflops, a2a_gbps=args.a2a_gbps, ag_gbps=args.ag_gbps,
              a2a_fixed_ms=args.a2a_fixed_ms, ag_fixed_ms=args.ag_fixed_ms, launch_us=args.launch_us)
    if args.validate:
        return _main_validate(args, m)
    call_cost = None
    if args.call_cost or args.fit_calls:
        from bench import cp_call_cost

        call_cost = cp_call_cost.H200_FA4
        if args.fit_calls:
            call_cost, mean, worst = cp_call_cost.fit(args.fit_calls)
            print(f"call rates fitted to {len(args.fit_calls)} file(s): {call_cost} "
                  f"(mean error {mean:.1%}, worst {worst:.1%})")
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    res = _run_grid(dists, tokens, cps, args.rows, args.seed, m, args.repeats, call_cost)
    wall = time.perf_counter() - t0
    by_tokens, by_cp = _slopes(res)

    print("# Context-parallel simulation "
          "(our real planner; analytical peers; not GPU measurements)")
    print(f"\nrows per CP group B={args.rows}, seed={args.seed}, causal, Hq={HQ}, Hkv={HKV}, "
          f"D={HEAD_DIM}, bf16; planner query_cost={HQ / HKV:g}, tolerance={TOLERANCE}; "
          f"model: {m.tflops:g} TFLOP/s, all-to-all {m.a2a_gbps:g} GB/s, "
          f"all-gather {m.ag_gbps:g} GB/s{_fixed_note(m)}\n")
    if any(r["c"] == GOAL_CP for r in res):
        print(f"## Summary at CP={GOAL_CP} "
              "(K/V bytes per rank per layer, forward, max over ranks)\n")
        print(_summary_table(res, GOAL_CP))
        print()
    print("## Traffic and balance (bytes per rank per layer, forward, max over ranks)\n")
    print(_traffic_table(res))
    print("\n## Planner CPU time (build_plan, median process CPU ms, torch.set_num_threads(1))\n")
    print(_timing_table(res, cps))
    print("\n## Growth exponents of planner time (log-log slope)\n")
    print(_slope_table(by_tokens, by_cp))
    print("\n## Predicted attention step time per layer (fwd+bwd) and speedup over one GPU\n")
    print(_step_table(res))
    if call_cost is not None:
        print(f"\n## Per-GPU efficiency, staged design priced call by call ({call_cost})\n")
        print("one GPU (the same rates, one call over the row) / (c x slowest rank's staged step); "
              "exchange at the all-to-all bandwidth above, overlapped with stage A\n")
        print(_calls_table(res))
    print("\n## Goal checks\n")
    goals = _check_goals(res, by_tokens, by_cp)
    for ok, line in goals:
        tag = {"info": "info (would pass)", "info-fail": "info (would fail)"}.get(ok)
        print(f"{tag or ('PASS' if ok else 'FAIL')}  {line}")
    counted = [ok for ok, _ in goals if not isinstance(ok, str)]
    print(f"\n{sum(counted)}/{len(counted)} checks pass; grid of {len(res)} points "
          f"in {wall:.0f} s wall; load average before/after: {load0:.2f}/{os.getloadavg()[0]:.2f} "
          f"on {os.cpu_count()} CPUs")
    if args.out:
        from bench import cp_plots

        for path in cp_plots.grid_plots(res, args.out, args.plot_tokens):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
