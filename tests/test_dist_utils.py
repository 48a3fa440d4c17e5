"""The multi-rank harness (dist_utils, the ``run_ranks`` fixture) reports what went wrong on
which rank: a hang by name within the deadline, an exception with its traceback."""

import time

import pytest
import torch
import torch.distributed as dist

from dist_utils import GRACE, STACK_WAIT, RanksFailed


def rank_and_world(rank, world):
    return rank, world, dist.get_rank(), dist.get_world_size()


def rank_1_never_joins_the_all_reduce(rank, world):
    if rank == 0:
        dist.all_reduce(torch.ones(1))
    else:
        time.sleep(600)


def rank_1_raises(rank, world):
    if rank == 1:
        raise ValueError("rank 1 found a bad input")
    return rank


def rank_1_raises_while_rank_0_computes(rank, world):
    if rank == 1:
        raise ValueError("rank 1 found a bad input")
    time.sleep(600)  # never reaches a collective that would fail at once


def test_results_come_back_by_rank(run_ranks):
    assert run_ranks(rank_and_world, 3) == [(r, 3, r, 3) for r in range(3)]


@pytest.mark.slow
def test_a_hang_is_reported_by_rank_within_the_deadline(run_ranks):
    timeout = 6.0  # rank 0's all_reduce gives up after 3 s; rank 1 is killed at the deadline
    with pytest.raises(RanksFailed) as info:
        run_ranks(rank_1_never_joins_the_all_reduce, 2, timeout=timeout)
    failure = info.value
    assert failure.hung == [1]
    assert failure.elapsed is not None and failure.elapsed < timeout + 5
    # rank 0: its own traceback, through the rank function, ending in gloo's timeout
    assert "rank_1_never_joins_the_all_reduce" in failure.reports[0]
    assert "all_reduce" in failure.reports[0] and "Timed out" in failure.reports[0]
    # rank 1: named as hung, with where it was
    assert "\nrank 1 hung: still running" in str(failure)
    assert "in rank_1_never_joins_the_all_reduce" in failure.reports[1].split("Its Python stacks:")[1]


def test_a_rank_exception_reaches_the_parent_with_its_traceback(run_ranks):
    with pytest.raises(RanksFailed) as info:
        run_ranks(rank_1_raises, 2, timeout=30)
    report = info.value.reports[1]
    assert report.startswith("raised:\nTraceback (most recent call last):")
    assert 'in rank_1_raises\n    raise ValueError("rank 1 found a bad input")' in report
    assert report.rstrip().endswith("ValueError: rank 1 found a bad input")
    assert info.value.hung == []


@pytest.mark.slow
def test_after_a_rank_fails_the_others_are_stopped_without_waiting_for_the_deadline(run_ranks):
    with pytest.raises(RanksFailed) as info:
        run_ranks(rank_1_raises_while_rank_0_computes, 2, timeout=300)
    failure = info.value
    assert failure.hung == [0] and failure.elapsed < GRACE + STACK_WAIT + 5
    assert failure.reports[0].startswith(f"hung: still running {GRACE:g} s after rank 1 failed; killed.")
    assert failure.reports[1].rstrip().endswith("ValueError: rank 1 found a bad input")
