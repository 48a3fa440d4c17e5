"""Every AutoParallel internal :mod:`shardings` uses, behind one door.

AutoParallel (installed from its git repository) has no stable API for its cost model or its
solution's per-node decisions; these are read here only, resolved on first use, and a missing
one raises :class:`doc_packed._compat.PrivateAPIError` naming it and the commit it was checked
on (docs/private_apis.md). Nothing is imported from AutoParallel when this module loads.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

import torch

from doc_packed._compat import PrivateAPIError

__all__ = [
    "CHECKED_AUTOPARALLEL",
    "chosen_decisions",
    "collective_cost_us",
    "device_tflops",
    "installed",
    "strategy_costs",
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
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise PrivateAPIError(
            f"shardings uses AutoParallel's {module}.{name}, checked on AutoParallel "
            f"{CHECKED_AUTOPARALLEL}; the installed AutoParallel does not have it ({err})"
        ) from err


def collective_cost_us(kind: str, nbytes: int, mesh_shape: Sequence[int], mesh_dim: int, topology: Any) -> float:
    """AutoParallel's estimate (us) of one collective of ``nbytes`` on ``mesh_dim``."""
    fn = _name("autoparallel.cost_models.collective_runtime_estimation", "collective_comm_cost")
    return fn(kind, nbytes, tuple(mesh_shape), mesh_dim, topology)


def device_tflops(dtype: torch.dtype) -> float:
    """The peak TFLOP/s AutoParallel's compute model assumes for ``dtype`` on this device."""
    return _name("autoparallel.cost_models.compute_estimation", "_get_device_tflops")(dtype)


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
