"""The context-parallel fault suite's multi-rank cases on 2 NCCL ranks, one GPU each.

The bodies are tests/test_cp_faults.py's (tests/cp_fault_cases.py), run through
``run_ranks(..., backend="nccl")``: a pure NCCL default group, so the agreement runs on its gloo
companion (checked here) while the data moves over NCCL. The data is float32 (the package takes
float64 on CPU only), made on the CPU with the gloo suite's seeds and moved to each rank's GPU;
``backend="auto"`` runs the math kernel on it (FA4 and flash take fp16/bf16 only, flex is never
auto-picked for context-parallel calls). Errors are against the float64 oracle on the CPU.
Not here: the agreement's cost (count_collectives) and the companion over two groups
(companion_group), which patch the channel and need gloo on the group itself / 4 ranks.

Run: ``python -m pytest -q -m gpu tests/test_cp_faults_nccl.py -p no:cacheprovider``
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cp_fault_cases import (
    agreement_channel,
    configured,
    divergent_history,
    later_divergence,
    many_layouts,
    nan_in_one_document,
    pass_divergence,
    rank_local_fault,
    shard_parity,
)
from test_cp_faults import (
    DIVERGENT,
    HISTORY_KINDS,
    RANK_LOCAL_CASES,
    _shard_cases,
    check_later_divergence,
    check_pass_divergence,
    check_private_history,
    check_rank_local_faults,
)

WORLD = 2
DTYPE = torch.float32
TOL = 1e-4  # float32 against the float64 oracle (one-ulp-scale errors are ~1e-6 here)


def _why_not() -> str | None:
    if not dist.is_nccl_available():
        return "needs torch.distributed with NCCL"
    if torch.cuda.device_count() < WORLD:
        return f"needs {WORLD} CUDA devices (one per NCCL rank), found {torch.cuda.device_count()}"
    return None


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_why_not() is not None, reason=_why_not() or "")]


@pytest.fixture
def ranks(run_ranks):
    """``ranks(body, *args)``: ``body`` on 2 NCCL ranks with float32 data."""
    return lambda fn, *args: run_ranks(configured, WORLD, DTYPE, fn, *args, backend="nccl")


def test_agreement_runs_on_a_gloo_companion(ranks):
    for rank, (err, companion, config) in enumerate(ranks(agreement_channel)):
        assert companion and "cpu" not in config, (rank, config)
        assert err < TOL, (rank, err)


def test_one_token_and_empty_shards_exact(ranks):
    for rank, errs in enumerate(ranks(shard_parity, _shard_cases(WORLD))):
        for i, err in enumerate(errs):
            assert err < TOL, f"rank {rank} case {i}: max error {err}"


def test_private_history_never_desynchronises(ranks):
    """Rank 0 alone evicts or forgets its cached layout (or bumps cu_seqlens' version) between two
    steps: it re-plans alone and both steps stay exact."""
    check_private_history(ranks(divergent_history, HISTORY_KINDS), TOL)


def test_later_call_divergence_raises_same_error_everywhere(ranks):
    check_later_divergence(ranks(later_divergence, list(DIVERGENT)), TOL)


def test_forward_against_backward_raises_on_both(ranks):
    check_pass_divergence(ranks(pass_divergence), TOL)


def test_rank_local_faults_raise_on_every_rank(ranks):
    check_rank_local_faults(ranks(rank_local_fault, RANK_LOCAL_CASES), TOL)


def test_many_layouts_agree_and_stay_bounded(ranks):
    for worst, cached in ranks(many_layouts, 40, 5):
        assert worst < TOL and cached <= 32


# Documents of row 0: [0, 5), [5, 17) (across the two shards), [17, 26), [26, 32); row 1: [0, 20),
# [20, 32). The NaN: row 0, token 10 (rank 0's shard), head 1 of q.
NAN_CASE = dict(lengths=[[5, 12, 9, 6], [20, 12]], S=32, Hq=2, Hkv=1, D=8)


@pytest.mark.parametrize("causal", [True, False])
def test_nan_in_one_document_stays_there(ranks, causal):
    """A NaN in one document's q on rank 0: every other document's out, lse and grads on both
    ranks are finite and match the oracle; the poisoned document's output is not finite."""
    results = ranks(nan_in_one_document, dict(NAN_CASE, causal=causal), (0, 10, 1))
    for rank, (err, finite, _hit) in enumerate(results):
        assert finite and err < TOL, (rank, err, finite)
    assert results[0][2] > 0  # the NaN did reach the poisoned document's outputs
