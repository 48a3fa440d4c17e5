"""What a solver sees as the cost of each strategy, and the context-parallel exchange's share.

AutoParallel prices an op by running it on sharded fake tensors under ``FlopCounterMode``
(``max(flops / (0.7 * peak), bytes / bandwidth)``, floor 7 us) and prices every edge by the
redistribution it implies. So:

- replicate / batch / heads / sequence strategies get their true compute from the flop
  formula (:mod:`doc_packed.flops`): local shapes, the causal/window discount, and a
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
  The formula sees local shapes only. With the call's ``planning_cp_dim`` hint
  (:func:`doc_packed.planning`) the strategies shard the sequence on that named dim only, so
  that is the dim priced. Without it the dim is inferred: the dim of size ``cp``; where several
  dims have that size (e.g. 8 hosts x 8 GPUs) the exchange is priced on the slowest of them,
  exact within one host (every dim has the same links) and conservative across hosts.
  The traffic and the imbalance come from our real planner run on a representative layout:
  rows of lognormal documents of the call's ``planning_doc_len`` tokens (:func:`doc_packed.planning`;
  default: one document per row, the worst case for context parallelism's traffic).
"""

from __future__ import annotations

import functools

from doc_packed import flops, plan_context_parallel
from doc_packed.layout import lognormal_lengths
from doc_packed.ops import cp_degree

from ._ap_compat import collective_cost_us, device_tflops, installed
from ._compat import current_mesh, mesh_topology

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
    return plan_context_parallel(
        [representative_bounds(seq_len, doc_len)], cp, causal=causal, window_size=(left, right), query_cost=query_cost
    )


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
    q_side = (
        []
        if sum(plan.q_moved_tokens) == 0
        else ([3 * qm * q_row, qm * lse_row, qm * q_row] if backward else [qm * q_row, qm * q_row, qm * lse_row])
    )
    kv_side = [] if sum(plan.kv_recv_tokens) == 0 else ([kv, kv] if backward else [kv])
    return kv_side + q_side


def _exchange_us(mesh, cp: int, nbytes: list[int], cp_dim: str | None = None) -> float | None:
    """AutoParallel's time for the exchange's collectives on the mesh dim named ``cp_dim`` (the
    call's planning hint; the strategies shard the sequence on it only), else on the dim of size
    ``cp`` (the slowest such dim when several have that size); None when no dim fits."""
    names = mesh.mesh_dim_names or ()
    if cp_dim is not None and cp_dim in names:
        dims = [names.index(cp_dim)] if mesh.size(names.index(cp_dim)) == cp else []
    else:
        dims = [d for d in range(mesh.ndim) if mesh.size(d) == cp]
    if not dims:
        return None
    topology = mesh_topology(mesh)
    # the all-gather model takes the gathered size; per rank it moves (n-1)/n of it
    return max(
        sum(collective_cost_us("allgather", int(b * cp / max(cp - 1, 1)), mesh.shape, d, topology) for b in nbytes)
        for d in dims
    )


def _planning_cost(q_shape, kv_heads, seq_len, causal, left, right, dtype, backward, flop_count, doc_len, cp_dim):
    """Flop count of a sequence-sharded call while AutoParallel plans: imbalance + exchange."""
    mesh = current_mesh()
    if mesh is None or not installed():
        return flop_count
    rows, local_len, q_heads, head_dim = q_shape
    cp = cp_degree(local_len, seq_len)
    doc_len = flops.planned_doc_len(doc_len, seq_len)
    plan = representative_plan(seq_len, doc_len, cp, causal, left, right, q_heads / kv_heads)
    nbytes = exchange_bytes(plan, rows, q_heads, kv_heads, head_dim, dtype.itemsize, backward)
    us = _exchange_us(mesh, cp, nbytes, cp_dim)
    if us is None:
        return flop_count
    return int(flop_count * plan.imbalance + us * 1e-6 * device_tflops(dtype) * 1e12 * 0.7)


def register() -> None:
    """Price sequence-sharded calls while a solver plans (idempotent)."""
    flops.set_planning_cost(_planning_cost)
