"""backend="auto-isolated" / "auto-invariant": auto's order, skipping backends without the
property (docs/contract.md sections 4 and 5). The choice is tested with every backend made to
look available; the results on CPU against the float64 oracle."""

import pytest
import torch

import doc_packed as dp
from doc_packed import kernels
from doc_packed.kernels import Backend, VarlenSpec
from doc_packed_testing.oracle import reference


def _table(unavailable: set[str]) -> tuple[Backend, ...]:
    return tuple(
        b._replace(why_not=(lambda q, spec, kv, var, n=b.name: "stand-in: absent" if n in unavailable else None))
        for b in kernels.TABLE
    )


LOCAL = VarlenSpec([0, 8, 16], [0, 8, 16], True, -1, 0, row_len=16)  # whole rows
CP = VarlenSpec([0, 8], [0, 8], True, -1, 0)  # a context-parallel call's shape


@pytest.mark.parametrize(
    "absent,spec,expected",
    [
        (set(), LOCAL, {"auto": "fa4", "auto-isolated": "fa4", "auto-invariant": "math"}),
        ({"fa4"}, LOCAL, {"auto": "flex", "auto-isolated": "flash", "auto-invariant": "math"}),
        ({"fa4", "flash"}, LOCAL, {"auto": "flex", "auto-isolated": "math", "auto-invariant": "math"}),
        ({"fa4"}, CP, {"auto": "flash", "auto-isolated": "flash", "auto-invariant": "math"}),
    ],
)
def test_modes_skip_backends_without_the_property(monkeypatch, absent, spec, expected):
    monkeypatch.setattr(kernels, "TABLE", _table(absent))
    q = torch.empty(16, 4, 8)
    assert {mode: kernels.choose(mode, spec, q, 2) for mode in expected} == expected


def test_the_properties_match_the_contract():
    table = {b.name: b for b in kernels.TABLE}
    assert [n for n, b in table.items() if b.isolated] == ["fa4", "flash", "math"]
    assert [n for n, b in table.items() if b.invariant] == ["math"]
    assert set(kernels.AUTO_MODES) <= set(kernels.BACKENDS)


@pytest.mark.parametrize("mode", ["auto-isolated", "auto-invariant"])
def test_modes_run_and_match_the_oracle(mode):
    q = torch.randn(2, 16, 4, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 16, 2, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 16, 2, 8, dtype=torch.float64, requires_grad=True)
    cu = dp.cu_seqlens_from_lengths([[5, 11], [16]], 16, max_docs=3)
    out = dp.doc_packed_attn(q, k, v, cu, backend=mode, causal=True)
    ref, _ = reference(q, k, v, cu)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    g = torch.autograd.grad(out.sum(), (q, k, v))
    rg = torch.autograd.grad(ref.sum(), (q, k, v))
    for a, b in zip(g, rg):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_a_nan_stays_in_its_document_under_auto_isolated():
    q, k, v = (torch.randn(1, 12, 2, 8) for _ in range(3))
    v[0, 2] = float("nan")
    cu = dp.cu_seqlens_from_lengths([[4, 8]], 12, max_docs=2)
    out = dp.doc_packed_attn(q, k, v, cu, backend="auto-isolated", causal=True)
    assert out[0, :4].isnan().any() and not out[0, 4:].isnan().any()


def test_unknown_mode_is_refused():
    q = torch.randn(1, 8, 2, 8)
    cu = dp.cu_seqlens_from_lengths([[8]], 8)
    with pytest.raises(ValueError, match="backend must be one of"):
        dp.doc_packed_attn(q, q, q, cu, backend="auto-fast", causal=True)


def test_context_parallel_choices_are_shared_across_layouts_and_match_choose(monkeypatch):
    """A new layout's first context-parallel call chooses without running the rules again (the
    memo spans specs), and what it gets is what choose gives that spec: the rules read of a
    context-parallel spec only whether it has bidirectional prefixes."""
    asked = []

    def fa4_rule(q, spec, kv, var):
        asked.append(spec)
        return "stand-in: no prefixes" if spec is not None and spec.prefix is not None else None

    table = tuple(b._replace(why_not=fa4_rule) if b.name == "fa4" else b for b in _table({"flex", "flash"}))
    monkeypatch.setattr(kernels, "TABLE", table)
    monkeypatch.setattr(kernels, "_CP_CHOICES", {})
    q, var = torch.empty(16, 4, 8), kernels.Variant()
    layouts = [([0, 8], [0, 8]), ([0, 3, 8], [0, 5, 9]), ([0, 1, 2, 8], [0, 4, 4, 12])]
    plain = [VarlenSpec(cq, ck, True, -1, 0) for cq, ck in layouts]
    prefixed = [VarlenSpec(cq, ck, True, -1, 0, prefix=[1] * (len(cq) - 1)) for cq, ck in layouts]
    got = [kernels._chosen("auto", s, q, 2, var) for s in plain + prefixed]
    assert len(asked) == 2  # one choice per prefix class, not per layout
    assert got == [kernels.choose("auto", s, q, 2, var) for s in plain + prefixed] == ["fa4"] * 3 + ["math"] * 3
    asked.clear()
    # local calls (flex reads their rows) and forced backends stay per spec
    for s in (LOCAL, VarlenSpec([0, 4, 16], [0, 4, 16], True, -1, 0, row_len=16)):
        kernels._chosen("auto", s, q, 2, var)
    assert len(asked) == 2
