"""bench_e2e's vocabulary-parallel loss: logits whose vocabulary the solver split over ranks give
the per-token cross entropy, and the gradient, of the full logits (float64 reference)."""

from __future__ import annotations

from bench_loss_cases import vocab_parallel_case


def test_vocab_parallel_loss_matches_full_logits(run_ranks):
    for rank, (loss_err, grad_err) in enumerate(run_ranks(vocab_parallel_case, 2, 11)):
        assert loss_err < 1e-5 and grad_err < 1e-6, (rank, loss_err, grad_err)


def test_vocab_parallel_loss_uneven_split(run_ranks):
    """Uneven split as DTensor's Shard makes it (11 columns over 3 ranks: 4, 4, 3)."""
    for rank, errs in enumerate(run_ranks(vocab_parallel_case, 3, 11)):
        assert max(errs) < 1e-5, (rank, errs)
