"""The collectives DTensor runs to move a tensor between placements, where a per-dim view misses some.

Compared mesh dim by mesh dim, ``(S(1), S(1)) -> (S(2), S(1))`` on a (cp, tp) mesh changes one
dim and looks like one all-to-all on ``cp``. DTensor runs more: both dims shard tensor dim 1, the
inner (``tp``) split of it is undone first (an all-gather on ``tp``), the all-to-all on ``cp``
then moves twice the bytes, and ``tp`` splits again. AutoParallel's edge costs and the step model
priced such moves per dim, so a layout that keeps activations sequence-sharded on both dims and
gives attention heads on the outer one looked as cheap as the forced (sequence, heads) layout and
ran 14-22% slower on 4 x H200 (docs/end_to_end.md, session 24).

:func:`steps` is DTensor's own plan for a move (torch's ``_gen_transform_infos``), :func:`undone`
says whether it holds steps a per-dim view misses, and :func:`undone_plan` is the plan where it
does. :func:`step_bytes` gives each
step's collective and the bytes the step model prices it at; :func:`solver_edge_costs` makes
AutoParallel price such moves step by step with its own collective costs (other moves keep
AutoParallel's price).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any, NamedTuple

from ._ap_compat import edge_costs, move_cost
from ._compat import DTensorSpec, TensorMeta, transform_infos

__all__ = ["Step", "solver_edge_costs", "step_bytes", "steps", "undone", "undone_plan"]


class Step(NamedTuple):
    """One step of DTensor's plan: on ``mesh_dim``, ``src`` to ``dst``, for the tensor as that
    mesh dim sees it (``logical_shape``: the global shape split by the other dims' shards)."""

    mesh_dim: int
    src: Any
    dst: Any
    logical_shape: tuple[int, ...]


def steps(src: Any, dst: Any) -> list[Step] | None:
    """DTensor's plan to move ``src`` to ``dst`` (DTensor specs of one mesh, with tensor metadata);
    None where this torch has no planner to ask."""
    if transform_infos is None:
        return None
    return [
        Step(t.mesh_dim, t.src_dst_placements[0], t.src_dst_placements[1], tuple(int(n) for n in t.logical_shape))
        for t in transform_infos(src, dst)
    ]


def undone(plan: list[Step], src: Any, dst: Any) -> bool:
    """Whether ``plan`` runs steps a per-dim view misses: a step on a mesh dim whose placement the
    move keeps (undone, then redone), or more than one step on a dim."""
    dims = [s.mesh_dim for s in plan]
    return len(dims) != len(set(dims)) or any(src.placements[d] == dst.placements[d] for d in dims)


def undone_plan(src: Any, dst: Any) -> list[Step] | None:
    """DTensor's plan for moving ``src`` to ``dst`` where it holds steps a per-dim view misses;
    None where it does not, where the move changes nothing, or where torch cannot plan it (the
    per-dim price then stands)."""
    if src.placements == dst.placements or src.tensor_meta is None:
        return None
    try:
        plan = steps(src, dst)
    except Exception:  # noqa: BLE001 - a move torch cannot plan keeps its per-dim price
        return None
    return plan if plan and undone(plan, src, dst) else None


def step_bytes(step: Step, itemsize: int, mesh_shape: tuple[int, ...]) -> tuple[str, float] | None:
    """The collective ``step`` runs and its bytes as :func:`~shardings.step_model.collective_us`
    takes them (the whole tensor for all_gather / reduce_scatter / all_reduce, a rank's send buffer
    for all_to_all); None for a local step (a slice, or a local write of a partial)."""
    full = math.prod(step.logical_shape) * itemsize
    a, b = step.src, step.dst
    if a.is_shard() and b.is_replicate():
        return "all_gather", float(full)
    if a.is_shard() and b.is_shard():
        return "all_to_all", full / mesh_shape[step.mesh_dim]
    if a.is_partial() and b.is_replicate():
        return "all_reduce", float(full)
    if a.is_partial() and b.is_shard():
        return "reduce_scatter", float(full)
    return None


def _one_dim_specs(src: Any, step: Step) -> tuple[Any, Any]:
    """``step`` as a move of its own: the tensor at its logical shape, placed only on its mesh dim."""
    from torch.distributed.tensor import Replicate

    meta = src.tensor_meta
    shape = step.logical_shape
    stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
    tm = TensorMeta(shape=meta.shape.__class__(shape), stride=stride, dtype=meta.dtype)

    def spec(p):
        placements = [Replicate()] * src.mesh.ndim
        placements[step.mesh_dim] = p
        return DTensorSpec(src.mesh, tuple(placements), tensor_meta=tm)

    return spec(step.src), spec(step.dst)


def solver_edge_costs() -> contextlib.AbstractContextManager[None]:
    """While on, AutoParallel prices an edge whose move DTensor runs with steps a per-dim view
    misses (:func:`undone`) as the sum of its own price of each step, each at the step's logical
    shape (never below its own price of the whole move); every other edge keeps AutoParallel's
    price. :func:`shardings.costs.pricing` and :func:`shardings.flow.place` turn it on."""
    if transform_infos is None:
        return contextlib.nullcontext()
    return edge_costs(_edge_cost)


def _edge_cost(theirs: Callable[[Any, Any], float], src: Any, tgt: Any) -> float:
    base = theirs(src, tgt)
    plan = undone_plan(src, tgt)
    if plan is None:
        return base
    return max(base, sum(move_cost(*_one_dim_specs(src, step)) for step in plan))
