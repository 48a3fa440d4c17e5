"""The demo's report (doc_packed_examples/demo.py) never contradicts itself: context-parallel figures and
plots only when attention is sequence-sharded, units on every figure, a one-line note without
matplotlib. Built from a real plan, no ranks spawned (the demo itself runs in CI)."""

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


def test_plots(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    line = demo.write_plots(_result(True), str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cp_kv_traffic.png", "cp_work.png"]
    assert str(tmp_path / "cp_work.png") in line
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
