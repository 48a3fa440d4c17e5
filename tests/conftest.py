import os
import random

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "2")

import doc_packed  # noqa: E402,F401  (registers the ops; tests on DTensor import shardings)


def random_lengths(rng: random.Random, seq_len: int, *, zero_docs: bool = True) -> list[int]:
    """A random split of ``seq_len`` into documents, with zero-length and 1-token ones."""
    out, left = [], seq_len
    while left > 0:
        kind = rng.random()
        if kind < 0.15:
            n = 1
        elif kind < 0.3 and zero_docs:
            n = 0
        else:
            n = rng.randint(1, max(1, seq_len // 2))
        n = min(n, left)
        out.append(n)
        left -= n
    return out


@pytest.fixture
def rng():
    return random.Random(1234)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
