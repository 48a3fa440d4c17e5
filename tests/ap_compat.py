"""Test/bench-only shims that let AutoParallel's current head run where our tests run.

- torch 2.11 (the GPU machines): AutoParallel's head reads
  ``_SingleDimStrategyInfo.allow_uneven_sharding`` and passes ``allow_uneven_sharding=`` to
  ``expand_to_full_mesh_op_strategy``; both arrived after 2.11. :func:`torch_patched_for_autoparallel`
  adds the attribute (``None``: DTensor's default) and drops the keyword where the installed
  torch lacks it, and puts both back on exit (on torch 2.13 it changes nothing).
- CPU meshes and H200s: AutoParallel's compute model looks the device name up in its table of
  peak FLOP/s (which has "H100" but not "H200"); :func:`device_name_for_cost_model` makes it see
  an H100, so estimates use H100 peaks.
Nothing here is imported by the library.
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
        yield


_FOR_THE_PROCESS = contextlib.ExitStack()  # never closed: see patch_autoparallel_for_torch


def patch_autoparallel_for_torch() -> None:
    """:func:`torch_patched_for_autoparallel` for the rest of this process, never undone.

    The plain-call form, for code that needs the shims for the life of its process:
    bench/bench_e2e.py's ``worker`` (a spawned rank) and bench/bench_emulate.py's main call it
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
