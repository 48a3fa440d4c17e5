"""Attention variants under context parallelism on gloo ranks, exact against the float64 oracle:
sinks (their term joins each query's merged row once), softcap (per stage), D_v != D (zero-padded
through the exchange), bidirectional prefixes (in the plan's pair counts and key ranges; prefix
queries get keys after themselves) and max logits (one all-gather of K, reduced by max); and the
same under DTensor placements."""

import random

import pytest

from doc_packed_testing.oracle import random_lengths
from cp_variant_cases import cp_variant_parity, dtensor_variant_parity


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
    # bidirectional prefixes (random per document), alone and with every other variant
    for window in ((-1, -1), (7, 0)):
        out.append(
            dict(
                lengths=[[S], random_lengths(rng, S)],
                S=S,
                Hq=4,
                Hkv=2,
                D=8,
                window=window,
                prefix=True,
                max_docs=S,
                seed=1,
            )
        )
    out.append(
        dict(
            lengths=[random_lengths(rng, S), [5, S - 12, 7]],
            S=S,
            Hq=4,
            Hkv=1,
            D=8,
            Dv=4,
            window=(-1, -1),
            prefix=True,
            sinks=True,
            softcap=2.0,
            max_docs=S,
            seed=2,
        )
    )
    # a gradient through lse too (softcap: two extra backwards, each rank's share)
    out.append(
        dict(
            lengths=[[S], random_lengths(rng, S)],
            S=S,
            Hq=4,
            Hkv=2,
            D=8,
            window=(-1, -1),
            sinks=True,
            softcap=2.0,
            prefix=True,
            lse_loss=True,
            max_docs=S,
            seed=3,
        )
    )
    out.append(
        dict(lengths=[random_lengths(rng, S)], S=S, Hq=2, Hkv=2, D=8, window=(4, 0), lse_loss=True, max_docs=S, seed=4)
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
    out.append(dict(base, placements=(Shard(1),), Dv=4))  # prefixes under the sequence placement
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


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
@pytest.mark.parametrize("left", [-1, 5])
def test_plan_counts_prefix_pairs_and_covers_their_keys(cp, left):
    """The plan's work is the exact pair count with prefixes (the oracle's dense mask), every
    query is planned once, and every key a planned query sees lies in its rank's key ranges."""
    import torch
    from doc_packed_testing.oracle import dense_mask

    from doc_packed._doc_layout import get_layout
    from doc_packed._variants import prefixes
    from doc_packed.cp.plan import build_plan

    rng = random.Random(cp * 10 + left)
    S = 96
    rows = [random_lengths(rng, S) for _ in range(2)]
    width = max(len(r) for r in rows) + 1
    cu = torch.tensor(
        [[0, *torch.tensor(r).cumsum(0).tolist()] + [S] * (width - len(r)) for r in rows], dtype=torch.int32
    )
    gaps = cu.diff(dim=1)
    pl = torch.tensor([[rng.randint(0, int(n)) for n in row] for row in gaps], dtype=torch.int32)
    layout = get_layout(cu, S)
    plan = build_plan(layout, cp, True, left, 0, prefixes=prefixes(cu, pl))
    masks = [dense_mask(cu[b].tolist(), S, True, (left, -1), pl[b].tolist()) for b in range(2)]
    assert sum(plan.work) == sum(int(m.sum()) for m in masks)
    seen = torch.zeros(2, S, dtype=torch.int64)
    for r in range(cp):
        for seg in plan.segments[r]:
            seen[seg.batch, seg.start : seg.end] += 1
            need = masks[seg.batch][seg.start : seg.end].any(0).nonzero().flatten()
            if need.numel():
                assert seg.key_start <= int(need.min()) and int(need.max()) < seg.key_end
            covered = any(b == seg.batch and s <= seg.key_start and seg.key_end <= e for b, s, e in plan.kv_ranges[r])
            assert covered or seg.key_start == seg.key_end
    assert bool((seen == 1).all())
