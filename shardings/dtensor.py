"""Eager DTensor dispatch for the ``doc_packed`` ops, with the sequence dim lowered to CP.

DTensor's usual path (sharding propagation over :mod:`shardings.strategies`, redistribution,
then the op on local tensors) runs unchanged, with one addition: when the chosen strategy
shards the sequence on a mesh dim, the local call gets that mesh dim's process group as
``cp_group``, so the op runs the context-parallel exchange instead of failing on a shard.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor.placement_types import Shard

from doc_packed.ops import arg_index

from ._compat import install_custom_op_handler, op_dispatcher, tree_unflatten


def _handler(op_call, args, kwargs):
    dispatcher = op_dispatcher()
    info = dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    dispatcher.sharding_propagator.propagate(info)
    sharding = info.output_sharding
    schema = info.schema
    if sharding.needs_redistribute:
        dispatcher.redistribute_local_args(
            info, sharding.redistribute_schema, sharding.use_val_from_redistribute_schema
        )
        schema = sharding.redistribute_schema
    local = list(tree_unflatten(list(info.local_args), info.args_tree_spec) if info.args_tree_spec else info.local_args)
    q_spec = schema.args_schema[arg_index(op_call, "q")]
    seq_dims = [d for d, p in enumerate(q_spec.placements) if p == Shard(1)]
    _check_sequence_kept(info.schema.args_schema[arg_index(op_call, "q")], seq_dims)
    if seq_dims:
        local[arg_index(op_call, "cp_group")] = info.compute_mesh.get_group(seq_dims[0]).group_name
    result = op_call(*local, **info.local_kwargs)
    return dispatcher.wrap(result, sharding.output_spec)


def _check_sequence_kept(arrived, seq_dims: list[int]) -> None:
    """A ``q`` that arrives sequence-sharded runs context-parallel on that mesh dim or raises:
    never silently re-placed (values would be right, the placement not the one asked for)."""
    asked = [d for d, p in enumerate(arrived.placements) if p == Shard(1)]
    lost = [d for d in asked if d not in seq_dims]
    if not lost:
        return
    mesh = arrived.mesh
    names = mesh.mesh_dim_names
    where = f"mesh dim {names[lost[0]] if names else lost[0]!r} (size {mesh.shape[lost[0]]})"
    if len(asked) > 1:
        why = "only one mesh dim may shard the sequence (it is Shard(1) on several)"
    else:
        why = (
            "no strategy keeps it there: a planning(cp_dim=...) hint names another dim, or the "
            "other mesh dims' placements do not divide the batch or heads (shardings/strategies.py)"
        )
    raise ValueError(
        f"q is sequence-sharded (Shard(1)) on {where}, but doc_packed attention cannot run context-"
        f"parallel there: {why}. Redistribute q, k, v to the placement you want before the call."
    )


def register() -> None:
    install_custom_op_handler(torch.ops.doc_packed.attn_fwd.default, _handler)
    install_custom_op_handler(torch.ops.doc_packed.attn_bwd.default, _handler)
    install_custom_op_handler(torch.ops.doc_packed.attn_max_logits.default, _handler)
