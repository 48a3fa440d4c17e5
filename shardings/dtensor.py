"""Eager DTensor dispatch for the ``doc_packed`` ops, with the sequence dim lowered to CP.

DTensor's usual path (sharding propagation over :mod:`shardings.strategies`, redistribution,
then the op on local tensors) runs unchanged, with one addition: when the chosen strategy
shards the sequence on a mesh dim, the local call gets that mesh dim's process group as
``cp_group``, so the op runs the context-parallel exchange instead of failing on a shard.
"""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Shard

_CP_GROUP_INDEX = {"fwd": 10, "bwd": 13}
_Q_INDEX = {"fwd": 0, "bwd": 1}


def _which(op) -> str:
    return "fwd" if op is torch.ops.doc_packed.attn_fwd.default else "bwd"


def _handler(op_call, args, kwargs):
    dispatcher = DTensor._op_dispatcher
    info = dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    dispatcher.sharding_propagator.propagate(info)
    sharding = info.output_sharding
    schema = info.schema
    if sharding.needs_redistribute:
        dispatcher.redistribute_local_args(
            info, sharding.redistribute_schema, sharding.use_val_from_redistribute_schema
        )
        schema = sharding.redistribute_schema
    local = list(
        pytree.tree_unflatten(list(info.local_args), info.args_tree_spec)
        if info.args_tree_spec
        else info.local_args
    )
    which = _which(op_call)
    q_spec = schema.args_schema[_Q_INDEX[which]]
    seq_dims = [d for d, p in enumerate(q_spec.placements) if p == Shard(1)]
    if seq_dims:
        local[_CP_GROUP_INDEX[which]] = info.compute_mesh.get_group(seq_dims[0]).group_name
    result = op_call(*local, **info.local_kwargs)
    return dispatcher.wrap(result, sharding.output_spec)


def register() -> None:
    handlers = DTensor._op_dispatcher._custom_op_handlers
    handlers[torch.ops.doc_packed.attn_fwd.default] = _handler
    handlers[torch.ops.doc_packed.attn_bwd.default] = _handler
