"""Moves DTensor runs in more steps than a per-dim view sees (shardings/transforms.py): DTensor's
plan, the step model's price of it, and AutoParallel's edge cost while the correction is on."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard

from shardings import step_model, transforms
from shardings._compat import DTensorSpec, TensorMeta

SHAPE = (1, 65536, 16, 128)  # [B, S, H, D] bf16: q of the e2e model at 1 x 64k
NESTED = ((Shard(1), Shard(1)), (Shard(2), Shard(1)))  # heads on the outer dim: the inner split undone first
INNER = ((Shard(1), Shard(1)), (Shard(1), Shard(2)))  # heads on the inner dim: one all-to-all
FROM_REPLICATE = ((Shard(1), Replicate()), (Shard(1), Shard(2)))  # a local slice
ITEM = 2


@pytest.fixture
def mesh():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    yield init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    dist.destroy_process_group()


def _specs(mesh, move):
    t = torch.empty(SHAPE, device="meta", dtype=torch.bfloat16)
    meta = TensorMeta(t.shape, t.stride(), t.dtype)
    return tuple(DTensorSpec(mesh, p, tensor_meta=meta) for p in move)


def test_dtensor_undoes_the_inner_split_to_move_the_outer_one(mesh):
    src, dst = _specs(mesh, NESTED)
    plan = transforms.steps(src, dst)
    half = (1, 32768, 16, 128)
    assert plan == [
        transforms.Step(1, Shard(1), Replicate(), half),
        transforms.Step(0, Shard(1), Shard(2), SHAPE),
        transforms.Step(1, Replicate(), Shard(1), half),
    ]
    assert transforms.undone(plan, src, dst)
    src, dst = _specs(mesh, INNER)
    plan = transforms.steps(src, dst)
    assert plan == [transforms.Step(1, Shard(1), Shard(2), half)] and not transforms.undone(plan, src, dst)


def test_the_step_model_prices_every_step_dtensor_runs(mesh):
    rates, topo = step_model.Rates.load(), step_model.Topology(8)
    full = 65536 * 16 * 128 * ITEM
    us, kinds = step_model.redistribute_us(rates, topo, *_specs(mesh, NESTED))
    # all-gather of the inner half (its gathered bytes), then an all-to-all whose send buffer is that half
    want = step_model.collective_us(rates, "all_gather", full / 2, 2) + step_model.collective_us(
        rates, "all_to_all", full / 2, 2
    )
    assert kinds == ["all_gather", "all_to_all"] and us == pytest.approx(want)
    # a move with no undone step keeps the per-dim price: one all-to-all of the local quarter
    us, kinds = step_model.redistribute_us(rates, topo, *_specs(mesh, INNER))
    assert kinds == ["all_to_all"] and us == pytest.approx(step_model.collective_us(rates, "all_to_all", full / 4, 2))
    assert step_model.redistribute_us(rates, topo, *_specs(mesh, FROM_REPLICATE)) == (0.0, [])


def test_autoparallel_prices_undone_steps_only_while_the_correction_is_on(mesh):
    pytest.importorskip("autoparallel")
    pytest.importorskip("pulp")
    from autoparallel import optimize_sharding
    from autoparallel.cost_models import collective_runtime_estimation as est

    from doc_packed_testing.ap_compat import device_name_for_cost_model
    from shardings.autoparallel import cost_model_for

    before = est.get_nccl_topo_config()
    est.set_nccl_topo_config(cost_model_for(mesh, 8))
    try:
        with device_name_for_cost_model():
            theirs = {m: optimize_sharding.estimate_strategy_comms_cost(*_specs(mesh, m)) for m in (NESTED, INNER)}
            with transforms.solver_edge_costs():
                ours = {m: optimize_sharding.estimate_strategy_comms_cost(*_specs(mesh, m)) for m in (NESTED, INNER)}
                src, _ = _specs(mesh, NESTED)
                steps = transforms.steps(*_specs(mesh, NESTED))
                by_step = sum(est.redistribute_cost(*transforms._one_dim_specs(src, s), [0, 1]) for s in steps)
            after = optimize_sharding.estimate_strategy_comms_cost(*_specs(mesh, NESTED))
    finally:
        est.set_nccl_topo_config(before)
    assert ours[INNER] == theirs[INNER]  # nothing undone: AutoParallel's own price
    assert ours[NESTED] == pytest.approx(by_step) and by_step > 2 * theirs[NESTED]
    assert after == theirs[NESTED]  # restored on exit
