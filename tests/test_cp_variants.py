"""Attention variants under context parallelism on gloo ranks: sinks (their term joins each
query's merged row once) and softcap (per stage) exact against the float64 oracle; the variants
context parallelism cannot run yet (prefixes, max logits, a value head dim unlike q's) raise
NotImplementedError naming the variant on every rank."""

import random

import pytest

from conftest import random_lengths
from cp_variant_cases import cp_variant_parity, cp_variant_rejected


def _cases(world):
    rng = random.Random(world)
    S = 60 if world == 3 else 64
    out = []
    for sinks, softcap in ((True, None), (False, 2.0), (True, 1.5)):
        for window in ((-1, -1), (9, 0)):
            out.append(
                dict(
                    lengths=[[S], random_lengths(rng, S)],
                    S=S,
                    Hq=4,
                    Hkv=2,
                    D=8,
                    window=window,
                    sinks=sinks,
                    softcap=softcap,
                    max_docs=S,
                )
            )
    # one-token and zero-length documents, MQA
    out.append(
        dict(
            lengths=[[1] * 20 + [3, 0, 1] + [S - 24]],
            S=S,
            Hq=3,
            Hkv=1,
            D=8,
            window=(-1, -1),
            sinks=True,
            softcap=3.0,
            max_docs=S,
        )
    )
    return out


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow)])
def test_cp_sinks_and_softcap_match_oracle(run_ranks, world):
    for rank, errs in enumerate(run_ranks(cp_variant_parity, world, _cases(world))):
        for i, err in enumerate(errs):
            assert err < 1e-10, f"rank {rank} case {i}: max error {err}"


def test_cp_unsupported_variants_raise_on_every_rank(run_ranks):
    for msgs in run_ranks(cp_variant_rejected, 2):
        assert "prefix_lens under context parallelism" in msgs[0]
        assert "return_max_logits under context parallelism" in msgs[1]
        assert "value head dim unlike q's under context parallelism" in msgs[2]
        assert msgs[3] == (1, 16, 2, 8)
