"""Sharding strategies of ``doc_packed::attn_fwd`` / ``attn_bwd``, registered once with DTensor.

Per mesh dim a strategy is one of four *kinds*:

=========  =====================================  ==========================  ===============
kind       q / k / v / out and their gradients    lse ``[B, H, S]``           cu_seqlens
=========  =====================================  ==========================  ===============
replicate  Replicate                              Replicate                   Replicate
batch      Shard(0)                               Shard(0)                    Shard(0)
heads      Shard(2)                               Shard(1)                    Replicate
sequence   Shard(1) (context parallel)            Shard(2)                    Replicate
=========  =====================================  ==========================  ===============

A strategy is one kind per mesh dim, offered only when it divides evenly: the batch size by the
product of the batch dims, ``H_q`` *and* ``H_kv`` by the product of the head dims (so GQA groups
stay whole), ``S`` by the sequence dim; at most one mesh dim shards the sequence. One exception:
when ``q`` already arrives ``Shard(1)`` on a mesh dim (eager DTensor: the caller's placement),
the sequence kind stays offered there for any ``S``: DTensor's uneven shards are ``torch.chunk``'s,
which is what context parallelism takes (``seq_len`` is the global length). Solvers
(AutoParallel, where every input has many candidate placements) are offered even shards only.
A ``Shard(1)`` that no strategy keeps raises in :mod:`shardings.dtensor` instead of being
re-placed.

The variants' tensor inputs (docs/contract.md, "Variants"), when given, ride along: ``sinks
[H_q]`` is ``Shard(0)`` under heads (it shards with the heads) and Replicate otherwise;
``prefix_lens [B, MAX_DOCS]`` travels with ``cu_seqlens`` (``Shard(0)`` under batch, else
Replicate).

The rules go through DTensor's own registry (``register_op_strategy``, the layer that
``register_sharding`` wraps): eager DTensor dispatch and AutoParallel's solver both read it.
``register_sharding`` itself cannot express the cross-dim rules above (it expands per-dim
choices by a cartesian product), hence the layer below it.

Planning time: a strategy's redistribution costs (one per candidate placement of each input)
come from torch's ``generate_redistribute_costs``, which under a solver's fake tensors re-plans
every transform uncached (~0.5 ms each). They depend on the specs' mesh, placements and global
shape and dtype only, and the forward's and backward's inputs (q / dout / out, k / v) share
them, so :func:`_redistribute_costs` remembers each row: on a (2, 4) mesh it cuts our strategies'
CPU time 2.8x (`bench/bench_solve.py --strategies`; docs/scenarios.md, "Solve time").
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Collection, Sequence

import torch
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from doc_packed.ops import arg_index, lse_dtype

from ._compat import (
    DTensorSpec,
    OpSchema,
    OpSpec,
    OpStrategy,
    RuntimeSchemaInfo,
    TensorMeta,
    generate_redistribute_costs,
    register_op_strategy,
)

__all__ = ["KINDS", "FWD", "BWD", "offered_kinds", "kind_of"]

KINDS = ("replicate", "batch", "heads", "sequence")
_R, _S0, _S1, _S2 = Replicate(), Shard(0), Shard(1), Shard(2)

# kind -> (output placements, input placements) for one mesh dim
FWD: dict[str, tuple[tuple[Placement, ...], tuple[Placement, ...]]] = {
    # outputs: out, lse | inputs: q, k, v, cu_seqlens
    "replicate": ((_R, _R), (_R, _R, _R, _R)),
    "batch": ((_S0, _S0), (_S0, _S0, _S0, _S0)),
    "heads": ((_S2, _S1), (_S2, _S2, _S2, _R)),
    "sequence": ((_S1, _S2), (_S1, _S1, _S1, _R)),
}
BWD: dict[str, tuple[tuple[Placement, ...], tuple[Placement, ...]]] = {
    # outputs: dq, dk, dv | inputs: dout, q, k, v, out, lse, cu_seqlens
    "replicate": ((_R,) * 3, (_R,) * 7),
    "batch": ((_S0,) * 3, (_S0,) * 7),
    "heads": ((_S2,) * 3, (_S2,) * 5 + (_S1, _R)),
    "sequence": ((_S1,) * 3, (_S1,) * 5 + (_S2, _R)),
}


def offered_kinds(
    mesh_shape: Sequence[int],
    batch: int,
    seq_len: int,
    q_heads: int,
    kv_heads: int,
    sequence_dims: Collection[int] | None = None,
    uneven_sequence_dims: Collection[int] = (),
) -> list[tuple[str, ...]]:
    """Every per-mesh-dim kind assignment offered for these global sizes (the sequence only on
    ``sequence_dims`` when given; on ``uneven_sequence_dims`` also when the dim does not divide
    ``seq_len``)."""
    offered = []
    for kinds in itertools.product(KINDS, repeat=len(mesh_shape)):
        size = {kind: math.prod(n for n, k in zip(mesh_shape, kinds) if k == kind) for kind in KINDS}
        if kinds.count("sequence") > 1:
            continue
        if sequence_dims is not None and any(k == "sequence" and d not in sequence_dims for d, k in enumerate(kinds)):
            continue
        if batch % size["batch"] or q_heads % size["heads"] or kv_heads % size["heads"]:
            continue
        if seq_len % size["sequence"] and not any(
            k == "sequence" and d in uneven_sequence_dims for d, k in enumerate(kinds)
        ):
            continue
        offered.append(kinds)
    return offered


def kind_of(placements: Sequence[Placement]) -> tuple[str, ...]:
    """Per mesh dim, the kind that q's (or a q-like tensor's) ``placements`` express."""
    names = {_R: "replicate", _S0: "batch", _S2: "heads", _S1: "sequence"}
    return tuple(names.get(p, str(p)) for p in placements)


def _meta(shape: Sequence[int], dtype: torch.dtype) -> TensorMeta:
    shape = torch.Size(shape)
    stride = tuple(torch.empty(shape, device="meta").stride())
    return TensorMeta(shape, stride, dtype)


def _static_arg(op_schema: OpSchema, name: str) -> object:
    i = arg_index(op_schema.op, name)
    args = op_schema.args_schema
    return args[i] if len(args) > i else op_schema.kwargs_schema.get(name)


def _sequence_dims(mesh, cp_dim: object) -> list[int] | None:
    """The mesh dims that may shard the sequence: the one the call's ``planning_cp_dim`` names,
    or all (None) without a hint."""
    if cp_dim is None:
        return None
    names = tuple(mesh.mesh_dim_names or ())
    if cp_dim not in names:
        raise ValueError(
            f"planning cp_dim={cp_dim!r} (doc_packed.planning) is not a dim of this mesh; its dims "
            f"are {list(names) if names else 'unnamed (give init_device_mesh mesh_dim_names=...)'}"
        )
    return [names.index(cp_dim)]


def _arriving_sequence_dims(inputs: Sequence[OpStrategy], op: object) -> list[int]:
    """The mesh dims on which ``q`` arrives ``Shard(1)`` when its placement is given (one
    candidate: eager DTensor dispatch); none while a solver weighs many."""
    q = inputs[arg_index(op, "q")]
    if len(q.strategies) != 1:
        return []
    return [d for d, p in enumerate(q.strategies[0].output_spec.placements) if p == _S1]


# kind -> placement of the variants' tensors: sinks [H_q] go with the heads, prefix_lens with cu_seqlens
_SINKS = {"replicate": _R, "batch": _R, "heads": _S0, "sequence": _R}
_PREFIX = {"replicate": _R, "batch": _S0, "heads": _R, "sequence": _R}


def _variant_inputs(op_schema: OpSchema) -> list[dict[str, Placement]]:
    """The variants' tensor inputs present in this call, in argument order (each as its
    kind -> placement table)."""
    op, args = op_schema.op, op_schema.args_schema
    present = []
    for name, table in (("sinks", _SINKS), ("prefix_lens", _PREFIX)):
        i = arg_index(op, name)
        if len(args) > i and isinstance(args[i], OpStrategy):
            present.append(table)
    return present


# (mesh, target, producer's candidates) -> costs; a plan's distinct rows number in the hundreds
_COSTS: dict[tuple, list[float]] = {}
_COSTS_MAX = 4096


def _cost_key(spec: DTensorSpec) -> tuple | None:
    """What torch's redistribution cost of ``spec`` depends on besides the mesh: placements,
    shard order, global shape and dtype (not strides)."""
    meta = spec.tensor_meta
    if meta is None:
        return None
    return (spec.placements, getattr(spec, "shard_order", None), tuple(meta.shape), meta.dtype)


def _redistribute_costs(producer: OpStrategy, target: DTensorSpec) -> list[float]:
    """``generate_redistribute_costs(producer, target)`` (torch's), remembered per distinct
    (mesh, target, producer candidates): a fresh list each call (solvers write into it)."""
    keys = tuple(_cost_key(s.output_spec) for s in producer.strategies)
    target_key = _cost_key(target)
    if target_key is None or any(k is None for k in keys):
        return generate_redistribute_costs(producer, target)
    key = (target.mesh, target_key, keys)
    costs = _COSTS.get(key)
    if costs is None:
        costs = generate_redistribute_costs(producer, target)
        if len(_COSTS) >= _COSTS_MAX:
            _COSTS.clear()
        _COSTS[key] = costs
    return list(costs)


def _strategy(op_schema: OpSchema) -> OpStrategy:
    op = op_schema.op
    table = FWD if op is torch.ops.doc_packed.attn_fwd.default else BWD
    args = op_schema.args_schema
    inputs = [a for a in args if isinstance(a, OpStrategy)]
    mesh = inputs[0].mesh
    q_meta = inputs[arg_index(op, "q")].strategies[0].output_spec.tensor_meta
    k_meta = inputs[arg_index(op, "k")].strategies[0].output_spec.tensor_meta
    B, S, Hq, _ = q_meta.shape
    Hkv = k_meta.shape[2]
    extra = _variant_inputs(op_schema)
    if table is FWD:
        v_meta = inputs[arg_index(op, "v")].strategies[0].output_spec.tensor_meta
        out_shape = (B, S, Hq, v_meta.shape[3])
        out_metas = [_meta(out_shape, q_meta.dtype), _meta((B, Hq, S), lse_dtype(q_meta.dtype))]
    else:
        out_metas = [_meta(inputs[i].strategies[0].output_spec.tensor_meta.shape, q_meta.dtype) for i in (1, 2, 3)]
    in_metas = [s.strategies[0].output_spec.tensor_meta for s in inputs]
    sequence_dims = _sequence_dims(mesh, _static_arg(op_schema, "planning_cp_dim"))
    specs = []
    for kinds in offered_kinds(mesh.shape, B, S, Hq, Hkv, sequence_dims, _arriving_sequence_dims(inputs, op)):
        outs = [
            DTensorSpec(mesh, tuple(table[kd][0][i] for kd in kinds), tensor_meta=m) for i, m in enumerate(out_metas)
        ]
        placements = [tuple(table[kd][1][i] for kd in kinds) for i in range(len(table[kinds[0]][1]))]
        placements += [tuple(t[kd] for kd in kinds) for t in extra]
        ins = [DTensorSpec(mesh, p, tensor_meta=m) for p, m in zip(placements, in_metas)]
        costs = [_redistribute_costs(s, spec) for s, spec in zip(inputs, ins)]
        specs.append(OpSpec(output_specs=tuple(outs), input_specs=ins, redistribute_cost=costs))
    return OpStrategy(specs)


# kind -> placement of attn_max_logits' [H_q] output: a max over every query of the call, so a
# batch shard holds a partial max; the sequence kind reduces over its ranks inside the op
_MAX_OUT = {"replicate": _R, "batch": Partial("max"), "heads": _S0, "sequence": _R}


def _max_logits_strategy(op_schema: OpSchema) -> OpStrategy:
    """``attn_max_logits(q, k, cu_seqlens, ..., prefix_lens)``: q/k/cu_seqlens placed as the
    forward's, prefix_lens with cu_seqlens, the ``[H_q]`` output by :data:`_MAX_OUT`."""
    op, args = op_schema.op, op_schema.args_schema
    inputs = [a for a in args if isinstance(a, OpStrategy)]
    mesh = inputs[0].mesh
    q_meta = inputs[0].strategies[0].output_spec.tensor_meta
    B, S, Hq, _ = q_meta.shape
    Hkv = inputs[1].strategies[0].output_spec.tensor_meta.shape[2]
    i = arg_index(op, "prefix_lens")
    has_prefix = len(args) > i and isinstance(args[i], OpStrategy)
    out_meta = _meta((Hq,), lse_dtype(q_meta.dtype))
    in_metas = [s.strategies[0].output_spec.tensor_meta for s in inputs]
    sequence_dims = _sequence_dims(mesh, None)
    specs = []
    for kinds in offered_kinds(mesh.shape, B, S, Hq, Hkv, sequence_dims, _arriving_sequence_dims(inputs, op)):
        fwd = [FWD[kd][1] for kd in kinds]
        placements = [tuple(f[j] for f in fwd) for j in (0, 1, 3)]  # q, k, cu_seqlens
        if has_prefix:
            placements.append(tuple(_PREFIX[kd] for kd in kinds))
        ins = [DTensorSpec(mesh, p, tensor_meta=m) for p, m in zip(placements, in_metas)]
        out = DTensorSpec(mesh, tuple(_MAX_OUT[kd] for kd in kinds), tensor_meta=out_meta)
        costs = [_redistribute_costs(s, spec) for s, spec in zip(inputs, ins)]
        specs.append(OpSpec(output_specs=out, input_specs=ins, redistribute_cost=costs))
    return OpStrategy(specs)


def register() -> None:
    """Register the ops' strategies with DTensor (idempotent)."""
    for op in (torch.ops.doc_packed.attn_fwd.default, torch.ops.doc_packed.attn_bwd.default):
        # every argument from seq_len on is a non-tensor that keys DTensor's sharding cache
        register_op_strategy(op, schema_info=RuntimeSchemaInfo(static_argnum=arg_index(op, "seq_len")))(_strategy)
    op = torch.ops.doc_packed.attn_max_logits.default
    register_op_strategy(op, schema_info=RuntimeSchemaInfo(static_argnum=arg_index(op, "seq_len")))(
        _max_logits_strategy
    )
