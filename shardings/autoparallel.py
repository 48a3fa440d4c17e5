"""AutoParallel glue: lower the solver's sequence-sharded attention to context parallelism,
and report what the solver chose for every ``doc_packed`` node.

Usage::

    with AutoParallel(model, input_fn, mesh) as autop:
        autop.add_input_constraints(...)
        placement = autop.optimize_placement()
        placement = lower_context_parallel(autop, placement)
        describe_attention(autop, placement)   # prints a report, returns the choices
        parallel = autop.apply_placement(placement)

AutoParallel (https://github.com/meta-pytorch/autoparallel) is installed from its git
repository; this module imports nothing from it at import time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.distributed.tensor.placement_types import Shard

from doc_packed import flops
from doc_packed.ops import arg_index

from ._ap_compat import chosen_decisions
from ._compat import unset_fake_temporarily
from .costs import exchange_bytes, representative_plan
from .strategies import kind_of

__all__ = ["lower_context_parallel", "describe_attention", "force_attention_layout", "AttentionChoice"]

_ROLES = {torch.ops.doc_packed.attn_fwd.default: "forward", torch.ops.doc_packed.attn_bwd.default: "backward"}


def _arg(node, name: str):
    """Argument ``name`` of a traced ``doc_packed`` node (positional or keyword)."""
    i = arg_index(node.target, name)
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, 0 if name == "planning_doc_len" else None)


def _attention_nodes(placement):
    for node, spec in placement.items():
        if getattr(node, "op", None) == "call_function" and node.target in _ROLES:
            yield node, spec


def _sequence_dim(spec, q_index: int) -> int | None:
    dims = [d for d, p in enumerate(spec.input_specs[q_index].placements) if p == Shard(1)]
    return dims[0] if dims else None


def lower_context_parallel(autop, placement):
    """Make the attention nodes the solver sequence-sharded run context parallel.

    Call between ``optimize_placement()`` and ``apply_placement()``. Each such node of
    ``autop.gm`` gets the process group of its sequence mesh dim as ``cp_group`` (the nodes are
    edited in place, so the placement dict stays valid). Returns the placement to apply.
    """
    mesh = autop.mesh
    for node, spec in _attention_nodes(placement):
        group_index = arg_index(node.target, "cp_group")
        dim = _sequence_dim(spec, arg_index(node.target, "q"))
        if dim is None:
            continue
        args = list(node.args)
        name = mesh.get_group(dim).group_name
        if len(args) > group_index:
            args[group_index] = name
            node.args = tuple(args)
        else:
            node.kwargs = {**node.kwargs, "cp_group": name}
    return placement


def force_attention_layout(autop, layout: dict[str, str]) -> None:
    """Constrain every ``doc_packed`` node to one kind per mesh dim, e.g.
    ``{"dp": "batch", "cp": "sequence"}`` (unnamed dims: ``"dim0"``...; missing ones replicate).

    Call before ``optimize_placement()``: to compare the solver's choice with pure DP or pure
    CP, or to pin a layout the solver would not pick at a size where every op costs its floor.
    """
    from .strategies import BWD, FWD, KINDS

    mesh = autop.mesh
    names = mesh.mesh_dim_names or tuple(f"dim{d}" for d in range(mesh.ndim))
    unknown = set(layout) - set(names)
    if unknown:
        raise ValueError(f"unknown mesh dims {sorted(unknown)}; this mesh has {list(names)}")
    kinds = [layout.get(n, "replicate") for n in names]
    for k in kinds:
        if k not in KINDS:
            raise ValueError(f"unknown kind {k!r}; expected one of {KINDS}")
    for node in autop.gm.graph.nodes:
        if node.op == "call_function" and node.target in _ROLES:
            table = FWD if _ROLES[node.target] == "forward" else BWD
            placement = tuple(table[k][0][0] for k in kinds)
            autop.sharding_optimizer.add_node_constraint(node, placement)


@dataclass
class AttentionChoice:
    """What the solver chose for one ``doc_packed`` node."""

    node: str
    role: str  # "forward" / "backward"
    layout: dict[str, str]  # mesh dim name -> "batch" / "heads" / "sequence" / "replicate"
    compute_us: float  # AutoParallel's estimate for the local op (CP exchange included)
    redistribute_us: float  # AutoParallel's estimate for reshaping its inputs
    source: str = ""
    cp: dict = field(default_factory=dict)  # balance / traffic of the plan, when sequence-sharded

    def __str__(self) -> str:
        where = ", ".join(f"{k}: {v}" for k, v in self.layout.items())
        s = (
            f"{self.node:<12} {self.role:<8} {where:<44} compute {self.compute_us:9.1f} us"
            f"  redistribute {self.redistribute_us:9.1f} us"
        )
        if self.cp:
            s += (
                f"\n{'':<22}cp={self.cp['cp']} imbalance {self.cp['imbalance']:.3f}, K/V in "
                f"{self.cp['kv_recv_tokens']} tok/row-set (all-gather {self.cp['all_gather_tokens']}), "
                f"queries moved {self.cp['q_moved_tokens']}, exchange {self.cp['exchange_MB']:.1f} MB/rank"
            )
        return s


def describe_attention(autop, placement, *, cu_seqlens: torch.Tensor | None = None, print_report: bool = True):
    """Every ``doc_packed`` node's chosen placement, cost estimates and CP plan, in words.

    ``cu_seqlens`` (a real, global one) makes the CP figures those of that layout; by default
    they come from the node's planning hint (:func:`doc_packed.planning`). For the
    rest of the graph see ``autop.sharding_optimizer.get_json()`` (placements, costs and source
    line of every node) and ``autop.sharding_optimizer.get_log(verbose=True)``.
    """
    chosen, normalize = chosen_decisions(autop.sharding_optimizer)
    mesh = autop.mesh
    names = mesh.mesh_dim_names or tuple(f"dim{d}" for d in range(mesh.ndim))
    choices = []
    for node, spec in _attention_nodes(placement):
        role, q_index = _ROLES[node.target], arg_index(node.target, "q")
        concrete = normalize(node)
        kinds = kind_of(spec.input_specs[q_index].placements)
        dvs = chosen.get(concrete, [])
        compute = sum(dv.compute_cost for dv in dvs)
        redistribute = sum(dv.comm_cost for dv in dvs)
        q_meta = spec.input_specs[q_index].tensor_meta
        k_meta = spec.input_specs[q_index + 1].tensor_meta
        cp_info = {}
        dim = _sequence_dim(spec, q_index)
        if dim is not None:
            cp = mesh.size(dim)
            B, S, Hq, D = q_meta.shape
            Hkv = k_meta.shape[2]
            rows = B
            for d, p in enumerate(spec.input_specs[q_index].placements):
                if p == Shard(0):
                    rows //= mesh.size(d)
                if p == Shard(2):
                    Hq, Hkv = Hq // mesh.size(d), Hkv // mesh.size(d)
            causal, left, right = (_arg(node, n) for n in ("causal", "window_left", "window_right"))
            if cu_seqlens is not None:
                import doc_packed

                with unset_fake_temporarily():  # AutoParallel's context runs under fake mode
                    plan = doc_packed.plan_context_parallel(
                        cu_seqlens, cp, causal=causal, window_size=(left, right), query_cost=Hq / Hkv
                    )
                rows_per_plan = 1
            else:
                doc_len = flops.planned_doc_len(_arg(node, "planning_doc_len"), S)
                plan = representative_plan(S, doc_len, cp, causal, left, right, Hq / Hkv)
                rows_per_plan = rows
            nbytes = sum(exchange_bytes(plan, rows_per_plan, Hq, Hkv, D, q_meta.dtype.itemsize, role == "backward"))
            cp_info = dict(
                cp=cp,
                imbalance=plan.imbalance,
                kv_recv_tokens=max(plan.kv_recv_tokens) * rows_per_plan,
                all_gather_tokens=(plan.batch * S - plan.batch * S // cp) * rows_per_plan,
                q_moved_tokens=max(plan.q_moved_tokens) * rows_per_plan,
                exchange_MB=nbytes / 2**20,
                planned_from="cu_seqlens" if cu_seqlens is not None else "planning assumption",
            )
        stack = node.meta.get("stack_trace", "") or ""
        source = stack.strip().splitlines()[-2].strip() if stack.strip() else ""
        choices.append(
            AttentionChoice(
                node=node.name,
                role=role,
                layout=dict(zip(names, kinds)),
                compute_us=compute,
                redistribute_us=redistribute,
                source=source,
                cp=cp_info,
            )
        )
    if print_report:
        print("doc_packed attention placements (AutoParallel):")
        for c in choices:
            print(" ", c)
        print("  rest of the graph: autop.sharding_optimizer.get_json() / .get_log(verbose=True)")
    return choices
