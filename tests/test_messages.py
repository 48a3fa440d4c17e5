"""What a user reads: error messages in the words of the call they made, and readable reports
(issue 38's smaller items)."""

import numpy as np
import pytest
import torch
import torch.distributed as dist

import doc_packed as dp

# ----------------------------------------------------------------------------- cu_seqlens builders


@pytest.mark.parametrize("lengths", [[[5.5, 10.5]], [[5.0, 11]], [["5", 11]], [[True, 15]]])
def test_cu_seqlens_from_lengths_rejects_non_integers(lengths):
    with pytest.raises(TypeError, match=r"lengths\[0\] must hold ints"):
        dp.cu_seqlens_from_lengths(lengths, 16)


def test_cu_seqlens_from_lengths_takes_integer_scalars():
    got = dp.cu_seqlens_from_lengths([[np.int64(5), torch.tensor(11)]], 16)
    assert got.tolist() == [[0, 5, 16]]
    with pytest.raises(TypeError, match="seq_len must be an int"):
        dp.cu_seqlens_from_lengths([[5, 11]], 16.0)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- the varlen entry's words


def _packed(T=10):
    return torch.randn(T, 2, 8), torch.randn(T, 2, 8), torch.randn(T, 2, 8)


@pytest.mark.parametrize(
    "cu,match",
    [
        ([0, 4, 8], r"^cu_seqlens must end at T = 10, the tokens in q, got 8$"),
        ([1, 4, 10], r"^cu_seqlens must start at 0, got 1$"),
        ([0, 4, 12], r"^cu_seqlens entry 2 is 12, past T = 10, the tokens in q$"),
        ([0, 6, 4, 10], r"^cu_seqlens must be non-decreasing, but entry 2 \(4\) < entry 1 \(6\)$"),
    ],
)
def test_varlen_errors_speak_of_1d_cu_seqlens_and_tokens(cu, match):
    with pytest.raises(ValueError, match=match):
        dp.doc_packed_attn_varlen(*_packed(), torch.tensor(cu, dtype=torch.int32), None, causal=True)


def _local_chunk_of_cu(rank, world):
    """Each rank passes the boundaries of its own chunk instead of the global cu_seqlens."""
    T = 8
    q, k, v = _packed(T)
    local_cu = torch.tensor([0, 3, T], dtype=torch.int32)
    try:
        dp.doc_packed_attn_varlen(q, k, v, local_cu, None, causal=True, cp_group=dist.group.WORLD)
    except ValueError as err:
        return str(err)
    return None


def test_varlen_context_parallel_hint_that_cu_seqlens_is_global(run_ranks):
    for msg in run_ranks(_local_chunk_of_cu, 2):
        assert msg is not None and msg.startswith(
            "cu_seqlens must end at T = 16, the whole sequence's tokens (2 ranks' chunks of q together), got 8"
        )
        assert "under context parallelism cu_seqlens is global" in msg


def _local_rows_of_cu(rank, world):
    """The rows entry: each rank passes its own chunk's boundaries."""
    q, k, v = (t[None] for t in _packed(8))
    try:
        dp.doc_packed_attn(q, k, v, torch.tensor([[0, 3, 8]], dtype=torch.int32), causal=True, cp_group=dist.group.WORLD)
    except ValueError as err:
        return str(err)
    return None


def test_rows_context_parallel_hint_that_cu_seqlens_is_global(run_ranks):
    for msg in run_ranks(_local_rows_of_cu, 2):
        assert msg == (
            "cu_seqlens[0] must end at the sequence length 16 (2 ranks' chunks of q together) (unused slots repeat "
            "it), got 8; under context parallelism cu_seqlens is global: every rank passes the whole sequence's "
            "boundaries, not the part that falls in its own chunk"
        )


# ----------------------------------------------------------------------------- reports


def test_print_plan_is_a_table_and_repr_one_line():
    cu = dp.cu_seqlens_from_lengths([[700, 5, 1000, 343], [2048]], 2048)
    plan = dp.plan_context_parallel(cu, 4)
    text = str(plan).splitlines()
    assert text[0] == "context-parallel plan: 4 ranks, 2 row(s) of 2048 tokens, causal"
    assert f"imbalance {plan.imbalance:.3f}" in text[1] and "3072 K/V tokens" in text[1]
    rows = text[3:]
    assert len(rows) == 4
    for r, line in enumerate(rows):
        fields = line.split()
        assert fields[0] == str(r)
        assert fields[1:4] == [f"{plan.work[r]:,}", f"{plan.kv_recv_tokens[r]:,}", f"{plan.q_moved_tokens[r]:,}"]
    assert "\n" not in repr(plan) and repr(plan).startswith("ContextParallelPlan(cp_size=4, seq_len=2048")
    windowed = dp.plan_context_parallel(cu, 2, causal=False, window_size=(64, 8))
    assert str(windowed).splitlines()[0].endswith("bidirectional, window (64, 8)")


def test_env_last_line_reads():
    from doc_packed import env

    last = env.report().splitlines()[-1]
    first = next(name for name, why in env.backend_reasons().items() if why is None)
    assert last == f"auto would run {first} for such a call made on one device (not context parallel)"
