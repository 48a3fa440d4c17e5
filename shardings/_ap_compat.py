"""Every AutoParallel internal :mod:`shardings` uses, behind one door.

AutoParallel (installed from its git repository) has no stable API for its cost model or its
solution's per-node decisions; these are read here only, resolved on first use, and a missing
one raises :class:`doc_packed._compat.PrivateAPIError` naming it and the commit it was checked
on (docs/private_apis.md). Nothing is imported from AutoParallel when this module loads.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from doc_packed._compat import PrivateAPIError, private

__all__ = [
    "CHECKED_AUTOPARALLEL",
    "chosen_decisions",
    "edge_costs",
    "installed",
    "move_cost",
    "reset_compute_cost_cache",
    "solution_cost",
    "solver_flops_per_us",
    "strategy_costs",
    "topology_config",
]

CHECKED_AUTOPARALLEL = "a54c252 (2026-06-29)"


def installed() -> bool:
    """Whether AutoParallel's cost model can be imported here."""
    try:
        importlib.import_module("autoparallel.cost_models.collective_runtime_estimation")
    except ImportError:
        return False
    return True


def _name(module: str, name: str) -> Any:
    return private(
        module,
        name,
        lambda err: (
            f"shardings uses AutoParallel's {module}.{name}, checked on AutoParallel "
            f"{CHECKED_AUTOPARALLEL}; the installed AutoParallel does not have it ({err})"
        ),
    )


_COMPUTE = "autoparallel.cost_models.compute_estimation"
_REFERENCE_MM = 8192  # a square bf16 matmul this size is compute-bound in AutoParallel's model


def reset_compute_cost_cache() -> None:
    """Empty AutoParallel's per-(op, shapes) compute-cost cache (no-op without AutoParallel)."""
    if installed():
        _name(_COMPUTE, "reset_compute_cost_cache")()


@functools.lru_cache(maxsize=16)
def _solver_rate(dtype: torch.dtype, device_name: str) -> float:
    fn = _name(_COMPUTE, "estimate_strategy_runtime_cost")
    n = _REFERENCE_MM
    graph = torch.fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    for p in (a, b):
        p.meta["val"] = torch.empty(n, n, dtype=dtype, device="meta")
    mm = graph.call_function(torch.ops.aten.mm.default, (a, b))
    us = fn(mm, None)
    if not us or us <= 0:
        raise PrivateAPIError(
            f"AutoParallel's estimate_strategy_runtime_cost priced a {n}^3 matmul at {us!r} us; "
            f"checked on AutoParallel {CHECKED_AUTOPARALLEL}"
        )
    return 2 * n**3 / us


def solver_flops_per_us(dtype: torch.dtype) -> float:
    """How many counted FLOPs AutoParallel's compute model turns into one microsecond for
    ``dtype`` on this device: measured on a reference matmul through its public
    ``estimate_strategy_runtime_cost`` (cached per dtype and device name)."""
    return _solver_rate(dtype, str(torch.get_device_module().get_device_name(None)))


def topology_config(num_hosts: int, gpus_per_host: int, **kwargs: Any) -> Any:
    """AutoParallel's ``NCCLTopoConfig`` for Hopper-class hosts (NVSwitch) of ``gpus_per_host``
    GPUs, ``num_hosts`` of them: pass it as ``AutoParallel(..., cost_model=...)``. Its own
    detection returns None on CPU or when the mesh is not a multiple of 8 GPUs and falls back to
    an 87.7 GB/s link model."""
    fn = _name("autoparallel.cost_models", "h100_topo_config")
    return fn(num_nodes=num_hosts, gpus_per_node=gpus_per_host, **kwargs)


_EDGES = "autoparallel.optimize_sharding"
_COMMS = "autoparallel.cost_models.collective_runtime_estimation"


@contextlib.contextmanager
def edge_costs(cost: Callable[[Callable[[Any, Any], float], Any, Any], float]) -> Iterator[None]:
    """While on, AutoParallel's solver prices the move on each edge (producer's output spec ->
    consumer's input spec) as ``cost(theirs, src, tgt)``, ``theirs`` being its own estimate (the
    solver calls ``optimize_sharding.estimate_strategy_comms_cost`` per edge while it builds its
    decision variables, in ``AutoParallel.__enter__``). No-op without AutoParallel."""
    if not installed():
        yield
        return
    module = importlib.import_module(_EDGES)
    theirs = _name(_EDGES, "estimate_strategy_comms_cost")
    setattr(module, "estimate_strategy_comms_cost", lambda src, tgt: cost(theirs, src, tgt))
    try:
        yield
    finally:
        setattr(module, "estimate_strategy_comms_cost", theirs)


def move_cost(src: Any, tgt: Any) -> float:
    """AutoParallel's own price (us) of moving ``src`` to ``tgt``, mesh dim by mesh dim in order,
    with the collective cost model it was given (``collective_runtime_estimation.redistribute_cost``)."""
    return _name(_COMMS, "redistribute_cost")(src, tgt, list(range(src.mesh.ndim)))


def solution_cost(optimizer: Any, placement: Any) -> dict[str, float]:
    """The solver's objective for ``placement`` split into compute, comm and transition (us)."""
    _check_optimizer(optimizer, ("_compute_solution_cost", "_to_concrete_solution"))
    return optimizer._compute_solution_cost(optimizer._to_concrete_solution(placement))


def _check_optimizer(optimizer: Any, attrs: Sequence[str]) -> None:
    for attr in attrs:
        if not hasattr(optimizer, attr):
            raise PrivateAPIError(
                f"shardings reads ShardingOptimizer.{attr}, checked on AutoParallel "
                f"{CHECKED_AUTOPARALLEL}; the installed AutoParallel does not have it"
            )


def chosen_decisions(optimizer: Any) -> tuple[dict, Any]:
    """The solved optimizer's decision variables per graph node, and its node normaliser
    (``node -> the key under which its decisions are stored``)."""
    _check_optimizer(optimizer, ("selected_keys", "nodes", "_resolve_decision_var", "_normalize_node"))
    chosen: dict = {}
    for key in optimizer.selected_keys:
        chosen.setdefault(optimizer.nodes[key[0]], []).append(optimizer._resolve_decision_var(key))
    return chosen, optimizer._normalize_node


def strategy_costs(optimizer: Any, node: Any) -> list[tuple[Any, float, float, bool]]:
    """Every strategy the solved optimizer offered ``node``, in its order, as (strategy,
    compute us, communication us, chosen): the communication is what redistributing the
    node's inputs from where the solution put their producers would cost (a decision key is
    ``(node index, argument, strategy index, producer's strategy index)``)."""
    _check_optimizer(optimizer, ("selected_keys", "node_map", "strats", "_resolve_decision_var", "_normalize_node"))
    node = optimizer._normalize_node(node)
    index = optimizer.node_map[node]
    keys = [key for key in optimizer.selected_keys if key[0] == index]
    producers = {argi: inp for _, argi, _, inp in keys}
    chosen = {out for _, _, out, _ in keys}
    rows = []
    for out, strategy in enumerate(optimizer.strats[node].strategies):
        dvs = [optimizer._resolve_decision_var((index, argi, out, inp)) for argi, inp in producers.items()]
        compute = sum(dv.compute_cost for dv in dvs)
        comm = sum(dv.comm_cost + dv.sharding_transition_cost for dv in dvs)
        rows.append((strategy, float(compute), float(comm), out in chosen))
    return rows
