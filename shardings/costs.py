"""What a solver sees as the cost of a ``doc_packed`` call: time from measured rates, handed to
AutoParallel as FLOP-equivalents.

AutoParallel prices an op by running it on sharded fake tensors under ``FlopCounterMode`` and
converting the count to time at one efficiency for every op (``0.7 x`` the device's peak), and
prices every edge by the redistribution it implies. Our op's flop formula
(:mod:`doc_packed.flops`) is therefore the one supported place where its price enters. While a
:func:`pricing` context is active, a call on fake ``cu_seqlens`` with no group (which is what a
solver prices) counts as ``time x rate``: ``time`` is :func:`shardings.step_model.attention_us`
(the backend's measured TFLOP/s for the layout's mean document length, the host cost per call,
and for a sequence shard the plan's imbalance and the exchange: bytes / measured all-to-all
bandwidth + a fixed cost per exchange), and ``rate`` is how many FLOPs the solver converts to
one microsecond, measured once through AutoParallel's public ``estimate_strategy_runtime_cost``
on a reference matmul (so a change of its efficiency factor or peak table is followed, not
copied). Real runs (real ``cu_seqlens``, or a group) count real FLOPs.

The layout priced is the context's real ``cu_seqlens`` when given, else rows of lognormal
documents of the call's ``planning_doc_len`` (:func:`doc_packed.planning`; default one document
per row, the worst case for context parallelism's traffic). The mesh dim of a sequence shard is
the call's ``planning_cp_dim`` hint, else the dims of that size (across hosts if any is).

Without an explicit :func:`pricing`, calls priced inside AutoParallel (which enters its mesh)
use the default rates file on that mesh and 8 GPUs per host (``_compat.current_mesh``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from doc_packed import flops
from doc_packed.ops import cp_degree

from ._ap_compat import installed, reset_compute_cost_cache, solver_flops_per_us
from ._compat import current_mesh
from .step_model import Layout, Rates, Topology, attention_us
from .transforms import solver_edge_costs

__all__ = ["Pricing", "pricing", "active_pricing", "call_us", "register"]


@dataclass(frozen=True)
class Pricing:
    """How the solver's calls are priced: on ``mesh``, with ``rates`` (a device's measured rates),
    ``topology`` (GPUs per host), ``layout`` (a real layout, or None: the call's hint) and
    ``backend`` (None: the rates file's first)."""

    mesh: Any
    rates: Rates
    topology: Topology = Topology()
    layout: Layout | None = None
    backend: str | None = None


_ACTIVE: list[Pricing] = []


@contextlib.contextmanager
def pricing(
    mesh,
    *,
    rates: Rates | str | None = None,
    gpus_per_host: int = 8,
    cu_seqlens: torch.Tensor | None = None,
    backend: str | None = None,
) -> Iterator[Pricing]:
    """Price ``doc_packed`` calls for a solver planning on ``mesh`` (wrap ``AutoParallel(...)``'s
    ``with`` in it): ``rates`` a :class:`~shardings.step_model.Rates` or the path of a rates
    file (default: ``shardings/h200_rates.json``), ``gpus_per_host`` the hosts' size,
    ``cu_seqlens`` a real ``[B, MAX_DOCS + 1]`` layout to count pairs and plan on (read here,
    on the host), ``backend`` the kernel whose rates apply. Clears AutoParallel's cost cache on
    entry and exit (it keys on shapes, not on these). While on, AutoParallel also prices the
    moves DTensor runs in more steps than a per-dim view sees by those steps
    (:func:`~shardings.transforms.solver_edge_costs`)."""
    if not isinstance(rates, Rates):
        rates = Rates.load(rates)
    if gpus_per_host < 1:
        raise ValueError(f"gpus_per_host must be >= 1, got {gpus_per_host}")
    layout = Layout.from_cu_seqlens(cu_seqlens) if cu_seqlens is not None else None
    p = Pricing(mesh, rates, Topology(gpus_per_host), layout, backend)
    _ACTIVE.append(p)
    reset_compute_cost_cache()
    try:
        with solver_edge_costs():
            yield p
    finally:
        _ACTIVE.remove(p)
        reset_compute_cost_cache()


def active_pricing() -> Pricing | None:
    """The innermost :func:`pricing`, else the default pricing on the mesh AutoParallel entered
    (None outside both)."""
    if _ACTIVE:
        return _ACTIVE[-1]
    mesh = current_mesh()
    if mesh is None or not installed():
        return None
    return Pricing(mesh, Rates.load())


def _sequence_inter_host(p: Pricing, cp: int, cp_dim: str | None) -> bool:
    mesh = p.mesh
    shape = tuple(mesh.shape)
    names = tuple(mesh.mesh_dim_names or ())
    if cp_dim is not None and cp_dim in names:
        dims = [names.index(cp_dim)]
    else:
        dims = [d for d in range(len(shape)) if shape[d] == cp]
    return any(p.topology.crosses_hosts(shape, d) for d in dims)


def call_us(
    p: Pricing,
    q_shape,
    kv_heads: int,
    seq_len: int,
    causal: bool,
    left: int,
    right: int,
    dtype: torch.dtype,
    backward: bool,
    doc_len: int = 0,
    cp_dim: str | None = None,
):
    """One call's :class:`~shardings.step_model.AttentionCost` under ``p`` (local shapes)."""
    rows, local_len, q_heads, head_dim = q_shape
    cp = cp_degree(local_len, seq_len)
    layout = p.layout if p.layout is not None else Layout(flops.planned_doc_len(doc_len, seq_len))
    return attention_us(
        p.rates,
        rows=rows,
        seq_len=seq_len,
        local_len=local_len,
        q_heads=q_heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        itemsize=dtype.itemsize,
        causal=causal,
        window=(left, right),
        layout=layout,
        backward=backward,
        backend=p.backend,
        inter_host=cp > 1 and _sequence_inter_host(p, cp, cp_dim),
    )


def _planning_cost(q_shape, kv_heads, seq_len, causal, left, right, dtype, backward, flop_count, doc_len, cp_dim):
    """The flop count a solver sees for a call on fake ``cu_seqlens`` with no group."""
    p = active_pricing()
    if p is None or q_shape[1] == 0:
        return flop_count
    cost = call_us(p, q_shape, kv_heads, seq_len, causal, left, right, dtype, backward, doc_len, cp_dim)
    return int(cost.total * solver_flops_per_us(dtype))


def register() -> None:
    """Price ``doc_packed`` calls while a solver plans (idempotent)."""
    flops.set_planning_cost(_planning_cost)
