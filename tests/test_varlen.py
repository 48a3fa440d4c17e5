"""The packed (flash-attention varlen) entry, int64 cu_seqlens and strided [B, H, S, D] views,
against the float64 oracle on the CPU."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import doc_packed as dp
from api_cases import varlen_cp, varlen_dtensor
from doc_packed_testing.oracle import random_lengths
from doc_packed_testing.oracle import reference

MASKS = [(True, (-1, -1)), (False, (-1, -1)), (True, (5, 0)), (False, (4, 7)), (False, (0, 0))]


def _packed(T, Hq, Hkv, D, dtype=torch.float64):
    mk = lambda h: torch.randn(T, h, D, dtype=dtype, requires_grad=True)  # noqa: E731
    return mk(Hq), mk(Hkv), mk(Hkv)


def _cu(lengths, dtype=torch.int32):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=dtype)


def _check(q, k, v, cu, causal, window, atol=1e-10, **kw):
    out, lse = dp.doc_packed_attn_varlen(
        q, k, v, cu, kw.pop("max_seqlen", None), causal=causal, window_size=window, return_lse=True, **kw
    )
    ref_out, ref_lse = reference(q[None], k[None], v[None], cu[None], causal, window, scale=kw.get("scale"))
    assert out.shape == q.shape and lse.shape == (q.shape[1], q.shape[0])  # lse [H, T] as flash's varlen
    torch.testing.assert_close(out.double(), ref_out[0], atol=atol, rtol=atol)
    torch.testing.assert_close(lse.double(), ref_lse[0], atol=atol, rtol=atol)
    g = torch.randn_like(ref_out)
    got = torch.autograd.grad(out.double(), (q, k, v), g[0])
    want = torch.autograd.grad(ref_out, (q, k, v), g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b.double(), atol=atol * 4, rtol=atol * 4)


@pytest.mark.parametrize("causal,window", MASKS)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("lengths,Hq,Hkv", [([5, 0, 20, 12], 4, 2), ([1], 2, 2), ([0, 30, 0, 0, 7, 1], 6, 1)])
def test_parity(lengths, Hq, Hkv, dtype, causal, window):
    q, k, v = _packed(sum(lengths), Hq, Hkv, 8)
    _check(q, k, v, _cu(lengths, dtype), causal, window, max_seqlen=max(lengths))


@settings(max_examples=30, deadline=None)
@given(
    data=st.data(), T=st.integers(1, 70), heads=st.sampled_from([(1, 1), (4, 2), (3, 1)]), mask=st.sampled_from(MASKS)
)
def test_property(data, T, heads, mask):
    seed = data.draw(st.integers(0, 2**31 - 1))
    torch.manual_seed(seed)
    lengths = random_lengths(random.Random(seed), T)
    q, k, v = _packed(T, heads[0], heads[1], 4)
    _check(q, k, v, _cu(lengths, data.draw(st.sampled_from([torch.int32, torch.int64]))), *mask, atol=1e-9)


def test_fused_qkv_views_and_scale():
    # q, k, v as views of one [T, 3, H, D] projection: strided tokens, contiguous head dim
    T, H, D = 33, 3, 8
    qkv = torch.randn(T, 3, H, D, dtype=torch.float64, requires_grad=True)
    q, k, v = qkv.unbind(1)
    cu = _cu([10, 23])
    out = dp.doc_packed_attn_varlen(q, k, v, cu, 23, scale=0.3, causal=False)
    ref, _ = reference(q[None], k[None], v[None], cu[None], False, (-1, -1), scale=0.3)
    torch.testing.assert_close(out, ref[0], atol=1e-10, rtol=1e-10)


def test_same_as_rows_entry():
    """The varlen entry is doc_packed_attn on one row: bit for bit the same."""
    q, k, v = _packed(40, 4, 2, 8, dtype=torch.float32)
    cu = _cu([7, 0, 33])
    a = dp.doc_packed_attn_varlen(q, k, v, cu, 33, window_size=(3, 0), causal=True)
    b = dp.doc_packed_attn(q[None], k[None], v[None], cu[None], window_size=(3, 0), causal=True)[0]
    assert torch.equal(a, b)


def test_max_seqlen_is_checked():
    q, k, v = _packed(20, 2, 2, 4)
    cu = _cu([4, 16])
    for ok in (16, 17, 2**31 - 1, None):
        dp.doc_packed_attn_varlen(q, k, v, cu, ok, causal=True)
    with pytest.raises(
        ValueError, match=r"max_seqlen=15 is smaller than the longest document in cu_seqlens \(16 tokens\)"
    ):
        dp.doc_packed_attn_varlen(q, k, v, cu, 15, causal=True)


VARLEN_ERRORS = [
    (
        lambda q, k, v, cu, m: (q[None], k, v, cu, m),
        ValueError,
        r"q must be 3-D packed \[T, H, D\], got shape \(1, 20, 4, 8\)",
    ),
    (lambda q, k, v, cu, m: (q, k[:-1], v[:-1], cu, m), ValueError, "k and v hold 19 tokens but q holds 20"),
    (lambda q, k, v, cu, m: (q, k, v[:, :1], cu, m), ValueError, "must share"),
    (lambda q, k, v, cu, m: (q, k[..., :4], v[..., :4], cu, m), ValueError, "k's head dim 4 must equal q's head dim 8"),
    (lambda q, k, v, cu, m: (q[:, :3], k, v, cu, m), ValueError, "q has 3 heads and k/v have 2"),
    (lambda q, k, v, cu, m: (q[:0], k[:0], v[:0], cu, m), ValueError, r"q \[T, H_q, D\] has T \(tokens\) = 0"),
    (lambda q, k, v, cu, m: (q[:, :0], k, v, cu, m), ValueError, r"has H_q \(heads\) = 0"),
    (
        lambda q, k, v, cu, m: (q, k, v, cu.float(), m),
        TypeError,
        "cu_seqlens must be int32 or int64, got torch.float32",
    ),
    (lambda q, k, v, cu, m: (q, k, v, cu[None], m), ValueError, r"cu_seqlens must be 1-D \[N \+ 1\]"),
    (lambda q, k, v, cu, m: (q, k, v, cu[:1], m), ValueError, r"cu_seqlens must be 1-D \[N \+ 1\] with N >= 1"),
    (lambda q, k, v, cu, m: (q, k, v, cu, 12.0), TypeError, "max_seqlen must be an int or None, got 12.0"),
    (
        lambda q, k, v, cu, m: (q, k, v, cu, torch.tensor(12)),
        TypeError,
        "max_seqlen must be an int or None, got a Tensor",
    ),
    (lambda q, k, v, cu, m: (q, k, v, cu, 0), ValueError, r"max_seqlen must be in \[1, 2\*\*31 - 1\]"),
    (lambda q, k, v, cu, m: (q.int(), k, v, cu, m), TypeError, "q has dtype torch.int32"),
    (
        lambda q, k, v, cu, m: (q, k, v, torch.tensor([0, 12, 8, 20], dtype=torch.int64), m),
        ValueError,
        r"^cu_seqlens must be non-decreasing",
    ),
    (
        lambda q, k, v, cu, m: (q, k, v, torch.tensor([0, 12, 21]), m),
        ValueError,
        r"entry 2 is 21, past T = 20, the tokens in q",
    ),
    (lambda q, k, v, cu, m: (q, k, v, torch.tensor([0, 12, 19]), m), ValueError, r"must end at T = 20, the tokens in q, got 19"),
]


def _ok():
    q = torch.randn(20, 4, 8)
    k, v = torch.randn(20, 2, 8), torch.randn(20, 2, 8)
    return q, k, v, _cu([12, 8]), 12


@pytest.mark.parametrize("mutate,exc,match", VARLEN_ERRORS)
def test_argument_errors(mutate, exc, match, monkeypatch):
    from doc_packed.kernels import math

    def boom(*a, **kw):
        raise AssertionError("a kernel ran before validation")

    monkeypatch.setattr(math, "forward", boom)
    with pytest.raises(exc, match=match):
        dp.doc_packed_attn_varlen(*mutate(*_ok()), causal=True)


def test_right_window_with_causal_raises():
    q, k, v, cu, m = _ok()
    with pytest.raises(ValueError, match=r"right window 3 > 0 but causal=True"):
        dp.doc_packed_attn_varlen(q, k, v, cu, m, window_size=(2, 3), causal=True)


def test_compile_fullgraph():
    import torch._dynamo

    torch._dynamo.reset()

    def step(q, k, v, cu):
        out, lse = dp.doc_packed_attn_varlen(q, k, v, cu, 40, window_size=(6, 0), return_lse=True, causal=True)
        return (out.float() ** 2).sum() + lse.sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    for lengths in ([10, 30], [1] * 40, [20, 0, 20]):
        cu = _cu(lengths, torch.int64)
        q, k, v = _packed(40, 4, 2, 8, dtype=torch.float32)
        loss = compiled(q, k, v, cu)
        ref = step(q, k, v, cu)
        torch.testing.assert_close(loss, ref)
        for a, b in zip(torch.autograd.grad(loss, (q, k, v)), torch.autograd.grad(ref, (q, k, v))):
            torch.testing.assert_close(a, b)
    # a bad argument raises our error from the compiled call, before any kernel
    bad = torch.compile(
        lambda q, k, v, cu: dp.doc_packed_attn_varlen(q, k, v, cu, 40, causal=True, window_size=(-2, 0)),
        fullgraph=True,
        backend="eager",
    )
    with pytest.raises(ValueError, match=r"window_size=\(-2, 0\): each side must be >= 0"):
        bad(q, k, v, cu)
    # max_seqlen is checked in eager calls only: reading it under compile would recompile per value
    with pytest.raises(ValueError, match=r"max_seqlen must be in \[1, 2\*\*31 - 1\]"):
        dp.doc_packed_attn_varlen(q, k, v, cu, 0, causal=True)
    unread = torch.compile(lambda q, k, v, cu: dp.doc_packed_attn_varlen(q, k, v, cu, 0, causal=True), backend="eager")
    torch.testing.assert_close(unread(q, k, v, cu), dp.doc_packed_attn_varlen(q, k, v, cu, None, causal=True))


# ----------------------------------------------------------------------------- int64 everywhere


def test_int64_shares_the_int32_layout():
    from doc_packed._doc_layout import clear_cache, get_layout

    clear_cache()
    cu32 = dp.cu_seqlens_from_lengths([[3, 0, 9], [12]], 12, max_docs=4)
    a = get_layout(cu32.long(), 12)
    assert get_layout(cu32, 12) is a  # one layout per value, whatever the dtype
    assert get_layout(cu32.long().clone(), 12) is a
    q = torch.randn(2, 12, 2, 4, dtype=torch.float64)
    torch.testing.assert_close(dp.doc_packed_attn(q, q, q, cu32.long(), causal=True), reference(q, q, q, cu32)[0])
    p32 = dp.plan_context_parallel(cu32, 2)
    assert dp.plan_context_parallel(cu32.long(), 2) is p32  # the plan memoised on the shared layout
    big = torch.tensor([[0, 2**32 + 3]], dtype=torch.int64)
    with pytest.raises(ValueError, match=r"past 2\*\*31 - 1"):
        dp.plan_context_parallel(big, 2)


def test_int64_positions_and_document_ids():
    cu = dp.cu_seqlens_from_lengths([[3, 0, 9], [12]], 12, max_docs=4)
    assert torch.equal(dp.data.document_ids(cu.long(), 12), dp.data.document_ids(cu, 12))
    assert torch.equal(dp.positions(cu.long(), 12), dp.positions(cu, 12))


# ----------------------------------------------------------------------------- [B, H, S, D] views


@pytest.mark.parametrize("B", [1, 3])
def test_sdpa_layout_views(B, monkeypatch):
    """A contiguous [B, H, S, D] passed as .transpose(1, 2): exact, and with B == 1 the kernel
    gets the caller's memory (no copy); with B > 1 one copy per pass."""
    from doc_packed.kernels import math

    seen = []
    real = math.forward
    monkeypatch.setattr(math, "forward", lambda spec, q, *a: (seen.append(q.data_ptr()), real(spec, q, *a))[1])
    S, D = 29, 8
    qh = torch.randn(B, 4, S, D, dtype=torch.float64, requires_grad=True)
    kh = torch.randn(B, 2, S, D, dtype=torch.float64, requires_grad=True)
    vh = torch.randn(B, 2, S, D, dtype=torch.float64, requires_grad=True)
    q, k, v = (t.transpose(1, 2) for t in (qh, kh, vh))
    cu = dp.cu_seqlens_from_lengths([[9, 0, 20], [29], [1, 28]][:B], S, max_docs=3)
    out = dp.doc_packed_attn(q, k, v, cu, window_size=(4, 0), causal=True)
    ref, _ = reference(q, k, v, cu, True, (4, 0))
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    assert (seen[0] == qh.data_ptr()) == (B == 1)
    g = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(out, (qh, kh, vh), g), torch.autograd.grad(ref, (qh, kh, vh), g)):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9)


# ----------------------------------------------------------------------------- ranks


def test_varlen_context_parallel(run_ranks):
    cases = [
        dict(cu=[0, 5, 5, 20, 37], Hq=4, Hkv=2, causal=True, window=(-1, -1), max_seqlen=17),
        dict(cu=[0, 30, 31, 37], Hq=2, Hkv=1, causal=False, window=(4, 3), max_seqlen=30, dtype=torch.int64),
        dict(cu=[0, 36], Hq=2, Hkv=2, causal=True, window=(7, 0), max_seqlen=36),
    ]
    for errs in run_ranks(varlen_cp, 2, cases):
        assert max(errs) < 1e-10


def test_varlen_dtensor(run_ranks):
    """Shard(0) of T is the sequence placement (context parallel), Shard(1) the heads."""
    from torch.distributed.tensor import Replicate, Shard

    cases = [
        dict(cu=[0, 9, 9, 24, 40], Hq=4, Hkv=2, window=(-1, -1), dim=0),
        dict(cu=[0, 9, 24, 39], Hq=4, Hkv=2, window=(3, 0), dim=0),  # T odd: uneven shards
        dict(cu=[0, 9, 24, 40], Hq=4, Hkv=2, window=(3, 0), dim=1),
        dict(cu=[0, 40], Hq=2, Hkv=2, window=(-1, -1), dim=None),
    ]
    want = {0: ((Shard(0),), (Shard(1),)), 1: ((Shard(1),), (Shard(0),)), None: ((Replicate(),), (Replicate(),))}
    for report in run_ranks(varlen_dtensor, 2, cases):
        for c, (err, out_pl, grad_pl, lse_pl) in zip(cases, report):
            assert err < 1e-10
            assert out_pl == grad_pl == want[c["dim"]][0] and lse_pl == want[c["dim"]][1]


# ----------------------------------------------------------------------------- on a GPU


def _fa4_reason():
    if not torch.cuda.is_available():
        return "needs a CUDA device"
    from doc_packed.kernels import fa4

    return fa4.unsupported_reason(torch.empty(0, 8, 64, device="cuda", dtype=torch.bfloat16), 2)


_FA4_WHY_NOT = _fa4_reason()
_GPU_BACKENDS = [
    "flash",
    "flex",
    pytest.param("fa4", marks=pytest.mark.skipif(_FA4_WHY_NOT is not None, reason=f"FA4 {_FA4_WHY_NOT}")),
]
_needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.gpu
@_needs_cuda
@pytest.mark.parametrize("backend", _GPU_BACKENDS)
@pytest.mark.parametrize("B", [1, 2])
def test_gpu_sdpa_layout_views(backend, B):
    """[B, H, S, D].transpose(1, 2) on each GPU backend: the same result and gradients as the
    contiguous call (B == 1: the kernel reads the strided view; B == 2: the op's one copy), both
    within bf16 tolerance of the float64 oracle."""
    S, Hq, Hkv, D = 1024, 8, 2, 64
    g = torch.Generator().manual_seed(7)
    qh, kh, vh = (torch.randn(B, h, S, D, generator=g).cuda().bfloat16().requires_grad_() for h in (Hq, Hkv, Hkv))
    dout = torch.randn(B, S, Hq, D, generator=g).cuda().bfloat16()
    cu = dp.cu_seqlens_from_lengths([[300, 0, 600, 124], [1024]][:B], S, max_docs=4).cuda()
    out = dp.doc_packed_attn(
        qh.transpose(1, 2), kh.transpose(1, 2), vh.transpose(1, 2), cu, window_size=(64, 0), backend=backend, causal=True
    )
    grads = torch.autograd.grad(out, (qh, kh, vh), dout)
    qc, kc, vc = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (qh, kh, vh))
    ref = dp.doc_packed_attn(qc, kc, vc, cu, window_size=(64, 0), backend=backend, causal=True)
    ref_grads = torch.autograd.grad(ref, (qc, kc, vc), dout)
    assert _rel(out, ref) <= 1e-3
    for a, b in zip(grads, ref_grads):
        assert _rel(a.transpose(1, 2), b) <= 1e-3
    oracle, _ = reference(qc.detach().cpu(), kc.detach().cpu(), vc.detach().cpu(), cu.cpu(), True, (64, 0))
    assert _rel(out.cpu(), oracle) <= 1e-2


@pytest.mark.gpu
@_needs_cuda
@pytest.mark.parametrize("backend", ["auto", *_GPU_BACKENDS])
def test_gpu_varlen_int64_no_sync_after_first_call(backend):
    """The varlen entry with an int64 CUDA cu_seqlens and max_seqlen: exact within bf16 tolerance,
    and later calls (forward and backward) make no host sync."""
    T = 2048
    cu = torch.tensor([0, 500, 500, 1700, 1701, 2048], dtype=torch.int64, device="cuda")
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(T, h, 128, generator=g).cuda().bfloat16().requires_grad_() for h in (16, 4, 4))
    out = dp.doc_packed_attn_varlen(q, k, v, cu, 1200, backend=backend, causal=True)  # first call: reads cu once
    oracle, _ = reference(q.detach().cpu()[None], k.detach().cpu()[None], v.detach().cpu()[None], cu.cpu()[None])
    assert _rel(out.cpu(), oracle[0]) <= 1e-2
    out.float().sum().backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            dp.doc_packed_attn_varlen(q, k, v, cu, 1200, backend=backend, causal=True).float().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
