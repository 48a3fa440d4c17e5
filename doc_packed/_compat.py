"""Every private torch name :mod:`doc_packed` uses, behind one door.

torch does not promise these names across releases. Each is resolved here, on first use, and a
missing one raises :class:`PrivateAPIError` naming it, the torch versions it was checked on and
the installed one, instead of an ``AttributeError`` deep in a kernel. docs/private_apis.md lists
them all (with :mod:`shardings._compat` and :mod:`shardings._ap_compat`). FlashAttention-4's
private interface has its own door, :mod:`doc_packed.kernels.fa4`.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "CHECKED_TORCH",
    "MIN_TORCH",
    "PrivateAPIError",
    "apply_kernel_options",
    "assert_async",
    "compile_fx",
    "create_fw_bw_graph",
    "default_store",
    "dispatch_mode_class",
    "flex_attention_backward_hop",
    "flex_attention_hop",
    "is_functorch_wrapped",
    "modes_active",
    "op_argument_names",
    "post_point_to_point",
    "profiler_enabled",
    "resolve_process_group",
    "tensor_version",
    "varlen_attn_ops",
]

MIN_TORCH = (2, 11)
CHECKED_TORCH = ("2.11", "2.13")


class PrivateAPIError(ImportError):
    """A private torch (or AutoParallel) name we rely on is missing from the installed version."""


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


if _torch_version() < MIN_TORCH:
    raise ImportError(
        f"doc_packed needs torch >= {'.'.join(map(str, MIN_TORCH))} (checked on "
        f"{', '.join(CHECKED_TORCH)}); this is torch {torch.__version__}"
    )


def private(module: str, name: str, missing: Callable[[Exception], str] | None = None) -> Any:
    """``module.name``, or :class:`PrivateAPIError` saying what is missing and where it was seen:
    ``missing(error)`` words it (default: a torch name, with the versions it was checked on)."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        if missing is None:
            message = (
                f"doc_packed uses torch's private {module}.{name}, checked on torch "
                f"{', '.join(CHECKED_TORCH)}; torch {torch.__version__} does not have it ({err}). "
                "See docs/private_apis.md."
            )
        else:
            message = missing(err)
        raise PrivateAPIError(message) from err


def assert_async(condition: torch.Tensor, message: str) -> None:
    """Fail with ``message`` where ``condition`` (a one-element bool tensor) is False, without a
    host sync: an assertion node under ``torch.compile`` (``doc_packed.compat`` checks there that
    two ``cu_seqlens`` tensors agree)."""
    torch._assert_async(condition, message)


# ----------------------------------------------------------------------------- distributed


def resolve_process_group(group_name: str) -> torch.distributed.ProcessGroup:
    """The process group registered under ``group_name`` (what functional collectives take)."""
    return private("torch.distributed.distributed_c10d", "_resolve_process_group")(group_name)


def default_store() -> torch.distributed.Store:
    """The store ``init_process_group`` made (context parallelism's gloo companion groups)."""
    return private("torch.distributed.distributed_c10d", "_get_default_store")()


# (process group, device type) -> whether its backend batches point-to-point ops itself (NCCL)
_coalesces: dict[tuple[Any, str], bool] = {}


def post_point_to_point(
    pg: torch.distributed.ProcessGroup, device: torch.device, ops: list[tuple[bool, torch.Tensor, int, int]]
) -> list[Any]:
    """Post ``ops`` (``(send, tensor, peer's rank in pg, tag)``) as one batch; the works to wait on.

    What ``torch.distributed.batch_isend_irecv`` does, in the same order: where ``pg``'s backend
    batches point-to-point ops itself (NCCL: one ``ncclGroupStart``/``ncclGroupEnd``), the ops go
    straight to ``pg`` between its private ``_start_coalescing`` and ``_end_coalescing``, as
    ``batch_isend_irecv``'s own NCCL path does, without its Python per op (``P2POp`` checks,
    group-rank translation and argument checks in ``isend``/``irecv``); elsewhere (gloo) through
    ``batch_isend_irecv`` itself.
    """
    dist = torch.distributed
    key = (pg, device.type)
    native = _coalesces.get(key)
    if native is None:  # batch_isend_irecv's own test, then the names this path needs
        native = _coalesces[key] = (
            type(pg) is dist.ProcessGroup
            and bool(getattr(pg._get_backend(device), "supports_coalescing", False))
            and hasattr(pg, "_start_coalescing")
            and hasattr(pg, "_end_coalescing")
        )
    if not native:
        return dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend if send else dist.irecv, t, dist.get_global_rank(pg, peer), pg, tag)
                for send, t, peer, tag in ops
            ]
        )
    pg._start_coalescing(device)
    try:
        for send, t, peer, tag in ops:
            (pg.send if send else pg.recv)([t], peer, tag)
    finally:
        work = pg._end_coalescing(device)
    return [work]


# ----------------------------------------------------------------------------- tensors and ops


def tensor_version(t: torch.Tensor) -> int | None:
    """``t``'s in-place version counter; None for inference tensors, which have none."""
    try:
        return t._version
    except RuntimeError:
        return None


def modes_active() -> bool:
    """Whether a torch dispatch mode (FlopCounterMode, FakeTensorMode, make_fx, selective
    checkpointing, ...) or function mode (``with torch.device(...)``, ...) is active."""
    return bool(_len_dispatch_stack()()) or bool(_function_mode_enabled()())


@functools.cache
def _len_dispatch_stack() -> Any:
    return private("torch._C", "_len_torch_dispatch_stack")


@functools.cache
def _function_mode_enabled() -> Any:
    return private("torch._C", "_is_torch_function_mode_enabled")


def is_functorch_wrapped(t: torch.Tensor) -> bool:
    """Whether ``t`` is a functorch transform's wrapper (``torch.func.grad``, ``vmap``, ...)."""
    return bool(_functorch_wrapped()(t))


@functools.cache
def _functorch_wrapped() -> Any:
    return private("torch._C._functorch", "is_functorch_wrapped_tensor")


def profiler_enabled() -> bool:
    """Whether the autograd profiler (``torch.profiler.profile``) is recording."""
    return bool(_profiler_enabled()())


@functools.cache
def _profiler_enabled() -> Any:
    return private("torch.autograd", "_profiler_enabled")


@functools.cache
def dispatch_mode_class() -> Any:
    """``TorchDispatchMode``, the base of a mode that sees every tensor op of a block (FA4's
    backward is recorded under one, :mod:`doc_packed.kernels.fa4_launch`)."""
    return private("torch.utils._python_dispatch", "TorchDispatchMode")


def op_argument_names(op: torch._ops.OpOverload) -> set[str]:
    """Names of an operator overload's schema arguments."""
    return {a.name for a in op._schema.arguments}


@functools.cache
def varlen_attn_ops() -> tuple[Any, Any]:
    """torch's flash varlen ``(forward, backward)`` overloads (torch >= 2.11)."""
    import torch.nn.attention.varlen  # noqa: F401  (registers torch.ops.torch_attn)

    try:
        ns = torch.ops.torch_attn
        return ns._varlen_attn.default, ns._varlen_attn_backward.default
    except (AttributeError, RuntimeError) as err:
        raise PrivateAPIError(
            "doc_packed's flash backend uses torch.ops.torch_attn._varlen_attn(_backward), "
            f"checked on torch {', '.join(CHECKED_TORCH)}; torch {torch.__version__} lacks it"
        ) from err


# ----------------------------------------------------------------------------- flex attention


def flex_attention_hop() -> Any:
    """flex_attention's forward higher-order op (takes a BlockMask's ``as_tuple()`` form)."""
    return private("torch._higher_order_ops.flex_attention", "flex_attention")


def flex_attention_backward_hop() -> Any:
    return private("torch._higher_order_ops.flex_attention", "flex_attention_backward")


def create_fw_bw_graph() -> Any:
    """The helper that traces flex's score/mask functions into joint forward-backward graphs."""
    return private("torch._higher_order_ops.flex_attention", "create_fw_bw_graph")


def apply_kernel_options() -> Any:
    """flex_attention's defaulting of ``kernel_options`` (what the public call does first)."""
    return private("torch.nn.attention.flex_attention", "_apply_kernel_options")


def compile_fx() -> Any:
    """Inductor's graph compiler (compiles one traced flex call, no dynamo)."""
    return private("torch._inductor.compile_fx", "compile_fx")
