"""bench/cp_model.py, the context-parallel step-time model, against hand-computed references.

Every expected number is either written out by hand (the arithmetic is in the comments) or
computed by a brute-force oracle here (enumerating (query, key) pairs and key sets token by
token), never by calling the function under test a second time.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from bench import cp_model
from bench.cp_model import Model
from doc_packed._doc_layout import DocLayout
from doc_packed.cp.plan import build_plan


def _layout(rows: list[list[int]], S: int) -> DocLayout:
    """A layout from per-row document lengths."""
    return DocLayout([np.concatenate([[0], np.cumsum(r)]).tolist() for r in rows], S)


def _masks(layout: DocLayout) -> list[cp_model.RowMask]:
    return [cp_model.RowMask(docs) for docs in layout.rows]


# ---- per-token bytes and the analytical peers ------------------------------------------------
def test_per_token_bytes_by_hand():
    m = Model()  # Hq=32, Hkv=8, D=128, bf16
    assert m.kv_tok == 2 * 8 * 128 * 2 == 4096
    assert m.q_fwd == 2 * 32 * 128 * 2 + 4 * 32 == 16512  # q in, out back, fp32 lse back
    assert m.q_bwd == 4 * 32 * 128 * 2 + 4 * 32 == 32896  # q, out, dout in, dq back, lse


def test_allgather_bytes_by_hand():
    # K and V of T*(c-1)/c tokens: 4096 B/token * 131072 * 7/8
    assert Model().allgather_bytes(1 << 17, 8) == 469_762_048
    small = Model(hq=4, hkv=2, d=8)  # 2*2*8*2 = 64 B per token
    assert small.allgather_bytes(1000, 4) == 48_000  # 64 * 750
    assert small.allgather_bytes(1000, 1) == 0


@pytest.mark.parametrize("c, expected", [
    (4, 3_932_160),  # c < Hkv: (2*32 + 2*8) * 128 * 2 * (1024/4) * 3/4
    (8, 2_293_760),  # c = Hkv: (64 + 16) * 256 * 128 * 7/8
    (16, 1_474_560),  # c > Hkv: Hkv' = 16, (64 + 32) * 256 * 64 * 15/16
    (32, 1_015_808),  # c = Hq, the last possible: Hkv' = 32, (64 + 64) * 256 * 32 * 31/32
])
def test_ulysses_bytes_gqa_cap(c, expected):
    assert Model().ulysses_bytes(1024, c) == pytest.approx(expected, rel=1e-12)


def test_ulysses_cap_changes_the_bytes_and_c_above_hq_is_impossible():
    m = Model()
    uncapped = (2 * 32 + 2 * 8) * 128 * 2 * (1024 / 16) * 15 / 16  # 1,228,800 without the cap
    assert m.ulysses_bytes(1024, 16) > uncapped
    assert math.isnan(m.ulysses_bytes(1024, 64))
    assert math.isnan(Model(hq=4, hkv=1).ulysses_bytes(1024, 5))
    assert not math.isnan(Model(hq=4, hkv=1).ulysses_bytes(1024, 4))


def test_exchange_bytes_by_hand():
    m = Model(hq=2, hkv=1, d=4)  # kv_tok 16, q_fwd 2*2*4*2 + 8 = 40, q_bwd 4*2*4*2 + 8 = 72
    # fwd: rank 0 3*16 + 1*40 = 88, rank 1 0 + 2*40 = 80
    # fwd+bwd: + 2*kv*16 + q*72: rank 0 88 + 96 + 72 = 256, rank 1 80 + 0 + 144 = 224
    assert m.exchange_bytes([3, 0], [1, 2]) == (88, 256)


# ---- the step-time formula -------------------------------------------------------------------
_M = Model(hq=2, hkv=1, d=4, tflops=1e-6, a2a_gbps=1e-3, ag_gbps=2e-3, a2a_fixed_ms=5.0,
           ag_fixed_ms=7.0)  # 4*Hq*D*3.5 = 112 flops per pair, 1 MFLOP/s, 1 MB/s and 2 MB/s


def test_step_time_terms_on_made_up_numbers():
    assert _M.compute_s(1000) == pytest.approx(0.112)  # 1000 * 112 / 1e6
    assert _M.a2a_s(2e6) == pytest.approx(2.005)  # 5 ms + 2 MB / 1 MB/s
    assert _M.ag_s(2e6) == pytest.approx(1.007)  # 7 ms + 2 MB / 2 MB/s
    assert Model(tflops=100.0).compute_s(1e9) == pytest.approx(1e9 * 4 * 32 * 128 * 3.5 / 1e14)


def test_evaluate_step_times_by_hand():
    # one row of 64 tokens: documents [0, 48) and [48, 64); 1176 + 136 = 1312 causal pairs
    lay = _layout([[48, 16]], 64)
    r = cp_model.evaluate("made-up", 64, 2, lay, _masks(lay), _M, repeats=1)

    def secs(pairs):
        return pairs * 112 / 1e6

    # head-tail, chunks of 16: rank 0 = chunk 0 (136) + chunk 3 (136, a new document),
    # rank 1 = chunk 1 (16*16 + 136) + chunk 2 (32*16 + 136) = 392 + 648
    assert r["ag_imb"] == pytest.approx(1040 * 2 / 1312)
    ag = 16 * 64 // 2  # 512 B forward; fwd+bwd is 3x
    assert r["ag_bytes"] == ag
    assert r["step"]["allgather"] == pytest.approx(secs(1040) + 0.007 + 3 * ag / 2e6)
    assert r["step"]["allgather_ideal"] == pytest.approx(secs(656) + 0.007 + 3 * ag / 2e6)
    uly = (2 * 2 + 2 * 2) * 4 * 2 * 32 * 0.5  # c = 2 > Hkv = 1: Hkv' = 2; 1024 B
    assert r["uly_bytes"] == pytest.approx(uly)
    assert r["step"]["ulysses"] == pytest.approx(secs(656) + 0.005 + 2 * uly / 1e6)
    assert r["t1"] == pytest.approx(secs(1312))
    plan = build_plan(lay, 2, True, -1, 0, query_cost=2.0, tolerance=0.01)
    both = max(k * 16 + q * 40 + 2 * k * 16 + q * 72
               for k, q in zip(plan.kv_recv_tokens, plan.q_moved_tokens))
    assert r["step"]["ours"] == pytest.approx(secs(max(plan.work)) + 0.005 + both / 1e6)


# ---- work and traffic of the designs ---------------------------------------------------------
def test_head_tail_work_by_hand():
    lay = _layout([[48, 16]], 64)
    assert cp_model.head_tail_work(lay, 2, _masks(lay)) == [272, 1040]
    one = _layout([[64]], 64)
    # chunks of 8 of one document: chunk j has 64j + 36 pairs; rank r: j = r and 7 - r
    assert cp_model.head_tail_work(one, 4, _masks(one)) == [520] * 4


def test_row_mask_work_against_enumeration():
    lengths = [5, 17, 1, 20, 7]
    doc = np.repeat(np.arange(len(lengths)), lengths)
    mask = cp_model.RowMask(_layout([lengths], 50).rows[0])
    for a in range(0, 50, 3):
        for e in range(a, 51, 4):
            brute = sum(1 for q in range(a, e) for k in range(q + 1) if doc[k] == doc[q])
            assert mask.work(a, e) == brute, (a, e)


def test_minheap_one_document_by_hand():
    # S = 32, c = 2: 16 chunks of 2 tokens, chunk j has 4j + 3 pairs. LPT with 8 chunks per
    # rank, ties to the lower rank: rank 0 gets j = 15, 12, 11, 8, 7, 4, 3, 0 and rank 1 the
    # rest, 264 pairs each. Rank 0 owns [0, 16): 4 of its chunks (8 queries) are outside and its
    # keys are [0, 32), 16 of them not its own; rank 1's keys are [0, 30): 14 + 2 = 16 outside.
    lay = _layout([[32]], 32)
    got = cp_model.minheap_assign(lay, 2, _masks(lay))
    assert (got.work, got.kv_recv, got.q_moved) == ([264, 264], [16, 16], [8, 8])
    assert got.imbalance == 1.0


def _minheap_oracle(rows: list[list[int]], S: int, c: int):
    """The locality-blind min-heap, token by token: pairs, key sets and owners enumerated."""
    docs = [np.repeat(np.arange(len(r)), r) for r in rows]
    starts = [np.concatenate([[0], np.cumsum(r)])[:-1][d] for r, d in zip(rows, docs)]
    n = 8 * c
    chunks = []
    for b, d in enumerate(docs):
        for i in range(n):
            a, e = S * i // n, S * (i + 1) // n
            w = sum(1 for q in range(a, e) for k in range(q + 1) if d[k] == d[q])
            chunks.append((w, b, a, e))
    chunks.sort(key=lambda x: (-x[0], x[1], x[2]))
    cap = math.ceil(len(chunks) / c)
    load, count, mine = [0] * c, [0] * c, [[] for _ in range(c)]
    for w, b, a, e in chunks:
        r = min((rk for rk in range(c) if count[rk] < cap), key=lambda rk: (load[rk], rk))
        load[r] += w
        count[r] += 1
        mine[r].append((b, a, e))
    cs = math.ceil(S / c)  # torch.chunk: rank r owns [r*cs, (r+1)*cs) of every row
    kv, qm = [], []
    for r in range(c):
        own = {(b, t) for b in range(len(rows)) for t in range(r * cs, min((r + 1) * cs, S))}
        queries = {(b, q) for b, a, e in mine[r] for q in range(a, e)}
        keys = {(b, k) for b, q in queries for k in range(int(starts[b][q]), q + 1)}
        kv.append(len(keys - own))
        qm.append(len(queries - own))
    return load, kv, qm


@pytest.mark.parametrize("rows, S, c", [
    ([[5, 17, 1, 20, 7], [30, 20]], 50, 3),  # uneven chunks (2 or 3 tokens) and shards (17)
    ([[64], [10, 10, 44]], 64, 4),
    ([[3, 1, 1, 40, 19, 32]], 96, 2),
])
def test_minheap_against_brute_force(rows, S, c):
    lay = _layout(rows, S)
    got = cp_model.minheap_assign(lay, c, _masks(lay))
    work, kv, qm = _minheap_oracle(rows, S, c)
    assert (got.work, got.kv_recv, got.q_moved) == (work, kv, qm)
    assert max(kv) > 0 and max(qm) > 0  # the case moves something


def test_kv_lower_bound_by_hand():
    # S = 256, c = 4 (shards of 64): [0, 100) keeps at most 64 at home -> 36;
    # [100, 256) overlaps 28, 64, 64 -> 156 - 64 = 92
    assert cp_model.kv_lower_bound(_layout([[100, 156]], 256), 4) == 92
    assert cp_model.kv_lower_bound(_layout([[64] * 4], 256), 4) == 0


# ---- ours: the real planner -----------------------------------------------------------------
def test_ours_traffic_is_the_planners_counts_times_bytes_per_token():
    lay = cp_model.make_layout("lognormal-512", 8192, 2, 2026)
    r = cp_model.evaluate("lognormal-512", 8192, 8, lay, _masks(lay), Model(), repeats=1)
    plan = build_plan(lay, 8, True, -1, 0, query_cost=4.0, tolerance=0.01)
    kv, qm = plan.kv_recv_tokens, plan.q_moved_tokens
    assert max(kv) > 0 and max(qm) > 0
    assert r["kv_max"] == max(kv) and r["q_max"] == max(qm)
    assert r["ours_kv_bytes"] == max(kv) * 4096
    assert r["ours_bytes"] == max(k * 4096 + q * 16512 for k, q in zip(kv, qm))
    assert r["imb"] == plan.imbalance


@pytest.mark.parametrize("rows", [[[40, 24] * 4], [[64] * 4, [40, 24] * 4]])
def test_documents_aligned_with_shards_move_nothing(rows):
    # every shard of 64 holds whole documents with the same work: nothing to balance or fetch
    lay = _layout(rows, 256)
    r = cp_model.evaluate("aligned", 256 * len(rows), 4, lay, _masks(lay), Model(), repeats=1)
    assert (r["kv_max"], r["q_max"], r["ours_bytes"], r["ours_kv_bytes"], r["kv_lb"]) == (0, 0, 0, 0, 0)
    assert r["imb"] == 1.0
    assert r["ag_bytes"] > 0


# ---- distributions and layouts ---------------------------------------------------------------
@pytest.mark.parametrize("dist", cp_model.DISTS)
def test_layout_rows_cover_s_and_are_deterministic(dist):
    lay = cp_model.make_layout(dist, 1 << 16, 2, 7)
    assert lay.seq_len == 1 << 15 and len(lay.rows) == 2
    for docs in lay.rows:
        assert docs[0][0] == 0 and docs[-1][1] == 1 << 15
        assert all(e1 == s2 for (_, e1), (s2, _) in zip(docs, docs[1:]))
    assert cp_model.make_layout(dist, 1 << 16, 2, 7).rows == lay.rows


def test_distribution_shapes():
    rng = np.random.default_rng(0)
    lengths = cp_model.row_lengths("lognormal-2k", 1 << 22, rng)
    assert sum(lengths) == 1 << 22 and min(lengths) >= 1
    assert 0.9 * 2048 < np.mean(lengths[:-1]) < 1.1 * 2048  # E[length] = mean, not e^(1/2) x
    power = cp_model.row_lengths("powerlaw", 1 << 18, rng)
    assert sum(power) == 1 << 18 and min(power[:-1]) >= 128
    ls = cp_model.row_lengths("long+short", 1 << 16, rng)
    assert sum(ls) == 1 << 16 and ls.count(1 << 15) == 1
    assert cp_model.row_lengths("one-doc", 4096, rng) == [4096]
    assert cp_model.make_layout("lognormal-512", 1 << 14, 1, 1).rows != \
        cp_model.make_layout("lognormal-512", 1 << 14, 1, 2).rows
    with pytest.raises(ValueError):
        cp_model.make_layout("one-doc", 1000, 3, 0)
    with pytest.raises(ValueError):
        cp_model.row_lengths("uniform", 1000, rng)


# ---- validation math -------------------------------------------------------------------------
def _measured_row(S: int, plan, one_ms: float, ours_ms: float, ag_ms: float) -> dict:
    """A bench_cp.py --json point of one document on 2 GPUs."""
    return {"S": S, "layout": "one doc", "gpus": 2, "docs": 1,
            "plan": {"kv_recv_tokens": list(plan.kv_recv_tokens),
                     "q_moved_tokens": list(plan.q_moved_tokens)},
            "one_gpu": {"fwdbwd_ms": one_ms}, "ours": {"fwdbwd_ms": ours_ms},
            "allgather": {"fwdbwd_ms": ag_ms}}


def test_validate_point_one_document_by_hand():
    S = 4096
    plan = build_plan(_layout([[S]], S), 2, True, -1, 0, query_cost=4.0, tolerance=0.01)
    pairs = S * (S + 1) // 2
    got = cp_model.validate_point(_measured_row(S, plan, 100.0, 60.0, 55.0), Model())
    assert got["same_plan"]
    # the compute rate is the one-GPU time's: compute of w pairs takes 100 ms * w / pairs
    assert got["tflops"] == pytest.approx(4 * 32 * 128 * 3.5 * pairs / 0.1 / 1e12)
    assert got["ours_compute_ms"] == pytest.approx(100.0 * max(plan.work) / pairs)
    assert got["ag_compute_ms"] == pytest.approx(50.0)  # one document: head-tail is exact
    assert got["ag_bytes"] == 3 * 4096 * S // 2
    assert got["ag_pred_ms"] == pytest.approx(50.0 + 3 * 4096 * S / 2 / 256e9 * 1e3)
    both = max(k * 4096 + q * 16512 + 2 * k * 4096 + q * 32896
               for k, q in zip(plan.kv_recv_tokens, plan.q_moved_tokens))
    assert got["ours_bytes"] == both
    assert got["ours_pred_ms"] == pytest.approx(got["ours_compute_ms"] + both / 283e9 * 1e3)


def test_validate_point_flags_a_different_plan_and_document_count():
    S = 4096
    plan = build_plan(_layout([[S]], S), 2, True, -1, 0, query_cost=4.0, tolerance=0.01)
    row = _measured_row(S, plan, 100.0, 60.0, 55.0)
    row["plan"]["kv_recv_tokens"][0] += 1
    assert not cp_model.validate_point(row, Model())["same_plan"]
    row["docs"] = 2
    with pytest.raises(AssertionError, match="documents"):
        cp_model.validate_point(row, Model())


def test_validate_point_knows_the_cp_packed_layout():
    """bench_cp.py --packing cp names its layout "lognormal 2k cp-packed": validate regenerates
    the same CP-aware order (it depends on the GPU count) and finds the run's plan."""
    from doc_packed.data import lognormal_lengths, pack_order

    S, c = 1 << 14, 4
    got = cp_model.bench_cp_lengths(S, "lognormal 2k cp-packed", c=c)
    assert got == pack_order(lognormal_lengths(S, 2048, seed=S), S, cp_size=c).lengths[0]
    assert sum(got) == S
    with pytest.raises(ValueError, match="pass c"):
        cp_model.bench_cp_lengths(S, "lognormal 2k cp-packed")
    plan = build_plan(_layout([got], S), c, True, -1, 0, query_cost=4.0, tolerance=0.01)
    row = _measured_row(S, plan, 100.0, 60.0, 55.0)
    row.update(layout="lognormal 2k cp-packed", gpus=c, docs=len(got))
    out = cp_model.validate_point(row, Model())
    assert out["same_plan"] and out["docs"] == len(got) and out["c"] == c


def test_fit_exchange_recovers_fixed_cost_and_bandwidth():
    def point(layout, gb, ms, ag_gb, ag_ms):
        return {"layout": layout, "ours_bytes": gb * 1e9, "ours_ms": 10 + ms, "ours_compute_ms": 10,
                "ag_bytes": ag_gb * 1e9, "ag_ms": ag_ms, "ag_compute_ms": 0.0}

    res = [point("a", x, 2 + 0.5 * x, x, 5 - x) for x in (1, 2, 3)]  # 2 ms + 2000 GB/s
    res += [point("b", x, 1 + 0.25 * x, x, 3.0) for x in (1, 3)]  # 1 ms + 4000 GB/s
    rows = {(r[0], r[1]): r[2:] for r in cp_model.fit_exchange(res)}
    assert rows[("ours", "a")] == ["2.5 / 3.0 / 3.5", "+2.00", "2000", "0.00"]
    assert rows[("ours", "b")] == ["1.2 / 1.8", "+1.00", "4000", "0.00"]
    x = np.array([1, 2, 3, 1, 3.0])
    y = np.array([2.5, 3.0, 3.5, 1.25, 1.75])
    slope, fixed = np.polyfit(x, y, 1)
    assert rows[("ours", "all 5 points")][1:3] == [f"{fixed:+.2f}", f"{1e3 / slope:.0f}"]
    assert rows[("all-gather", "a")][2] == "n/a (slope <= 0)"


# ---- the staged (overlapped) model ------------------------------------------------------------
def test_work_from_against_enumeration():
    # rows of documents; pairs (q, k) with q in [a, e), k >= lo, k <= q, same document
    docs = [(0, 5), (5, 12), (12, 20)]
    mask = cp_model.RowMask(docs)
    for a, e, lo in [(0, 20, 0), (3, 15, 7), (6, 20, 10), (12, 20, 12), (0, 4, 2)]:
        want = sum(1 for ds, de in docs for q in range(max(a, ds), min(e, de))
                   for k in range(max(ds, lo), q + 1))
        assert mask.work_from(a, e, lo) == want, (a, e, lo)


def test_own_work_is_stage_a_pairs_by_enumeration():
    # one row of 16 tokens over 2 ranks: documents [0, 6), [6, 16); rank 1 owns [8, 16)
    layout = _layout([[6, 10]], 16)
    plan = build_plan(layout, 2, True, -1, 0, query_cost=1.0, tolerance=0.01)
    own = cp_model.own_work(plan, 2, _masks(layout), 16)
    owned = [(0, 8), (8, 16)]
    for r, (os_, oe) in enumerate(owned):
        want = 0
        for b, a, e in plan.q_ranges[r]:
            for q in range(max(a, os_), min(e, oe)):
                ds = 0 if q < 6 else 6
                want += sum(1 for k in range(max(ds, os_), q + 1) if k < oe)
        assert own[r] == want
        assert own[r] <= plan.work[r]


def test_overlap_model_by_hand():
    m = Model(tflops=1.0, a2a_gbps=1.0)  # 1 TFLOP/s, 1 GB/s: numbers stay readable
    pair = 4 * 32 * 128 * 3.5 / 1e12  # seconds of fwd+bwd per pair
    # nothing received: the whole work is stage A, no bytes
    assert m.overlap_s(1000, 1000, 0, 0) == pytest.approx(1000 * pair)
    # stage A hides the exchange when it is longer: fwd max(A_f, in) + B_f + back ...
    own, work, kv = 10**6, 2 * 10**6, 100
    a, b, f = own * pair, (work - own) * pair, 1 / 3.5
    fwd = max(a * f, kv * 4096 / 1e9) + b * f
    bwd = max(a * (1 - f), kv * 4096 / 1e9) + b * (1 - f) + kv * 4096 / 1e9
    assert m.overlap_s(own, work, kv, 0) == pytest.approx(fwd + bwd)
    # kernel calls at launch_us each
    m2 = Model(tflops=1.0, a2a_gbps=1.0, launch_us=50.0)
    assert m2.overlap_s(own, work, kv, 0, calls=4) == pytest.approx(fwd + bwd + 4 * 50e-6)


@pytest.mark.parametrize("rows, S, c", [([[300, 700, 24]], 1024, 2), ([[100] * 10 + [24]], 1024, 4)])
def test_overlap_never_slower_than_the_serial_model(rows, S, c):
    layout = _layout(rows, S)
    masks = _masks(layout)
    m = Model()
    res = cp_model.evaluate("x", S, c, layout, masks, m, 1)
    assert res["step"]["ours_overlap"] <= res["step"]["ours"] + 1e-12
    plan = build_plan(layout, c, True, -1, 0, query_cost=m.hq / m.hkv, tolerance=0.01)
    assert res["step"]["ours_overlap"] >= m.compute_s(max(plan.work)) * (1 - 1e-9)
