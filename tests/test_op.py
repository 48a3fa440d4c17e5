"""doc_packed_attn against the dense float64 oracle, on the CPU (exact blockwise) path."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import doc_packed as dp
from doc_packed_testing.oracle import random_lengths
from doc_packed_testing.oracle import dense_mask, reference

MASKS = [
    (True, (-1, -1)),
    (False, (-1, -1)),
    (True, (5, 0)),
    (True, (0, -1)),
    (False, (4, 7)),
    (False, (-1, 3)),
    (False, (3, -1)),
    (False, (0, 0)),
]


def _inputs(B, S, Hq, Hkv, D, dtype=torch.float64, grad=True):
    mk = lambda h: torch.randn(B, S, h, D, dtype=dtype, requires_grad=grad)  # noqa: E731
    return mk(Hq), mk(Hkv), mk(Hkv)


def _layout(rng, B, S, max_docs=None):
    rows = [random_lengths(rng, S) for _ in range(B)]
    if max_docs is None:
        max_docs = max(len(r) for r in rows) + 2
    return dp.cu_seqlens_from_lengths(rows, S, max_docs=max_docs)


def _check(q, k, v, cu, causal, window, atol, grad=True):
    out, lse = dp.doc_packed_attn(q, k, v, cu, causal=causal, window_size=window, return_lse=True)
    ref_out, ref_lse = reference(q, k, v, cu, causal, window)
    assert out.dtype == q.dtype and out.shape == q.shape
    torch.testing.assert_close(out.double(), ref_out, atol=atol, rtol=atol)
    torch.testing.assert_close(lse.double(), ref_lse, atol=atol, rtol=atol)
    if grad:
        g = torch.randn_like(ref_out)
        got = torch.autograd.grad(out.double(), (q, k, v), g)
        want = torch.autograd.grad(ref_out, (q, k, v), g)
        for a, b in zip(got, want):
            torch.testing.assert_close(a.double(), b.double(), atol=atol * 4, rtol=atol * 4)


@pytest.mark.parametrize("causal,window", MASKS)
@pytest.mark.parametrize("B,S,Hq,Hkv,D", [(1, 1, 2, 2, 4), (2, 37, 4, 2, 8), (3, 64, 6, 1, 16)])
def test_parity_float64(rng, B, S, Hq, Hkv, D, causal, window):
    q, k, v = _inputs(B, S, Hq, Hkv, D)
    _check(q, k, v, _layout(rng, B, S), causal, window, atol=1e-10)


@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (40, 100)), (True, (300, 0))])
def test_long_documents_cross_tiles(rng, causal, window):
    # documents longer than the kernel's query block and key tile
    S = 1300
    cu = dp.cu_seqlens_from_lengths([[700, 1, 599], [1300]], S, max_docs=4)
    q, k, v = _inputs(2, S, 2, 1, 8)
    _check(q, k, v, cu, causal, window, atol=1e-9)


def test_many_documents(rng):
    S = 257
    cu = dp.cu_seqlens_from_lengths([[1] * 200 + [57], [3] * 85 + [2]], S)
    q, k, v = _inputs(2, S, 4, 4, 8)
    _check(q, k, v, cu, True, (-1, -1), atol=1e-10)
    _check(q, k, v, cu, False, (2, 1), atol=1e-10)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2), (torch.float16, 4e-3)])
def test_low_precision(rng, dtype, atol):
    q, k, v = _inputs(2, 50, 4, 2, 16, dtype=dtype, grad=False)
    cu = _layout(rng, 2, 50)
    out, lse = dp.doc_packed_attn(q, k, v, cu, return_lse=True, causal=True)
    ref_out, ref_lse = reference(q, k, v, cu)
    assert out.dtype == dtype and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref_out, atol=atol, rtol=atol)
    torch.testing.assert_close(lse.double(), ref_lse, atol=atol, rtol=atol)


def test_scale_and_strided_views(rng):
    # q/k/v as views of one fused projection [B, S, 3, H, D]: non-contiguous but mergeable
    B, S, H, D = 2, 40, 3, 8
    qkv = torch.randn(B, S, 3, H, D, dtype=torch.float64, requires_grad=True)
    q, k, v = qkv.unbind(2)
    cu = _layout(rng, B, S)
    out = dp.doc_packed_attn(q, k, v, cu, scale=0.3, causal=False)
    ref, _ = reference(q, k, v, cu, False, (-1, -1), scale=0.3)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    g = torch.randn_like(ref)
    (a,) = torch.autograd.grad(out, qkv, g)
    (b,) = torch.autograd.grad(ref, qkv, g)
    torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9)


def test_lse_gradient(rng):
    q, k, v = _inputs(2, 30, 4, 2, 8)
    cu = _layout(rng, 2, 30)
    out, lse = dp.doc_packed_attn(q, k, v, cu, return_lse=True, window_size=(4, 0), causal=True)
    ref_out, ref_lse = reference(q, k, v, cu, True, (4, 0))
    w1, w2 = torch.randn_like(ref_out), torch.randn_like(ref_lse)
    got = torch.autograd.grad((out * w1).sum() + (lse * w2).sum(), (q, k, v))
    want = torch.autograd.grad((ref_out * w1).sum() + (ref_lse * w2).sum(), (q, k, v))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9)


def test_gradcheck():
    cu = dp.cu_seqlens_from_lengths([[3, 0, 1, 4], [8]], 8, max_docs=5)
    q, k, v = _inputs(2, 8, 4, 2, 4)
    for causal, window in [(True, (-1, -1)), (False, (2, 1))]:
        fn = lambda q, k, v: dp.doc_packed_attn(  # noqa: E731
            q, k, v, cu, causal=causal, window_size=window, return_lse=True
        )
        assert torch.autograd.gradcheck(fn, (q, k, v))


@settings(max_examples=40, deadline=None)
@given(
    data=st.data(),
    B=st.integers(1, 3),
    S=st.integers(1, 90),
    heads=st.sampled_from([(1, 1), (4, 2), (3, 1), (4, 4)]),
    mask=st.sampled_from(MASKS),
)
def test_property_random_layouts(data, B, S, heads, mask):
    seed = data.draw(st.integers(0, 2**31 - 1))
    rng = random.Random(seed)
    torch.manual_seed(seed)
    cu = _layout(rng, B, S, max_docs=data.draw(st.integers(0, 4)) + max(1, S))
    q, k, v = _inputs(B, S, heads[0], heads[1], 4)
    _check(q, k, v, cu, *mask, atol=1e-9)


def test_opcheck(rng):
    from torch.library import opcheck

    B, S = 2, 19
    cu = _layout(rng, B, S)
    q, k, v = _inputs(B, S, 4, 2, 8, dtype=torch.float32)
    args = (q, k, v, cu, S, True, -1, 0, 0.3, "auto", None)
    opcheck(torch.ops.doc_packed.attn_fwd.default, args)
    out, lse = torch.ops.doc_packed.attn_fwd(*args)
    dout = torch.randn_like(out)
    bargs = (dout, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), cu, S, True, -1, 0, 0.3, "auto", None)
    opcheck(torch.ops.doc_packed.attn_bwd.default, bargs)


def test_ops_run_outside_recorded_cuda_graphs():
    """Every op does host work per call that a CUDA-graph replay would skip, so each carries
    torch's cudagraph_unsafe tag: Inductor runs it between its recorded graphs (the GPU side of
    this: tests/test_gpu_cudagraphs.py)."""
    for name in ("attn_fwd", "attn_bwd", "attn_max_logits", "argument_error"):
        assert torch.Tag.cudagraph_unsafe in getattr(torch.ops.doc_packed, name).default.tags, name


def test_compile_fullgraph_does_not_bake_cu_seqlens(rng):
    import torch._dynamo

    torch._dynamo.reset()
    B, S = 2, 48

    def step(q, k, v, cu):
        out = dp.doc_packed_attn(q, k, v, cu, window_size=(9, 0), causal=True)
        return (out.float() ** 2).sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    frames_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for layout in ([[10, 38], [48]], [[1] * 48, [20, 0, 28]]):
        cu = dp.cu_seqlens_from_lengths(layout, S, max_docs=48)
        q, k, v = _inputs(B, S, 4, 2, 8, dtype=torch.float32)
        loss = compiled(q, k, v, cu)
        grads = torch.autograd.grad(loss, (q, k, v))
        ref_loss = step(q, k, v, cu)
        ref_grads = torch.autograd.grad(ref_loss, (q, k, v))
        torch.testing.assert_close(loss, ref_loss)
        for a, b in zip(grads, ref_grads):
            torch.testing.assert_close(a, b)
    # one graph serves both layouts: cu_seqlens values are inputs, not constants
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - frames_before == 1


def test_flop_formula_exact_and_planning(rng):
    from torch.utils.flop_counter import FlopCounterMode

    B, S, Hq, Hkv, D = 2, 40, 4, 2, 8
    lengths = [[10, 0, 30], [1, 39]]
    cu = dp.cu_seqlens_from_lengths(lengths, S, max_docs=4)
    q, k, v = _inputs(B, S, Hq, Hkv, D, dtype=torch.float32)
    for causal, window in [(True, (-1, -1)), (True, (3, 0)), (False, (2, 5))]:
        visible = sum(
            int(dense_mask(cu[b].tolist(), S, causal, window).sum())
            for b in range(B)
        )
        with FlopCounterMode(display=False) as fc:
            out = dp.doc_packed_attn(q, k, v, cu, causal=causal, window_size=window)
            out.sum().backward()
        counts = fc.get_flop_counts()["Global"]
        assert counts[torch.ops.doc_packed.attn_fwd] == 4 * visible * Hq * D
        assert counts[torch.ops.doc_packed.attn_bwd] == 10 * visible * Hq * D
    # fake tensors: the planning assumption (one document per row by default, or the hint's
    # representative row: lognormal documents of that mean, counted here on the dense mask)
    from torch._subclasses.fake_tensor import FakeTensorMode

    row = int(dense_mask(list(dp.flops.representative_bounds(S, 8)), S, True, (-1, 0)).sum())

    with FakeTensorMode():
        fq, fk, fv = (torch.empty(B, S, h, D) for h in (Hq, Hkv, Hkv))
        fcu = torch.empty(B, 4, dtype=torch.int32)
        with FlopCounterMode(display=False) as fc:
            torch.ops.doc_packed.attn_fwd(fq, fk, fv, fcu, S, True, -1, 0, 1.0, "auto", None)
        assert fc.get_total_flops() == 4 * B * (S * (S + 1) // 2) * Hq * D
        # the call's planning_doc_len: the representative row of lognormal documents of mean 8
        with FlopCounterMode(display=False) as fc:
            torch.ops.doc_packed.attn_fwd(fq, fk, fv, fcu, S, True, -1, 0, 1.0, "auto", None, 8)
        assert fc.get_total_flops() == 4 * B * row * Hq * D
        # a sequence shard (4-way) counts a quarter of the row's work
        sq, sk, sv = (torch.empty(B, S // 4, h, D) for h in (Hq, Hkv, Hkv))
        with FlopCounterMode(display=False) as fc:
            torch.ops.doc_packed.attn_fwd(sq, sk, sv, fcu, S, True, -1, 0, 1.0, "auto", "g", 8)
        assert fc.get_total_flops() == -(-4 * B * row * Hq * D // 4)
