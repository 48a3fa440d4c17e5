"""What a solver sees as the cost of each strategy, and the context-parallel exchange's share.

AutoParallel prices an op by running it on sharded fake tensors under ``FlopCounterMode``
(``max(flops / (0.7 * peak), bytes / bandwidth)``, floor 7 us) and prices every edge by the
redistribution it implies. So:

- replicate / batch / heads / sequence strategies get their true compute from the flop
  formula (:mod:`doc_packed._flops`): local shapes, the causal/window discount, and a
  ``1/c`` share for a ``c``-way sequence shard;
- the sequence strategy's *internal* AllToAll-V is invisible to the edge pricing, so while
  AutoParallel plans (its mesh is the current mesh and the call is a sequence shard with no
  group yet), this module adds it to the flop count as FLOP-equivalents of its time:
  ``time * 0.7 * peak``, with ``time`` from AutoParallel's own collective model for that
  mesh dim. Each of the exchange's collectives is priced like an all-gather moving the same
  bytes per rank (latency + bytes / link bandwidth). Not AutoParallel's ``all_to_all``
  model: that one multiplies its estimate by 5 (a FIXME in its source), while on 2 x H200
  ``all_to_all_single`` measured 283 GB/s against all-gather's 256 GB/s. Ulysses-style
  ``Shard(1) -> Shard(2)`` redistributions are still priced by AutoParallel's own model.
  The mesh dim is the one the priced strategy shards the sequence on (read from AutoParallel's
  ``estimate_strategy_runtime_cost`` frame; the formula itself only sees local shapes).
  The traffic and the imbalance come from our real planner run on a representative layout:
  rows of lognormal documents of mean :func:`doc_packed.set_planning_doc_len` tokens
  (default: one document per row, the worst case for context parallelism's traffic).
"""

from __future__ import annotations

import functools
import sys

from torch.distributed.tensor.placement_types import Shard

from doc_packed import _flops
from doc_packed._layout import DocLayout
from doc_packed.cp.plan import build_plan
from doc_packed.examples import lognormal_lengths

__all__ = ["representative_plan", "exchange_bytes", "register"]


def representative_bounds(seq_len: int, doc_len: int) -> list[int]:
    """Document boundaries of one representative row: lognormal lengths (sigma 1) of mean
    ``doc_len``, from a fixed seed, so that documents straddle shard boundaries the way real
    packed data does (equal lengths would align with the shards and hide all traffic).
    ``doc_len >= seq_len`` is one document."""
    if doc_len >= seq_len:
        return [0, seq_len]
    bounds = [0]
    for n in lognormal_lengths(seq_len, doc_len, seed=seq_len * 1_000_003 + doc_len):
        bounds.append(bounds[-1] + n)
    return bounds


@functools.lru_cache(maxsize=256)
def representative_plan(seq_len: int, doc_len: int, cp: int, causal: bool, left: int, right: int, query_cost: float):
    """Our planner on one representative row (:func:`representative_bounds`)."""
    layout = DocLayout([representative_bounds(seq_len, doc_len)], seq_len)
    return build_plan(layout, cp, causal, left, right, query_cost=query_cost)


def exchange_bytes(
    plan, rows: int, q_heads: int, kv_heads: int, head_dim: int, itemsize: int, backward: bool
) -> list[int]:
    """Per collective of one layer's forward (or backward) exchange, the bytes the busiest
    rank receives: the runtime's collectives in order.

    Forward: K|V rows, moved queries, their outputs back, their lse back.
    Backward (K/V fetched again): K|V, moved q|out|dout, their lse, dQ back, dK|dV back.
    """
    kv = max(plan.kv_recv_tokens) * rows * 2 * kv_heads * head_dim * itemsize
    qm = max(plan.q_moved_tokens) * rows
    q_row, lse_row = q_heads * head_dim * itemsize, q_heads * 4
    q_side = [] if sum(plan.q_moved_tokens) == 0 else (
        [3 * qm * q_row, qm * lse_row, qm * q_row] if backward else [qm * q_row, qm * q_row, qm * lse_row]
    )
    kv_side = [] if sum(plan.kv_recv_tokens) == 0 else ([kv, kv] if backward else [kv])
    return kv_side + q_side


def _autoparallel_pricing():
    """(collective_comm_cost, MeshTopoInfo, peak_tflops_fn) if AutoParallel is planning now."""
    try:
        from autoparallel.cost_models.collective_runtime_estimation import collective_comm_cost
        from autoparallel.cost_models.compute_estimation import _get_device_tflops
        from torch.distributed.device_mesh import _mesh_resources
        from torch.distributed.tensor._collective_utils import MeshTopoInfo
    except ImportError:
        return None
    try:
        mesh = _mesh_resources.get_current_mesh()
    except RuntimeError:
        return None
    return mesh, collective_comm_cost, MeshTopoInfo, _get_device_tflops


def _sequence_mesh_dim(mesh, cp: int, backward: bool) -> int | None:
    """The mesh dim that shards the sequence in the strategy AutoParallel is pricing.

    AutoParallel calls the flop formula from ``estimate_strategy_runtime_cost(node, strategy)``
    with fake tensors of the sharded shapes only; the strategy in that frame says which mesh
    dim holds ``Shard(1)``. Without it (another caller), the innermost dim of size ``cp``.
    """
    frame = sys._getframe()
    for _ in range(40):
        frame = frame.f_back
        if frame is None:
            break
        if frame.f_code.co_name == "estimate_strategy_runtime_cost":
            strategy = frame.f_locals.get("strategy")
            specs = getattr(strategy, "input_specs", None)
            if specs:
                placements = specs[1 if backward else 0].placements
                dims = [d for d, p in enumerate(placements) if p == Shard(1)]
                if dims:
                    return dims[0]
            break
    dims = [d for d in range(mesh.ndim) if mesh.size(d) == cp]
    return dims[-1] if dims else None


def _planning_cost(q_shape, kv_heads, seq_len, causal, left, right, dtype, backward, flops):
    """Flop count of a sequence-sharded call while AutoParallel plans: imbalance + exchange."""
    pricing = _autoparallel_pricing()
    if pricing is None:
        return flops
    mesh, comm_cost, topo_cls, tflops = pricing
    rows, local_len, q_heads, head_dim = q_shape
    cp = -(-seq_len // local_len)
    dim = _sequence_mesh_dim(mesh, cp, backward)
    if dim is None:
        return flops
    doc_len = min(_flops.planning_doc_len() or seq_len, seq_len)
    plan = representative_plan(seq_len, doc_len, cp, causal, left, right, q_heads / kv_heads)
    topo = topo_cls.build_from_mesh(mesh)
    # the all-gather model takes the gathered size; per rank it moves (n-1)/n of it
    us = sum(
        comm_cost("allgather", int(b * cp / max(cp - 1, 1)), tuple(mesh.shape), dim, topo)
        for b in exchange_bytes(plan, rows, q_heads, kv_heads, head_dim, dtype.itemsize, backward)
    )
    return int(flops * plan.imbalance + us * 1e-6 * tflops(dtype) * 1e12 * 0.7)


def register() -> None:
    _flops.planning_cost_hook = _planning_cost
