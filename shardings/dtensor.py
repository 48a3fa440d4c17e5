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
    if seq_dims:
        local[arg_index(op_call, "cp_group")] = info.compute_mesh.get_group(seq_dims[0]).group_name
    result = op_call(*local, **info.local_kwargs)
    return dispatcher.wrap(result, sharding.output_spec)


def register() -> None:
    install_custom_op_handler(torch.ops.doc_packed.attn_fwd.default, _handler)
    install_custom_op_handler(torch.ops.doc_packed.attn_bwd.default, _handler)
