import os
import random
import tempfile

import pytest
import torch

# One intra-op thread unless OMP_NUM_THREADS asks for more: the problems are tiny, and on a
# 2-core host that is also running something else two threads spin against each other
# (test_op.py::test_gradcheck: 94 s with 2, 7 s with 1). torch is imported already, so the
# variable is for subprocesses and spawned ranks; this process is set directly.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

import doc_packed  # noqa: E402,F401  (registers the ops; tests on DTensor import shardings)
import dist_utils  # noqa: E402


@pytest.fixture
def rng():
    return random.Random(1234)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _fresh_caches():
    """Forget remembered validations, layouts and what hangs off them (specs, kernel choices):
    tests patch which backends are installed, which a process never sees change."""
    from doc_packed import _doc_layout, api

    api._VALIDATED.clear()
    _doc_layout.clear_cache()


@pytest.fixture
def run_ranks(tmp_path):
    """``run_ranks(fn, world_size, *args, timeout=..., backend="gloo")``: ``fn(rank, world_size,
    *args)`` on ``world_size`` gloo ranks (spawned processes; ``backend="nccl"``: NCCL ranks, one
    GPU each), returning their results by rank; see dist_utils.py for the timeouts and what a
    failure reports. ``fn`` must be a module-level function. Each call's rank files (tracebacks,
    stacks) stay under the test's ``tmp_path``."""

    def run(fn, world_size, *args, timeout=dist_utils.DEFAULT_TIMEOUT, backend="gloo"):
        workdir = tempfile.mkdtemp(prefix=f"{fn.__name__}-", dir=tmp_path)
        return dist_utils.run_ranks(fn, world_size, *args, timeout=timeout, workdir=workdir, backend=backend)

    return run
