"""bench/cp_call_cost.py: the call-level cost model of a context-parallel rank (CPU only)."""

from __future__ import annotations

import json
import random

import pytest

from doc_packed.cp.plan import ROW_COST

from bench import cp_call_cost as cc
from bench.cp_model import Model
from bench.emulated_layouts import emulated_lengths


def _tiles_brute(nq: int, nk: int, causal: bool) -> int:
    """128 x 128 tiles holding a visible pair, by checking every pair (bottom-right causal)."""
    seen = set()
    for i in range(nq):
        for j in range(nk):
            if not causal or j <= i + nk - nq:
                seen.add((i // cc.TILE, j // cc.TILE))
    return len(seen)


@pytest.mark.parametrize("causal", [True, False])
def test_segment_tiles_match_a_pair_by_pair_count(causal):
    rng = random.Random(3)
    shapes = [(1, 1), (128, 128), (129, 300), (300, 129), (256, 512), (0, 5)]
    shapes += [(rng.randint(1, 400), rng.randint(1, 400)) for _ in range(12)]
    for nq, nk in shapes:
        assert cc.segment_tiles(nq, nk, causal) == _tiles_brute(nq, nk, causal), (nq, nk)


def test_ranks_cover_the_one_gpu_work_and_their_own_rows():
    """Split over ranks, the calls hold at least the one-GPU op's tiles, every stage A spans its
    rank's rows, and merged rows are rows a stage B computed."""
    S, c = 8192, 4
    lengths = emulated_lengths("lognormal 512", S)
    plan = cc.plan_for(lengths, S, c)
    one = cc.one_gpu_features(cc._layout(lengths, S).rows, S)
    stages = [cc.rank_stages(plan, r) for r in range(c)]
    assert sum(a.tiles + b.tiles for a, b in stages) >= one.tiles
    for a, b in stages:
        assert a.q_rows == a.k_rows == S // c and a.merged == 0
        assert b.merged <= b.q_rows


def test_fit_recovers_the_rates_that_made_the_times(tmp_path):
    """Times written from known rates for small emulation cells come back as those rates."""
    true = cc.CallCost(tile_us=1.5, q_row_us=0.02, k_row_us=0.03, merge_us=0.05)
    rows = []
    for S, c, layout, packing in [(4096, 2, "lognormal 512", "greedy"), (8192, 4, "lognormal 512", "greedy"),
                                  (8192, 4, "lognormal 2k", "greedy"), (8192, 2, "one doc", "greedy"),
                                  (8192, 4, "lognormal 512", "cp")]:
        lengths = emulated_lengths(layout, S, c, packing)
        plan = cc.plan_for(lengths, S, c)
        ranks = [{"rank": r, "ms": true.ms(a + b)} for r, (a, b) in enumerate(cc.rank_stages(plan, r) for r in range(c))]
        one = true.ms(cc.one_gpu_features(cc._layout(lengths, S).rows, S))
        # as bench_cp_emulate records it: the planner's row prices, so the fit re-plans alike
        rows.append(dict(S=S, cp=c, layout=layout, packing=packing, ranks=ranks, one_gpu_ms=one, row_cost=list(ROW_COST)))
    path = tmp_path / "emulated.json"
    path.write_text(json.dumps({"rows": rows}))
    got, mean, worst = cc.fit([str(path)])
    assert worst < 1e-6
    for g, t in zip((got.tile_us, got.q_row_us, got.k_row_us, got.merge_us), (true.tile_us, true.q_row_us, true.k_row_us, true.merge_us)):
        assert g == pytest.approx(t, rel=1e-4)


def test_staged_step_is_the_overlap_model_with_given_stage_times():
    m = Model()
    own, work, kv, qm = 3_000_000, 5_000_000, 700, 120
    assert m.staged_s(m.compute_s(own), m.compute_s(work - own), kv, qm) == m.overlap_s(own, work, kv, qm)


def test_step_model_prices_ranks_call_by_call():
    """simulate_cp's --call-cost: the one-GPU time is the rates on one call over the row, and the
    staged step is at least the slowest rank's own kernel time."""
    from bench.cp_model import RowMask, evaluate

    S, c = 8192, 4
    layout = cc._layout(emulated_lengths("lognormal 512", S), S)
    m = Model()
    r = evaluate("lognormal-512", S, c, layout, [RowMask(d) for d in layout.rows], m, 1, cc.H200_FA4)
    assert r["t1_calls"] == pytest.approx(cc.H200_FA4.ms(cc.one_gpu_features(layout.rows, S)) / 1e3)
    plan = cc.plan_for(emulated_lengths("lognormal 512", S), S, c)
    slowest = max(cc.H200_FA4.ms(a + b) for a, b in (cc.rank_stages(plan, k) for k in range(c))) / 1e3
    assert r["step"]["ours_calls"] >= slowest > 0
    assert evaluate("lognormal-512", S, 128, layout, [RowMask(d) for d in layout.rows], m, 1, cc.H200_FA4)["t1_calls"] is None


def test_row_priced_plans_are_faster_in_the_fitted_model():
    """The runtime plans with row prices (doc_packed.cp.plan.ROW_COST): on the emulation's
    16 cells, priced call by call with the fitted H200 rates, its slowest ranks beat the
    pairs-only planner's on average and in no cell lose (session 13: 0.914 -> 0.932)."""
    def efficiency(lengths, S, c, row_cost):
        one = cc.H200_FA4.ms(cc.one_gpu_features(cc._layout(lengths, S).rows, S))
        plan = cc.plan_for(lengths, S, c, row_cost)
        return one / c / max(cc.H200_FA4.ms(sum(cc.rank_stages(plan, r), cc.Features())) for r in range(c))

    before, after = [], []
    for S in (131072, 262144):
        for c in (4, 8):
            for layout in ("lognormal 2k", "lognormal 512"):
                for packing in ("greedy", "cp"):
                    lengths = emulated_lengths(layout, S, c, packing)
                    before.append(efficiency(lengths, S, c, None))
                    after.append(efficiency(lengths, S, c, ROW_COST))
    assert sum(after) / len(after) >= sum(before) / len(before) + 0.01
    assert min(a - b for a, b in zip(after, before)) > -0.03
