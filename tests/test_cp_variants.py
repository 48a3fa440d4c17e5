"""Attention variants under context parallelism on gloo ranks: sinks (their term joins each
query's merged row once), softcap (per stage) and D_v != D exact against the float64 oracle; the variants
context parallelism cannot run yet (prefixes) raise NotImplementedError naming the variant on
every rank; a value head dim unlike q's runs zero-padded (exact); max logits reduce by max over
the ranks (one all-gather of K)."""

import random

import pytest

from conftest import random_lengths
from cp_variant_cases import cp_variant_parity, cp_variant_rejected, dtensor_variant_parity


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
    # a value head dim unlike q's, narrower and wider (zero-padded through the exchange)
    out.append(
        dict(lengths=[[S], random_lengths(rng, S)], S=S, Hq=4, Hkv=2, D=8, Dv=4, window=(5, 0), sinks=True, max_docs=S)
    )
    out.append(
        dict(
            lengths=[[S], random_lengths(rng, S)],
            S=S,
            Hq=4,
            Hkv=2,
            D=8,
            Dv=16,
            window=(-1, -1),
            softcap=2.0,
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
        assert msgs[1] == (1, 16, 2, 8)


def _dtensor_cases():
    from torch.distributed.tensor import Replicate, Shard

    base = dict(
        lengths=[0, 0],
        S=64,
        Hq=4,
        Hkv=2,
        D=8,
        Dv=8,
        cu=[[0, 40, 43, 44, 64], [0, 64, 64, 64, 64]],
        prefix=[[10, 3, 0, 20], [64, 0, 0, 0]],
    )
    out = []
    for p in (Replicate(), Shard(0), Shard(2)):  # replicate, batch, heads
        out.append(dict(base, placements=(p,), softcap=2.0))
        out.append(dict(base, placements=(p,), Dv=4, prefix=None))
    out.append(dict(base, placements=(Shard(1),), softcap=2.0, prefix=None))  # sequence: context parallel
    out.append(dict(base, placements=(Shard(1),), Dv=4, prefix=None))
    return out


def test_dtensor_variants(run_ranks):
    """sinks shard with the heads, prefix_lens travel with cu_seqlens, softcap and a value head dim
    unlike q's pass through every placement (the sequence one without prefixes): exact, and out
    keeps q's placement."""
    cases = _dtensor_cases()
    for report in run_ranks(dtensor_variant_parity, 2, cases):
        for case, (err, placements) in zip(cases, report):
            assert err < 1e-10, (case["placements"], err)
            assert placements == case["placements"]


def test_strategies_carry_the_variant_inputs():
    """The offered strategies place sinks with the heads (Shard(0) under heads, else Replicate)
    and prefix_lens with cu_seqlens (Shard(0) under batch, else Replicate)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import shardings  # noqa: F401

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))

        def strat(shape, dtype=torch.float32):
            t = torch.empty(shape, device="meta", dtype=dtype)
            spec = DTensorSpec(mesh, (Replicate(),), tensor_meta=TensorMeta(t.shape, t.stride(), dtype))
            return OpStrategy([OpSpec(spec)])

        q, kv, v = strat((2, 64, 4, 8)), strat((2, 64, 2, 8)), strat((2, 64, 2, 4))
        cu, sinks, prefix = strat((2, 5), torch.int32), strat((4,)), strat((2, 4), torch.int32)
        op = torch.ops.doc_packed.attn_fwd.default
        args = (q, kv, v, cu, 64, True, -1, 0, 1.0, "auto", None, 0, None, 2.0, sinks, prefix)
        result = DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs[op](OpSchema(op, args, {}))
        seen = {}
        for s in result.strategies:
            qp = s.input_specs[0].placements[0]
            seen[qp] = (s.input_specs[4].placements[0], s.input_specs[5].placements[0], s.output_specs[0].shape)
        assert seen[Shard(2)][:2] == (Shard(0), Replicate())
        assert seen[Shard(0)][:2] == (Replicate(), Shard(0))
        assert seen[Replicate()][:2] == (Replicate(), Replicate())
        assert seen[Shard(1)][:2] == (Replicate(), Replicate())
        assert all(shape == torch.Size((2, 64, 4, 4)) for _, _, shape in seen.values())  # out has v's head dim
    finally:
        dist.destroy_process_group()
