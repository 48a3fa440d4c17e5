"""Synthetic document lengths: what tests, benchmarks and planning estimates pack when they have
no real data (:func:`doc_packed.flops.representative_bounds` builds its representative row from
them)."""

from __future__ import annotations

import math
import random

__all__ = ["lognormal_lengths"]


def lognormal_lengths(total: int, mean: float, seed: int | random.Random = 0, sigma: float = 1.0) -> list[int]:
    """Document lengths summing to ``total``: lognormal draws of mean ``mean`` (log-space
    deviation ``sigma``), at least 1 token, the last one cut to fit. Deterministic per seed."""
    rng = seed if isinstance(seed, random.Random) else random.Random(seed)
    mu = math.log(mean) - sigma**2 / 2
    out, left = [], total
    while left > 0:
        n = max(1, min(left, int(rng.lognormvariate(mu, sigma))))
        out.append(n)
        left -= n
    return out
