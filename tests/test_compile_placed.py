"""shardings.compile: which compiler runs a placed module, and why (no AutoParallel needed)."""

import sys

import pytest
import torch

from shardings import compile as sc


def test_missing_torch_names_reads_the_module_source(tmp_path, monkeypatch):
    (tmp_path / "probe_mod.py").write_text(
        "from torch.nn import Linear\n"
        "def later():\n"
        "    from torch.nn.functional import not_a_function_xyz\n"
        "    from torch._no_such_module_xyz import thing\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    missing = sc._missing_torch_names("probe_mod")
    assert missing == ["torch.nn.functional.not_a_function_xyz", "torch._no_such_module_xyz"]
    sys.modules.pop("probe_mod", None)


def test_choices_and_reasons(monkeypatch):
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="backend must be one of"):
        sc.compile_placed(model, "bogus")
    same, choice = sc.compile_placed(model, "eager")
    assert same is model and choice.backend == "eager"

    monkeypatch.setattr(sc, "autoparallel_backend_blocker", lambda: "torch lacks x.y")
    compiled, choice = sc.compile_placed(model, "auto")
    assert choice.backend == "inductor" and "torch lacks x.y" in choice.reason
    assert compiled is not model and compiled._orig_mod is model
    with pytest.raises(RuntimeError, match="cannot run: torch lacks x.y"):
        sc.compile_placed(model, "autoparallel")
    _, choice = sc.compile_placed(model, "inductor")
    assert choice.backend == "inductor" and choice.reason == "asked for"


def test_place_rejects_bad_arguments_before_tracing():
    """shardings.flow.place checks its compile backend and pricing arguments before it imports
    AutoParallel, traces or solves (so this runs without AutoParallel)."""
    from shardings.flow import place

    model, mesh = torch.nn.Linear(4, 4), object()
    with pytest.raises(ValueError, match="compile_backend must be one of"):
        place(model, lambda: (torch.zeros(1, 4),), mesh, compile_backend="bogus")
    with pytest.raises(ValueError, match="rates are used by the attention pricing, which needs gpus_per_host"):
        place(model, lambda: (torch.zeros(1, 4),), mesh, gpus_per_host=None, rates="rates.json")


def _spy_on_compile(monkeypatch) -> list:
    """Make ``torch.compile`` (as shardings.compile calls it) record the Inductor options of each
    call, in the returned list, and compile as before."""
    seen: list = []
    real_compile = torch.compile

    def spy(module, **kwargs):
        seen.append(kwargs.get("options"))
        return real_compile(module, **kwargs)

    monkeypatch.setattr(sc.torch, "compile", spy)
    return seen


def test_inductor_overlap_scheduling_only_where_asked_and_possible(monkeypatch):
    """The Inductor fallback compiles without overlap scheduling unless asked; asked, it passes
    torch's overlap settings to torch.compile on a GPU mesh, and says why not on a CPU one or on a
    torch without them."""
    model = torch.nn.Linear(4, 4)
    seen = _spy_on_compile(monkeypatch)
    _, choice = sc.compile_placed(model, "inductor")
    assert seen[-1] is None and choice.options == ()
    _, choice = sc.compile_placed(model, "inductor", overlap_scheduling=True)  # CPU parameters
    assert seen[-1] is None and "overlap scheduling off (a CPU mesh" in choice.reason

    monkeypatch.setattr(sc, "_on_cpu", lambda module: False)  # as on a GPU mesh
    _, choice = sc.compile_placed(model, "inductor", overlap_scheduling=True)
    assert seen[-1] == sc.INDUCTOR_OVERLAP and dict(choice.options) == sc.INDUCTOR_OVERLAP
    assert "enable_overlap_scheduling=True" in str(choice)

    known = sc._compat.inductor_settings() - {"aten_distributed_optimizations.enable_overlap_scheduling"}
    monkeypatch.setattr(sc._compat, "inductor_settings", lambda: known)
    _, choice = sc.compile_placed(model, "inductor", overlap_scheduling=True)
    assert seen[-1] is None and "has no aten_distributed_optimizations.enable_overlap_scheduling" in choice.reason


def test_autoparallel_backend_gets_the_overlap_hook_for_forward_and_backward(monkeypatch):
    """AutoParallel's backend takes no Inductor options and turns the overlap pass on by itself on
    GPU meshes; compile_placed runs it with the pass's timing hook set for both graphs (the
    backward compiled with the forward, inside the same settings), and leaves the process's
    settings as they were. A stand-in backend records what Inductor saw at each compile."""
    import types

    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    from shardings import overlap

    if sc._EAGER_BACKWARD not in sc._compat.functorch_settings():
        pytest.skip(f"torch {torch.__version__} has no {sc._EAGER_BACKWARD}: the hook is not set there")
    seen: list[tuple[bool, object]] = []

    def inner(gm, example_inputs, **kwargs):
        seen.append((bool(kwargs.get("is_backward")), inductor_config.aten_distributed_optimizations.custom_runtime_estimation))
        return compile_fx_inner(gm, example_inputs, **kwargs)

    def autoparallel_backend(enable_ac, overlap_scheduling):
        assert overlap_scheduling  # a GPU mesh's default
        return lambda gm, example_inputs: compile_fx(gm, example_inputs, inner_compile=inner)

    fake = types.ModuleType("autoparallel.compile")
    fake.autoparallel_backend = autoparallel_backend  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "autoparallel.compile", fake)
    monkeypatch.setattr(sc, "autoparallel_backend_blocker", lambda: None)
    monkeypatch.setattr(sc, "_on_cpu", lambda module: False)  # as on a GPU mesh
    torch._dynamo.reset()

    model = torch.nn.Linear(8, 8)
    compiled, choice = sc.compile_placed(model, "autoparallel")
    assert choice.backend == "autoparallel" and dict(choice.options)[sc._ESTIMATE] is overlap.runtime_estimate_ms
    with inductor_config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        compiled(torch.randn(4, 8, requires_grad=True)).sum().backward()  # compiled here, not found in a cache
    assert sorted(is_bw for is_bw, _ in seen) == [False, True]  # forward and backward compiled
    assert all(hook is overlap.runtime_estimate_ms for _, hook in seen)
    assert inductor_config.aten_distributed_optimizations.custom_runtime_estimation is None  # restored
    assert model.weight.grad is not None
    torch._dynamo.reset()


def test_cuda_graphs_on_the_inductor_path_of_gpu_meshes_only(monkeypatch):
    """cuda_graphs=True passes Inductor's CUDA-graph settings (with graph partitions around
    doc_packed's calls), with or without overlap scheduling, also where AutoParallel's backend
    could run; it refuses a CPU mesh and a forced AutoParallel backend before compiling."""
    model = torch.nn.Linear(4, 4)
    seen = _spy_on_compile(monkeypatch)
    with pytest.raises(ValueError, match="cuda_graphs=True needs a GPU mesh"):
        sc.compile_placed(model, "inductor", cuda_graphs=True)  # CPU parameters
    assert seen == []
    monkeypatch.setattr(sc, "_on_cpu", lambda module: False)  # as on a GPU mesh
    with pytest.raises(ValueError, match="Inductor path only"):
        sc.compile_placed(model, "autoparallel", cuda_graphs=True)
    with pytest.raises(ValueError, match="needs a compiled module"):
        sc.compile_placed(model, "eager", cuda_graphs=True)
    assert seen == []
    graphs = {"triton.cudagraphs": True, "graph_partition": True}
    _, choice = sc.compile_placed(model, "inductor", cuda_graphs=True)
    assert seen[-1] == graphs and dict(choice.options) == graphs and choice.reason == "asked for"
    _, choice = sc.compile_placed(model, "inductor", cuda_graphs=True, overlap_scheduling=True)
    assert seen[-1] == {**sc.INDUCTOR_OVERLAP, **graphs}
    monkeypatch.setattr(sc, "autoparallel_backend_blocker", lambda: None)  # AutoParallel's backend runs
    _, choice = sc.compile_placed(model, "auto", cuda_graphs=True)
    assert choice.backend == "inductor" and "takes no CUDA-graph setting" in choice.reason
    assert seen[-1] == graphs
    for key in graphs:
        assert key in sc._compat.inductor_settings(), key
