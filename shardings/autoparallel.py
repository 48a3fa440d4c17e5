"""AutoParallel glue: lower the solver's sequence-sharded attention to context parallelism,
and report what the solver chose for every ``doc_packed`` node.

Usage::

    with pricing(mesh, gpus_per_host=8), AutoParallel(model, input_fn, mesh, cost_model=cost_model_for(mesh, 8)) as autop:
        autop.add_input_constraints(...)
        placement = autop.optimize_placement()
        placement = lower_context_parallel(autop, placement)
        describe_attention(autop, placement, alternatives=True)   # chosen + alternatives, costs in ms
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

from ._ap_compat import chosen_decisions, strategy_costs, topology_config
from ._compat import unset_fake_temporarily
from .costs import Pricing, active_pricing, call_us
from .step_model import Layout, Rates, exchange_bytes, plan_for
from .strategies import kind_of

__all__ = [
    "lower_context_parallel",
    "describe_attention",
    "force_attention_layout",
    "AttentionChoice",
    "Alternative",
    "attention_time_us",
    "sequence_break_even",
    "BreakEven",
    "cost_model_for",
]

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


def cost_model_for(mesh, gpus_per_host: int = 8, **kwargs):
    """AutoParallel's collective cost model for ``mesh`` on hosts of ``gpus_per_host`` GPUs
    (Hopper, NVSwitch): pass it as ``AutoParallel(..., cost_model=cost_model_for(mesh, n))``.

    AutoParallel detects the topology itself only on a CUDA device whose mesh is a multiple of
    8 GPUs; otherwise (CPU planning, 2 or 4 GPUs) it silently falls back to torch's model of an
    87.7 GB/s link, which priced the tensor-parallel all-gathers and reduce-scatters of a 4 x
    H200 mesh ~3x too high (docs/scenarios.md). ``kwargs`` go to AutoParallel's
    ``h100_topo_config`` (e.g. ``bw_inter`` in GB/s per GPU)."""
    if gpus_per_host < 1:
        raise ValueError(f"gpus_per_host must be >= 1, got {gpus_per_host}")
    per_host = min(gpus_per_host, mesh.size())
    return topology_config(-(-mesh.size() // per_host), per_host, **kwargs)


def force_attention_layout(autop, layout: dict[str, str]) -> list[str]:
    """Constrain every ``doc_packed`` node to one kind per mesh dim, e.g.
    ``{"dp": "batch", "cp": "sequence"}`` (unnamed dims: ``"dim0"``...; missing ones replicate).

    Call before ``optimize_placement()``: to compare the solver's choice with pure DP or pure
    CP, or to pin a layout the solver would not pick at a size where every op costs its floor.
    Returns the constraints' names: ``autop.sharding_optimizer.remove_constraints(names)``
    frees the layout again (then ``.resolve()`` re-solves without re-tracing).
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
    names_added: list[str] = []
    for node in autop.gm.graph.nodes:
        if node.op == "call_function" and node.target in _ROLES:
            table = FWD if _ROLES[node.target] == "forward" else BWD
            placement = tuple(table[k][0][0] for k in kinds)
            names_added += autop.sharding_optimizer.add_node_constraint(node, placement) or []
    return names_added


def _words(layout: dict[str, str]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in layout.items())


@dataclass(frozen=True)
class Alternative:
    """One strategy AutoParallel offered an attention node, with its estimates in ms:
    ``compute_ms`` the local op (the CP exchange and imbalance included when sequence-sharded),
    ``comm_ms`` redistributing the node's inputs from where the solution put their producers
    (what it would cost its consumers is not included)."""

    layout: dict[str, str]
    compute_ms: float
    comm_ms: float
    chosen: bool

    @property
    def total_ms(self) -> float:
        return self.compute_ms + self.comm_ms

    def __str__(self) -> str:
        return (
            f"{_words(self.layout):<36} compute {self.compute_ms:8.3f} ms + communication "
            f"{self.comm_ms:8.3f} ms = {self.total_ms:8.3f} ms"
        )


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
    # with describe_attention(alternatives=True): the chosen strategy first, then the cheapest others
    alternatives: list[Alternative] = field(default_factory=list)

    def __str__(self) -> str:
        s = (
            f"{self.node:<12} {self.role:<8} {_words(self.layout):<44} compute {self.compute_us / 1e3:8.3f} ms"
            f"  redistribute {self.redistribute_us / 1e3:8.3f} ms"
        )
        for alt in self.alternatives:
            if not alt.chosen:  # the chosen one is the line above
                s += f"\n{'':<22}instead: {alt}"
        if self.cp:
            s += (
                f"\n{'':<22}cp={self.cp['cp']} imbalance {self.cp['imbalance']:.3f}, K/V in "
                f"{self.cp['kv_recv_tokens']} tok/row-set (all-gather {self.cp['all_gather_tokens']}), "
                f"queries moved {self.cp['q_moved_tokens']}, exchange {self.cp['exchange_MB']:.1f} MB/rank"
            )
        return s


def _alternatives(optimizer, node, q_index: int, names, top: int) -> list[Alternative]:
    """The chosen strategy, then the ``top`` cheapest others (one per layout in words)."""
    best: dict[tuple[str, ...], Alternative] = {}
    for strategy, compute, comm, is_chosen in strategy_costs(optimizer, node):
        kinds = kind_of(strategy.input_specs[q_index].placements)
        alt = Alternative(dict(zip(names, kinds)), compute / 1e3, comm / 1e3, is_chosen)
        old = best.get(kinds)
        if old is None or alt.chosen or (not old.chosen and alt.total_ms < old.total_ms):
            best[kinds] = alt
    ranked = sorted(best.values(), key=lambda a: (not a.chosen, a.total_ms))
    return ranked[: top + 1]


def describe_attention(
    autop,
    placement,
    *,
    cu_seqlens: torch.Tensor | None = None,
    print_report: bool = True,
    alternatives: bool = False,
    top: int = 3,
):
    """Every ``doc_packed`` node's chosen placement, cost estimates and CP plan, in words.

    ``cu_seqlens`` (a real, global one) makes the CP figures those of that layout; by default
    they come from the node's planning hint (:func:`doc_packed.planning`). With
    ``alternatives=True`` each choice also lists the chosen strategy and the ``top`` cheapest
    other layouts AutoParallel offered that node, with its compute and communication estimates
    in ms (:class:`Alternative`). For the rest of the graph see
    ``autop.sharding_optimizer.get_json()`` (placements, costs and source line of every node)
    and ``autop.sharding_optimizer.get_log(verbose=True)``.
    """
    if alternatives and (not isinstance(top, int) or top < 0):
        raise ValueError(f"top must be an int >= 0 (alternatives listed besides the chosen one), got {top!r}")
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
        redistribute = sum(dv.comm_cost + dv.sharding_transition_cost for dv in dvs)
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
                        cu_seqlens, cp, causal=causal, window_size=(left, right), query_cost=Hq / Hkv, row_cost=None
                    )
                rows_per_plan = 1
            else:
                p = active_pricing()
                layout = p.layout if p is not None and p.layout is not None else None
                layout = layout or Layout(flops.planned_doc_len(_arg(node, "planning_doc_len"), S))
                plan, planned_rows = plan_for(layout, S, cp, causal, left, right, Hq / Hkv)
                rows_per_plan = rows / planned_rows
            nbytes = sum(exchange_bytes(plan, rows_per_plan, Hq, Hkv, D, q_meta.dtype.itemsize, role == "backward"))
            cp_info = dict(
                cp=cp,
                imbalance=plan.imbalance,
                kv_recv_tokens=round(max(plan.kv_recv_tokens) * rows_per_plan),
                all_gather_tokens=round((plan.batch * S - plan.batch * S // cp) * rows_per_plan),
                q_moved_tokens=round(max(plan.q_moved_tokens) * rows_per_plan),
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
                alternatives=_alternatives(autop.sharding_optimizer, node, q_index, names, top) if alternatives else [],
            )
        )
    if print_report:
        print("doc_packed attention placements (AutoParallel's estimates):")
        for c in choices:
            print(" ", c)
        print("  rest of the graph: autop.sharding_optimizer.get_json() / .get_log(verbose=True)")
    return choices


def attention_time_us(
    mesh,
    dim: int,
    kind: str,
    *,
    rows: int,
    seq_len: int,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    doc_len: int = 0,
    backward: bool = False,
) -> float:
    """One attention call's time (us) with ``kind`` on mesh dim ``dim`` (the other dims
    replicate), as the solver is told it (:func:`shardings.costs.call_us`): the backend's
    measured rate for rows of ``doc_len``-token lognormal documents, the host cost per call,
    and for ``"sequence"`` the plan's imbalance and the exchange on that dim's links. Priced
    under the active :func:`shardings.costs.pricing` (its rates, hosts and layout), else the
    default rates on 8-GPU hosts."""
    m = mesh.size(dim)
    shape = [rows, seq_len, q_heads, head_dim]
    kv = kv_heads
    if kind == "batch":
        shape[0] = -(-rows // m)
    elif kind == "heads":
        shape[2], kv = -(-q_heads // m), -(-kv_heads // m)
    elif kind == "sequence":
        shape[1] = -(-seq_len // m)
    elif kind != "replicate":
        raise ValueError(f"kind must be 'replicate', 'batch', 'heads' or 'sequence', got {kind!r}")
    p = active_pricing()
    if p is None or p.mesh is not mesh:
        p = Pricing(mesh, p.rates if p is not None else Rates.load())
    names = mesh.mesh_dim_names
    left, right = window_size
    right = 0 if causal else right
    cost = call_us(
        p, tuple(shape), kv, seq_len, causal, left, right, dtype, backward, doc_len, names[dim] if names else None
    )
    return cost.total


@dataclass(frozen=True)
class BreakEven:
    """Where a sequence-sharded attention call (forward + backward) starts to cost less than
    ``other`` by :func:`attention_time_us`: ``seq_len`` tokens per row (None: not below
    ``limit``), and both times there in ms."""

    other: str
    seq_len: int | None
    sequence_ms: float
    other_ms: float
    limit: int


def sequence_break_even(
    mesh, dim: int, other: str = "replicate", *, start: int = 0, limit: int = 1 << 24, **shape
) -> BreakEven:
    """The smallest row length (a multiple of the dim's size, from ``start`` up to ``limit``)
    at which the sequence placement on mesh dim ``dim`` beats ``other`` for one attention
    layer's forward + backward, by :func:`attention_time_us` (``shape``: its keyword arguments
    but ``seq_len`` and ``backward``). Doubles the length until sequence wins, then bisects."""
    step = mesh.size(dim)
    if other == "sequence":
        raise ValueError("other must be the layout to compare with: 'replicate', 'batch' or 'heads', not 'sequence'")
    if limit < step:
        raise ValueError(f"limit must be at least the mesh dim's size ({step}), got {limit}")

    def cost(S: int, kind: str) -> float:
        return sum(attention_time_us(mesh, dim, kind, seq_len=S, backward=b, **shape) for b in (False, True))

    def wins(S: int) -> bool:
        return cost(S, "sequence") < cost(S, other)

    lo, hi = 0, max(step, -(-start // step) * step)
    while not wins(hi):
        if hi >= limit:
            return BreakEven(other, None, cost(hi, "sequence") / 1e3, cost(hi, other) / 1e3, limit)
        lo, hi = hi, min(2 * hi, limit)
    while hi - lo > step:  # invariant: sequence wins at hi, not at lo (or lo is 0)
        mid = (lo + hi) // 2 // step * step
        if mid <= lo:
            break
        lo, hi = (lo, mid) if wins(mid) else (mid, hi)
    return BreakEven(other, hi, cost(hi, "sequence") / 1e3, cost(hi, other) / 1e3, limit)
