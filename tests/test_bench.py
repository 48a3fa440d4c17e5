"""Every benchmark script runs once, as ``python -m bench.<script> --dry-run``: a tiny size on CPU,
so a script that no longer runs fails here (the figures of a dry run mean nothing). Scripts
that need AutoParallel skip without it, as the AutoParallel tests do. Importing a script runs
nothing (no command-line parsing at import)."""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# script: (arguments after --dry-run, needs AutoParallel, slow: ~10 s or more on 2 cores)
DRY_RUNS = {
    "accuracy": ([], False, False),
    "bench_op": ([], False, False),
    "bench_overhead": ([], False, False),
    "bench_variants": ([], False, False),
    "bench_autograd_thread": ([], False, False),
    "bench_cp_reductions": ([], False, False),
    "bench_cp_emulate": ([], False, False),
    "profile_cp_rank": (["--autograd", "--autograd-threads", "off"], False, True),
    "bench_packing": ([], False, False),
    "bench_cp_host": ([], False, True),
    "bench_cp_first_call": (["--profile"], False, False),
    "soak_cp": ([], False, True),
    "bench_agreement": ([], False, True),
    "bench_cp": (["--sizes", "512", "--quick"], False, True),
    "bench_e2e": (
        ["--gpus", "2", "--seq", "256", "--batch", "2", "--mean-doc", "48", "--steps", "1", "--warmup", "1",
         "--modes", "cp", "--threads", "launched", "--no-anchor", "--profile", "{tmp}", "--trace-steps", "0",
         "--call-stats"],
        True, True,
    ),
    "bench_emulate": (["--seq", "256", "--layouts", "cp", "--docs", "lognormal", "--steps", "1", "--warmup", "1",
                       "--rounds", "1", "--skip-eager", "--compile", "eager"], True, True),
    "ap_scenarios": ([], True, True),
    "bench_step_model": ([], True, True),
    "bench_solve": ([], True, True),
    "simulate_cp": ([], False, False),
    "bench_packing_ab": ([], False, False),
    "measure_doc_cost": ([], False, False),
    "measure_collectives": ([], False, True),
    "trace_collectives": ([], False, False),
    "e2e_targets": ([], False, False),
}
# scripts without a CPU dry run yet: what they measure is FA4's own entry points (bench_gqa_rows,
# bench_host_layers, bench_first_call) or CUDA rates (measure_rates), with nothing on CPU to stand in
NO_DRY_RUN_YET = {"bench_first_call", "bench_gqa_rows", "bench_host_layers", "measure_rates"}


def _scripts() -> set[str]:
    return {
        p.stem
        for p in (ROOT / "bench").glob("*.py")
        if "__main__" in p.read_text() and p.stem != "__init__"
    }


def test_every_script_is_listed():
    assert _scripts() == set(DRY_RUNS) | NO_DRY_RUN_YET


def test_every_script_parses_only_in_main():
    """``main(argv=None)`` parses the command line; nothing at module level does."""
    bad = []
    for name in sorted(_scripts()):
        tree = ast.parse((ROOT / "bench" / f"{name}.py").read_text())
        mains = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"]
        if not mains or not mains[0].args.args or mains[0].args.args[0].arg != "argv":
            bad.append(f"{name}: no main(argv)")
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.If)):
                continue
            if any(isinstance(n, ast.Attribute) and n.attr in ("argv", "parse_args") for n in ast.walk(node)):
                if "parse_args([])" not in ast.unparse(node):  # the defaults, not the command line
                    bad.append(f"{name}:{node.lineno} reads the command line at import")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=[pytest.mark.slow] if DRY_RUNS[n][2] else []) for n in DRY_RUNS],
)
def test_dry_run(name, tmp_path):
    """``{tmp}`` in a script's arguments is a scratch folder: what the script writes there is checked."""
    extra, needs_autoparallel, _ = DRY_RUNS[name]
    extra = [a.replace("{tmp}", str(tmp_path)) for a in extra]
    if needs_autoparallel:
        pytest.importorskip("autoparallel")
        pytest.importorskip("pulp")
    cmd = [sys.executable, "-m", f"bench.{name}", "--dry-run", *extra]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, f"{' '.join(cmd)}:\n{run.stdout[-3000:]}\n{run.stderr[-5000:]}"
    if name == "bench_e2e":  # --profile: each rank's host time, and rank 0's profiles of both kinds
        text = (tmp_path / "profile_cp.txt").read_text()
        assert text.startswith("host ms to queue") and "1: " in text.splitlines()[0]
        assert "rank 0: cProfile" in text and "doc_packed::attn_fwd" in text
        calls = text.split("attention calls in order, host ms each: ")[1].splitlines()[0].split(", ")
        assert [c.split()[0] for c in calls] == ["attn_fwd"] * 2 + ["attn_bwd"] * 2  # the dry run's 2 layers
        # the timed step's calls, the first of each pass on its layout apart, on both ranks
        line = next(x for x in run.stdout.splitlines() if "host ms per attention call, first of its pass" in x)
        assert "r0 " in line and "r1 " in line, line
        # and, in brackets, the same without the agreement's wait: never more than the whole
        calls = re.findall(r"r\d ([\d.]+) / ([\d.]+) \(([\d.]+) / ([\d.]+)\)", line)
        for first, other, first_work, other_work in calls:
            assert float(first_work) <= float(first) and float(other_work) <= float(other), line
        assert len(re.findall(r"r\d [\d.]+ / [\d.]+ \(", line)) == 2, line
        # the exchanges' and the kernel calls' shares of the same calls: within the call's own work
        split = next(x for x in run.stdout.splitlines() if "of which exchanges / kernel calls" in x)
        shares = re.findall(r"r\d ([\d.]+) / ([\d.]+), ([\d.]+) / ([\d.]+)", split)
        assert len(shares) == 2, split
        for (_, _, fw, ow), (fx, ox, fk, ok) in zip(calls, shares):
            assert float(fx) + float(fk) <= float(fw) + 0.02 and float(ox) + float(ok) <= float(ow) + 0.02, split
            assert float(fk) > 0 and float(ok) > 0, split
        # the slowest step against its own layout's predicted time: a ratio to the median, >= 1
        adjusted = next(x for x in run.stdout.splitlines() if "against each step's own layout" in x)
        assert float(adjusted.rsplit(":", 1)[1]) >= 1.0, adjusted
        # --trace-steps 0: the first timed step traced on both ranks, the attention op in its table
        for rank in (0, 1):
            (table,) = tmp_path.glob(f"trace_cp_*threads_step0_rank{rank}.txt")
            assert "doc_packed::attn_fwd" in table.read_text()
            assert table.with_suffix(".json").stat().st_size > 0
        # --call-stats: every rank's calls one by one, each pass's first call apart from the later
        # ones (the dry run's 2 layers: one of each per pass and step), the agreement's wait taken
        # out of the wall time, never more than it
        for rank in (0, 1):
            line = next(x for x in run.stdout.splitlines() if x.strip().startswith(f"r{rank} per call"))
            got = re.findall(r"(forward|backward) (first|later) x(\d+) (\d+) / (\d+) / (\d+)", line)
            assert sorted((p, w, int(n)) for p, w, n, *_ in got) == [
                ("backward", "first", 1), ("backward", "later", 1), ("forward", "first", 1), ("forward", "later", 1)
            ], line
            assert all(int(work) <= int(wall) for *_, wall, work, _ in got), line
        # the slowest steps' stall counters: every rank's, the context switches counted
        stalls = [x for x in run.stdout.splitlines() if "allocators, faults, switches" in x]
        assert stalls and all("r0 " in x and "r1 " in x and "switches" in x for x in stalls), stalls
    if name == "e2e_targets":  # session 25's 1 x 128k file: its cp run's 672 ms collection broke the 1.5 bound
        assert "1.84 (1.85) **not met**" in run.stdout and "targets met: 4 of 5" in run.stdout, run.stdout
    if name == "bench_cp_first_call":  # each rank's passes, new layout against reused, and the profile
        rows = [r.split(" | ") for r in run.stdout.splitlines() if r.startswith("| 1 x 1024 ")]
        assert sorted((r[1], r[2]) for r in rows) == [("0", "backward"), ("0", "forward"), ("1", "backward"), ("1", "forward")]
        assert all(float(x.strip(" |")) > 0 for r in rows for x in r[7:10]), rows
        assert all(float(x) > 0 for r in rows for x in r[10].split(", ")), rows  # the anchor's first and later calls
        assert "cProfile, 1 x 1024, rank 1 of 2" in run.stdout
    if name == "trace_collectives":  # rank 0 waits 100 us at each of 3 calls, then both move for 50 us
        rows = {r.split(" | ")[0][2:]: r.split(" | ")[2:6] for r in run.stdout.splitlines() if r.startswith("| 0 ") or r.startswith("| 1 ")}
        assert rows == {"0": ["3", "450", "300", "150"], "1": ["3", "150", "0", "150"]}, run.stdout
    if name == "measure_collectives":  # 4 ranks: each of the 6 pairs, each mesh dim's groups, the world; 3 kinds each
        rows = [x for x in run.stdout.splitlines() if x.startswith("| ") and not x.startswith("| group")]
        groups = {r.split(" | ")[0][2:] for r in rows}
        assert len(groups) == 6 + 2 + 1 and len(rows) == 3 * len(groups), run.stdout
        assert {r.split(" | ")[1] for r in rows} == {"all_to_all", "all_gather", "reduce_scatter"}
