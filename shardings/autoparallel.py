"""AutoParallel glue: lower the solver's sequence-sharded attention to context parallelism,
and report what the solver chose for every ``doc_packed`` node.

Usage::

    with pricing(mesh, gpus_per_host=8), AutoParallel(model, input_fn, mesh, cost_model=cost_model_for(mesh, 8)) as autop:
        autop.add_input_constraints(...)
        placement = autop.optimize_placement()
        placement = lower_context_parallel(autop, placement)
        describe_attention(autop, placement)   # chosen + 2 alternatives, costs in ms, and why
        parallel = autop.apply_placement(placement)

The whole flow in one call, these steps included: :func:`shardings.flow.place`.

AutoParallel (https://github.com/meta-pytorch/autoparallel) is installed from its git
repository; this module imports nothing from it at import time.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch.distributed.tensor.placement_types import Shard

from doc_packed import flops
from doc_packed.ops import arg_index, node_arg

from ._ap_compat import chosen_decisions, strategy_costs, topology_config
from ._compat import trace_artifact, unset_fake_temporarily
from .costs import Pricing, active_pricing, call_us
from .step_model import AttentionCost, Layout, Rates, exchange_bytes, plan_for
from .strategies import kind_of

__all__ = [
    "lower_context_parallel",
    "describe_attention",
    "force_attention_layout",
    "AttentionChoice",
    "Alternative",
    "attention_report_json",
    "attention_report_lines",
    "attention_cost",
    "attention_time_us",
    "layout_alternatives",
    "sequence_break_even",
    "BreakEven",
    "cost_model_for",
]

_ROLES = {torch.ops.doc_packed.attn_fwd.default: "forward", torch.ops.doc_packed.attn_bwd.default: "backward"}


def _arg(node, name: str):
    """Argument ``name`` of a traced ``doc_packed`` node (positional or keyword)."""
    return node_arg(node, name, 0 if name == "planning_doc_len" else None)


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


_COMPONENTS = ("kernel", "exchange", "redistribution")


@dataclass(frozen=True)
class Alternative:
    """One strategy AutoParallel offered an attention node, with its estimates in ms:
    ``compute_ms`` the local op (the CP exchange and imbalance included when sequence-sharded),
    of which ``exchange_ms`` is the context-parallel exchange (split by our step model's share,
    0 for other layouts), and ``comm_ms`` redistributing the node's inputs from where the
    solution put their producers (what it would cost its consumers is not included)."""

    layout: dict[str, str]
    compute_ms: float
    comm_ms: float
    chosen: bool
    exchange_ms: float = 0.0

    @property
    def kernel_ms(self) -> float:
        return self.compute_ms - self.exchange_ms

    @property
    def total_ms(self) -> float:
        return self.compute_ms + self.comm_ms

    def parts(self) -> dict[str, float]:
        """``kernel``, ``exchange`` and ``redistribution`` in ms (they sum to :attr:`total_ms`)."""
        return {"kernel": self.kernel_ms, "exchange": self.exchange_ms, "redistribution": self.comm_ms}

    def to_dict(self) -> dict:
        return {**asdict(self), **{f"{k}_ms": v for k, v in self.parts().items()}, "total_ms": self.total_ms}

    def __str__(self) -> str:
        return (
            f"{_words(self.layout):<30} kernel {self.kernel_ms:7.3f} + exchange {self.exchange_ms:7.3f} "
            f"+ redistribution {self.comm_ms:7.3f} = {self.total_ms:7.3f} ms"
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
    # the chosen strategy first, then the cheapest others (describe_attention's ``top``)
    alternatives: list[Alternative] = field(default_factory=list)

    def why(self) -> str:
        """Why the chosen layout won, from the figures of this node alone."""
        if not self.alternatives or not self.alternatives[0].chosen:
            return ""
        chosen, others = self.alternatives[0], self.alternatives[1:]
        if not others:
            return "the only layout offered"
        best = min(others, key=lambda a: a.total_ms)
        delta = best.total_ms - chosen.total_ms
        if delta >= 0:
            diffs = {k: best.parts()[k] - chosen.parts()[k] for k in _COMPONENTS}
            what = max(diffs, key=lambda k: diffs[k])
            return (
                f"cheapest here: the next best, {_words(best.layout)}, costs {delta:.3f} ms more, mostly "
                f"{what} ({diffs[what]:+.3f} ms)"
            )
        return (
            f"{_words(best.layout)} is {-delta:.3f} ms cheaper at this node alone; the solver minimises the "
            "whole graph (its neighbours' redistributions are not in these figures) and keeps any constraint "
            "(force_attention_layout)"
        )

    def to_dict(self) -> dict:
        """JSON-ready: every field, ``why``, and each alternative's kernel/exchange/redistribution."""
        d = asdict(self)
        d["alternatives"] = [a.to_dict() for a in self.alternatives]
        d["why"] = self.why()
        return d

    def __str__(self) -> str:
        head = f"{self.node} ({self.role}): {_words(self.layout)}"
        if self.source:
            head += f"   [{self.source}]"
        lines = [head]
        if self.alternatives:
            for alt in self.alternatives:
                lines.append(f"    {'chosen ' if alt.chosen else 'instead'} {alt}")
            lines.append(f"    why: {self.why()}")
        else:
            lines.append(
                f"    compute {self.compute_us / 1e3:.3f} ms, redistribution {self.redistribute_us / 1e3:.3f} ms"
            )
        if self.cp:
            lines.append(
                f"    plan: cp={self.cp['cp']} imbalance {self.cp['imbalance']:.3f}, K/V in "
                f"{self.cp['kv_recv_tokens']} tok/row-set (all-gather {self.cp['all_gather_tokens']}), "
                f"queries moved {self.cp['q_moved_tokens']}, exchange {self.cp['exchange_MB']:.1f} MB/rank"
            )
        return "\n".join(lines)


def attention_report_json(choices: list[AttentionChoice]) -> str:
    """:func:`describe_attention`'s report as JSON: one object per attention node."""
    return json.dumps([c.to_dict() for c in choices], indent=1)


def _exchange_share(strategy, q_index: int, node, mesh) -> float:
    """The share of the node's local cost that is the context-parallel exchange, by the active
    pricing's step model (0 when not sequence-sharded or nothing prices it)."""
    p = active_pricing()
    spec = strategy.input_specs[q_index]
    if p is None or Shard(1) not in spec.placements:
        return 0.0
    shape = list(spec.tensor_meta.shape)
    kv = strategy.input_specs[q_index + 1].tensor_meta.shape[2]
    for n, pl in zip(mesh.shape, spec.placements):
        if pl.is_shard():
            shape[pl.dim] = -(-shape[pl.dim] // n)
            kv = -(-kv // n) if pl.dim == 2 else kv
    causal, left, right = (_arg(node, n) for n in ("causal", "window_left", "window_right"))
    seq_len = spec.tensor_meta.shape[1]
    cost = call_us(
        p, tuple(shape), kv, seq_len, causal, left, right, spec.tensor_meta.dtype, _ROLES[node.target] == "backward",
        _arg(node, "planning_doc_len") or 0, None,
    )  # fmt: skip
    return cost.exchange / cost.total if cost.total > 0 else 0.0


def _alternatives(optimizer, node, q_index: int, names, top: int, mesh) -> list[Alternative]:
    """The chosen strategy, then the ``top`` cheapest others (one per layout in words)."""
    best: dict[tuple[str, ...], Alternative] = {}
    for strategy, compute, comm, is_chosen in strategy_costs(optimizer, node):
        kinds = kind_of(strategy.input_specs[q_index].placements)
        share = _exchange_share(strategy, q_index, node, mesh)
        alt = Alternative(dict(zip(names, kinds)), compute / 1e3, comm / 1e3, is_chosen, compute / 1e3 * share)
        old = best.get(kinds)
        if old is None or alt.chosen or (not old.chosen and alt.total_ms < old.total_ms):
            best[kinds] = alt
    ranked = sorted(best.values(), key=lambda a: (not a.chosen, a.total_ms))
    return ranked[: top + 1]


def _source_line(node) -> str:
    """The model's source line that made ``node`` (from its stack trace; "" when none)."""
    stack = (node.meta.get("stack_trace", "") or "").strip()
    return stack.splitlines()[-2].strip() if stack else ""


def _cp_report(node, spec, q_index: int, mesh, cu_seqlens: torch.Tensor | None) -> dict:
    """The context-parallel plan of a sequence-sharded node, in figures: its balance and
    traffic per rank (``{}`` when the node's sequence is not sharded)."""
    dim = _sequence_dim(spec, q_index)
    if dim is None:
        return {}
    cp = mesh.size(dim)
    q_meta = spec.input_specs[q_index].tensor_meta
    B, S, Hq, D = q_meta.shape
    Hkv = spec.input_specs[q_index + 1].tensor_meta.shape[2]
    rows = B
    for d, p in enumerate(spec.input_specs[q_index].placements):
        if p == Shard(0):
            rows //= mesh.size(d)
        if p == Shard(2):
            Hq, Hkv = Hq // mesh.size(d), Hkv // mesh.size(d)
    plan, rows_per_plan = _report_plan(node, cu_seqlens, S, cp, Hq / Hkv, rows)
    backward = _ROLES[node.target] == "backward"
    nbytes = sum(exchange_bytes(plan, rows_per_plan, Hq, Hkv, D, q_meta.dtype.itemsize, backward))
    return dict(
        cp=cp,
        imbalance=plan.imbalance,
        kv_recv_tokens=round(max(plan.kv_recv_tokens) * rows_per_plan),
        all_gather_tokens=round((plan.batch * S - plan.batch * S // cp) * rows_per_plan),
        q_moved_tokens=round(max(plan.q_moved_tokens) * rows_per_plan),
        exchange_MB=nbytes / 2**20,
        planned_from="cu_seqlens" if cu_seqlens is not None else "planning assumption",
    )


def _report_plan(node, cu_seqlens: torch.Tensor | None, S: int, cp: int, query_cost: float, rows: int):
    """``(plan, rows per plan row)`` the report describes: the plan the runtime will run for
    ``cu_seqlens`` (row-priced: its pairs need not be even), else one for the node's planning
    assumption (the active pricing's layout, or rows of its planned document length)."""
    causal, left, right = (_arg(node, n) for n in ("causal", "window_left", "window_right"))
    if cu_seqlens is not None:
        import doc_packed

        with unset_fake_temporarily():  # AutoParallel's context runs under fake mode
            plan = doc_packed.plan_context_parallel(
                cu_seqlens, cp, causal=causal, window_size=(left, right), query_cost=query_cost
            )
        return plan, 1
    p = active_pricing()
    layout = p.layout if p is not None and p.layout is not None else None
    layout = layout or Layout(flops.planned_doc_len(_arg(node, "planning_doc_len"), S))
    plan, planned_rows = plan_for(layout, S, cp, causal, left, right, query_cost)
    return plan, rows / planned_rows


def describe_attention(
    autop,
    placement,
    *,
    cu_seqlens: torch.Tensor | None = None,
    print_report: bool = True,
    alternatives: bool = True,
    top: int = 2,
    json_path: str | None = None,
):
    """Every ``doc_packed`` node's chosen placement, cost estimates and CP plan, in words.

    ``cu_seqlens`` (a real, global one) makes the CP figures those of that layout; by default
    they come from the node's planning hint (:func:`doc_packed.planning`). Each choice lists
    the chosen strategy and the ``top`` (2) cheapest other layouts AutoParallel offered that
    node, with its estimates in ms split into kernel, CP exchange and redistribution
    (:class:`Alternative`), and says why the chosen one won (:meth:`AttentionChoice.why`);
    ``alternatives=False`` skips them. The report is also JSON: written to ``json_path`` when
    given, and always emitted into ``TORCH_TRACE`` as the artifact ``doc_packed_attention``,
    beside AutoParallel's own (:func:`attention_report_json`). For the rest of the graph see
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
        dvs = chosen.get(normalize(node), [])
        choices.append(
            AttentionChoice(
                node=node.name,
                role=role,
                layout=dict(zip(names, kind_of(spec.input_specs[q_index].placements))),
                compute_us=sum(dv.compute_cost for dv in dvs),
                redistribute_us=sum(dv.comm_cost + dv.sharding_transition_cost for dv in dvs),
                source=_source_line(node),
                cp=_cp_report(node, spec, q_index, mesh, cu_seqlens),
                alternatives=_alternatives(autop.sharding_optimizer, node, q_index, names, top, mesh)
                if alternatives
                else [],
            )
        )
    trace_artifact("doc_packed_attention", lambda: attention_report_json(choices))
    if json_path is not None:
        with open(json_path, "w") as f:
            f.write(attention_report_json(choices))
    if print_report:
        print("\n".join(attention_report_lines(choices)))
    return choices


def attention_report_lines(choices: list[AttentionChoice]) -> list[str]:
    """The printed report: per attention node its layout, the alternatives and why."""
    lines = ["doc_packed attention placements (AutoParallel's estimates, ms per call):"]
    for c in choices:
        lines += ["  " + line for line in str(c).splitlines()]
    lines.append("  rest of the graph: autop.sharding_optimizer.get_json() / .get_log(verbose=True)")
    return lines


def attention_cost(
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
) -> AttentionCost:
    """One attention call's cost with ``kind`` on mesh dim ``dim`` (the other dims replicate),
    split into compute and exchange (:func:`attention_time_us` is its total, with its terms)."""
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
    return call_us(
        p, tuple(shape), kv, seq_len, causal, left, right, dtype, backward, doc_len, names[dim] if names else None
    )


def attention_time_us(mesh, dim: int, kind: str, **shape: Any) -> float:
    """One attention call's time (us) with ``kind`` on mesh dim ``dim`` (the other dims
    replicate), as the solver is told it (:func:`shardings.costs.call_us`): the backend's
    measured rate for rows of ``doc_len``-token lognormal documents, the host cost per call,
    and for ``"sequence"`` the plan's imbalance and the exchange on that dim's links. Priced
    under the active :func:`shardings.costs.pricing` (its rates, hosts and layout), else the
    default rates on 8-GPU hosts. ``shape``: :func:`attention_cost`'s keywords (``rows``,
    ``seq_len``, ``q_heads``, ``kv_heads``, ``head_dim``, ``dtype``, and ``causal``,
    ``window_size``, ``doc_len``, ``backward``)."""
    return attention_cost(mesh, dim, kind, **shape).total


def layout_alternatives(
    mesh,
    dim: int,
    chosen: str,
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
) -> list[Alternative]:
    """Without a solver: the step model's estimate of one attention call for each layout mesh dim
    ``dim`` can take at these sizes (:func:`~shardings.strategies.offered_kinds`, the sequence
    also on uneven chunks; the other dims replicate), ``chosen`` first, then the others cheapest
    first. Each is an :class:`Alternative` priced as :func:`attention_time_us` prices it (same
    keywords), its kernel and context-parallel exchange apart; ``comm_ms`` (redistribution) is
    0: only a solver prices the edges around the call."""
    from .strategies import offered_kinds

    m = mesh.size(dim)
    kinds = [k for (k,) in offered_kinds((m,), rows, seq_len, q_heads, kv_heads, uneven_sequence_dims=(0,))]
    if chosen not in kinds:
        raise ValueError(f"chosen={chosen!r} is not a layout offered on a mesh dim of {m} at these sizes: {kinds}")
    names = mesh.mesh_dim_names or tuple(f"dim{d}" for d in range(mesh.ndim))
    alts = []
    for kind in kinds:
        cost = attention_cost(
            mesh, dim, kind, rows=rows, seq_len=seq_len, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
            dtype=dtype, causal=causal, window_size=window_size, doc_len=doc_len, backward=backward,
        )  # fmt: skip
        alts.append(Alternative({names[dim]: kind}, cost.total / 1e3, 0.0, kind == chosen, cost.exchange / 1e3))
    return sorted(alts, key=lambda a: (not a.chosen, a.total_ms))


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
