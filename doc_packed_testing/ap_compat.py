"""Test/bench-only shims that let AutoParallel's current head run where our tests run.

- torch 2.11 (the GPU machines): AutoParallel's head reads
  ``_SingleDimStrategyInfo.allow_uneven_sharding`` and passes ``allow_uneven_sharding=`` to
  ``expand_to_full_mesh_op_strategy``; both arrived after 2.11. :func:`torch_patched_for_autoparallel`
  adds the attribute (``None``: DTensor's default) and drops the keyword where the installed
  torch lacks it, and puts both back on exit (on torch 2.13 it changes nothing).
- One-device meshes: AutoParallel keeps ``Shard(d)`` of a size-1 dim there (its
  ``remove_invalid_configs`` asks ``size >= mesh size``, and 1 >= 1), and torch's view rule then
  raises on it instead of rejecting it: ``aten.expand`` of RMSNorm's ``[B, S, 1]`` statistic to
  ``[B, S, D]`` with ``Shard(2)`` dies with ``KeyError: 2`` in ``_view_ops._rewrite_plain_shard``
  (torch 2.13) while AutoParallel builds its strategies, so no model with an RMSNorm places on one
  GPU. :func:`torch_patched_for_autoparallel` also drops strategies that shard a size-1 dim (over
  one device a shard is the whole tensor: Replicate stays; on larger mesh dims AutoParallel already
  drops them).
- CPU meshes and H200s: AutoParallel's compute model looks the device name up in its table of
  peak FLOP/s (which has "H100" but not "H200"); :func:`device_name_for_cost_model` makes it see
  an H100, so estimates use H100 peaks.
Nothing here is imported by the libraries.
"""

from __future__ import annotations

import contextlib
import inspect
from unittest.mock import patch

import torch


def autoparallel_available() -> bool:
    """Whether AutoParallel and pulp import (``doc_packed.env.autoparallel_status`` says why not)."""
    from doc_packed.env import autoparallel_status

    return autoparallel_status()[0]


@contextlib.contextmanager
def torch_patched_for_autoparallel():
    """Within the block, torch has the two names AutoParallel's head needs (see the module
    docstring); on exit, whatever was patched is restored. Patches only what is missing, so
    nesting is harmless."""
    from torch.distributed.tensor._ops import single_dim_strategy as sds
    import torch.distributed.tensor._ops.utils as utils

    with contextlib.ExitStack() as stack:
        if not hasattr(sds._SingleDimStrategyInfo, "allow_uneven_sharding"):
            stack.enter_context(
                patch.object(sds._SingleDimStrategyInfo, "allow_uneven_sharding", None, create=True)
            )
        original = utils.expand_to_full_mesh_op_strategy
        if "allow_uneven_sharding" not in inspect.signature(original).parameters:
            def expand(*args, allow_uneven_sharding=None, **kwargs):
                return original(*args, **kwargs)

            stack.enter_context(patch.object(utils, "expand_to_full_mesh_op_strategy", expand))
        _no_shards_of_size_one(stack)
        yield


def _no_shards_of_size_one(stack: contextlib.ExitStack) -> None:
    """AutoParallel's ``remove_invalid_configs`` (both modules that call it) also drops any
    strategy that shards a dim of size 1 (see the module docstring)."""
    try:
        from autoparallel.shardings import placement_options, propagation_rules
    except ImportError:
        return
    original = propagation_rules.remove_invalid_configs
    if getattr(original, "_drops_size_one_shards", False):
        return  # nested: already patched

    def remove_invalid_configs(out_strat, mesh):
        out = original(out_strat, mesh)
        kept = [s for s in out.strategies if not any(_shards_size_one(spec) for spec in _specs(s))]
        if len(kept) == len(out.strategies):
            return out
        return type(out)(kept)

    remove_invalid_configs._drops_size_one_shards = True  # type: ignore[attr-defined]
    for module in (propagation_rules, placement_options):
        stack.enter_context(patch.object(module, "remove_invalid_configs", remove_invalid_configs))


def _specs(strategy) -> list:
    out = strategy.output_specs
    specs = list(out) if isinstance(out, (tuple, list)) else [out]
    return [s for s in specs + list(strategy.input_specs or []) if s is not None and s.tensor_meta is not None]


def _shards_size_one(spec) -> bool:
    shape = spec.tensor_meta.shape
    return any(p.is_shard() and shape[p.dim] == 1 for p in spec.placements)


_FOR_THE_PROCESS = contextlib.ExitStack()  # never closed: see patch_autoparallel_for_torch


def patch_autoparallel_for_torch() -> None:
    """:func:`torch_patched_for_autoparallel` for the rest of this process, never undone.

    The plain-call form, for code that needs the shims for the life of its process:
    ``bench.bench_e2e``'s ``worker`` (a spawned rank) and ``bench.bench_emulate``'s main call it
    once. Tests use the context manager, which undoes what it did.
    """
    _FOR_THE_PROCESS.enter_context(torch_patched_for_autoparallel())


@contextlib.contextmanager
def device_name_for_cost_model(name: str = "H100"):
    with contextlib.ExitStack() as stack:
        stack.enter_context(patch("torch.cpu.get_device_name", lambda *a, **k: name, create=True))
        if torch.cuda.is_available():
            stack.enter_context(patch("torch.cuda.get_device_name", lambda *a, **k: name))
        yield


@contextlib.contextmanager
def gpus_per_host(n: int = 8):
    """Make DTensor's topology model see ``n`` devices per host (fake and CPU meshes otherwise
    count one), so the innermost mesh dims are priced as NVLink and the outer as network."""
    from torch.distributed.device_mesh import _mesh_resources

    with patch.object(type(_mesh_resources), "num_devices_per_host", lambda self, device_type: n):
        yield
