"""ap_compat's torch shims patch only what the installed torch lacks and undo it on exit
(no AutoParallel needed: an older torch is faked with monkeypatch)."""

import pytest
import torch.distributed.tensor._ops.utils as utils
from torch.distributed.tensor._ops import single_dim_strategy as sds

from doc_packed_testing.ap_compat import torch_patched_for_autoparallel


@pytest.fixture
def torch_2_11(monkeypatch):
    """torch as of 2.11: no ``allow_uneven_sharding`` anywhere."""
    calls = []

    def expand(*args, **kwargs):
        calls.append((args, kwargs))
        return "expanded"

    if hasattr(sds._SingleDimStrategyInfo, "allow_uneven_sharding"):
        monkeypatch.delattr(sds._SingleDimStrategyInfo, "allow_uneven_sharding")
    monkeypatch.setattr(utils, "expand_to_full_mesh_op_strategy", expand)
    return expand, calls


def test_shims_fill_in_and_are_undone(torch_2_11):
    expand, calls = torch_2_11
    with torch_patched_for_autoparallel():
        assert sds._SingleDimStrategyInfo.allow_uneven_sharding is None
        shim = utils.expand_to_full_mesh_op_strategy
        assert shim is not expand
        assert shim("mesh", "schema", allow_uneven_sharding=True, input_index=1) == "expanded"
        assert calls == [(("mesh", "schema"), {"input_index": 1})]  # the keyword torch lacks is dropped
        with torch_patched_for_autoparallel():  # nested: nothing more to patch
            assert utils.expand_to_full_mesh_op_strategy is shim
        assert utils.expand_to_full_mesh_op_strategy is shim
    assert not hasattr(sds._SingleDimStrategyInfo, "allow_uneven_sharding")
    assert utils.expand_to_full_mesh_op_strategy is expand


def test_shims_are_undone_after_an_error(torch_2_11):
    expand, _ = torch_2_11
    with pytest.raises(KeyError), torch_patched_for_autoparallel():
        raise KeyError("x")
    assert not hasattr(sds._SingleDimStrategyInfo, "allow_uneven_sharding")
    assert utils.expand_to_full_mesh_op_strategy is expand


def test_the_installed_torch_is_as_it_was_after_the_block():
    before = utils.expand_to_full_mesh_op_strategy, sds._SingleDimStrategyInfo.__dict__.copy()
    with torch_patched_for_autoparallel():
        pass
    assert (utils.expand_to_full_mesh_op_strategy, sds._SingleDimStrategyInfo.__dict__.copy()) == before


def test_strategies_that_shard_a_size_one_dim_are_dropped(monkeypatch):
    """On a one-device mesh AutoParallel keeps Shard(d) of a size-1 dim, which torch's view rules
    then raise on (``KeyError`` in ``_rewrite_plain_shard``): the shim drops those strategies from
    what ``remove_invalid_configs`` keeps, in both modules that call it, and undoes it on exit."""
    pytest.importorskip("autoparallel")
    from types import SimpleNamespace as NS

    from autoparallel.shardings import placement_options, propagation_rules
    from torch.distributed.tensor import Replicate, Shard

    monkeypatch.setattr(propagation_rules, "remove_invalid_configs", lambda out, mesh: out)
    monkeypatch.setattr(placement_options, "remove_invalid_configs", propagation_rules.remove_invalid_configs)

    class Strategies(NS):
        def __init__(self, strategies):
            super().__init__(strategies=strategies)

    def spec(shape, placement):
        return NS(tensor_meta=NS(shape=shape), placements=(placement,))

    stat = (2, 32, 1)  # RMSNorm's statistic [B, S, 1]
    keep = [NS(output_specs=spec(stat, Replicate()), input_specs=[spec(stat, Shard(0))])]
    drop = [
        NS(output_specs=spec(stat, Shard(2)), input_specs=[spec(stat, Shard(2))]),
        NS(output_specs=(spec((2, 32, 4), Replicate()),), input_specs=[spec(stat, Shard(2))]),
    ]
    with torch_patched_for_autoparallel():
        for module in (propagation_rules, placement_options):
            out = module.remove_invalid_configs(Strategies(keep + drop), mesh=None)
            assert out.strategies == keep
    out = propagation_rules.remove_invalid_configs(Strategies(keep + drop), None)
    assert len(out.strategies) == 3  # undone
