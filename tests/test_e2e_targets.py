"""bench/e2e_targets.py: each of the training-loop issue's targets read from bench_e2e's JSON,
met or not, on runs built here with known figures."""

from __future__ import annotations

import pytest

from bench import e2e_targets


def _run(world, batch, seq, mesh, modes, anchor_per_gpu=None):
    """A bench_e2e --json file: ``modes`` maps mode -> (per GPU against the anchor's compiled
    tokens/s, step times in s, predicted step s); the anchor is set so that the first mode's per
    GPU figure is ``anchor_per_gpu``."""
    rows, tokens = [], batch * seq
    anchor = None
    for mode, (per_gpu, times, predicted) in modes.items():
        step = sum(times) / len(times)
        tps = tokens / step
        if anchor is None:
            anchor = tps / world / per_gpu
        rows.append(
            dict(
                mode=mode,
                attention={"forward": {"cp": "sequence"}},
                predicted_step_s=predicted,
                threads={"64": dict(step_s=step, tokens_per_s=tps, step_times_s=times)},
            )
        )
    head = dict(world=world, batch=batch, seq=seq, mesh=mesh, launcher="spawn", anchor={"compiled_tokens_per_s": anchor})
    return [head, *rows]


def test_each_target_met_or_not():
    cptp = _run(
        4, 1, 65536, [["cp", 2], ["tp", 2]],
        {
            "cp_tp": (0.79, [0.05, 0.05, 0.05, 0.05, 0.08], 0.046),  # mean 0.056: 1.22 of its model
            "auto": (None, [0.06] * 5, 0.056),  # 1.07 of its model; against forced's 0.056: +7%
        },
    )
    cp2 = _run(2, 1, 131072, [["cp", 2]], {"cp": (0.93, [0.17, 0.18, 0.17, 0.25], 0.17)})
    rows = {(r["gpus"], r["mode"]): r for r in e2e_targets.rows_of([cptp, cp2])}
    tp = rows[(4, "cp_tp")]
    assert tp["per_gpu"] == pytest.approx(0.79) and tp["per_gpu_target"] == 0.80 and tp["per_gpu_ok"] is False
    assert tp["slowest"] == pytest.approx(0.08 / 0.05) and tp["slowest_ok"] is False
    assert tp["model"] == pytest.approx(0.056 / 0.046) and tp["model_ok"] is False
    assert tp["free"] is None  # a forced mode
    auto = rows[(4, "auto")]
    assert auto["per_gpu_target"] is None and auto["per_gpu_ok"] is None  # the free choice: no per-GPU bar
    assert auto["free"] == pytest.approx(0.06 / 0.056 - 1) and auto["free_ok"] is False
    assert auto["model"] == pytest.approx(0.06 / 0.056) and auto["model_ok"] is True
    cp = rows[(2, "cp")]
    assert cp["per_gpu"] == pytest.approx(0.93) and cp["per_gpu_ok"] is True  # target 0.92
    assert cp["slowest"] == pytest.approx(0.25 / 0.175) and cp["slowest_ok"] is True
    lines = e2e_targets.table(list(rows.values()))
    assert cp["model"] == pytest.approx(0.1925 / 0.17) and cp["model_ok"] is True  # 1.13
    # verdicts: cp_tp 0 of 3, auto 2 of 3 (slowest, model), cp 3 of 3
    assert lines[-1] == "\ntargets met: 5 of 9", lines[-1]
    assert any(x.startswith("| 4 | 1 x 65536 | cp 2, tp 2 | cp_tp (cp sequence) | spawn, 64 | 0.79") for x in lines), lines


def test_no_anchor_no_per_gpu_figure():
    run = _run(2, 2, 32768, [["cp", 2]], {"cp": (0.9, [0.1] * 3, 0.1)})
    run[0]["anchor"] = None
    (row,) = e2e_targets.rows_of([run])
    assert row["per_gpu"] is None and row["per_gpu_ok"] is None and row["model_ok"] is True
