"""Compile a module placed by AutoParallel: the default way to run it.

``autop.apply_placement(...)`` returns a module whose graphs run through an FX interpreter that
copies node provenance on every node of every step (AutoParallel's debugging-friendly eager
runner): measured 3.4-4x slower per GPU than the same model written by hand. Compiled, the gap
closes. :func:`compile_placed` picks the compiler and says which and why:

- ``"autoparallel"``: ``torch.compile(module, backend=autoparallel.autoparallel_backend(...))``,
  AutoParallel's Inductor passes (save/recompute replay, optional activation checkpointing,
  communication/compute overlap scheduling). Used when AutoParallel's backend can run on the
  installed torch: its partitioner imports names from ``torch._functorch.partitioners`` that
  torch 2.11 lacks (``is_opaque_node``, ``_is_assert_only_symbool``), which :func:`compile_placed`
  checks by reading those imports from AutoParallel's own source, not from a version table.
  Overlap scheduling needs a GPU (Triton); on CPU meshes it is turned off.
- In both, the overlap pass times ``doc_packed``'s calls with :mod:`shardings.overlap` instead of
  running them on random inputs (for AutoParallel's backend, which takes no Inductor options, the
  hook is set around its compile, and the backward graph is compiled with the forward).
- ``"inductor"``: plain ``torch.compile(module)``, the fallback (torch 2.11). With
  ``overlap_scheduling=True`` (not the default until measured), torch's own communication/compute
  overlap pass for ATen graphs (``torch._inductor.config.aten_distributed_optimizations``, the
  settings AutoParallel's backend patches in) where the installed torch has it, on GPU meshes.
- ``"eager"``: the module as AutoParallel returns it, for debugging.

``doc_packed``'s ops stay opaque custom ops in the compiled graphs (no graph breaks:
``fullgraph=True``); context parallelism and its per-layout plan run inside them, planned once per
``cu_seqlens`` and shared by every layer.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
from dataclasses import dataclass
from typing import Any

import torch

from . import _compat, overlap

__all__ = ["BACKENDS", "INDUCTOR_OVERLAP", "CompileChoice", "autoparallel_backend_blocker", "compile_placed"]

BACKENDS = ("auto", "autoparallel", "inductor", "eager")


@dataclass(frozen=True)
class CompileChoice:
    """Which compiler :func:`compile_placed` used, and why."""

    backend: str  # "autoparallel" / "inductor" / "eager"
    reason: str
    options: tuple[tuple[str, object], ...] = ()

    def __str__(self) -> str:
        opts = ", ".join(f"{k}={getattr(v, '__qualname__', v)}" for k, v in self.options)
        return f"{self.backend}{f' ({opts})' if opts else ''}: {self.reason}"


def _missing_torch_names(module: str) -> list[str]:
    """``module.name`` for every ``from torch... import name`` in ``module``'s source (also inside
    functions, where AutoParallel defers them) that the installed torch lacks."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return [module]
    with open(spec.origin) as f:
        tree = ast.parse(f.read())
    missing = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
            try:
                mod = importlib.import_module(node.module)
            except ImportError:
                missing.append(node.module)
                continue
            missing.extend(f"{node.module}.{a.name}" for a in node.names if not hasattr(mod, a.name))
    return missing


@functools.cache
def autoparallel_backend_blocker() -> str | None:
    """Why AutoParallel's compile backend cannot run here, or None when it can."""
    try:
        import autoparallel.compile  # noqa: F401
    except ImportError as err:
        return f"AutoParallel's compile backend does not import ({err})"
    missing = _missing_torch_names("autoparallel.compile")
    if missing:
        return (
            f"AutoParallel's compile backend needs {', '.join(missing)}, which torch "
            f"{torch.__version__} lacks (they arrived in later torch releases)"
        )
    return None


def _on_cpu(module: torch.nn.Module) -> bool:
    """Whether the module's mesh (or, for plain parameters, their device) is a CPU one."""
    for p in module.parameters():
        mesh = getattr(p, "device_mesh", None)
        return (mesh.device_type if mesh is not None else p.device.type) == "cpu"
    return True


_ESTIMATE = "aten_distributed_optimizations.custom_runtime_estimation"  # the overlap pass's timing hook
_EAGER_BACKWARD = "force_non_lazy_backward_lowering"  # AOTAutograd compiles the backward with the forward

# torch's communication/compute overlap pass for ATen graphs, as AutoParallel's backend turns it on
# (autoparallel/compile.py's _INDUCTOR_OVERLAP_PATCHES): the scheduler moves each collective early
# and its wait late around independent compute, and buckets collectives it can merge. doc_packed's
# calls are timed by the step model (shardings.overlap): the pass's own way, running each compute
# node on random inputs, would run a context-parallel call's agreement and exchange inside the
# compile, on random cu_seqlens (measured on one H200, torch 2.11: the compile fails there)
INDUCTOR_OVERLAP: dict[str, Any] = {
    "aten_distributed_optimizations.enable_overlap_scheduling": True,
    "aten_distributed_optimizations.collective_bucketing": True,
    "aten_distributed_optimizations.insert_overlap_deps": True,
    _ESTIMATE: overlap.runtime_estimate_ms,
}


# CUDA graphs with graph partitions: Inductor records every stretch of kernels between ops
# tagged cudagraph_unsafe (doc_packed's calls) and replays it
_CUDA_GRAPHS: dict[str, Any] = {"triton.cudagraphs": True, "graph_partition": True}


def _estimated(compile_fn):
    """AutoParallel's backend with the overlap pass's hook set (it takes no Inductor options) for
    the forward and the backward graph: the backward is compiled with the forward, inside the
    same settings, not lazily at the first ``backward()`` where they would be gone."""

    def compile_with_estimates(gm, example_inputs):
        with _compat.compile_settings({_ESTIMATE: overlap.runtime_estimate_ms}, {_EAGER_BACKWARD: True}):
            return compile_fn(gm, example_inputs)

    return compile_with_estimates


def _inductor_overlap(module: torch.nn.Module) -> tuple[dict[str, Any], str]:
    """Inductor's config patches for overlap scheduling on ``module``, or why there are none."""
    if _on_cpu(module):
        return {}, "a CPU mesh: the pass needs Triton"
    known = _compat.inductor_settings()
    missing = [k for k in INDUCTOR_OVERLAP if k not in known]
    if missing:
        return {}, f"torch {torch.__version__} has no {', '.join(missing)}"
    return dict(INDUCTOR_OVERLAP), ""


def _compiled(module: object) -> torch.nn.Module:
    """``torch.compile`` of a module is a module (an ``OptimizedModule``); its stubs say callable."""
    assert isinstance(module, torch.nn.Module)
    return module


def compile_placed(
    module: torch.nn.Module,
    backend: str = "auto",
    *,
    activation_checkpointing: bool = False,
    overlap_scheduling: bool | None = None,
    fullgraph: bool = True,
    cuda_graphs: bool = False,
) -> tuple[torch.nn.Module, CompileChoice]:
    """Compile a module returned by ``autop.apply_placement``; return it and the choice made.

    Args:
        module: the placed module (after ``to_empty``/weight loading, or before: parameters are
            read at call time).
        backend: ``"auto"`` (AutoParallel's backend where it runs, else plain Inductor),
            ``"autoparallel"``, ``"inductor"`` or ``"eager"`` (no compilation, for debugging).
            A forced ``"autoparallel"`` that cannot run raises RuntimeError saying why.
        activation_checkpointing: AutoParallel backend only: recompute activations to save
            memory. Off by default, so the placed model does the work a hand-written one does.
        overlap_scheduling: Inductor's communication/compute overlap scheduling. AutoParallel
            backend: default on for GPU parameters, off on CPU (it needs Triton); where it is on
            and this torch has the hook, the backward graph is compiled with the forward. Inductor
            fallback: default off; True turns on torch's pass on GPU meshes where this torch has
            it (:data:`INDUCTOR_OVERLAP`), and the choice says which settings were applied.
        fullgraph: passed to ``torch.compile``: a graph break raises instead of splitting.
        cuda_graphs: Inductor path only: record the compiled graphs' kernels and collectives as
            CUDA graphs and replay them (``triton.cudagraphs`` with graph partitions), so a step
            costs the host one replay per partition instead of a launch per kernel.
            ``doc_packed``'s calls run between the partitions, every call, as without it (their
            ops are tagged ``cudagraph_unsafe``). Needs a GPU mesh; raises ValueError otherwise,
            or with ``backend="autoparallel"`` or ``"eager"``.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if cuda_graphs:
        if backend == "eager":
            raise ValueError("cuda_graphs=True needs a compiled module: pass backend='inductor'")
        if backend == "autoparallel":
            raise ValueError("cuda_graphs=True runs on the Inductor path only: pass backend='inductor'")
        if _on_cpu(module):
            raise ValueError("cuda_graphs=True needs a GPU mesh: the placed module's parameters are on the CPU")
    if backend == "eager":
        return module, CompileChoice("eager", "asked for: AutoParallel's FX-interpreter runner, slow, for debugging")
    blocker = autoparallel_backend_blocker()
    if backend == "autoparallel" and blocker is not None:
        raise RuntimeError(f"backend='autoparallel' cannot run: {blocker}; use 'inductor'")
    if backend == "inductor" or blocker is not None or cuda_graphs:
        if backend == "inductor":
            reason = "asked for"
        elif blocker is not None:
            reason = f"fallback: {blocker}"
        else:
            reason = "cuda_graphs=True: AutoParallel's backend takes no CUDA-graph setting"
        patches, why_not = _inductor_overlap(module) if overlap_scheduling else ({}, "")
        if why_not:
            reason += f"; overlap scheduling off ({why_not})"
        if cuda_graphs:
            patches.update(_CUDA_GRAPHS)
        compiled = torch.compile(module, fullgraph=fullgraph, options=dict(patches) or None)
        return _compiled(compiled), CompileChoice("inductor", reason, tuple(patches.items()))
    from autoparallel.compile import autoparallel_backend

    cpu = _on_cpu(module)
    if overlap_scheduling is None:
        overlap_scheduling = not cpu
    options: tuple[tuple[str, object], ...] = (
        ("activation_checkpointing", activation_checkpointing),
        ("overlap_scheduling", overlap_scheduling),
    )
    compile_fn = autoparallel_backend(enable_ac=activation_checkpointing, overlap_scheduling=overlap_scheduling)
    if (
        overlap_scheduling
        and _ESTIMATE in _compat.inductor_settings()
        and _EAGER_BACKWARD in _compat.functorch_settings()
    ):
        compile_fn = _estimated(compile_fn)
        options += ((_ESTIMATE, overlap.runtime_estimate_ms),)
    compiled = torch.compile(module, backend=compile_fn, fullgraph=fullgraph)
    reason = "asked for" if backend == "autoparallel" else "AutoParallel's backend runs on this torch"
    if cpu and not overlap_scheduling:
        reason += "; overlap scheduling off on CPU (it needs Triton)"
    return _compiled(compiled), CompileChoice("autoparallel", reason, options)
