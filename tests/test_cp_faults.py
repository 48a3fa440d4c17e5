"""Context parallelism under faults, on real gloo ranks (docs/contract.md, section 8).

Every rank of a group must make the same call; each call checks that with one small all-gather
before any data moves. Here: one-token and empty shards (exact, lse in the loss), ranks whose
private caches differ (re-planning alone is harmless), ranks that differ in any input of a later
call or whose own checks fail (the same error on every rank, and the group stays usable), the
protocol's cost (one collective, 24 bytes per rank), the gloo companion used for groups without
a CPU backend, and thousands of layouts. Every multi-rank run goes through ``run_ranks`` (a
deadline per group; a hang is reported by rank with its stacks).
"""

from __future__ import annotations

import pytest

from cp_fault_cases import (
    companion_group,
    count_collectives,
    divergent_history,
    later_divergence,
    many_layouts,
    pass_divergence,
    rank_local_fault,
    shard_parity,
)

TOL = 1e-10  # float64 against the float64 oracle


def _shard_cases(world: int) -> list[dict]:
    """One-token shards (B=1, Hkv=1: the case whose dK/dV reduction once aliased its input),
    empty shards (torch.chunk gives the last ranks nothing), and mixes of the two."""
    out = [
        dict(lengths=[[world]], S=world, Hq=1, Hkv=1, D=4),  # one token per rank
        dict(lengths=[[1] * world], S=world, Hq=2, Hkv=1, D=4),  # one one-token document per rank
        dict(lengths=[[world + 1]], S=world + 1, Hq=1, Hkv=1, D=4, causal=False),
        dict(lengths=[[3, world + 3]], S=world + 6, Hq=2, Hkv=2, D=4, window=(2, 0)),
    ]
    if world == 4:
        # S=6 over 4: chunks of 2, 2, 2 and nothing; S=5: 2, 2, 1, 0; S=9: 3, 3, 3, 0
        out += [
            dict(lengths=[[6]], S=6, Hq=2, Hkv=1, D=4),
            dict(lengths=[[6]], S=6, Hq=2, Hkv=1, D=4, count_flops=True),  # flop formula, empty shard
            dict(lengths=[[2, 3], [5]], S=5, Hq=1, Hkv=1, D=4),
            dict(lengths=[[4, 5], [1, 8]], S=9, Hq=2, Hkv=1, D=4, causal=False, window=(1, 2)),
        ]
    if world == 3:
        out.append(dict(lengths=[[1, 1]], S=2, Hq=1, Hkv=1, D=4))  # chunks 1, 1, 0
    return out


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow)])
def test_one_token_and_empty_shards_exact(run_ranks, world):
    for rank, errs in enumerate(run_ranks(shard_parity, world, _shard_cases(world))):
        for i, err in enumerate(errs):
            assert err < TOL, f"rank {rank} case {i}: max error {err}"


@pytest.mark.slow
def test_private_history_never_desynchronises(run_ranks):
    """Rank 0 alone evicts or forgets its cached layout (or bumps cu_seqlens' version) between two
    steps: it re-plans alone (no collective in planning) and both steps stay exact."""
    check_private_history(run_ranks(divergent_history, 2, HISTORY_KINDS), TOL)


HISTORY_KINDS = ["local_calls", "add_zero", "clear", "thousands"]


def check_private_history(results: list, tol: float) -> None:
    """:func:`divergent_history`'s results over :data:`HISTORY_KINDS`: both steps exact, rank 0
    re-planned alone, the layout cache bounded (also run on NCCL: test_cp_faults_nccl.py)."""
    for kind in HISTORY_KINDS:
        for rank, r in enumerate(results):
            assert max(r[kind][0]) < tol, (kind, rank, r[kind])
        assert results[1][kind][1] == 1, kind  # rank 1 planned once
        assert results[0][kind][1] == (1 if kind == "add_zero" else 2), (kind, results[0][kind])
        assert results[0][kind][2] <= 32  # the layout cache stays bounded (2000 layouts)


DIVERGENT = {
    "head_dim": "head dim",
    "dtype": "dtype",
    "q_heads": "q heads",
    "kv_heads": "k/v heads",
    "causal": "causal",
    "window": "window",
    "scale": "scale",
    "cu_seqlens": "cu_seqlens values",
    "seq_len": "seq_len",
}


@pytest.mark.slow
def test_later_call_divergence_raises_same_error_everywhere(run_ranks):
    """After an agreed (cached) call, rank 1 differs in one input: every rank raises the very same
    ValueError naming the field and the ranks' values; then an agreed call runs exactly."""
    check_later_divergence(run_ranks(later_divergence, 2, list(DIVERGENT)), TOL)


def check_later_divergence(results: list, tol: float) -> None:
    """:func:`later_divergence`'s results over :data:`DIVERGENT`: the very same ValueError on
    every rank, naming the field and both ranks' values; the group still in step after it."""
    for what, field in DIVERGENT.items():
        messages = {r[what][1] for r in results}
        assert len(messages) == 1, (what, messages)  # the very same message on every rank
        (message,) = messages
        assert message is not None and "disagree" in message and field in message, (what, message)
        assert "rank 0:" in message and "rank 1:" in message, (what, message)
        assert {r[what][2] for r in results} == {"ValueError"}
        for first, _, _, last in (r[what] for r in results):  # still in step after the error
            assert first < tol and last < tol, what


@pytest.mark.slow
def test_forward_against_backward_raises_on_both(run_ranks):
    check_pass_divergence(run_ranks(pass_divergence, 2), TOL)


def check_pass_divergence(results: list, tol: float) -> None:
    """:func:`pass_divergence`'s results: one error naming the pass on both ranks, then exact."""
    assert results[0][0] == results[1][0] and "pass" in results[0][0], results
    assert all(err < tol for _, err in results)


LOCAL_FAULTS = ["decreasing", "past_end", "shard_length", "batch", "q_dtype", "window", "backend", "k_heads"]
SAME_FAULT = ["q_dtype_all", "decreasing_all"]


@pytest.mark.slow
def test_rank_local_faults_raise_on_every_rank(run_ranks):
    """Rank 1's own input is bad (values, shapes, dtype, mask, backend): every rank raises the
    same ValueError, which carries rank 1's own message; a clean step then runs exactly. The
    same fault on every rank: each raises its own error (its type kept). int64 cu_seqlens on one
    rank: all succeed (int64 accepted) or all raise one error."""
    check_rank_local_faults(run_ranks(rank_local_fault, 2, RANK_LOCAL_CASES), TOL)


RANK_LOCAL_CASES = LOCAL_FAULTS + SAME_FAULT + ["int64"]


def check_rank_local_faults(results: list, tol: float) -> None:
    """:func:`rank_local_fault`'s results over :data:`RANK_LOCAL_CASES`: one outcome on every
    rank (rank 1's own message, or each rank's own error when all are at fault), then exact."""
    for what in RANK_LOCAL_CASES:
        got = [r[what][0] for r in results]
        assert len(set(got)) == 1, (what, got)  # the same outcome on every rank
        assert all(r[what][1] < tol for r in results), what  # and the group is still in step
        if what == "int64":
            continue
        message, kind = got[0]
        if what in SAME_FAULT:
            assert kind == ("TypeError" if what == "q_dtype_all" else "ValueError") and "rejected" not in message
        else:
            assert kind == "ValueError" and "rank 1" in message and "rejected their inputs" in message, (what, message)


@pytest.mark.parametrize("companion", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_agreement_costs_one_small_collective(run_ranks, companion):
    """A cached forward + backward: one agreement all-gather per pass (3 int64 words per rank)
    besides the schedule's data exchanges, two per pass."""
    world = 2
    for measured, (fwd, bwd), err, _us, _raw_us in run_ranks(count_collectives, world, companion):
        assert err < TOL
        assert measured["agree_calls"] == 2, measured
        assert measured["agree_bytes_sent"] == 2 * 24, measured
        assert measured["agree_bytes_received"] == 2 * 24 * world, measured
        assert measured["data"] == fwd + bwd, measured
        # the plan moves queries here: one exchange out and one home per pass (K|V with the
        # moved rows; out|lse, or dQ with partial dK|dV)
        assert (fwd, bwd) == (2, 2)


@pytest.mark.slow
def test_companion_group_over_two_cp_groups(run_ranks):
    results = run_ranks(companion_group, 4)
    for rank, (errs, message, made) in enumerate(results):
        assert made and max(errs) < TOL, (rank, errs)
        if rank < 2:
            assert message is None  # the other group disagreed, not this one
    assert results[2][1] == results[3][1] and "causal" in results[2][1]


@pytest.mark.slow
def test_many_layouts_agree_and_stay_bounded(run_ranks):
    for worst, cached in run_ranks(many_layouts, 3, 120, 5):
        assert worst < TOL and cached <= 32
