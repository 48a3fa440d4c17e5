"""The training-loop issue's targets (#36) read from ``bench_e2e --json`` files: one table, each
figure beside its target and whether it is met.

Per GPU is tokens/s per GPU over the one-GPU plain model compiled in the same run (the anchor),
mean step (median in brackets); slowest / median is the raw ratio of the timed steps (in
brackets: each step against its own layout's priced work); measured / model is the mean step
over the step model's prediction; the free choice (a mode named ``auto`` or ``*_auto``) is
compared with the fastest forced mode of the same file and thread setting. Targets, from the
issue: per GPU cp >= 0.92 at 1 x 128k and >= 0.90 at 2 x 32k on 2 GPUs, cp >= 0.88 at 1 x 128k,
dp_cp >= 0.88 and cp_tp >= 0.80 on 4 GPUs; slowest / median <= 1.5; measured / model within
15%; the free choice at most 5% slower than the best forced layout.
Usage: ``python -m bench.e2e_targets RUN.json [RUN.json ...]``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics

from bench._harness import add_dry_run

# (GPUs, mode, rows, S) -> per GPU against the plain model compiled
PER_GPU = {
    (2, "cp", 1, 131072): 0.92,
    (2, "cp", 2, 32768): 0.90,
    (4, "cp", 1, 131072): 0.88,
    (4, "dp_cp", 2, 65536): 0.88,
    (4, "cp_tp", 1, 65536): 0.80,
}
SLOWEST_OVER_MEDIAN = 1.5
MODEL_WITHIN = 0.15
FREE_WITHIN = 0.05
# a file of the dry run: session 25's 2 x H200 run at 1 x 128k (before the header named B and S)
DRY_RUN_FILE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "results" / "s25_e2e2h200_128k.json"


def _free(mode: str) -> bool:
    return mode == "auto" or mode.endswith("_auto")


def _verdict(ok: bool | None) -> str:
    return "" if ok is None else (" met" if ok else " **not met**")


def rows_of(runs: list[list[dict]]) -> list[dict]:
    """One row per (file, mode, thread setting): the figures and each target's verdict (None:
    no target for that row)."""
    out = []
    for run in runs:
        head, modes = run[0], [r for r in run[1:] if "threads" in r]
        anchor = (head.get("anchor") or {}).get("compiled_tokens_per_s")
        world, B, S = head["world"], head.get("batch"), head.get("seq")
        forced_best: dict[str, float] = {}
        for r in modes:
            if not _free(r["mode"]):
                for threads, t in r["threads"].items():
                    forced_best[threads] = min(forced_best.get(threads, float("inf")), t["step_s"])
        for r in modes:
            for threads, t in r["threads"].items():
                tokens = t["tokens_per_s"] * t["step_s"]
                median = statistics.median(t["step_times_s"])
                per_gpu = None if anchor is None else t["tokens_per_s"] / world / anchor
                target = PER_GPU.get((world, r["mode"], B, S))
                slowest = max(t["step_times_s"]) / median
                model = t["step_s"] / r["predicted_step_s"] if r.get("predicted_step_s") else None
                best = forced_best.get(threads) if _free(r["mode"]) else None
                free = None if best is None else t["step_s"] / best - 1
                out.append(
                    dict(
                        gpus=world,
                        size=f"{B} x {S}" if B and S else f"{tokens:.0f} tokens",
                        mesh=head.get("mesh"),
                        mode=r["mode"],
                        attention=", ".join(f"{d} {v}" for d, v in (r.get("attention", {}).get("forward") or {}).items()),
                        launcher=head.get("launcher", "?"),
                        threads=threads,
                        per_gpu=per_gpu,
                        per_gpu_median=None if per_gpu is None else per_gpu * t["step_s"] / median,
                        per_gpu_target=target,
                        per_gpu_ok=None if target is None or per_gpu is None else per_gpu >= target,
                        slowest=slowest,
                        slowest_layout=t.get("slowest_vs_layout"),
                        slowest_ok=slowest <= SLOWEST_OVER_MEDIAN,
                        model=model,
                        model_ok=None if model is None else abs(model - 1) <= MODEL_WITHIN,
                        free=free,
                        free_ok=None if free is None else free <= FREE_WITHIN,
                    )
                )
    return out


def table(rows: list[dict]) -> list[str]:
    lines = [
        "| GPUs | B x S | mesh | mode (attention, forward) | launcher, threads | per GPU (median) | target "
        "| slowest / median (against its layout); target 1.5 | measured / model; target within 15% "
        "| free choice vs best forced; target <= 5% |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        per_gpu = "-" if r["per_gpu"] is None else f"{r['per_gpu']:.2f} ({r['per_gpu_median']:.2f})"
        target = "-" if r["per_gpu_target"] is None else f"{r['per_gpu_target']:.2f}{_verdict(r['per_gpu_ok'])}"
        layout = "" if r["slowest_layout"] is None else f" ({r['slowest_layout']:.2f})"
        model = "-" if r["model"] is None else f"{r['model']:.2f}{_verdict(r['model_ok'])}"
        free = "-" if r["free"] is None else f"{100 * r['free']:+.1f}%{_verdict(r['free_ok'])}"
        mesh = "-" if r["mesh"] is None else ", ".join(f"{n} {s}" for n, s in r["mesh"])
        lines.append(
            f"| {r['gpus']} | {r['size']} | {mesh} | {r['mode']} ({r['attention']}) | {r['launcher']}, "
            f"{r['threads']} | {per_gpu} | {target} | {r['slowest']:.2f}{layout}{_verdict(r['slowest_ok'])} "
            f"| {model} | {free} |"
        )
    verdicts = [r[k] for r in rows for k in ("per_gpu_ok", "slowest_ok", "model_ok", "free_ok") if r[k] is not None]
    lines.append(f"\ntargets met: {sum(verdicts)} of {len(verdicts)}")
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*", help="bench_e2e --json outputs")
    add_dry_run(ap, f"read {DRY_RUN_FILE.name} (a committed run) instead of the files given")
    args = ap.parse_args(argv)
    files = [DRY_RUN_FILE] if args.dry_run else args.files
    if not files:
        ap.error("give at least one bench_e2e --json file")
    runs = [json.loads(pathlib.Path(f).read_text()) for f in files]
    for line in table(rows_of(runs)):
        print(line)


if __name__ == "__main__":
    main()
