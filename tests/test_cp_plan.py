"""Context-parallel plan properties, checked against independent counts from the dense mask."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import doc_packed as dp
from doc_packed_testing.oracle import random_lengths
from doc_packed.cp.plan import ROW_COST
from doc_packed.cp.plan import RowCost, build_plan
from doc_packed._doc_layout import get_layout
from doc_packed.cp.schedule import build_schedule
from doc_packed.data import lognormal_lengths
from doc_packed_testing.oracle import dense_mask

MASKS = [(True, (-1, -1)), (True, (6, 0)), (False, (-1, -1)), (False, (3, 5)), (False, (4, -1))]


def independent_check(cu, S, c, causal, window, plan):
    B = cu.shape[0]
    cs = -(-S // c)
    owned = [(min(r * cs, S), min((r + 1) * cs, S)) for r in range(c)]
    masks = [dense_mask(cu[b].tolist(), S, causal, window) for b in range(B)]
    covered = torch.zeros(B, S, dtype=torch.int64)
    for r in range(c):
        work, keys, moved = 0, set(), 0
        for b, s, e in plan.q_ranges[r]:
            assert 0 <= s < e <= S
            covered[b, s:e] += 1
            m = masks[b][s:e]
            work += int(m.sum())
            for p2 in m.any(0).nonzero().flatten().tolist():
                keys.add((b, p2))
            moved += sum(1 for p in range(s, e) if not owned[r][0] <= p < owned[r][1])
        recv = {(b, p2) for b, p2 in keys if not owned[r][0] <= p2 < owned[r][1]}
        assert plan.work[r] == work
        assert plan.kv_recv_tokens[r] == len(recv)  # each needed key once, nothing else
        assert plan.q_moved_tokens[r] == moved
        ex = build_schedule(plan, r, torch.device("cpu"))
        assert sum(ex.kv_recv_splits) == len(recv)
        assert sum(ex.q_recv_splits) == moved
    assert bool((covered == 1).all()), "every query computed exactly once"
    runs_agree(plan, [build_schedule(plan, r, torch.device("cpu")) for r in range(c)])


def _sent_rows(plan, src, dst, kind):
    """The local rows of ``src`` that ``dst`` needs (keys) or computes (queries), in plan order."""
    start, end = plan.owners[src]
    ranges = plan.kv_ranges[dst] if kind == "kv" else [(g.batch, g.start, g.end) for g in plan.segments[dst]]
    return [b * (end - start) + p - start for b, s, e in ranges for p in range(max(s, start), min(e, end))]


def runs_agree(plan, schedules):
    """The exchange's runs: what a rank sends a peer, run by run, is what the peer expects from
    it, and the runs cover the rows the plan says the peer needs from it, in the plan's order."""
    for src in schedules:
        for kind in ("kv", "q"):
            for dst, runs in enumerate(getattr(src, f"{kind}_send_runs")):
                expected = getattr(schedules[dst], f"{kind}_recv_runs")[src.rank]
                assert [n for _, n in runs] == [n for _, n in expected], (kind, src.rank, dst)
                if kind == "kv":  # the partial dK/dV come home run by run, the same runs
                    assert [n for _, n in src.kv_back_recv[dst]] == [n for _, n in expected]
                rows = [r for r0, n in runs for r in range(r0, r0 + n)]
                assert rows == ([] if dst == src.rank else _sent_rows(plan, src.rank, dst, kind)), (kind, src.rank, dst)
                assert len(rows) == getattr(schedules[dst], f"{kind}_recv_splits")[src.rank]  # what dst sizes for it
                # adjacent runs are merged: one transfer per contiguous block
                assert all(a + n != b for (a, n), (b, _) in zip(runs, runs[1:])), runs
    for dst in schedules:  # received runs land one after another, grouped by source rank
        for kind in ("kv", "q"):
            lands = [run for runs in getattr(dst, f"{kind}_recv_runs") for run in runs]
            assert [a for a, _ in lands] == [sum(n for _, n in lands[:i]) for i in range(len(lands))]


@pytest.mark.parametrize("row_cost", [None, ROW_COST], ids=["pairs", "row-priced"])
@pytest.mark.parametrize("causal,window", MASKS)
@pytest.mark.parametrize("c", [1, 2, 3, 4, 7])
def test_plan_exact_counts(rng, c, causal, window, row_cost):
    S = 97
    cu = dp.cu_seqlens_from_lengths([random_lengths(rng, S) for _ in range(2)] + [[S]], S, max_docs=S)
    plan = dp.plan_context_parallel(cu, c, causal=causal, window_size=window, row_cost=row_cost)
    independent_check(cu, S, c, causal, window, plan)


@settings(max_examples=30, deadline=None)
@given(
    data=st.data(),
    S=st.integers(1, 150),
    c=st.integers(1, 6),
    mask=st.sampled_from(MASKS),
    row_cost=st.sampled_from([None, ROW_COST, RowCost(1.0, 5.0, 0.0)]),
)
def test_plan_property(data, S, c, mask, row_cost):
    rng = random.Random(data.draw(st.integers(0, 10**9)))
    B = data.draw(st.integers(1, 3))
    cu = dp.cu_seqlens_from_lengths([random_lengths(rng, S) for _ in range(B)], S, max_docs=S)
    plan = dp.plan_context_parallel(cu, c, causal=mask[0], window_size=mask[1], row_cost=row_cost)
    independent_check(cu, S, c, mask[0], mask[1], plan)


@pytest.mark.parametrize("mean", [256, 1024, 4096])
@pytest.mark.parametrize("c", [4, 8, 16])
def test_plan_balance_and_traffic_on_realistic_layouts(c, mean):
    rng = random.Random(c * 7919 + mean)
    S = 32768
    cu = dp.cu_seqlens_from_lengths([lognormal_lengths(S, mean, rng) for _ in range(2)], S)
    plan = dp.plan_context_parallel(cu, c, row_cost=None)  # pairs alone (row prices trade pairs for rows)
    assert plan.imbalance <= 1.10
    # far less K/V than all-gather (2 rows x (S - S/c) tokens per rank)
    all_gather = 2 * (S - S // c)
    assert max(plan.kv_recv_tokens) < 0.5 * all_gather
    assert sum(plan.work) == sum(
        n * (n + 1) // 2 for b in range(2) for n in torch.tensor(cu[b].tolist()).diff().tolist()
    )


def _extra_rows_by_hand(plan, cu, S, causal, window):
    """Per rank, from the dense mask: each query range cut at shard boundaries; an own part whose
    queries see keys of other shards adds (its queries, those keys, its queries), a moved-in part
    (its queries, the span from its first to its last key seen, 0)."""
    masks = [dense_mask(cu[b].tolist(), S, causal, window) for b in range(cu.shape[0])]
    out = []
    for r, (os_, oe) in enumerate(plan.owners):
        q = k = m = 0
        for b, s, e in plan.q_ranges[r]:
            cuts = sorted({s, e, *(x for x, _ in plan.owners if s < x < e)})
            for a, z in zip(cuts, cuts[1:]):
                seen = masks[b][a:z].any(0).nonzero().flatten().tolist()
                if os_ <= a < oe:
                    remote = [p for p in seen if not os_ <= p < oe]
                    if remote:
                        q, k, m = q + z - a, k + len(remote), m + z - a
                elif seen:
                    q, k = q + z - a, k + seen[-1] - seen[0] + 1
                else:
                    q += z - a
        out.append((q, k, m))
    return out


@pytest.mark.parametrize("row_cost", [None, ROW_COST], ids=["pairs", "row-priced"])
@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (True, (6, 0)), (False, (-1, -1))])
@pytest.mark.parametrize("c", [2, 3, 4])
def test_extra_rows_match_the_dense_mask(rng, c, causal, window, row_cost):
    S = 97
    cu = dp.cu_seqlens_from_lengths([random_lengths(rng, S) for _ in range(2)] + [[S]], S, max_docs=S)
    plan = dp.plan_context_parallel(cu, c, causal=causal, window_size=window, query_cost=2.0, row_cost=row_cost)
    assert list(plan.extra_rows) == _extra_rows_by_hand(plan, cu, S, causal, window)


@pytest.mark.parametrize("c", [2, 4])
def test_row_prices_move_pairs_off_the_ranks_that_read_remote_keys(c):
    """A rank whose queries read keys from other shards carries those rows: balanced with row
    prices, the priced loads come out more even than the pairs-only plan's, and the rank with
    the most extra rows gives pairs to the one with the fewest."""
    S = 16384
    for seed in range(20):  # the first layout whose re-plan is kept (most are: tests below)
        cu = dp.cu_seqlens_from_lengths([lognormal_lengths(S, 2048, random.Random(seed))], S)
        base = dp.plan_context_parallel(cu, c, query_cost=4.0, row_cost=None)
        priced = dp.plan_context_parallel(cu, c, query_cost=4.0, row_cost=ROW_COST)
        if priced.work != base.work:
            break
    else:
        pytest.fail(f"no re-plan kept in 20 lognormal layouts at cp={c}")
    for plan in (base, priced):
        rows = _extra_rows_by_hand(plan, cu, S, True, (-1, -1))
        assert plan.priced(ROW_COST) == tuple(
            w + int(162 * q + 292 * k + 238 * m) for w, (q, k, m) in zip(plan.work, rows)
        )
    assert max(priced.priced(ROW_COST)) < max(base.priced(ROW_COST))
    assert sum(priced.work) == sum(base.work)  # the same problem, split differently
    extra = [p - w for p, w in zip(base.priced(ROW_COST), base.work)]
    heavy, light = extra.index(max(extra)), extra.index(min(extra))
    assert priced.work[heavy] - priced.work[light] < base.work[heavy] - base.work[light]
    # zero prices: the pairs-only plan
    assert dp.plan_context_parallel(cu, c, query_cost=4.0, row_cost=RowCost(0, 0, 0)).q_ranges == base.q_ranges


@pytest.mark.parametrize("c", [2, 4, 8, 16])
@pytest.mark.parametrize("mean", [512, 2048])
def test_row_priced_plan_is_never_priced_higher_than_the_pairs_only_plan(c, mean):
    """Re-balancing can make things worse on small shards (a moved run brings its document's keys):
    the planner then keeps the pairs-only plan, so its busiest priced rank never gets busier."""
    S = 16384
    for seed in range(3):
        cu = dp.cu_seqlens_from_lengths([lognormal_lengths(S, mean, random.Random(seed))], S)
        base = dp.plan_context_parallel(cu, c, query_cost=4.0, row_cost=None)
        priced = dp.plan_context_parallel(cu, c, query_cost=4.0, row_cost=ROW_COST)
        assert max(priced.priced(ROW_COST)) <= max(base.priced(ROW_COST))


def test_single_long_document_is_balanced():
    S = 65536
    cu = dp.cu_seqlens_from_lengths([[S]], S)
    for c in (2, 4, 8):
        plan = dp.plan_context_parallel(cu, c, row_cost=None)
        assert plan.imbalance <= 1.02
        # unbalanced contiguous shards would be 2c/(c+1) off
        assert 2 * c / (c + 1) > 1.3


def test_plan_is_cached_and_immutable(rng):
    S = 64
    cu = dp.cu_seqlens_from_lengths([[30, 34]], S)
    a = dp.plan_context_parallel(cu, 4)
    b = dp.plan_context_parallel(cu, 4)
    assert a is b
    with pytest.raises(Exception):
        a.work = (0,)
    assert isinstance(a.q_ranges, tuple) and isinstance(a.q_ranges[0], tuple)


def test_plan_argument_errors():
    cu = dp.cu_seqlens_from_lengths([[30, 34]], 64)
    with pytest.raises(ValueError, match="cp_size"):
        dp.plan_context_parallel(cu, 0)
    with pytest.raises(ValueError, match="causal=True"):
        dp.plan_context_parallel(cu, 2, window_size=(3, 3))
    with pytest.raises(TypeError, match="row_cost must be a RowCost"):
        dp.plan_context_parallel(cu, 2, row_cost=(1.0, 2.0))
    with pytest.raises(ValueError, match="row_cost.key must be finite and >= 0"):
        dp.plan_context_parallel(cu, 2, row_cost=RowCost(1.0, -2.0, 0.0))
    with pytest.raises(ValueError, match="must start at 0"):
        dp.plan_context_parallel(torch.tensor([[1, 64]], dtype=torch.int32), 2)


def _realistic_layouts(n_per_case):
    """Lognormal layouts of several sizes and document lengths, as ``DocLayout``s."""
    from doc_packed._doc_layout import DocLayout

    out = []
    for B, S in ((4, 8192), (1, 32768), (2, 5000), (3, 97)):
        for i in range(n_per_case):
            rng = random.Random(hash((B, S, i)) & 0xFFFFFFF)
            mean = rng.choice([16, 300, 2048, 9000])
            cu = dp.cu_seqlens_from_lengths(
                [lognormal_lengths(S, mean, rng) for _ in range(B)], S, max_docs=max(2, S // 8)
            )
            out.append(DocLayout(cu.tolist(), S))
    return out


def test_closed_form_causal_planner_cuts_where_bisection_does(monkeypatch):
    """Causal training masks plan with square roots instead of bisection (the planner runs on
    every new layout): the very same plans as the general planner, to the token."""
    from doc_packed.cp import plan as cp_plan

    layouts = _realistic_layouts(6)
    for c in (2, 3, 8):
        for qc in (1.0, 4.0):
            fast = [cp_plan.build_plan(lay, c, True, -1, 0, query_cost=qc, row_cost=ROW_COST) for lay in layouts]
            with monkeypatch.context() as m:
                m.setattr(cp_plan, "_CausalPlanner", cp_plan._Planner)
                slow = [cp_plan.build_plan(lay, c, True, -1, 0, query_cost=qc, row_cost=ROW_COST) for lay in layouts]
            for a, b in zip(fast, slow):
                assert (a.segments, a.work, a.extra_rows) == (b.segments, b.work, b.extra_rows)


@pytest.mark.parametrize("left", [0, 5, 300, 4095])
def test_closed_form_window_planner_cuts_where_bisection_does(monkeypatch, left):
    """Causal masks with a left window plan in closed form too (a triangle up to the window's
    fill, a line after it): the very same plans as the general planner's bisection."""
    from doc_packed.cp import plan as cp_plan

    layouts = _realistic_layouts(3)
    for c in (2, 5):
        fast = [cp_plan.build_plan(lay, c, True, left, 0, query_cost=4.0, row_cost=ROW_COST) for lay in layouts]
        with monkeypatch.context() as m:
            m.setattr(cp_plan, "_WindowPlanner", cp_plan._Planner)
            slow = [cp_plan.build_plan(lay, c, True, left, 0, query_cost=4.0, row_cost=ROW_COST) for lay in layouts]
        for a, b in zip(fast, slow):
            assert (a.segments, a.work, a.extra_rows) == (b.segments, b.work, b.extra_rows)


@settings(max_examples=400, deadline=None)
@given(
    data=st.data(),
    length=st.integers(1, 3000),
    left=st.one_of(st.integers(0, 40), st.integers(0, 4000)),
    start=st.integers(0, 10_000),
    tail=st.booleans(),
)
def test_window_cut_is_the_bisection_cut(data, length, left, start, tail):
    """_WindowPlanner's cut, work and key range against the general planner's, run by run."""
    from doc_packed.cp import plan as cp_plan

    fast, slow = object.__new__(cp_plan._WindowPlanner), object.__new__(cp_plan._Planner)
    for p in (fast, slow):
        p.causal, p.left, p.right = True, left, 0
    doc = cp_plan._Doc(start, start + length)
    i0 = data.draw(st.integers(0, length - 1))
    i1 = data.draw(st.integers(i0 + 1, length))
    a, e = start + i0, start + i1
    work = slow._work(doc, a, e)
    amount = data.draw(st.integers(1, work + 1))
    assert fast._work(doc, a, e) == work
    assert fast._key_range(doc, a, e) == slow._key_range(doc, a, e)
    assert fast._densities([[0, a, e, doc, 0]]) == slow._densities([[0, a, e, doc, 0]])
    assert fast._cut(doc, a, e, amount, tail) == slow._cut(doc, a, e, amount, tail)


def test_replans_skipped_only_where_none_could_be_kept(monkeypatch):
    """When the pairs-only plan's priced rows differ across ranks by less than the margin, the
    row-priced re-plans are not run; running them anyway never gives another plan."""
    from doc_packed.cp import plan as cp_plan

    def always_replan(layout, c, qc):  # the planner before the skip: re-plan unless all equal
        start = cp_plan._CausalPlanner(layout.rows, layout.seq_len, c, True, -1, 0, qc, cp_plan.TOLERANCE)
        best = start.fresh([0] * c)
        best.balance()
        extra = best.priced_rows(ROW_COST)
        best_max = max(w + x for w, x in zip(best.work(), extra)) * (1 - cp_plan._ROW_MARGIN)
        if max(extra) > min(extra):
            for step in cp_plan._ROW_STEPS:
                cand = start.fresh([int(step * (e - min(extra))) for e in extra])
                cand.balance()
                priced = max(w + x for w, x in zip(cand.work(), cand.priced_rows(ROW_COST)))
                if priced < best_max:
                    best, best_max = cand, priced
        return best.result((-1, 0), ROW_COST)

    skipped = 0
    for lay in _realistic_layouts(6):
        for c in (2, 4, 8):
            plan = cp_plan.build_plan(lay, c, True, -1, 0, query_cost=4.0, row_cost=ROW_COST)
            ref = always_replan(lay, c, 4.0)
            assert (plan.segments, plan.work) == (ref.segments, ref.work)
            rows = [cp_plan._price(r, ROW_COST) for r in ref.extra_rows]
            skipped += max(rows) - min(rows) <= cp_plan._ROW_MARGIN * max(w + x for w, x in zip(ref.work, rows))
    assert skipped > 0, "no layout exercised the skip"


def test_plan_context_parallel_reads_the_tolerance_the_runtime_reads(monkeypatch):
    """With its default, plan_context_parallel plans at cp.plan.TOLERANCE as it is at the call (a
    bench may change it), as the runtime does: the same object as runtime_plan's."""
    from doc_packed._doc_layout import get_layout
    from doc_packed.cp import plan as cp_plan

    S = 4096
    cu = dp.cu_seqlens_from_lengths([lognormal_lengths(S, 512, random.Random(5))], S)
    monkeypatch.setattr(cp_plan, "TOLERANCE", 0.2)
    plan = dp.plan_context_parallel(cu, 4, num_heads=(16, 4))
    assert plan.tolerance == 0.2
    assert plan is cp_plan.runtime_plan(get_layout(cu, S), 4, True, -1, 0, 4.0)


@settings(max_examples=300, deadline=None)
@given(data=st.data(), S=st.integers(1, 300), c=st.integers(1, 8))
def test_owned_parts_are_the_shard_intersection(data, S, c):
    """schedule._owned_by (each range cut to one shard) is _parts' split kept for that owner."""
    from doc_packed.cp.plan import chunk_len
    from doc_packed.cp.schedule import _owned_by, _parts

    cs = chunk_len(S, c)
    starts = data.draw(st.lists(st.tuples(st.integers(0, 2), st.integers(0, S - 1)), max_size=6))
    ranges = [(b, s, data.draw(st.integers(s + 1, S))) for b, s in starts]
    for r in range(c):
        split = [(b, s, e) for b, s0, e0 in ranges for o, s, e in _parts(b, s0, e0, cs, S) if o == r]
        assert _owned_by(ranges, r, cs, S) == split


def test_build_plan_rejects_a_negative_query_cost():
    """The planner prunes moves by their query cost alone (exact only for costs >= 0), so
    build_plan, public in its module, checks the cost as plan_context_parallel does."""
    layout = get_layout(torch.tensor([[0, 40, 64]], dtype=torch.int32), 64)
    with pytest.raises(ValueError, match="query_cost must be finite and >= 0"):
        build_plan(layout, 2, True, -1, 0, query_cost=-1.0)
