"""AutoParallel's flow in one call: trace, constrain, solve, lower, describe, apply, compile.

Usage::

    placed = place(model, input_fn, mesh, inputs=[(Shard(0), Shard(1)), (Shard(0), Replicate())],
                   outputs=[(Shard(0), Shard(1))], doc_len=2048, gpus_per_host=8)
    placed.parallel.to_empty(device="cuda")   # then initialise or load the weights
    logits = placed.module(tokens, cu_seqlens)  # compiled (compile_placed), context parallel where sequence-sharded

It is the staged flow of AutoParallel's ``AutoParallel`` class (and of torchtitan's AutoParallel
flow) with what doc-packed adds around it: the planning hints (:func:`doc_packed.planning`),
attention priced from measured rates (:func:`shardings.costs.pricing`), the real topology
(:func:`~shardings.autoparallel.cost_model_for`), the lowering of sequence-sharded attention to
context parallelism (:func:`~shardings.autoparallel.lower_context_parallel`), the report of
what was chosen (:func:`~shardings.autoparallel.describe_attention`) and the compiled module
(:func:`~shardings.compile.compile_placed`). A caller that needs a stage in between (re-solving
one trace under several constraints, as ``bench/ap_scenarios.py`` does) uses those pieces
directly. AutoParallel is imported when :func:`place` runs, never at import time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

import doc_packed

from .autoparallel import (
    AttentionChoice,
    cost_model_for,
    describe_attention,
    force_attention_layout,
    lower_context_parallel,
)
from .compile import BACKENDS, CompileChoice, compile_placed
from .costs import pricing
from .transforms import solver_edge_costs
from .step_model import Rates

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.tensor.placement_types import Placement

__all__ = ["PlacedModel", "place"]


@dataclass(frozen=True, eq=False)
class PlacedModel:
    """What :func:`place` returns.

    - ``module``: the module to run, compiled as ``compile_backend`` asked (``"eager"``: ``parallel`` itself).
    - ``parallel``: ``apply_placement``'s module; ``to_empty`` it, load the weights, and give its
      parameters to the optimizer (``module`` shares them).
    - ``compiled_with``: which compiler ran and why (:class:`~shardings.compile.CompileChoice`).
    - ``attention``: per ``doc_packed`` node, the layout chosen and AutoParallel's estimates
      (:func:`~shardings.autoparallel.describe_attention`; empty with ``describe=False``).
    - ``autop``: the ``AutoParallel`` object, exited: its ``gm``, ``mesh`` and ``sharding_optimizer``
      stay readable (``sharding_optimizer.get_json()``, ``get_log(verbose=True)``).
    - ``placement``: the solved placement (node -> strategy), lowered to context parallelism.

    ``module``, ``parallel`` and ``compiled_with`` are None when :func:`place` ran with ``apply=False``.
    """

    module: torch.nn.Module | None
    parallel: torch.nn.Module | None
    compiled_with: CompileChoice | None
    attention: tuple[AttentionChoice, ...]
    autop: Any
    placement: dict


def place(
    model: torch.nn.Module,
    input_fn: Callable[[], Any],
    mesh: DeviceMesh,
    *,
    inputs: Sequence[tuple[Placement, ...]] | None = None,
    outputs: Sequence[tuple[Placement, ...]] | None = None,
    attention: Mapping[str, str] | None = None,
    doc_len: int | None = None,
    cp_dim: str | None = None,
    gpus_per_host: int | None = 8,
    rates: Rates | str | None = None,
    cu_seqlens: torch.Tensor | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    describe: bool = True,
    print_report: bool = False,
    apply: bool = True,
    compile_backend: str = "auto",
    overlap_scheduling: bool | None = None,
    cuda_graphs: bool = False,
    progress: Callable[[str], AbstractContextManager[object]] | None = None,
) -> PlacedModel:
    """Place ``model`` on ``mesh`` with AutoParallel and return the module to run.

    Traces ``model`` (on the meta device, global shapes) with ``input_fn``'s inputs, constrains
    it, solves, lowers sequence-sharded attention to context parallelism, describes the attention
    placements, applies the placement and compiles the result, in that order (AutoParallel's
    ``add_input_constraints``, ``add_output_constraints``, ``optimize_placement``,
    ``apply_placement``, with doc-packed's steps between them).

    Args:
        inputs, outputs: AutoParallel's input and output constraints, one placement tuple per
            model input / output (None: the solver chooses).
        attention: pin every ``doc_packed`` node to one kind per mesh dim, e.g.
            ``{"dp": "batch", "cp": "sequence"}`` (:func:`~shardings.autoparallel.force_attention_layout`).
        doc_len, cp_dim: the planning hints (:func:`doc_packed.planning`): the mean document
            length the cost estimates assume (None: one document per row) and the mesh dim that
            may shard the sequence.
        gpus_per_host: the hosts' size, told to AutoParallel's collective cost model
            (:func:`~shardings.autoparallel.cost_model_for`) and to the attention pricing
            (:func:`~shardings.costs.pricing`). None: neither; AutoParallel detects the topology
            itself (on CUDA meshes of 8k GPUs only; elsewhere torch's 87.7 GB/s link model) and
            attention gets the default pricing.
        rates: the measured rates attention is priced at (a :class:`~shardings.step_model.Rates`
            or a rates file; default ``shardings/h200_rates.json``).
        cu_seqlens: a real, global ``[B, MAX_DOCS + 1]`` layout: attention is priced on its
            documents and the report's context-parallel figures are its plan's (read on the host,
            before AutoParallel's fake mode).
        mp_policy: AutoParallel's mixed-precision policy (``MixedPrecisionPolicy``; None: off).
        describe, print_report: build the attention report (:attr:`PlacedModel.attention`), and
            print it.
        apply: False stops after the report (to compare solutions): nothing is applied or compiled.
        compile_backend: :func:`~shardings.compile.compile_placed`'s ``backend`` (``"auto"``,
            ``"autoparallel"``, ``"inductor"``, ``"eager"``). Compilation is lazy: the first
            call of ``module`` compiles, after the weights are in place.
        overlap_scheduling: :func:`~shardings.compile.compile_placed`'s (None: its default).
        cuda_graphs: :func:`~shardings.compile.compile_placed`'s (Inductor path, GPU meshes).
        progress: called with ``"trace"``, ``"solve"`` and ``"apply"``; each returned context
            manager wraps that stage (e.g. to print its time).

    Raises:
        ValueError: ``rates`` without ``gpus_per_host``, a bad ``gpus_per_host``, ``attention``
            naming a dim or kind the mesh does not have, or a bad ``compile_backend``.
        RuntimeError: AutoParallel finds no feasible placement under the constraints.
    """
    if compile_backend not in BACKENDS:  # before the trace and the solve, not after
        raise ValueError(f"compile_backend must be one of {BACKENDS}, got {compile_backend!r}")
    if gpus_per_host is None and rates is not None:
        raise ValueError("rates are used by the attention pricing, which needs gpus_per_host (got None)")
    from autoparallel.api import AutoParallel

    def stage(name: str) -> AbstractContextManager[object]:
        return progress(name) if progress is not None else contextlib.nullcontext()

    with contextlib.ExitStack() as stack:
        stack.enter_context(doc_packed.planning(doc_len=doc_len, cp_dim=cp_dim))
        cost_model: Any = "nccl"  # AutoParallel's default: it detects the topology itself
        if gpus_per_host is not None:
            stack.enter_context(pricing(mesh, rates=rates, gpus_per_host=gpus_per_host, cu_seqlens=cu_seqlens))
            cost_model = cost_model_for(mesh, gpus_per_host)
        else:  # (pricing() enters it too)
            stack.enter_context(solver_edge_costs())
        with stage("trace"):
            autop = stack.enter_context(AutoParallel(model, input_fn, mesh, mp_policy=mp_policy, cost_model=cost_model))
        if inputs is not None:
            autop.add_input_constraints(list(inputs))
        if outputs is not None:
            autop.add_output_constraints(list(outputs))
        if attention is not None:
            force_attention_layout(autop, dict(attention))
        with stage("solve"):
            placement = autop.optimize_placement()
        placement = lower_context_parallel(autop, placement)
        choices: tuple[AttentionChoice, ...] = ()
        if describe:
            choices = tuple(describe_attention(autop, placement, cu_seqlens=cu_seqlens, print_report=print_report))
        parallel = None
        if apply:
            with stage("apply"):
                parallel = autop.apply_placement(placement)
    if parallel is None:
        return PlacedModel(None, None, None, choices, autop, placement)
    module, how = compile_placed(
        parallel, compile_backend, overlap_scheduling=overlap_scheduling, cuda_graphs=cuda_graphs
    )
    return PlacedModel(module, parallel, how, choices, autop, placement)
