"""doc_packed.compat's drop-ins against the peers' semantics, written out here as float64 oracles
from their sources (flash-attention 2's csrc/flash_attn/flash_api.cpp and interface; torch 2.13's
torch/nn/attention/varlen.py), and, on a GPU, against the peers themselves."""

import inspect

import pytest
import torch

import doc_packed as dp
from doc_packed import compat
from gpu_parity import cuda_packed

# ----------------------------------------------------------------------------- the peers' semantics


def flash_oracle(q, k, v, cu_q, cu_k, *, causal=False, window=(-1, -1), scale=None, softcap=0.0):
    """flash-attention 2's varlen forward in float64, as its kernel applies the arguments:
    ``causal`` forces the right window to 0; a negative side is unbounded; the mask is aligned
    bottom-right (query i of a segment of Lq queries and Lk keys sees key j when
    i + Lk - Lq - left <= j <= i + Lk - Lq + right); softcap > 0 maps each scaled logit s to
    softcap * tanh(s / softcap), anything else is off. Returns out [T, H, D] and lse [H, T]."""
    T, H, D = q.shape
    G = H // k.shape[1]
    scale = D**-0.5 if scale is None else scale
    left, right = window
    if causal:
        right = 0
    out = torch.zeros(T, H, v.shape[-1], dtype=torch.float64)
    lse = torch.full((H, T), float("-inf"), dtype=torch.float64)
    bq, bk = cu_q.tolist(), cu_k.tolist()
    for qa, qe, ka, ke in zip(bq[:-1], bq[1:], bk[:-1], bk[1:]):
        lq, lk = qe - qa, ke - ka
        if lq == 0:
            continue
        i = torch.arange(lq)[:, None] + (lk - lq)
        j = torch.arange(lk)[None, :]
        m = torch.ones(lq, lk, dtype=torch.bool)
        if left >= 0:
            m &= j >= i - left
        if right >= 0:
            m &= j <= i + right
        qs = q[qa:qe].double().transpose(0, 1)
        ks = k[ka:ke].double().repeat_interleave(G, 1).transpose(0, 1)
        vs = v[ka:ke].double().repeat_interleave(G, 1).transpose(0, 1)
        s = qs @ ks.transpose(1, 2) * scale
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        s = s.masked_fill(~m, float("-inf"))
        lse[:, qa:qe] = torch.logsumexp(s, -1)
        out[qa:qe] = (torch.softmax(s, -1) @ vs).transpose(0, 1)
    return out, lse


def torch_varlen_oracle(query, key, value, cu_q, cu_k, *, window=(-1, -1), scale=None):
    """torch 2.13's varlen_attn: ``is_causal = window_size == (-1, 0)``, then flash's kernel with
    that flag and the window as given."""
    return flash_oracle(query, key, value, cu_q, cu_k, causal=tuple(window) == (-1, 0), window=window, scale=scale)


# flash-attention 2.8's flash_attn_varlen_func, copied from its signature: (name, default)
FLASH2_SIGNATURE = [
    ("q", None), ("k", None), ("v", None), ("cu_seqlens_q", None), ("cu_seqlens_k", None),
    ("max_seqlen_q", None), ("max_seqlen_k", None), ("dropout_p", 0.0), ("softmax_scale", None),
    ("causal", False), ("window_size", (-1, -1)), ("softcap", 0.0), ("alibi_slopes", None),
    ("deterministic", False), ("return_attn_probs", False), ("block_table", None),
]  # fmt: skip

CU = torch.tensor([0, 7, 7, 30, 31, 48], dtype=torch.int32)  # a zero-length and a one-token document
MAXLEN = 23


def _packed(T=48, Hq=4, Hkv=2, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(T, h, D, generator=g, dtype=torch.float64) for h in (Hq, Hkv, Hkv)]


def _close(a, b):
    torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


@pytest.fixture
def no_kernel(monkeypatch):
    """Any kernel running fails the test: errors must come before."""
    from doc_packed.kernels import math

    def boom(*a, **kw):
        raise AssertionError("a kernel ran before validation")

    monkeypatch.setattr(math, "forward", boom)


# ----------------------------------------------------------------------------- flash-attention 2


def test_flash_signature_is_flash_attentions():
    params = inspect.signature(compat.flash_attn_varlen_func).parameters
    got = [(n, None if p.default is inspect.Parameter.empty else p.default) for n, p in params.items()]
    assert got == FLASH2_SIGNATURE
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params.values())


def test_flash_defaults_are_full_attention():
    """The port that silently changed the mask (issue 38): seven positional arguments, flash's
    defaults, give full attention inside each document, not causal."""
    q, k, v = _packed()
    out = compat.flash_attn_varlen_func(q, k, v, CU, CU, MAXLEN, MAXLEN)
    _close(out, flash_oracle(q, k, v, CU, CU)[0])
    causal = flash_oracle(q, k, v, CU, CU, causal=True)[0]
    assert (out - causal).abs().max() > 0.1


@pytest.mark.parametrize(
    "causal,window",
    [
        (False, (-1, -1)),
        (True, (-1, -1)),
        (False, (-1, 0)),  # flash: causal spelled as a window
        (True, (4, 0)),
        (True, (4, 3)),  # flash ignores the right window under causal (doc_packed_attn raises)
        (True, (4, -1)),
        (False, (3, 5)),
        (False, (0, 0)),
        (False, (-7, 2)),  # any negative side is unbounded
        (False, (100, 100)),  # wider than every document: no window
    ],
)
def test_flash_masks(causal, window):
    q, k, v = _packed()
    out, lse, s_dmask = compat.flash_attn_varlen_func(
        q, k, v, CU, CU, MAXLEN, MAXLEN, 0.0, 0.3, causal, window, return_attn_probs=True
    )
    ref_out, ref_lse = flash_oracle(q, k, v, CU, CU, causal=causal, window=window, scale=0.3)
    _close(out, ref_out)
    _close(lse, ref_lse)
    assert s_dmask.numel() == 0 and s_dmask.dtype == q.dtype  # flash without dropout returns it empty


@pytest.mark.parametrize("softcap", [0.0, 0, 1.5, 30.0])
def test_flash_softcap_zero_is_off(softcap):
    q, k, v = _packed(seed=1)
    out = compat.flash_attn_varlen_func(q * 4, k, v, CU, CU, MAXLEN, MAXLEN, causal=True, softcap=softcap)
    _close(out, flash_oracle(q * 4, k, v, CU, CU, causal=True, softcap=softcap)[0])


def test_flash_gqa_int64_cu_and_separate_equal_tensors():
    """GQA 4:1, int64 boundaries, and cu_seqlens_k a different tensor with the same values."""
    q, k, v = _packed(Hq=8, Hkv=2, seed=2)
    cu64 = CU.long()
    out = compat.flash_attn_varlen_func(q, k, v, cu64, cu64.clone(), MAXLEN, 40, causal=True)
    _close(out, flash_oracle(q, k, v, CU, CU, causal=True)[0])


def test_flash_deterministic_runs_the_invariant_backend():
    q, k, v = (t.float().requires_grad_() for t in _packed(seed=3))
    a = compat.flash_attn_varlen_func(q, k, v, CU, CU, MAXLEN, MAXLEN, causal=True, deterministic=True)
    b = dp.doc_packed_attn_varlen(q, k, v, CU, MAXLEN, causal=True, backend="auto-invariant")
    assert torch.equal(a, b)
    torch.testing.assert_close(a.double(), flash_oracle(q, k, v, CU, CU, causal=True)[0], atol=1e-5, rtol=1e-5)


def test_flash_gradients():
    q, k, v = (t.requires_grad_() for t in _packed(seed=4))
    out = compat.flash_attn_varlen_func(q, k, v, CU, CU, MAXLEN, MAXLEN, 0.0, None, False, (5, 2))
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), g)
    want = torch.autograd.grad(flash_oracle(q, k, v, CU, CU, window=(5, 2))[0], (q, k, v), g)
    for a, b in zip(got, want):
        _close(a, b)


@pytest.mark.parametrize(
    "kw,exc,match",
    [
        ({"dropout_p": 0.1}, ValueError, r"dropout_p=0\.1 is not supported.*dropout_p=0\.0"),
        ({"alibi_slopes": torch.ones(4)}, ValueError, r"alibi_slopes=a Tensor is not supported"),
        ({"block_table": torch.zeros(5, 1, dtype=torch.int32)}, ValueError, r"block_table=a Tensor .*paged"),
        ({"softcap": -1.0}, ValueError, r"softcap=-1\.0 is negative"),
        ({"window_size": (2,)}, TypeError, r"window_size must be a pair of ints"),
        ({"causal": 1}, TypeError, r"causal must be a bool"),
        ({"return_attn_probs": None}, TypeError, r"return_attn_probs must be a bool"),
        ({"max_seqlen_q": 2.5}, TypeError, r"max_seqlen_q must be an int"),
        ({"max_seqlen_k": 0}, ValueError, r"max_seqlen_k must be in \[1"),
        ({"max_seqlen_k": 20}, ValueError, r"max_seqlen=20 is smaller than the longest document"),
        ({"cu_seqlens_k": CU + 0 * CU - torch.tensor([0, 1, 0, 0, 0, 0])}, ValueError, r"cu_seqlens_q and cu_seqlens_k differ \(values\)"),  # noqa: E501
        ({"cu_seqlens_k": CU[:-1]}, ValueError, r"cu_seqlens_q and cu_seqlens_k differ \(shapes"),
    ],
)
def test_flash_unsupported_and_bad_arguments_raise_before_any_kernel(kw, exc, match, no_kernel):
    q, k, v = _packed()
    args = dict(q=q, k=k, v=v, cu_seqlens_q=CU, cu_seqlens_k=CU, max_seqlen_q=MAXLEN, max_seqlen_k=MAXLEN)
    with pytest.raises(exc, match=match):
        compat.flash_attn_varlen_func(**{**args, **kw})


# ----------------------------------------------------------------------------- torch varlen_attn


def test_torch_signature_covers_the_installed_one():
    """Every parameter of the installed torch's varlen_attn (2.13 here, 2.11 on the GPU machines)
    is ours too, same kind and default; ours is 2.13's exactly."""
    from torch.nn.attention import varlen

    theirs = inspect.signature(varlen.varlen_attn).parameters
    ours = inspect.signature(compat.varlen_attn).parameters
    for name, p in theirs.items():
        assert name in ours, name
        assert (ours[name].kind, ours[name].default) == (p.kind, p.default), name
    if "enable_gqa" in theirs:  # torch >= 2.13
        assert list(ours) == list(theirs)


@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (6, 0), (3, 5), (0, 0), [-1, 0]])
def test_torch_windows(window):
    """torch has no is_causal: (-1, -1) (default) is full, (-1, 0) causal, (W, 0) a causal window."""
    from torch.nn.attention.varlen import AuxRequest

    q, k, v = _packed(seed=5)
    out, lse = compat.varlen_attn(q, k, v, CU, CU, MAXLEN, MAXLEN, window_size=window, scale=0.2, return_aux=AuxRequest(lse=True))
    ref_out, ref_lse = torch_varlen_oracle(q, k, v, CU, CU, window=tuple(window), scale=0.2)
    _close(out, ref_out)
    _close(lse, ref_lse)


def test_torch_defaults_and_the_port_from_the_issue():
    """varlen_attn(q, k, v, cu, cu, m, m) is bidirectional (issue 38: doc_packed_attn_varlen
    defaulted to causal, 2.97 off); GQA without enable_gqa is accepted (torch 2.11's behaviour)."""
    q, k, v = _packed(Hq=6, Hkv=2, seed=6)
    out = compat.varlen_attn(q, k, v, CU, CU, MAXLEN, MAXLEN)
    assert isinstance(out, torch.Tensor)
    _close(out, torch_varlen_oracle(q, k, v, CU, CU)[0])
    _close(compat.varlen_attn(q, k, v, CU, CU, MAXLEN, MAXLEN, enable_gqa=True), out)
    with pytest.raises(TypeError, match="causal"):  # our own entry has no default to fall back on
        dp.doc_packed_attn_varlen(q, k, v, CU, MAXLEN)


def test_torch_num_splits_one_is_batch_invariant():
    q, k, v = (t.float() for t in _packed(seed=7))
    a = compat.varlen_attn(q, k, v, CU, CU, MAXLEN, MAXLEN, window_size=(-1, 0), num_splits=1)
    assert torch.equal(a, dp.doc_packed_attn_varlen(q, k, v, CU, MAXLEN, causal=True, backend="auto-invariant"))


@pytest.mark.parametrize(
    "kw,exc,match",
    [
        ({"seqused_k": torch.ones(5, dtype=torch.int32)}, ValueError, r"seqused_k=a Tensor is not supported"),
        ({"block_table": torch.zeros(5, 1, dtype=torch.int32)}, ValueError, r"block_table=a Tensor"),
        ({"cu_seq_k": None}, ValueError, r"cu_seq_k=None is not supported.*pass cu_seq_q's tensor"),
        ({"cu_seq_k": torch.tensor([0, 8, 8, 30, 31, 48], dtype=torch.int32)}, ValueError, r"cu_seq_q and cu_seq_k differ"),  # noqa: E501
        ({"max_q": None}, TypeError, r"max_q must be an int"),  # torch's ints are required
        ({"num_splits": 1.0}, TypeError, r"num_splits must be an int or None"),
        ({"window_size": (1, 2, 3)}, TypeError, r"window_size must be a pair"),
    ],
)
def test_torch_unsupported_and_bad_arguments_raise_before_any_kernel(kw, exc, match, no_kernel):
    q, k, v = _packed()
    args = dict(query=q, key=k, value=v, cu_seq_q=CU, cu_seq_k=CU, max_q=MAXLEN, max_k=MAXLEN)
    with pytest.raises(exc, match=match):
        compat.varlen_attn(**{**args, **kw})


# ----------------------------------------------------------------------------- on a GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    "args,kw",
    [((), {}), ((0.0, None, True), {}), ((), {"window_size": (64, 0)}), ((), {"causal": True, "window_size": (32, 16)}),
     ((), {"window_size": (-1, 0)}), ((), {"softcap": 5.0, "causal": True})],
)  # fmt: skip
def test_gpu_same_call_through_flash_attn(args, kw):
    """The same call, flash-attention 2's flash_attn_varlen_func and ours: out and lse."""
    flash_attn = pytest.importorskip("flash_attn", reason="flash-attn 2 is not installed")
    if not hasattr(flash_attn, "flash_attn_varlen_func"):  # FA4 alone installs flash_attn.cute only
        pytest.skip("flash-attn 2 is not installed (flash_attn has no flash_attn_varlen_func)")
    q, k, v, cu = cuda_packed()
    call = (q, k, v, cu, cu, 600, 600, *args)
    ref, ref_lse, _ = flash_attn.flash_attn_varlen_func(*call, return_attn_probs=True, **kw)
    out, lse, _ = compat.flash_attn_varlen_func(*call, return_attn_probs=True, **kw)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (64, 0), (32, 16)])
def test_gpu_same_call_through_torch_varlen_attn(window):
    """The same call, torch's varlen_attn and ours (GQA; enable_gqa where torch has it)."""
    from torch.nn.attention import varlen

    q, k, v, cu = cuda_packed()
    kw = {"enable_gqa": True} if "enable_gqa" in inspect.signature(varlen.varlen_attn).parameters else {}
    aux = varlen.AuxRequest(lse=True)
    ref, ref_lse = varlen.varlen_attn(q, k, v, cu, cu, 600, 600, window_size=window, return_aux=aux, **kw)
    out, lse = compat.varlen_attn(q, k, v, cu, cu, 600, 600, window_size=window, return_aux=aux, **kw)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse.float(), atol=2e-2, rtol=2e-2)
