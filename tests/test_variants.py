"""Attention variants (issue 18) on CPU against the float64 oracle: learnable sinks, softcapping,
prefix-bidirectional documents, a value head dim unlike q's, max logits; alone and combined with
GQA, windows, zero-length documents and B > 1, forward and gradients (sinks included), on the
eager path and through the custom op; validation; flop counts; torch.compile; flex's traced
passes (run eagerly on CPU)."""

import pytest
import torch
from doc_packed_testing.oracle import dense_mask, reference

import doc_packed as dp
from doc_packed import kernels
from doc_packed.kernels import fa4, flex

B, S, HQ, HKV, D = 2, 40, 4, 2, 8
# zero-length and one-token documents (cu_seqlens in _layout)
PREFIX = [[3, 0, 15, 1, 0], [1, 20, 0, 0, 0]]  # one per slot of cu_seqlens (max_docs=5)


def _layout():
    return torch.tensor([[0, 10, 10, 25, 40, 40], [0, 1, 40, 40, 40, 40]], dtype=torch.int32)


def _inputs(dv=D, dtype=torch.float64, hkv=HKV):
    q = torch.randn(B, S, HQ, D, dtype=dtype, requires_grad=True)
    k = torch.randn(B, S, hkv, D, dtype=dtype, requires_grad=True)
    v = torch.randn(B, S, hkv, dv, dtype=dtype, requires_grad=True)
    return q, k, v


def _variant(name):
    """kwargs of one variant (or a combination)."""
    sinks = torch.randn(HQ, dtype=torch.float64, requires_grad=True)
    prefix = torch.tensor(PREFIX, dtype=torch.int32)
    return {
        "sinks": {"sinks": sinks},
        "softcap": {"softcap": 1.5},
        "prefix": {"prefix_lens": prefix},
        "all": {"sinks": sinks, "softcap": 2.0, "prefix_lens": prefix},
        "plain": {},
    }[name]


def _ref_kwargs(kw):
    return {"sinks": kw.get("sinks"), "softcap": kw.get("softcap"), "prefix_lens": kw.get("prefix_lens")}


def _check(q, k, v, cu, window, kw, *, op_path=False, atol=1e-10):
    """Forward (out, lse, max logits) and gradients of q, k, v (and sinks) against the oracle."""
    import contextlib

    from torch.utils.flop_counter import FlopCounterMode

    ctx = FlopCounterMode(display=False) if op_path else contextlib.nullcontext()
    with ctx:  # a dispatch mode sends the call through the custom op
        out, lse, m = dp.doc_packed_attn(q, k, v, cu, window_size=window, return_lse=True, return_max_logits=True, **{"causal": True, **kw})
    ro, rl, rm = reference(q, k, v, cu, True, window, max_logits=True, **_ref_kwargs(kw))
    assert out.shape == (*q.shape[:3], v.shape[-1]) and m.shape == (q.shape[2],)
    torch.testing.assert_close(out.double(), ro, atol=atol, rtol=atol)
    torch.testing.assert_close(lse.double(), rl, atol=atol, rtol=atol)
    torch.testing.assert_close(m.double(), rm, atol=atol, rtol=atol)
    assert not m.requires_grad
    wrt = [q, k, v] + ([kw["sinks"]] if "sinks" in kw else [])
    g = torch.randn_like(ro)
    with ctx:
        got = torch.autograd.grad(out.double(), wrt, g)
    want = torch.autograd.grad(ro, wrt, g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b.double(), atol=atol * 4, rtol=atol * 4)


@pytest.mark.parametrize("name", ["sinks", "softcap", "prefix", "all"])
@pytest.mark.parametrize("window", [(-1, -1), (4, 0)])
@pytest.mark.parametrize("dv", [D, 12])
def test_variants_match_oracle(name, window, dv):
    q, k, v = _inputs(dv)
    _check(q, k, v, _layout(), window, _variant(name))


@pytest.mark.parametrize("name", ["sinks", "softcap", "prefix", "all"])
def test_variants_through_the_custom_op(name):
    q, k, v = _inputs(12)
    _check(q, k, v, _layout(), (3, 0), _variant(name), op_path=True)


def test_mqa_and_long_documents_cross_tiles():
    """One kv head, documents longer than a query block (128) and key tile (512), prefixes that
    straddle tile boundaries."""
    Bl, Sl = 1, 700
    cu = dp.cu_seqlens_from_lengths([[600, 100]], Sl, max_docs=3)
    prefix = torch.tensor([[300, 7, 0]], dtype=torch.int64)
    q = torch.randn(Bl, Sl, 2, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(Bl, Sl, 1, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(Bl, Sl, 1, 16, dtype=torch.float64, requires_grad=True)
    sinks = torch.tensor([0.5, -1.0], dtype=torch.float64, requires_grad=True)
    _check(q, k, v, cu, (200, 0), {"sinks": sinks, "softcap": 3.0, "prefix_lens": prefix})


def test_low_precision_variants():
    q, k, v = _inputs(12, torch.bfloat16)
    kw = _variant("all")
    out = dp.doc_packed_attn(q, k, v, _layout(), **{"causal": True, **kw})
    ro, _ = reference(q, k, v, _layout(), **_ref_kwargs(kw))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ro, atol=2e-2, rtol=2e-2)


def test_sink_lse_convention_and_lse_gradient():
    """lse includes the sink (a row that sees nothing: lse = sink, out = 0), and a gradient through
    lse reaches q, k and the sinks."""
    q, k, v = _inputs()
    cu = _layout()
    sinks = torch.randn(HQ, dtype=torch.float64, requires_grad=True)
    out, lse = dp.doc_packed_attn(q, k, v, cu, sinks=sinks, return_lse=True, window_size=(0, 0), causal=True)
    ro, rl = reference(q, k, v, cu, True, (0, 0), sinks=sinks)
    torch.testing.assert_close(lse, rl)
    w = torch.randn_like(rl)
    g = torch.randn_like(ro)
    got = torch.autograd.grad((out * g).sum() + (lse * w).sum(), (q, k, v, sinks))
    want = torch.autograd.grad((ro * g).sum() + (rl * w).sum(), (q, k, v, sinks))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_empty_rows_with_sinks():
    """A query that sees no key (left window 0 under non-causal right 0 cannot happen; use a
    document layout where every query sees itself only) has out 0 and lse = sink only when it
    sees nothing: here with one-token documents it sees itself, checked against the oracle."""
    cu = dp.cu_seqlens_from_lengths([[1] * 6], 6, max_docs=6)
    q = torch.randn(1, 6, 2, 4, dtype=torch.float64)
    k = torch.randn(1, 6, 1, 4, dtype=torch.float64)
    v = torch.randn(1, 6, 1, 4, dtype=torch.float64)
    sinks = torch.tensor([30.0, -30.0], dtype=torch.float64)  # nearly all mass on the sink / none
    out, lse = dp.doc_packed_attn(q, k, v, cu, sinks=sinks, return_lse=True, causal=True)
    ro, rl = reference(q, k, v, cu, sinks=sinks)
    torch.testing.assert_close(out, ro)
    torch.testing.assert_close(lse, rl)
    assert out[0, :, 0].abs().max() < 1e-10  # the sink took the mass of head 0


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("op_path", [False, True])
def test_softcap_lse_gradient(sinks, op_path):
    """A gradient through lse under softcapping (two extra backwards) matches the oracle, with and
    without sinks, on the eager path and through the custom op, beside prefixes and D_v != D."""
    import contextlib

    from torch.utils.flop_counter import FlopCounterMode

    q, k, v = _inputs(12)
    cu = _layout()
    kw = {"softcap": 1.5, "prefix_lens": torch.tensor(PREFIX, dtype=torch.int32)}
    if sinks:
        kw["sinks"] = torch.randn(HQ, dtype=torch.float64, requires_grad=True)
    ctx = FlopCounterMode(display=False) if op_path else contextlib.nullcontext()
    wrt = (q, k, v) + ((kw["sinks"],) if sinks else ())
    with ctx:
        out, lse = dp.doc_packed_attn(q, k, v, cu, window_size=(3, 0), return_lse=True, **{"causal": True, **kw})
        wl, g = torch.randn_like(lse), torch.randn_like(out)
        got = torch.autograd.grad((lse * wl).sum() + (out * g).sum(), wrt)
    ro, rl = reference(q, k, v, cu, True, (3, 0), **_ref_kwargs(kw))
    want = torch.autograd.grad((rl * wl).sum() + (ro * g).sum(), wrt)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    only_lse = torch.autograd.grad(
        dp.doc_packed_attn(q, k, v, cu, return_lse=True, **{"causal": True, **kw})[1].sum(), wrt, allow_unused=True
    )
    ref_only = torch.autograd.grad(reference(q, k, v, cu, **_ref_kwargs(kw))[1].sum(), wrt, allow_unused=True)
    for a, b in zip(only_lse, ref_only):
        torch.testing.assert_close(a, torch.zeros_like(a) if b is None else b)


def test_varlen_entry_variants():
    T = 30
    cu = torch.tensor([0, 12, 12, 30], dtype=torch.int32)
    prefix = torch.tensor([5, 0, 18], dtype=torch.int32)
    q = torch.randn(T, 4, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(T, 2, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(T, 2, 4, dtype=torch.float64, requires_grad=True)
    sinks = torch.randn(4, dtype=torch.float64, requires_grad=True)
    out, lse, m = dp.doc_packed_attn_varlen(
        q, k, v, cu, 18, sinks=sinks, softcap=1.0, prefix_lens=prefix, return_lse=True, return_max_logits=True, causal=True
    )
    ro, rl, rm = reference(
        q[None], k[None], v[None], cu[None], sinks=sinks, softcap=1.0, prefix_lens=prefix[None], max_logits=True
    )
    assert out.shape == (T, 4, 4) and lse.shape == (4, T)
    torch.testing.assert_close(out, ro[0])
    torch.testing.assert_close(lse, rl[0])
    torch.testing.assert_close(m, rm)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, sinks), g)
    want = torch.autograd.grad(ro[0], (q, k, v, sinks), g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    only_m = dp.doc_packed_attn_varlen(q, k, v, cu, None, return_max_logits=True, causal=True)
    assert isinstance(only_m, tuple) and len(only_m) == 2


def test_max_logits_plain_and_empty_heads():
    q, k, v = _inputs()
    out, m = dp.doc_packed_attn(q, k, v, _layout(), return_max_logits=True, causal=True)
    _, _, rm = reference(q, k, v, _layout(), max_logits=True)
    torch.testing.assert_close(m, rm)
    assert m.dtype == torch.float64  # lse's dtype: float32, float64 for float64 inputs
    qf, kf, vf = (t.float() for t in (q, k, v))
    assert dp.doc_packed_attn(qf, kf, vf, _layout(), return_max_logits=True, causal=True)[1].dtype == torch.float32


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "kw,err,match",
    [
        ({"softcap": 0.0}, ValueError, "softcap must be a positive"),
        ({"softcap": -1.0}, ValueError, "softcap must be a positive"),
        ({"softcap": float("nan")}, ValueError, "softcap must be a positive"),
        ({"softcap": "1"}, TypeError, "softcap must be a float"),
        ({"softcap": True}, TypeError, "softcap must be a float"),
        ({"sinks": torch.zeros(3)}, ValueError, r"sinks must be \[H_q\] = \[4\]"),
        ({"sinks": torch.zeros(4, 1)}, ValueError, "sinks must be"),
        ({"sinks": torch.zeros(4, dtype=torch.int32)}, TypeError, "sinks must be a floating"),
        ({"sinks": [0.0] * 4}, TypeError, "sinks must be a torch.Tensor"),
        ({"prefix_lens": torch.zeros(2, 4, dtype=torch.int32)}, ValueError, "prefix_lens must have one entry"),
        ({"prefix_lens": torch.zeros(2, 5)}, TypeError, "prefix_lens must be int32 or int64"),
        ({"prefix_lens": torch.zeros(2, 5, dtype=torch.int32), "causal": False}, ValueError, "needs causal=True"),
        ({"prefix_lens": torch.tensor([[11, 0, 0, 0, 0], [0] * 5])}, ValueError, r"prefix_lens\[0, 0\] is 11"),
        ({"prefix_lens": torch.tensor([[0, 1, 0, 0, 0], [0] * 5])}, ValueError, r"prefix_lens\[0, 1\] is 1"),
        ({"prefix_lens": torch.tensor([[-1, 0, 0, 0, 0], [0] * 5])}, ValueError, "outside"),
        ({"return_max_logits": 1}, TypeError, "return_max_logits must be a bool"),
        ({"softcap": 1.0, "backend": "flash"}, ValueError, "flash"),
    ],
)
def test_validation(kw, err, match):
    q, k, v = _inputs(grad=False) if False else (t.detach() for t in _inputs())
    with pytest.raises(err, match=match):
        dp.doc_packed_attn(q, k, v, _layout(), **{"causal": True, **kw})


def test_validation_value_head_dim_and_varlen_prefix():
    q, k, v = (t.detach() for t in _inputs(12))
    with pytest.raises(ValueError, match="must share"):
        dp.doc_packed_attn(q, k, v[:, :, :1], _layout(), causal=True)
    with pytest.raises(ValueError, match="empty head dim"):
        dp.doc_packed_attn(q, k, v[..., :0], _layout(), causal=True)
    cu = torch.tensor([0, 10, 40], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"prefix_lens must be 1-D \[N\] = \[2\]"):
        dp.doc_packed_attn_varlen(q[0], k[0], v[0], cu, None, prefix_lens=torch.zeros(3, dtype=torch.int32), causal=True)
    with pytest.raises(ValueError, match="must share"):
        dp.doc_packed_attn_varlen(q[0], k[0], v[0, :, :1], cu, None, causal=True)


# ----------------------------------------------------------------------------- kernels table


def test_backend_variant_rules():
    q = torch.empty(10, 4, 192)
    spec = kernels.VarlenSpec([0, 10], [0, 10], True, -1, 0, row_len=10, prefix=[4])
    assert spec.prefix == (4,)
    assert "prefix" in fa4.variant_reason(q, spec, kernels.Variant())
    assert flex.variant_reason(kernels.Variant(v_dim=96)) is not None
    assert flex.variant_reason(kernels.Variant(1.0, 64)) is None
    assert "softcap" in kernels._flash_variant_reason(None, kernels.Variant(softcap=1.0))
    assert "head dim" in kernels._flash_variant_reason(None, kernels.Variant(v_dim=64))
    assert "prefix" in kernels._flash_variant_reason(spec, kernels.Variant())
    # math takes everything; auto on CPU picks it
    assert kernels.choose("auto", spec, q, 2, kernels.Variant(1.0, 128)) == "math"
    # a prefix of 0 everywhere is no prefix
    assert kernels.VarlenSpec([0, 10], [0, 10], True, -1, 0, prefix=[0]).prefix is None


def test_spec_key_bounds_with_prefix_match_the_dense_mask():
    """The spec's per-query intervals equal the oracle's dense mask (prefix OR causal window)."""
    cu = _layout()
    for b in range(B):
        bounds = cu[b].tolist()
        docs = [(s, e) for s, e in zip(bounds[:-1], bounds[1:]) if e > s]
        pref = [p for p, (s, e) in zip(PREFIX[b], zip(bounds[:-1], bounds[1:])) if e > s]
        flat = [0] + [e for _, e in docs]
        for left in (-1, 0, 3):
            spec = kernels.VarlenSpec(flat, flat, True, left, 0, row_len=S, prefix=pref)
            lo, hi = spec.key_bounds()
            mask = dense_mask(bounds, S, True, (left, 0), PREFIX[b])
            j = torch.arange(S)
            got = (j[None] >= lo[:, None]) & (j[None] <= hi[:, None])
            assert torch.equal(got, mask)


# ----------------------------------------------------------------------------- flops, compile


def test_flop_counts_with_prefixes_and_value_head_dim():
    from torch.utils.flop_counter import FlopCounterMode

    q, k, v = (t.detach().float() for t in _inputs(12))
    cu = _layout()
    prefix = torch.tensor(PREFIX, dtype=torch.int32)
    for window in ((-1, -1), (2, 0)):
        visible = sum(int(dense_mask(cu[b].tolist(), S, True, window, PREFIX[b]).sum()) for b in range(B))
        q.requires_grad_(True)
        with FlopCounterMode(display=False) as fc:
            out = dp.doc_packed_attn(q, k, v, cu, prefix_lens=prefix, window_size=window, softcap=3.0, causal=True)
            out.sum().backward()
        counts = fc.get_flop_counts()["Global"]
        assert counts[torch.ops.doc_packed.attn_fwd] == 2 * visible * HQ * (D + 12)
        assert counts[torch.ops.doc_packed.attn_bwd] == 2 * visible * HQ * (3 * D + 2 * 12)


def test_compile_fullgraph_variants():
    import torch._dynamo

    torch._dynamo.reset()
    cu = _layout()
    prefix = torch.tensor(PREFIX, dtype=torch.int32)

    def step(q, k, v, sinks):
        out, m = dp.doc_packed_attn(
            q, k, v, cu, window_size=(5, 0), sinks=sinks, softcap=2.0, prefix_lens=prefix, return_max_logits=True, causal=True
        )
        return (out.float() ** 2).sum() + m.sum() * 0

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    q, k, v = (t.detach().float().requires_grad_(True) for t in _inputs(12))
    sinks = torch.randn(HQ, requires_grad=True)
    loss = compiled(q, k, v, sinks)
    grads = torch.autograd.grad(loss, (q, k, v, sinks))
    ref_loss = step(q, k, v, sinks)
    ref_grads = torch.autograd.grad(ref_loss, (q, k, v, sinks))
    torch.testing.assert_close(loss, ref_loss)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b)

    def bad(q, k, v):
        return dp.doc_packed_attn(q, k, v, cu, softcap=-1.0, causal=True)

    with pytest.raises(ValueError, match="softcap"):
        torch.compile(bad, fullgraph=True, backend="aot_eager")(q.detach(), k.detach(), v.detach())


def test_opcheck_variants():
    from torch.library import opcheck

    q, k, v = (t.detach() for t in _inputs(12))
    cu = _layout()
    sinks = torch.randn(HQ, dtype=torch.float64)
    prefix = torch.tensor(PREFIX, dtype=torch.int32)
    args = (q, k, v, cu, S, True, -1, 0, 0.3, "auto", None, 0, None, 2.0, sinks, prefix)
    opcheck(torch.ops.doc_packed.attn_fwd.default, args, test_utils=("test_schema", "test_faketensor"))
    margs = (q, k, cu, S, True, -1, 0, 0.3, None, 2.0, prefix, "auto")
    opcheck(torch.ops.doc_packed.attn_max_logits.default, margs, test_utils=("test_schema", "test_faketensor"))


# ----------------------------------------------------------------------------- flex (traced, eager on CPU)


@pytest.mark.parametrize("dv", [16, 32])
def test_flex_softcap_prefix_value_dim_on_cpu(dv):
    """flex's traced passes (run eagerly on CPU) with the softcap score_mod, prefix intervals and
    a value head dim unlike q's, against the math kernel on the same spec (rows of 128)."""
    L = 128
    cu = torch.tensor([[0, 50, 50, 128], [0, 128, 128, 128]], dtype=torch.int32)
    prefix = torch.tensor([[20, 0, 78], [5, 0, 0]], dtype=torch.int32)
    from doc_packed import ops
    from doc_packed._doc_layout import get_layout
    from doc_packed._variants import prefixes

    spec = ops.local_spec(get_layout(cu, L), True, 30, 0, prefixes(cu, prefix))
    T = 2 * L
    q = torch.randn(T, 4, 16)
    k = torch.randn(T, 2, 16)
    v = torch.randn(T, 2, dv)
    out, lse = flex.forward(spec, q, k, v, 0.3, 1.5, compile_graph=False)
    from doc_packed.kernels import math as mk

    ref_out, ref_lse = mk.forward(spec, q, k, v, 0.3, 1.5)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    dout = torch.randn_like(out)
    got = flex.backward(spec, dout, q, k, v, out, lse, 0.3, 1.5, compile_graph=False)
    want = mk.backward(spec, dout, q, k, v, ref_out, ref_lse, 0.3, 1.5)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    # max logits from flex's row max (OUTPUT_MAX, log2 units inside flex)
    got_max = flex.max_logits(spec, q, k, 0.3, 1.5, compile_graph=False)
    torch.testing.assert_close(got_max, mk.max_logits(spec, q, k, 0.3, 1.5), atol=1e-5, rtol=1e-5)


def test_env_says_which_backend_runs_each_variant_and_why():
    from doc_packed import env

    q, k, v = (t.detach() for t in _inputs(12))
    cu = _layout()
    prefix = torch.tensor(PREFIX, dtype=torch.int32)
    assert env.backend_for(q, k, cu, v=v, softcap=2.0, prefix_lens=prefix) == "math"
    why = env.call_reasons(q, k, cu, v=v, softcap=2.0, prefix_lens=prefix)
    assert why["math"] is None and "CUDA" in why["fa4"] and "CUDA" in why["flex"]
    with pytest.raises(ValueError, match="softcap must be a positive"):
        env.backend_for(q, k, cu, softcap=-1.0)
    with pytest.raises(ValueError, match="backend='flash'"):
        env.backend_for(q, k, cu, backend="flash", softcap=1.0)
