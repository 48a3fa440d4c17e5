"""Test/bench-only shims that let AutoParallel's current head run where our tests run.

- torch 2.11 (the GPU machines): AutoParallel's head reads
  ``_SingleDimStrategyInfo.allow_uneven_sharding`` and passes ``allow_uneven_sharding=`` to
  ``expand_to_full_mesh_op_strategy``; both arrived after 2.11. The shim adds the attribute
  (``None``: DTensor's default) and drops the keyword where the installed torch lacks it.
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
    try:
        import autoparallel.api  # noqa: F401
        import pulp  # noqa: F401
    except ImportError:
        return False
    return True


def patch_autoparallel_for_torch() -> None:
    from torch.distributed.tensor._ops import single_dim_strategy as sds
    import torch.distributed.tensor._ops.utils as utils

    if not hasattr(sds._SingleDimStrategyInfo, "allow_uneven_sharding"):
        sds._SingleDimStrategyInfo.allow_uneven_sharding = None
    original = utils.expand_to_full_mesh_op_strategy
    if "allow_uneven_sharding" not in inspect.signature(original).parameters and not getattr(
        original, "_doc_packed_shim", False
    ):
        def expand(*args, allow_uneven_sharding=None, **kwargs):
            return original(*args, **kwargs)

        expand._doc_packed_shim = True
        utils.expand_to_full_mesh_op_strategy = expand


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
