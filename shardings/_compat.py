"""Every private torch name :mod:`shardings` uses, behind one door (DTensor's internals).

DTensor's strategy layer (``OpStrategy``/``OpSpec``/``register_op_strategy``) is the layer that
``register_sharding`` wraps and that AutoParallel reads; torch keeps it private. A missing name
raises :class:`doc_packed._compat.PrivateAPIError` naming it and the versions checked
(docs/private_apis.md).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from doc_packed._compat import CHECKED_TORCH, PrivateAPIError, private

__all__ = [
    "DTensorSpec",
    "OpSchema",
    "OpSpec",
    "OpStrategy",
    "RuntimeSchemaInfo",
    "TensorMeta",
    "compile_settings",
    "current_mesh",
    "functorch_settings",
    "generate_redistribute_costs",
    "inductor_settings",
    "install_custom_op_handler",
    "op_dispatcher",
    "overlap_default_ms",
    "register_op_strategy",
    "trace_artifact",
    "transform_infos",
    "tree_unflatten",
    "unset_fake_temporarily",
]

DTensorSpec = private("torch.distributed.tensor._dtensor_spec", "DTensorSpec")
TensorMeta = private("torch.distributed.tensor._dtensor_spec", "TensorMeta")
OpSchema = private("torch.distributed.tensor._op_schema", "OpSchema")
OpSpec = private("torch.distributed.tensor._op_schema", "OpSpec")
OpStrategy = private("torch.distributed.tensor._op_schema", "OpStrategy")
RuntimeSchemaInfo = private("torch.distributed.tensor._op_schema", "RuntimeSchemaInfo")
generate_redistribute_costs = private("torch.distributed.tensor._ops.utils", "generate_redistribute_costs")
register_op_strategy = private("torch.distributed.tensor._ops.utils", "register_op_strategy")
tree_unflatten = private("torch.utils._pytree", "tree_unflatten")
try:  # DTensor's plan for a redistribution (shardings.transforms); without it, moves are priced per dim
    transform_infos: Callable[[Any, Any], list] | None = private(
        "torch.distributed.tensor._redistribute", "_gen_transform_infos"
    )
except PrivateAPIError:
    transform_infos = None

# torch's context_parallel() swaps DTensor's handler dict for a copy while it is on and, when it
# turns off, restores the dict this module held at its import
_TORCH_CP_MODULE = "torch.distributed.tensor.experimental._context_parallel._attention"


def op_dispatcher() -> Any:
    """DTensor's dispatcher (sharding propagation, redistribution, wrapping)."""
    try:
        return DTensor._op_dispatcher
    except AttributeError as err:
        raise PrivateAPIError(
            f"shardings uses DTensor._op_dispatcher, checked on torch {', '.join(CHECKED_TORCH)}; "
            f"torch {torch.__version__} does not have it"
        ) from err


def install_custom_op_handler(op: Any, handler: Callable) -> None:
    """Make DTensor call ``handler(op, args, kwargs)`` for ``op`` (idempotent).

    Also written into the dict torch's context-parallel mode restores on exit, so an entry
    installed while that mode is on is not lost when it turns off.
    """
    op_dispatcher()._custom_op_handlers[op] = handler
    saved = getattr(sys.modules.get(_TORCH_CP_MODULE), "existing_custom_ops", None)
    if isinstance(saved, dict):
        saved[op] = handler


def current_mesh() -> Any | None:
    """The DeviceMesh of the innermost ``with mesh:`` (AutoParallel plans inside one), or None:
    the mesh :mod:`shardings.costs` prices on when no ``pricing(mesh)`` names it."""
    resources = private("torch.distributed.device_mesh", "_mesh_resources")
    try:
        return resources.get_current_mesh()
    except RuntimeError:  # no mesh entered
        return None


def unset_fake_temporarily() -> Any:
    """Context manager: real tensors inside a fake-tensor mode (AutoParallel's context)."""
    return private("torch._subclasses.fake_tensor", "unset_fake_temporarily")()


def trace_artifact(name: str, payload: Callable[[], str]) -> None:
    """Emit a JSON artifact into the structured trace (``TORCH_TRACE``), beside AutoParallel's
    own (``autoparallel_sharding_optimizer_log``); free when tracing is off."""
    private("torch._logging", "trace_structured")(
        "artifact", metadata_fn=lambda: {"name": name, "encoding": "json"}, payload_fn=payload
    )


def inductor_settings() -> set[str]:
    """The dotted names of the settings the installed torch's Inductor has (its config module:
    ``torch._inductor.config``), to check a setting exists before ``torch.compile(options=...)``."""
    return set(private("torch._inductor", "config").get_config_copy())


_COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d_functional")


def overlap_default_ms(node: torch.fx.Node) -> float | None:
    """What Inductor's overlap pass estimates for ``node`` when no hook answers: None for the
    nodes it times itself (compute nodes: by benchmark or roofline; collectives: by its own
    model), else its estimate for the rest (roofline on torch 2.13+, memory-bound on 2.11)."""
    if node.op != "call_function" or getattr(node.target, "namespace", None) in _COLLECTIVE_NAMESPACES:
        return None
    passes = "torch._inductor.fx_passes.overlap_scheduling"
    if private(passes, "is_compute_node")(node):
        return None
    try:
        estimate = private(passes, "estimate_roofline_runtime_ms")
    except PrivateAPIError:  # torch 2.11
        estimate = private(passes, "estimate_mem_bound_runtime_ms")
    return float(estimate(node))


def functorch_settings() -> set[str]:
    """The names of AOTAutograd's settings in the installed torch (``torch._functorch.config``)."""
    return set(private("torch._functorch", "config").get_config_copy())


@contextlib.contextmanager
def compile_settings(inductor: dict[str, Any], functorch: dict[str, Any]) -> Iterator[None]:
    """Inductor's and AOTAutograd's settings patched while a compile runs inside the block
    (``torch._inductor.config``, ``torch._functorch.config``: what ``torch.compile(options=...)``
    does for Inductor's, for a backend that takes no options)."""
    with private("torch._inductor", "config").patch(inductor), private("torch._functorch", "config").patch(functorch):
        yield
