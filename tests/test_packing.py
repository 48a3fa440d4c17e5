"""doc_packed.data.packing: every document intact and once, rows of seq_len, the document index of
every position, balance under the real planner, determinism, streaming, and CP training on
CP-aware rows against the float64 oracle (gloo)."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import doc_packed as dp
from cp_cases import cp_parity
from doc_packed._mask import prefix_pairs
from doc_packed.cp.plan import chunk_len
from doc_packed.data import PAD, lognormal_lengths, pack_documents, pack_order, pack_stream


# ---- helpers ------------------------------------------------------------------------------------
def _check_order(order, lengths, seq_len):
    """Every non-empty document exactly once, rows of exactly seq_len, lengths consistent."""
    placed = [i for row in order.rows for i in row if i != PAD]
    assert sorted(placed) == [i for i, n in enumerate(lengths) if n > 0]
    pad = 0
    for row, ln in zip(order.rows, order.lengths, strict=True):
        assert len(row) == len(ln)
        assert sum(ln) == seq_len
        for i, n in zip(row, ln):
            assert n > 0
            if i == PAD:
                pad += n
            else:
                assert n == lengths[i]
    assert order.padded == pad


def _owner_first(order, seq_len, c):
    """Per-rank pairs before the planner moves anything, counted independently of packing.py:
    token by token, a query at in-document position i sees i + 1 keys (causal)."""
    cs = chunk_len(seq_len, c)
    loads = [0] * c
    for ln in order.lengths:
        at = 0
        for n in ln:
            for r in range(at // cs, (at + n - 1) // cs + 1):
                a, e = max(at, r * cs), min(at + n, (r + 1) * cs)
                loads[r] += sum(t - at + 1 for t in range(a, e))
            at += n
    return loads


def _forced_kv(lengths, seq_len, c, slack=0.01):
    """K/V that any packing moving no query at imbalance <= 1 + slack must receive somewhere."""
    cs = chunk_len(seq_len, c)
    cap = (1 + slack) * sum(n * (n + 1) // 2 for n in lengths) / c
    worst = 0
    for n in lengths:
        y = max(y for y in range(0, min(n, cs) + 1) if n * (n + 1) // 2 - (n - y) * (n - y + 1) // 2 <= cap)
        worst = max(worst, n - y)
    return worst


def _plan(order, seq_len, c):
    cu = dp.cu_seqlens_from_lengths(order.lengths, seq_len)
    return dp.plan_context_parallel(cu, c, query_cost=4.0, row_cost=None)  # the pairs planner packing aims at


def _uniform_rows(S, B, top, seed):
    """B rows of documents of uniform length in [1, top], each row cut to exactly S tokens."""
    rng, out = random.Random(seed), []
    for _ in range(B):
        left = S
        while left:
            out.append(min(left, rng.randint(1, top)))
            left -= out[-1]
    return out


def _rows_of(S, B, mean, seed):
    return [n for b in range(B) for n in lognormal_lengths(S, mean, 1000 * seed + b)]


# ---- invariants (hypothesis) ------------------------------------------------------------------
masks = st.sampled_from([(True, (-1, -1)), (True, (7, 0)), (False, (-1, -1)), (False, (5, 3))])


@settings(max_examples=150, deadline=None)
@given(
    seq_len=st.integers(1, 300),
    cp=st.sampled_from([None, 1, 2, 3, 4, 8]),
    mask=masks,
    data=st.data(),
)
def test_order_keeps_every_document_once(seq_len, cp, mask, data):
    lengths = data.draw(st.lists(st.integers(0, seq_len), min_size=1, max_size=40))
    causal, window = mask
    order = pack_order(lengths, seq_len, cp_size=cp, causal=causal, window_size=window)
    _check_order(order, lengths, seq_len)
    again = pack_order(list(lengths), seq_len, cp_size=cp, causal=causal, window_size=window)
    assert again == order  # deterministic: a function of the lengths


@settings(max_examples=60, deadline=None)
@given(seq_len=st.integers(4, 64), cp=st.sampled_from([None, 2, 4]), data=st.data())
def test_pack_documents_positions_and_index(seq_len, cp, data):
    lengths = data.draw(st.lists(st.integers(0, 3 * seq_len), min_size=1, max_size=12))
    if not any(lengths):
        lengths[0] = 1
    docs = [torch.stack([torch.full((n,), i), torch.arange(n)], 1) for i, n in enumerate(lengths)]
    out = pack_documents(docs, seq_len, cp_size=cp, pad_value=-7)
    assert out.rows.shape[1:] == (seq_len, 2) and out.doc_index.shape == out.rows.shape[:2]
    idx = out.doc_index
    pad = idx == PAD
    assert (out.rows[pad] == -7).all()
    assert (out.rows[..., 0][~pad] == idx[~pad]).all()  # the index names each position's document
    assert out.padded_fraction == pytest.approx(pad.float().mean().item())
    # every document's tokens in order, split into pieces of at most seq_len, each piece whole
    for i, n in enumerate(lengths):
        where = (idx == i).nonzero().tolist()
        got = sorted(out.rows[b, s, 1].item() for b, s in where)
        assert got == list(range(n))
    # cu_seqlens boundaries: no document crosses one, every piece starts one
    ids = dp.data.document_ids(out.cu_seqlens, seq_len)
    for b in range(idx.shape[0]):
        for s in range(1, seq_len):
            same_piece = idx[b, s] == idx[b, s - 1] != PAD and out.rows[b, s, 1] == out.rows[b, s - 1, 1] + 1
            if same_piece:
                assert ids[b, s] == ids[b, s - 1]
            if idx[b, s] != PAD and out.rows[b, s, 1] % seq_len == 0:
                assert ids[b, s] != ids[b, s - 1]


def test_greedy_is_first_fit_as_before():
    """Without cp_size the rows are the historical first-fit rows (old callers keep theirs)."""
    rng = random.Random(3)
    for _ in range(50):
        S = rng.randint(4, 50)
        docs = [torch.arange(rng.randint(1, 60)) for _ in range(rng.randint(1, 10))]
        out = dp.pack_documents(docs, S)
        # the old algorithm, written again here
        pieces = [p for d in docs for p in d.split(S)]
        rows, room = [], []
        for p in pieces:
            for r, free in enumerate(room):
                if p.shape[0] <= free:
                    rows[r].append(p)
                    room[r] -= p.shape[0]
                    break
            else:
                rows.append([p])
                room.append(S - p.shape[0])
        want = torch.zeros(len(rows), S, dtype=torch.int64)
        for r, row in enumerate(rows):
            want[r, : S - room[r]] = torch.cat(row)
        assert torch.equal(out.rows, want)
        cu = dp.cu_seqlens_from_lengths([[p.shape[0] for p in row] for row in rows], S)
        assert torch.equal(out.cu_seqlens, cu)


# ---- balance under the real planner --------------------------------------------------------------
BALANCE_CASES = [  # (S, rows, cp, lengths(seed)); every shard holds >= 8 mean documents
    ("lognormal-512", 32768, 4, 4, lambda s: _rows_of(32768, 4, 512, s)),
    ("lognormal-2k", 131072, 4, 4, lambda s: _rows_of(131072, 4, 2048, s)),
    ("lognormal-512 one row", 131072, 1, 4, lambda s: _rows_of(131072, 1, 512, s)),
    ("uniform", 16384, 4, 4, lambda s: _uniform_rows(16384, 4, 512, s)),
]


@pytest.mark.parametrize("name,S,B,c,make", BALANCE_CASES, ids=[c[0] for c in BALANCE_CASES])
def test_balance_bound_on_realistic_distributions(name, S, B, c, make):
    """Where no document is too long or too heavy for a shard (forced K/V 0), CP-aware rows
    are balanced within the planner's tolerance (so it moves no query) and receive at most 1% of
    all-gather's K/V; otherwise they do no worse than greedy on queries moved. Seeds 0..7."""
    met, free = 0, 0
    for seed in range(8):
        lengths = make(seed)
        order = pack_order(lengths, S, cp_size=c)
        _check_order(order, lengths, S)
        loads = _owner_first(order, S, c)
        imb = max(loads) * c / sum(loads)
        plan = _plan(order, S, c)
        ag = len(order.rows) * S * (c - 1) // c
        if _forced_kv(lengths, S, c) == 0 and sum(lengths) % S == 0:
            free += 1
            met += imb <= 1.01 and max(plan.q_moved_tokens) == 0 and max(plan.kv_recv_tokens) <= 0.01 * ag
            assert imb <= 1.02, (seed, imb)
            assert order.padded == 0
    assert free >= 2, "the case should have seeds that no document forces"
    assert met >= free - 1, f"only {met} of {free} unforced seeds met every goal"


def test_one_long_document_balanced_against_the_rest():
    """Half the row in one document: no packing can balance it without moving queries or
    receiving at least the forced K/V (its last piece is bounded by one rank's share). The
    CP-aware row places it so that its last rank receives just that: within 1% of the bound,
    and less than where greedy put it."""
    S, c = 65536, 4
    short = lognormal_lengths(S // 2, 256, 5)
    lengths = short[:10] + [S // 2] + short[10:]
    order = pack_order(lengths, S, cp_size=c)
    _check_order(order, lengths, S)
    greedy = pack_order(lengths, S)
    kv, kv_greedy = max(_plan(order, S, c).kv_recv_tokens), max(_plan(greedy, S, c).kv_recv_tokens)
    forced = _forced_kv(lengths, S, c)
    assert forced > S // 4
    assert forced <= kv <= 1.01 * forced
    assert kv < kv_greedy


def test_pair_count_is_the_planners():
    """The packer balances the pairs the planner counts: with a sliding window its owner-first
    loads equal the plan's work when nothing moves."""
    S, c = 32768, 4
    lengths = _rows_of(S, 2, 512, 11)
    order = pack_order(lengths, S, cp_size=c, window_size=(128, 0))
    cu = dp.cu_seqlens_from_lengths(order.lengths, S)
    plan = dp.plan_context_parallel(cu, c, window_size=(128, 0))
    from doc_packed.data._work import column_loads

    assert column_loads(order.lengths, S, c, True, 128, 0) == [
        sum(
            prefix_pairs(min(e, (r + 1) * (S // c)) - s, e - s, True, 128, 0)
            - prefix_pairs(max(s, r * (S // c)) - s, e - s, True, 128, 0)
            for row in cu.tolist()
            for s, e in zip(row[:-1], row[1:])
            if min(e, (r + 1) * (S // c)) > max(s, r * (S // c))
        )
        for r in range(c)
    ]
    if max(plan.q_moved_tokens) == 0:
        assert list(plan.work) == column_loads(order.lengths, S, c, True, 128, 0)


# ---- the vectorised counts ------------------------------------------------------------------------
@settings(max_examples=100, deadline=None)
@given(mask=masks, data=st.data())
def test_vectorised_pair_counts_match_token_by_token(mask, data):
    """``prefix_pairs_np`` is ``prefix_pairs`` elementwise, and ``column_loads`` (cumulative work
    at shard boundaries) equals counting every query's visible keys (``key_bounds``) by hand."""
    from doc_packed._mask import key_bounds
    from doc_packed.data._work import column_loads, prefix_pairs_np

    causal, (left, right) = mask
    if causal:
        right = 0
    S = data.draw(st.integers(1, 96))
    c = data.draw(st.integers(1, 9))
    rows = []
    for _ in range(data.draw(st.integers(1, 3))):
        row = data.draw(st.lists(st.integers(1, S), max_size=8))
        while sum(row) > S:
            row.pop()
        rows.append(row)
    ns = np.array([n for row in rows for n in row] or [0], dtype=np.int64)
    ks = np.array([data.draw(st.integers(-2, int(n) + 1)) for n in ns], dtype=np.int64)
    got = prefix_pairs_np(ks, ns, causal, left, right).tolist()
    assert got == [prefix_pairs(int(k), int(n), causal, left, right) for k, n in zip(ks, ns)]
    cs = chunk_len(S, c)
    want = [0] * c
    for row in rows:
        at = 0
        for n in row:
            for i in range(n):
                lo, hi = key_bounds(i, n, causal, left, right)
                want[min((at + i) // cs, c - 1)] += hi - lo + 1
            at += n
    assert column_loads(rows, S, c, causal, left, right) == want


# ---- what the goal cells taught ------------------------------------------------------------------
def _two_rank_optimum(lengths, S, limit=1.009):
    """Every split of one full row over 2 ranks, by hand: the least K/V rank 1 receives among the
    splits whose heavier rank is within ``limit`` of the mean (None if there is none)."""
    half, total = chunk_len(S, 2), sum(n * (n + 1) // 2 for n in lengths)
    best = None
    for mask in range(1 << len(lengths)):
        inside = [j for j in range(len(lengths)) if mask >> j & 1]
        toks, work = sum(lengths[j] for j in inside), sum(lengths[j] * (lengths[j] + 1) // 2 for j in inside)
        p = half - toks  # the head of one more document ends rank 0 (p = 0: none straddles)
        if p < 0 or (p and not any(lengths[j] > p for j in range(len(lengths)) if j not in inside)):
            continue
        w0 = work + p * (p + 1) // 2
        if max(w0, total - w0) <= limit * total / 2:
            best = p if best is None else min(best, p)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_two_ranks_few_documents_get_the_best_split(seed):
    """One row of few long documents over 2 ranks (lognormal-8k at 128k: 15 documents) has no
    exact balanced cut; the packer tries every split and takes the balanced one whose straddling
    document sends the fewest keys, the optimum found here independently (no query moves)."""
    rng = random.Random(seed)
    S = 4096
    lengths = _uniform_rows(S, 1, rng.choice([900, 1500, 2500]), seed)
    order = pack_order(lengths, S, cp_size=2)
    _check_order(order, lengths, S)
    best = _two_rank_optimum(lengths, S)
    plan = _plan(order, S, 2)
    if best is not None:
        assert max(plan.q_moved_tokens) == 0
        assert max(plan.kv_recv_tokens) == best


def test_bench_bounds_hold_below_what_a_packing_reaches():
    """bench_packing's bounds: the exact two-rank optimum equals the independent search above,
    the fill-aware bound never exceeds it, and a document that fills the row over 2 ranks
    cannot be balanced without moving queries (infinite bound)."""
    from bench.bench_packing import exact_two_kv, forced_kv

    S = 4096
    for seed in range(6):
        lengths = _uniform_rows(S, 1, random.Random(seed).choice([900, 1500, 2500]), seed)
        best = _two_rank_optimum(lengths, S, limit=1.01)
        assert exact_two_kv(lengths, S) == best
        if best is not None:
            assert forced_kv(lengths, S, 2) <= best
    assert forced_kv([S], S, 2) == float("inf")
    assert forced_kv([S // 2] * 2, S, 2) == 0  # one document per shard: balanced, nothing straddles


def test_documents_of_a_whole_shard_are_placed_whole():
    """long+short over 2 ranks in 8 rows: every row holds one document of exactly a shard. Each
    must sit alone in one shard (half the rows on each rank): nothing moves, nothing straddles
    (they used to be left to first-fit, 1.45 imbalance; the cells keep 1% free while assigning)."""
    S, c = 8192, 2
    lengths = []
    for b in range(8):
        short = lognormal_lengths(S // 2, 64, 70 + b)
        lengths += short[:5] + [S // 2] + short[5:]
    order = pack_order(lengths, S, cp_size=c)
    _check_order(order, lengths, S)
    plan = _plan(order, S, c)
    assert max(plan.q_moved_tokens) == 0
    assert max(plan.kv_recv_tokens) <= 0.01 * 8 * S // 2
    loads = _owner_first(order, S, c)
    assert max(loads) * c / sum(loads) <= 1.01


def _bench_rows(dist: str, S: int, B: int) -> list[int]:
    from bench.cp_model import make_layout

    layout = make_layout(dist, S * B, B, 2026)  # bench_packing's documents (seed 2026)
    return [e - s for row in layout.rows for s, e in row]


def _bench_cell(dist: str, S: int, B: int, c: int):
    """bench_packing's cell packed by pack_order (checked intact): ``(order, plan, imbalance)``,
    the imbalance of the owner-first loads."""
    lengths = _bench_rows(dist, S, B)
    order = pack_order(lengths, S, cp_size=c)
    _check_order(order, lengths, S)
    loads = _owner_first(order, S, c)
    return order, _plan(order, S, c), max(loads) * c / sum(loads)


def test_heavy_documents_leave_light_fill_to_their_columns():
    """lognormal-512 in 8 rows of 128k over 16 ranks (bench_packing's cell): one document is
    longer than a shard, and its last piece leaves its column only light documents. Counting on
    the shortest ones, which are held back to close cells, put that column 1.4% over (189
    queries moved); with claimed light tokens nothing moves and K/V stays under 1%."""
    S, B, c = 1 << 17, 8, 16
    order, plan, imbalance = _bench_cell("lognormal-512", S, B, c)
    assert imbalance <= 1.01
    assert max(plan.q_moved_tokens) == 0
    assert max(plan.kv_recv_tokens) <= 0.01 * B * S * (c - 1) // c
    assert order.padded == 0


def test_several_heavy_documents_meet_the_goal():
    """The same documents over 32 ranks (a shard holds 8 mean documents: a goal cell). Six
    documents longer than a shard put pieces in 11 columns. Placed for the fewest keys, each
    left its last column room only for the lightest documents, which the other columns took
    (365 queries moved, imbalance 1.016). The first packing leaves a document out, so the
    claimed pass also evens each heavy document's pieces (its last piece a little shorter, a few
    more keys): the goal holds, zero queries moved, K/V <= 1% of all-gather's, no padding."""
    S, B, c = 1 << 17, 8, 32
    order, plan, imbalance = _bench_cell("lognormal-512", S, B, c)
    assert imbalance <= 1.01
    assert max(plan.q_moved_tokens) == 0
    assert plan.imbalance <= 1.02
    assert max(plan.kv_recv_tokens) <= 0.01 * B * S * (c - 1) // c
    assert order.padded <= 0.005 * B * S


def _straddlers(rows, lens, cs):
    """(row, start, doc, length) of every segment that crosses a shard boundary."""
    out = []
    for b, (row, ln) in enumerate(zip(rows, lens)):
        at = 0
        for i, n in zip(row, ln):
            if at // cs != (at + n - 1) // cs:
                out.append((b, at, i, n))
            at += n
    return out


def _cell_tokens(rows, lens, cs, c):
    """Tokens of whole (non-straddling) documents per (row, column)."""
    out = [[0] * c for _ in rows]
    for b, (row, ln) in enumerate(zip(rows, lens)):
        at = 0
        for i, n in zip(row, ln):
            if at // cs == (at + n - 1) // cs:
                out[b][at // cs] += n
            at += n
    return out


def test_trades_between_cells_keep_cells_and_straddlers():
    """trade_cells (a packing's last resort where its heaviest column is a little over): where
    it returns rows, every document is there once, every cell holds the same tokens, every
    straddling document keeps its place (so ranks need the same keys), the loads it returns are
    the owner-first loads counted token by token, and no rank is above 1.01 of the mean; where
    it returns None, its input is untouched. Rows: documents in random order, nearly balanced."""
    from doc_packed.data import _trades, _work

    S, c = 4096, 4
    cs = S // c
    done = 0
    for seed in range(60):
        rng = random.Random(seed)
        lengths = _uniform_rows(S, 3, rng.choice([40, 120, 300]), seed)
        rows, lens, at = [[]], [[]], 0
        for i, n in enumerate(lengths):
            rows[-1].append(i)
            lens[-1].append(n)
            at += n
            if at == S and i + 1 < len(lengths):
                rows.append([])
                lens.append([])
                at = 0
        docs = _work.Docs(lengths, True, -1, 0)
        loads = _work.column_loads(lens, S, c, True, -1, 0)
        before = ([list(r) for r in rows], [list(x) for x in lens], list(loads))
        got = _trades.trade_cells(rows, lens, loads, docs, S, c)
        assert (rows, lens, loads) == before
        if got is None:
            continue
        new_rows, new_lens, new_loads = got
        order = dp.data.PackOrder(new_rows, new_lens, 0)
        _check_order(order, lengths, S)
        assert _straddlers(new_rows, new_lens, cs) == _straddlers(rows, lens, cs)
        assert _cell_tokens(new_rows, new_lens, cs, c) == _cell_tokens(rows, lens, cs, c)
        assert new_loads == _owner_first(order, S, c)
        assert max(new_loads) * c <= 1.01 * sum(new_loads)
        done += max(loads) * c > 1.01 * sum(loads)  # it had something to do
    assert done >= 40, f"only {done} of 60 inputs were brought within 1% by trades"


def test_a_pass_sure_to_leave_a_document_out_stops_early(monkeypatch):
    """powerlaw in 8 rows of 128k over 64 ranks (bench_packing's slowest cell): documents of
    several shards find no place in the 8-row assignment, so every row is packed again on its
    own. A pass stops as soon as a document longer than two shards finds no place (nothing can
    take it later); the rows are exactly those of the passes run to the end."""
    from doc_packed.data import _search

    S, B, c = 1 << 17, 8, 64
    lengths = _bench_rows("powerlaw", S, B)
    orig = _search.best_pass
    stopped = []

    def spy(*args, **kwargs):
        out = orig(*args, **kwargs)
        stopped.append(out[3] is None and bool(out[2]))
        return out

    monkeypatch.setattr(_search, "best_pass", spy)
    fast = pack_order(lengths, S, cp_size=c)
    assert any(stopped), "the case should have a pass that stops early"
    monkeypatch.setattr(_search, "best_pass", lambda *args, **kwargs: orig(*args[:7], **kwargs))  # bail left at False
    slow = pack_order(lengths, S, cp_size=c)
    assert fast == slow
    _check_order(fast, lengths, S)


def test_pack_order_tries_one_remedy_after_the_first_packing(monkeypatch):
    """lognormal-512 in 8 rows of 128k over 32 ranks, drawn with seed 9 (the bench draws 2026):
    the first packing moves queries (owner-first imbalance 1.017), the claimed one is worse
    (1.028). pack_order then tries no shifted pass (``one_remedy``: a bound on packings run, not
    on time): two packings instead of three, and the rows are those of all three, since the
    shifted pass (1.063) was no better either."""
    from doc_packed.data import _rows, _search
    from bench.cp_model import make_layout

    S, B, c = 1 << 17, 8, 32
    layout = make_layout("lognormal-512", S * B, B, 9)
    lengths = [e - s for row in layout.rows for s, e in row]
    orig = _search._pass
    passes: list[tuple[bool, bool]] = []  # (shifted, claimed) of every packing run

    def spy(*args, **kwargs):
        passes.append((args[9] is not None, args[10]))
        return orig(*args, **kwargs)

    monkeypatch.setattr(_search, "_pass", spy)
    bounded = _search.best_pass(lengths, S, c, True, -1, 0, B, True, one_remedy=True)
    assert passes == [(False, False), (False, True)]
    passes.clear()
    full = _search.best_pass(lengths, S, c, True, -1, 0, B, True)
    assert passes == [(False, False), (False, True), (True, False)]
    assert bounded == full
    assert max(full[3]) * c > 1.01 * sum(full[3])  # still moves queries (not the point here)
    passes.clear()
    order = pack_order(lengths, S, cp_size=c)
    assert passes == [(False, False), (False, True)]
    _check_order(order, lengths, S)
    assert order == _rows.pad_rows(*full[:2], S, c)


def test_trades_stop_at_a_work_count(monkeypatch):
    """lognormal-512 in one 1M row over 16 ranks, drawn with seed 1: the packing moves queries
    (imbalance 1.05, three columns over 1.01) and trades between cells cannot bring it within
    1%. Unbounded, all ``_TRADES`` trades run, each re-filling two cells' least-work tables of
    ~128 documents, and none is kept; with the work count (``_TRADE_WORK`` table entries) they
    stop after a few, with the same outcome and the same rows out of pack_order."""
    from doc_packed.data import _search, _trades, _work
    from bench.cp_model import make_layout

    S, c = 1 << 20, 16
    lengths = [e - s for row in make_layout("lognormal-512", S, 1, 1).rows for s, e in row]
    docs = _work.Docs(lengths, True, -1, 0)
    _, (rows, lens, _), loads, _ = _search._pass(docs, lengths, S, c, True, -1, 0, 1, True, None, False)
    assert max(loads) * c > 1.01 * sum(loads)
    orig = _trades._least_set
    trades = [0]

    def spy(*args):
        trades[0] += 1
        return orig(*args)

    monkeypatch.setattr(_trades, "_least_set", spy)
    bounded = _trades.trade_cells(rows, lens, loads, docs, S, c)
    n_bounded, trades[0] = trades[0], 0
    order = pack_order(lengths, S, cp_size=c)
    monkeypatch.setattr(_trades, "_TRADE_WORK", 1 << 62)
    trades[0] = 0
    unbounded = _trades.trade_cells(rows, lens, loads, docs, S, c)
    assert bounded is None and unbounded is None
    assert trades[0] == _trades._TRADES
    assert 0 < n_bounded < _trades._TRADES
    assert pack_order(lengths, S, cp_size=c) == order


# ---- streaming ---------------------------------------------------------------------------------
@pytest.mark.parametrize("lookahead", [1, 3])
@pytest.mark.parametrize("rows", [1, 2])
def test_stream_every_document_once_and_waits_bounded(lookahead, rows):
    S, c = 8192, 4
    lengths = lognormal_lengths(20 * S, 300, 9)
    emitted = [0]
    read_at = []

    def source():
        for i, n in enumerate(lengths):
            read_at.append(emitted[0])
            yield torch.full((min(n, 3 * S),), i)

    seen = []
    for batch in pack_stream(source(), S, cp_size=c, rows=rows, lookahead=lookahead):
        assert batch.rows.shape == (rows, S)
        ids = [i for i in batch.doc_index.unique().tolist() if i != PAD]
        for i in ids:
            assert (batch.rows[batch.doc_index == i] == i).all()
            assert emitted[0] - read_at[i] <= 4 * lookahead + 2, (i, emitted[0], read_at[i])
        seen += ids
        emitted[0] += 1
    assert sorted(seen) == list(range(len(lengths)))  # split pieces may share a batch
    assert len(seen) == len(lengths)


def test_stream_rows_per_batch_buy_balance():
    """Balance is a property of a batch: four rows per batch (planned together) are balanced
    where one row alone holds documents too heavy for a shard (measured: docs/packing.md)."""
    S, c = 32768, 4

    def mean_imbalance(rows):
        docs = (torch.empty(n) for n in lognormal_lengths(16 * S, 512, 4))
        imbs = []
        for batch in itertools.islice(pack_stream(docs, S, cp_size=c, rows=rows, lookahead=1), 16 // rows - 1):
            lens = [[int(x) for x in r.diff().tolist() if x > 0] for r in batch.cu_seqlens]
            loads = _owner_first(type("O", (), {"lengths": lens})(), S, c)
            imbs.append(max(loads) * c / sum(loads))
        return sum(imbs) / len(imbs)

    assert mean_imbalance(4) < mean_imbalance(1)
    assert mean_imbalance(4) <= 1.01


# ---- errors ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs,err,match",
    [
        (dict(cp_size=0), ValueError, "cp_size"),
        (dict(cp_size=True), TypeError, "cp_size"),
        (dict(cp_size=2, window_size=(3, 2)), ValueError, "causal"),
        (dict(seq_len=0), ValueError, "seq_len"),
    ],
)
def test_bad_arguments_raise(kwargs, err, match):
    args = dict(seq_len=16)
    args.update(kwargs)
    with pytest.raises(err, match=match):
        pack_order([3, 4], args.pop("seq_len"), **args)


def test_bad_lengths_raise():
    with pytest.raises(ValueError, match=r"lengths\[1\]"):
        pack_order([3, 17], 16, cp_size=2)
    with pytest.raises(ValueError, match=r"lengths\[0\]"):
        pack_order([-1], 16)
    with pytest.raises(TypeError, match="documents\\[0\\]"):
        pack_documents([[1, 2]], 16)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="lookahead"):
        next(pack_stream(iter([torch.zeros(3)]), 16, cp_size=2, lookahead=0))


# ---- CP attention on CP-aware rows matches the oracle (gloo) ------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_cp_on_packed_rows_matches_oracle(run_ranks, world):
    """Forward and backward of context-parallel attention on CP-aware rows equal the float64
    oracle, and on these rows the plan moves no query (the packing's point)."""
    S = 512
    lengths = [n for b in range(2) for n in lognormal_lengths(S, 12, 300 + b)]
    order = pack_order(lengths, S, cp_size=world)
    plan = _plan(order, S, world)
    assert max(plan.q_moved_tokens) == 0
    cases = [dict(lengths=order.lengths, S=S, Hq=4, Hkv=2, D=8, causal=True, window=(-1, -1), seed=world)]
    for rank, errs in enumerate(run_ranks(cp_parity, world, cases)):
        for err, paths in errs:
            assert err < 1e-10, f"rank {rank}: max error {err}"
            assert not paths[1]  # no query exchange ran
