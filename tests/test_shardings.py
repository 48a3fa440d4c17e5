"""Sharding strategies: the exact sets offered, and eager DTensor execution on gloo ranks."""

import itertools

import pytest
import torch
import torch.distributed as dist

import shardings  # noqa: F401  (registers the rules these tests read)
from api_cases import sequence_not_kept, uneven_sequence
from cp_cases import dtensor_parity

R, B, H, Q = "replicate", "batch", "heads", "sequence"


@pytest.fixture
def fake_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    yield
    dist.destroy_process_group()


def offered(mesh_shape, B_, S, Hq, Hkv, op="fwd", names=None, cp_dim=None):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy

    from shardings.strategies import kind_of

    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    rep = (Replicate(),) * mesh.ndim

    def strat(shape, dtype=torch.float32):
        t = torch.empty(shape, device="meta", dtype=dtype)
        return OpStrategy([OpSpec(DTensorSpec(mesh, rep, tensor_meta=TensorMeta(t.shape, t.stride(), dtype)))])

    q, kv = strat((B_, S, Hq, 8)), strat((B_, S, Hkv, 8))
    cu = strat((B_, 5), torch.int32)
    flags = (True, -1, 0, 1.0, "auto", None, 0, cp_dim)
    if op == "fwd":
        o = torch.ops.doc_packed.attn_fwd.default
        args = (q, kv, kv, cu, S, *flags)
    else:
        o = torch.ops.doc_packed.attn_bwd.default
        args = (q, q, kv, kv, q, strat((B_, Hq, S)), cu, S, *flags)
    result = DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs[o](OpSchema(o, args, {}))
    q_pos = 0 if op == "fwd" else 1
    return {kind_of(s.input_specs[q_pos].placements) for s in result.strategies}, result


def test_planning_cp_dim_keeps_the_sequence_on_that_dim(fake_world):
    free, _ = offered((2, 4), 8, 64, 8, 8, names=("dp", "cp"))
    hinted, _ = offered((2, 4), 8, 64, 8, 8, names=("dp", "cp"), cp_dim="cp")
    assert (Q, B) in free and (Q, H) in free  # without the hint either dim may shard it
    assert hinted == {k for k in free if k[0] != Q}
    hinted_bwd, _ = offered((2, 4), 8, 64, 8, 8, op="bwd", names=("dp", "cp"), cp_dim="dp")
    assert hinted_bwd and all(k[1] != Q for k in hinted_bwd) and any(k[0] == Q for k in hinted_bwd)
    with pytest.raises(ValueError, match="cp_dim='tp'.*not a dim of this mesh"):
        offered((2, 4), 8, 64, 8, 8, names=("dp", "cp"), cp_dim="tp")


def test_enumeration_1d(fake_world):
    got, _ = offered((8,), 8, 64, 8, 8)
    assert got == {(R,), (B,), (H,), (Q,)}
    got, _ = offered((8,), 4, 64, 8, 8)  # batch 4 does not split 8 ways
    assert got == {(R,), (H,), (Q,)}
    got, _ = offered((8,), 8, 60, 16, 4)  # GQA: 4 kv heads do not split 8 ways; 60 % 8 != 0
    assert got == {(R,), (B,)}


def test_enumeration_2d(fake_world):
    got, _ = offered((2, 4), 2, 64, 8, 4)
    kinds = (R, B, H, Q)
    expected = {
        (a, b) for a, b in itertools.product(kinds, kinds)
        if not (a == b == Q) and not (a == b == B)  # seq on one dim at most; B=2 splits 2 ways only
        and not (a == B and b == B) and not (b == B)  # batch 2 cannot split 4 ways
        and not (a == H and b == H)  # 4 kv heads cannot split 8 ways
    }
    assert got == expected
    got, _ = offered((2, 2), 4, 16, 4, 1)  # MQA: heads never offered
    assert got == {(a, b) for a, b in itertools.product((R, B, Q), repeat=2) if not (a == b == Q)}


def test_enumeration_3d_and_backward(fake_world):
    for op in ("fwd", "bwd"):
        got, res = offered((2, 2, 2), 2, 32, 4, 2, op=op)
        assert (B, Q, H) in got and (Q, H, B) in got and (B, H, Q) in got
        assert all(k.count(Q) <= 1 for k in got)
        assert all(k.count(B) <= 1 for k in got)  # B=2
        assert all(k.count(H) <= 1 for k in got)  # Hkv=2
        # one redistribution-cost row per tensor input, one entry per candidate input spec
        n_inputs = 4 if op == "fwd" else 7
        assert all(len(s.redistribute_cost) == n_inputs for s in res.strategies)
    # lse placement follows the kind: heads -> dim 1, sequence -> dim 2
    _, res = offered((2,), 2, 32, 4, 2)
    from torch.distributed.tensor import Shard

    by_kind = {s.input_specs[0].placements[0]: s.output_specs[1].placements[0] for s in res.strategies}
    assert by_kind[Shard(2)] == Shard(1) and by_kind[Shard(1)] == Shard(2) and by_kind[Shard(0)] == Shard(0)



def test_remembered_redistribution_costs_are_torchs(fake_world):
    """Our strategies' cost rows equal torch's generate_redistribute_costs for producers with
    many candidate placements (what a solver offers), including a producer whose specs differ
    only in strides from one already remembered; each row is a fresh list."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy
    from torch.distributed.tensor._ops.utils import generate_redistribute_costs

    from shardings import strategies

    mesh = init_device_mesh("cpu", (2, 4))
    options = (Replicate(), Shard(0), Shard(1), Shard(2), Partial())

    def candidates(shape, dtype=torch.bfloat16, transposed=False):
        t = torch.empty(shape, device="meta", dtype=dtype)
        if transposed:  # same shape, other strides
            t = torch.empty(shape[:1] + shape[2:3] + shape[1:2] + shape[3:], device="meta", dtype=dtype).transpose(1, 2)
        meta = TensorMeta(t.shape, t.stride(), dtype)
        valid = [p for p in options if not p.is_shard() or p.dim < len(shape)]
        return OpStrategy([OpSpec(DTensorSpec(mesh, p, tensor_meta=meta)) for p in itertools.product(valid, repeat=2)])

    strategies._COSTS.clear()
    B_, S, Hq, Hkv = 8, 64, 8, 4
    q, kv, cu = candidates((B_, S, Hq, 8)), candidates((B_, S, Hkv, 8)), candidates((B_, 5), torch.int32)
    flags = (True, -1, 0, 1.0, "auto", None, 0, None)
    fwd, bwd = torch.ops.doc_packed.attn_fwd.default, torch.ops.doc_packed.attn_bwd.default
    funcs = DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs
    lse = candidates((B_, Hq, S), torch.float32)
    dout = candidates((B_, S, Hq, 8), transposed=True)  # q's candidates, other strides
    cases = [(fwd, (q, kv, kv, cu, S, *flags)), (bwd, (dout, q, kv, kv, q, lse, cu, S, *flags))]
    for op, args in cases:
        result = funcs[op](OpSchema(op, args, {}))
        inputs = [a for a in args if isinstance(a, OpStrategy)]
        for spec in result.strategies:
            for producer, target, row in zip(inputs, spec.input_specs, spec.redistribute_cost):
                assert row == generate_redistribute_costs(producer, target)
    assert strategies._COSTS  # rows were remembered (and reused: dout hits q's)
    a = strategies._redistribute_costs(q, result.strategies[0].input_specs[1])
    a[0] = -1.0
    assert strategies._redistribute_costs(q, result.strategies[0].input_specs[1])[0] != -1.0

def _placements(*names):
    from torch.distributed.tensor import Replicate, Shard

    m = {"R": Replicate(), "B": Shard(0), "S": Shard(1), "H": Shard(2)}
    return tuple(m[n] for n in names)


BASE = dict(lengths=[[40, 3, 1, 20], [64]], S=64, Hq=4, Hkv=2, D=8)


def test_dtensor_execution_world2_1d(run_ranks):
    cases = [
        dict(BASE, causal=c, window=w, placements=_placements(p))
        for p in "RBHS"
        for c, w in [(True, (-1, -1)), (False, (5, 3))]
    ]
    for rank_report in run_ranks(dtensor_parity, 2, (2,), ("x",), cases):
        for case, (err, out_pl, grad_pl) in zip(cases, rank_report):
            assert err < 1e-10
            assert out_pl == case["placements"] and grad_pl == case["placements"]


@pytest.mark.slow
def test_dtensor_execution_world4_2d(run_ranks):
    combos = ["BH", "HB", "BS", "SB", "SH", "HS", "RS", "SR", "BR", "RH"]
    cases = [dict(BASE, causal=True, window=(7, 0), placements=_placements(*c)) for c in combos]
    for rank_report in run_ranks(dtensor_parity, 4, (2, 2), ("a", "b"), cases):
        for case, (err, out_pl, grad_pl) in zip(cases, rank_report):
            assert err < 1e-10
            assert out_pl == case["placements"] and grad_pl == case["placements"]


def test_registration_survives_torchs_context_parallel_mode():
    """torch's context_parallel() swaps DTensor's handler dict while on and restores its own
    copy when off; registering meanwhile must not be lost."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental._context_parallel import _attention as torch_cp

    handlers = lambda: DTensor._op_dispatcher._custom_op_handlers  # noqa: E731
    op = torch.ops.doc_packed.attn_fwd.default
    torch_cp._enable_cp_dtensor_dispatcher()
    try:
        handlers().pop(op, None)
        torch_cp.existing_custom_ops.pop(op, None)
        shardings.register()
        assert op in handlers()
    finally:
        torch_cp._disable_cp_dtensor_dispatcher()
    assert op in handlers()


def test_uneven_sequence_offered_only_where_q_arrives_sharded():
    from shardings.strategies import offered_kinds

    assert (Q,) not in offered_kinds((2,), 2, 63, 4, 2)  # a solver: even shards only
    assert (Q,) in offered_kinds((2,), 2, 63, 4, 2, uneven_sequence_dims=(0,))
    assert (Q, R) in offered_kinds((2, 2), 2, 63, 4, 2, uneven_sequence_dims=(0,))
    assert (R, Q) not in offered_kinds((2, 2), 2, 63, 4, 2, uneven_sequence_dims=(0,))


@pytest.mark.parametrize("S", [63, 33])
def test_uneven_shard1_runs_context_parallel(run_ranks, S):
    """S odd on 2 ranks: the call stays Shard(1) (torch.chunk shards, context parallel), exact."""
    from torch.distributed.tensor import Shard

    reports = run_ranks(uneven_sequence, 2, S, "S", (2,))
    for rank, (err, out_pl, grad_pl, local) in enumerate(reports):
        assert err < 1e-10
        assert out_pl == grad_pl == (Shard(1),)
        assert local == len(torch.arange(S).chunk(2)[rank])


@pytest.mark.slow
def test_uneven_shard1_with_an_empty_rank(run_ranks):
    """S=5 over 4 ranks: torch.chunk gives 2, 2, 1 and 0 tokens; still context parallel."""
    from torch.distributed.tensor import Shard

    reports = run_ranks(uneven_sequence, 4, 5, "S", (4,))
    assert [r[3] for r in reports] == [2, 2, 1, 0]
    for err, out_pl, grad_pl, _ in reports:
        assert err < 1e-10 and out_pl == grad_pl == (Shard(1),)


def test_sequence_placement_not_kept_raises(run_ranks):
    for msg in run_ranks(sequence_not_kept, 2):
        assert msg is not None and "q is sequence-sharded (Shard(1)) on mesh dim 'b' (size 2)" in msg


@pytest.mark.slow
def test_sequence_on_two_mesh_dims_raises(run_ranks):
    for msg in run_ranks(sequence_not_kept, 4, True):
        assert msg is not None and "only one mesh dim may shard the sequence" in msg
