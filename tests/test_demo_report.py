"""The demo's report (doc_packed_examples/demo.py) never contradicts itself: context-parallel figures and
plots only when attention is sequence-sharded, units on every figure, a one-line note without
matplotlib; the strategy figure draws the report's own estimates. Built from a real plan, no
ranks spawned (the demo itself runs in CI)."""

import argparse
import sys

import pytest

import doc_packed as dp
from doc_packed_examples import demo


def _result(sequence_sharded: bool, considered=(), break_even=""):
    args = argparse.Namespace(batch=2, seq=512, steps=1, mean_doc=100, seed=0, eager=True, free=bool(considered))
    batches = demo.make_batches(args)
    placed = demo.Placed(None, "cp: x", "eager: asked for", sequence_sharded, list(considered), break_even)
    plans = [dp.plan_context_parallel(cu, 4) for _, _, cu in batches]
    return demo.Result(args, 4, placed, batches, plans, [2.5], [2.5], 0.0, {"reference": 1.0, "training": 2.0})


def test_context_parallel_figures_only_when_sequence_sharded():
    cp = "\n".join(demo.report(_result(True)))
    p = dp.plan_context_parallel(demo.make_batches(_result(True).args)[0][2], 4)
    assert f"{list(p.work)} query-key pairs per rank and head" in cp
    assert f"{list(p.kv_recv_tokens)} tokens per rank (all-gather: {2 * (512 - 128)} each)" in cp
    assert "OK: context-parallel training matches one process" in cp
    other = "\n".join(demo.report(_result(False)))
    assert "query-key pairs" not in other and "K/V received" not in other
    assert "not used (attention is not sequence-sharded)" in other
    assert "OK: placed training matches one process" in other and "context-parallel training" not in other
    assert "reference 1.0 s, training 2.0 s" in other


def test_free_choice_section_lists_estimates_and_break_even():
    text = "\n".join(demo.report(_result(False, ["forward  cp: replicate  0.007 ms ..."], "sequence beats ...")))
    assert "AutoParallel's estimates" in text and "0.007 ms" in text
    assert "sequence would win" in text and "sequence beats" in text
    assert "considered" not in "\n".join(demo.report(_result(True)))


PNG = b"\x89PNG\r\n\x1a\n"


def test_plots(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    line = demo.write_plots(_result(True), str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cp_kv_traffic.png", "cp_work.png"]
    assert str(tmp_path / "cp_work.png") in line
    assert all(p.read_bytes().startswith(PNG) for p in tmp_path.iterdir())
    assert "not sequence-sharded" in demo.write_plots(_result(False), str(tmp_path / "none"))
    assert not (tmp_path / "none").exists()
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert demo.write_plots(_result(True), str(tmp_path)) == (
        "plots: matplotlib is not installed (pip install matplotlib); text report only"
    )


def test_without_autoparallel_the_report_says_what_it_skipped():
    """--free without AutoParallel is not silently ignored: the report names what was left out."""
    import torch

    args = argparse.Namespace(free=True, eager=True)
    why = "AutoParallel: does not import: ModuleNotFoundError: No module named 'autoparallel'"
    placed = demo._manual_cp_model(args, demo.Transformer(**demo.MODEL).double().state_dict(), why)
    r = _result(True)
    r.placed = placed
    text = "\n".join(demo.report(r))
    assert "skipped" in text and "describe_attention" in text and "--free's estimates and break-even" in text
    assert why in text
    plain = demo._manual_cp_model(argparse.Namespace(free=False, eager=True), {k: v for k, v in placed.model.state_dict().items()})
    assert plain.skipped == ""
    assert isinstance(placed.model, torch.nn.Module)


def test_strategy_report_lines_are_printed():
    r = _result(False)
    r.placed.strategies = ["attn_fwd (forward): cp: replicate", "    why: cheapest here"]
    text = "\n".join(demo.report(r))
    assert "strategies" in text and "why: cheapest here" in text


# ----------------------------------------------------------------------------- the strategy figure


@pytest.fixture
def mesh2():
    """A 2-rank mesh 'cp' on a fake process group (nothing runs on it: the step model reads its
    shape and names)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    finally:
        dist.destroy_process_group()


def _bars(ax):
    """The stacked bars of one Axes, read back: {part: [height per layout]} and the bottoms."""
    return {c.get_label(): [p.get_height() for p in c.patches] for c in ax.containers}, [
        [p.get_y() for p in c.patches] for c in ax.containers
    ]


def test_step_model_breakdown_prices_every_offered_layout(mesh2):
    """Without AutoParallel: each layout a 2-rank dim offers (2 rows, 4 / 2 heads: all four), the
    manual placement's sequence first, each priced as attention_time_us prices it under the same
    pricing, its exchange apart (0 unless sequence-sharded), no redistribution."""
    import torch

    from shardings.autoparallel import attention_time_us
    from shardings.costs import pricing

    r = _result(True)
    breakdown = demo._step_model_breakdown(r.args, mesh2, r.batches[0][2])
    assert list(breakdown) == ["forward", "backward"]
    heads = demo.MODEL["n_heads"]
    shape = dict(rows=2, seq_len=512, q_heads=heads, kv_heads=demo.MODEL["n_kv_heads"],
                 head_dim=demo.MODEL["dim"] // heads, dtype=torch.float64, doc_len=100)  # fmt: skip
    for role, alts in breakdown.items():
        assert [a.chosen for a in alts] == [True, False, False, False]
        assert alts[0].layout == {"cp": "sequence"}
        assert sorted(a.layout["cp"] for a in alts) == ["batch", "heads", "replicate", "sequence"]
        assert [a.total_ms for a in alts[1:]] == sorted(a.total_ms for a in alts[1:])
        with pricing(mesh2, gpus_per_host=2, cu_seqlens=r.batches[0][2]):
            for a in alts:
                want = attention_time_us(mesh2, 0, a.layout["cp"], backward=role == "backward", **shape) / 1e3
                assert a.total_ms == pytest.approx(want, rel=1e-12)
                assert a.comm_ms == 0.0 and (a.exchange_ms > 0) == (a.layout["cp"] == "sequence")


def test_strategy_figure_draws_the_reports_costs(mesh2, tmp_path):
    """The bars read back from each Axes are the report's kernel / exchange / redistribution of
    each layout, stacked in that order, the chosen one first and labelled so; strategies.png is
    a PNG; the text report prints the same figures."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from shardings.autoparallel import Alternative

    r = _result(True)
    r.placed.breakdown = demo._step_model_breakdown(r.args, mesh2, r.batches[0][2])
    # as AutoParallel reports them: with a redistribution estimate, the chosen one not the cheapest
    r.placed.breakdown["backward"] = [
        Alternative({"cp": "sequence"}, 0.5, 0.25, True, 0.125), Alternative({"cp": "replicate"}, 0.375, 0.0, False)
    ]  # fmt: skip
    r.placed.breakdown_from = "test estimates"
    fig = demo.strategy_figure(r.placed.breakdown, r.placed.breakdown_from)
    try:
        axes = fig.axes
        assert [ax.get_title() for ax in axes] == ["forward, one layer", "backward, one layer"]
        for ax, alts in zip(axes, r.placed.breakdown.values()):
            heights, bottoms = _bars(ax)
            assert list(heights) == ["kernel", "exchange", "redistribution"]
            for part, got in heights.items():
                assert got == pytest.approx([a.parts()[part] for a in alts], abs=1e-15)
            assert bottoms[2] == pytest.approx([a.kernel_ms + a.exchange_ms for a in alts], abs=1e-15)
            labels = [t.get_text() for t in ax.get_xticklabels()]
            assert labels[0] == "cp: sequence\n(chosen)" and "(chosen)" not in "".join(labels[1:])
            assert ax.get_ylabel() == "ms per call"
        assert _bars(axes[1])[0]["redistribution"] == [0.25, 0.0]
        assert "test estimates" in fig.texts[0].get_text()
    finally:
        plt.close(fig)
    line = demo.write_plots(r, str(tmp_path))
    assert str(tmp_path / "strategies.png") in line
    assert (tmp_path / "strategies.png").read_bytes().startswith(PNG)
    text = "\n".join(demo._strategies(r))
    a = r.placed.breakdown["forward"][0]
    assert f"kernel {a.kernel_ms:.3f} + exchange {a.exchange_ms:.3f} = {a.total_ms:.3f} ms  <- this run" in text
    r.placed.sequence_sharded = False
    only = tmp_path / "only"
    assert "no context-parallel figures" in demo.write_plots(r, str(only))
    assert [p.name for p in only.iterdir()] == ["strategies.png"]
