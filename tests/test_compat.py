"""doc_packed.compat's drop-ins against the peers' semantics, the float64 oracles of
tests/peer_oracles.py (written from the peers' sources), and, on a GPU, against the peers
themselves."""

import inspect
import warnings

import pytest
import torch

import doc_packed as dp
from doc_packed import compat
from doc_packed.compat import cute
from doc_packed_testing.gpu_parity import cuda_packed
from peer_oracles import fa4_oracle, flash_oracle, torch_varlen_oracle

# flash-attention 2.8's flash_attn_varlen_func, copied from its signature: (name, default)
FLASH2_SIGNATURE = [
    ("q", None), ("k", None), ("v", None), ("cu_seqlens_q", None), ("cu_seqlens_k", None),
    ("max_seqlen_q", None), ("max_seqlen_k", None), ("dropout_p", 0.0), ("softmax_scale", None),
    ("causal", False), ("window_size", (-1, -1)), ("softcap", 0.0), ("alibi_slopes", None),
    ("deterministic", False), ("return_attn_probs", False), ("block_table", None),
]  # fmt: skip

# flash-attn-4 4.0.0b36's flash_attn.cute.flash_attn_varlen_func, copied from its signature
FA4_SIGNATURE = [
    ("q", None), ("k", None), ("v", None), ("qv", None), ("cu_seqlens_q", None), ("cu_seqlens_k", None),
    ("max_seqlen_q", None), ("max_seqlen_k", None), ("min_seqlen_k", None), ("seqused_q", None),
    ("seqused_k", None), ("gather_kv_indices", None), ("page_table", None), ("softmax_scale", None),
    ("causal", False), ("window_size", (None, None)), ("learnable_sink", None), ("softcap", 0.0),
    ("num_splits", 1), ("pack_gqa", None), ("deterministic", False), ("score_mod", None),
    ("score_mod_bwd", None), ("mask_mod", None), ("block_sparse_tensors", None), ("aux_tensors", None),
    ("aux_scalars", None), ("return_lse", False), ("scheduler_metadata", None), ("seqlen_k_per_split", None),
    ("disable_scheduler_metadata", False), ("gather_bwd_recompute_p", False), ("gather_bwd_token_chunk", None),
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


# ----------------------------------------------------------------------------- FlashAttention-4 (flash_attn.cute)


def test_fa4_signature_is_fa4s():
    params = inspect.signature(cute.flash_attn_varlen_func).parameters
    got = [(n, None if p.default is inspect.Parameter.empty else p.default) for n, p in params.items()]
    assert got == FA4_SIGNATURE
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params.values())


def _import_fa4():
    """flash_attn.cute (FlashAttention-4) where it imports, else skip with the reason. Its CuTe
    DSL warns DeprecationWarning at import (4.8.1), which pytest's settings make an error."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            import flash_attn.cute as fa4
        except Exception as err:  # not installed, or its CUDA runtime does not load
            pytest.skip(f"flash_attn.cute (flash-attn-4) does not import: {type(err).__name__}: {err}")
    return fa4


def test_fa4_signature_is_the_installed_fa4s():
    """Where FA4 is installed (the GPU machines: 4.0.0b36), ours is its signature exactly."""
    fa4 = _import_fa4()
    theirs = inspect.signature(fa4.flash_attn_varlen_func).parameters
    ours = inspect.signature(cute.flash_attn_varlen_func).parameters
    assert [(n, p.kind, p.default) for n, p in ours.items()] == [(n, p.kind, p.default) for n, p in theirs.items()]


def test_fa4_defaults_are_full_attention_and_return_a_pair():
    """Eight positional arguments (FA4 puts qv fourth), FA4's defaults: full attention in each
    document, and FA4's (out, lse) pair with lse None when nothing needs it."""
    q, k, v = _packed()
    out, lse = cute.flash_attn_varlen_func(q, k, v, None, CU, CU, MAXLEN, MAXLEN)
    assert lse is None
    _close(out, fa4_oracle(q, k, v, CU)[0])
    assert (out - fa4_oracle(q, k, v, CU, causal=True)[0]).abs().max() > 0.1


@pytest.mark.parametrize(
    "causal,window",
    [
        (False, (None, None)),
        (True, (None, None)),
        (False, (None, 0)),  # FA4: causal spelled as a window
        (True, (4, None)),
        (True, (4, 3)),  # causal sets the right side to 0
        (True, (-1, -1)),  # both negative: no window (flash-attention 2's spelling)
        (False, (-3, -7)),
        (False, (3, 5)),
        (False, (0, 0)),
        (False, (None, 5)),
        (False, (5, None)),
        (False, (4, 0)),
        (False, (100, 100)),  # wider than every document: no window
        (True, [2, None]),  # a list, as FA4 takes it
    ],
)
def test_fa4_masks(causal, window):
    q, k, v = _packed(seed=8)
    out, lse = cute.flash_attn_varlen_func(
        q, k, v, cu_seqlens_q=CU, cu_seqlens_k=CU, softmax_scale=0.3, causal=causal, window_size=window, return_lse=True
    )
    ref_out, ref_lse = fa4_oracle(q, k, v, CU, causal=causal, window=tuple(window), scale=0.3)
    _close(out, ref_out)
    _close(lse, ref_lse)


@pytest.mark.parametrize("softcap", [0.0, 0, None, 1.5])
@pytest.mark.parametrize("with_sink", [False, True])
def test_fa4_softcap_and_learnable_sink(softcap, with_sink):
    q, k, v = _packed(seed=9)
    sink = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64) if with_sink else None
    out, lse = cute.flash_attn_varlen_func(
        q * 4, k, v, None, CU, CU, causal=True, learnable_sink=sink, softcap=softcap, return_lse=True
    )
    ref_out, ref_lse = fa4_oracle(q * 4, k, v, CU, causal=True, softcap=softcap, sink=sink)
    _close(out, ref_out)
    _close(lse, ref_lse)


def test_fa4_gradients_through_out_lse_and_sink():
    """FA4 4.0.0b36 differentiates out, the returned lse and learnable_sink: so does the drop-in."""
    q, k, v = (t.requires_grad_() for t in _packed(seed=10))
    sink = torch.tensor([0.3, -0.5, 1.0, 0.0], dtype=torch.float64, requires_grad=True)
    kw = dict(causal=False, window_size=(5, 2), learnable_sink=sink, softcap=2.0)
    out, lse = cute.flash_attn_varlen_func(q, k, v, None, CU, CU, **kw, return_lse=True)
    ref_out, ref_lse = fa4_oracle(q, k, v, CU, causal=False, window=(5, 2), sink=sink, softcap=2.0)
    g, w = torch.randn_like(out), torch.randn_like(lse)
    got = torch.autograd.grad((out * g).sum() + (lse * w).sum(), (q, k, v, sink))
    want = torch.autograd.grad((ref_out * g).sum() + (ref_lse * w).sum(), (q, k, v, sink))
    for a, b in zip(got, want):
        _close(a, b)


def test_fa4_lse_without_return_lse_is_kept_for_the_backward_only():
    """FA4 allocates the lse when an input requires grad and returns it even without
    return_lse; its backward then ignores the lse's gradient: ours is detached."""
    q, k, v = _packed(seed=11)
    assert cute.flash_attn_varlen_func(q, k, v, None, CU, CU)[1] is None
    out, lse = cute.flash_attn_varlen_func(q.requires_grad_(), k, v, None, CU, CU)
    assert lse is not None and not lse.requires_grad and out.requires_grad
    _close(lse, fa4_oracle(q, k, v, CU)[1])


def test_fa4_gqa_value_head_dim_int64_cu_and_separate_equal_tensors():
    """GQA 4:1, v's head dim unlike q's (FA4 takes hdim_v), int64 boundaries, cu_seqlens_k a
    different tensor with the same values, and a tensor max_seqlen (a device hint FA4 does not
    read on the host)."""
    g = torch.Generator().manual_seed(12)
    q, k = torch.randn(48, 8, 8, generator=g, dtype=torch.float64), torch.randn(48, 2, 8, generator=g, dtype=torch.float64)
    v = torch.randn(48, 2, 12, generator=g, dtype=torch.float64)
    cu64 = CU.long()
    out, lse = cute.flash_attn_varlen_func(
        q, k, v, None, cu64, cu64.clone(), torch.tensor(MAXLEN), 40, causal=True, return_lse=True
    )
    ref_out, ref_lse = fa4_oracle(q, k, v, CU, causal=True)
    assert out.shape == (48, 8, 12)
    _close(out, ref_out)
    _close(lse, ref_lse)


def test_fa4_kernel_hints_do_not_change_the_result():
    """num_splits, pack_gqa, min_seqlen_k, scheduler_metadata, seqlen_k_per_split and
    disable_scheduler_metadata steer FA4's kernels only: the same result, bit for bit."""
    q, k, v = _packed(seed=13)
    plain = cute.flash_attn_varlen_func(q, k, v, None, CU, CU, causal=True)[0]
    hinted = cute.flash_attn_varlen_func(
        q, k, v, None, CU, CU, MAXLEN, MAXLEN, 1, causal=True, num_splits=0, pack_gqa=True,
        scheduler_metadata=object(), seqlen_k_per_split=64, disable_scheduler_metadata=True,
        aux_tensors=[], aux_scalars=(),
    )[0]  # fmt: skip
    assert torch.equal(plain, hinted)


def test_fa4_deterministic_runs_the_invariant_backend():
    q, k, v = (t.float() for t in _packed(seed=14))
    a = cute.flash_attn_varlen_func(q, k, v, None, CU, CU, causal=True, deterministic=True)[0]
    b = dp.doc_packed_attn_varlen(q, k, v, CU, MAXLEN, causal=True, backend="auto-invariant")
    assert torch.equal(a, b)


@pytest.mark.parametrize(
    "kw,exc,match",
    [
        ({"qv": torch.ones(48, 4, 8)}, ValueError, r"^qv=a Tensor is not supported by doc_packed: no MLA"),
        ({"seqused_q": torch.ones(5, dtype=torch.int32)}, ValueError, r"^seqused_q=a Tensor is not supported"),
        ({"seqused_k": torch.ones(5, dtype=torch.int32)}, ValueError, r"^seqused_k=a Tensor is not supported"),
        ({"gather_kv_indices": torch.zeros(48, 4, dtype=torch.int32)}, ValueError, r"^gather_kv_indices=a Tensor"),
        ({"page_table": torch.zeros(5, 1, dtype=torch.int32)}, ValueError, r"^page_table=a Tensor .*paged"),
        ({"score_mod": abs}, ValueError, r"^score_mod=<built-in function abs> is not supported.*softcap="),
        ({"score_mod_bwd": abs}, ValueError, r"^score_mod_bwd="),
        ({"mask_mod": abs}, ValueError, r"^mask_mod=.*no mask_mod"),
        ({"block_sparse_tensors": (1,)}, ValueError, r"^block_sparse_tensors=\(1,\) is not supported"),
        ({"aux_tensors": [torch.ones(2)]}, ValueError, r"^aux_tensors=.*score_mod/mask_mod"),
        ({"aux_scalars": (2.0,)}, ValueError, r"^aux_scalars=\(2\.0,\) is not supported"),
        ({"gather_bwd_recompute_p": True}, ValueError, r"^gather_bwd_recompute_p=True .*gather_kv_indices only"),
        ({"gather_bwd_token_chunk": 64}, ValueError, r"^gather_bwd_token_chunk=64 .*gather_kv_indices only"),
        ({"cu_seqlens_q": None}, ValueError, r"^cu_seqlens_q=None is not supported.*doc_packed_attn\)$"),
        ({"cu_seqlens_k": None}, ValueError, r"^cu_seqlens_k=None is not supported"),
        ({"cu_seqlens_k": CU[:-1]}, ValueError, r"cu_seqlens_q and cu_seqlens_k differ \(shapes"),
        ({"cu_seqlens_k": torch.tensor([0, 8, 8, 30, 31, 48], dtype=torch.int32)}, ValueError, r"differ \(values\)"),
        ({"window_size": (-1, 0)}, ValueError, r"^window_size=\(-1, 0\) is not supported .*negative left side"),
        ({"window_size": (4, -1), "causal": False}, ValueError, r"negative right side.*None for an unbounded side"),
        ({"window_size": (-1, 4), "causal": True}, ValueError, r"^window_size=\(-1, 4\) with causal=True"),
        ({"window_size": (2.0, None)}, TypeError, r"^window_size must be a pair \(left, right\) of ints or None"),
        ({"window_size": (1, 2, 3)}, TypeError, r"^window_size must be a pair"),
        ({"softcap": -2.0}, ValueError, r"^softcap=-2\.0 is negative.*pass softcap=2\.0"),
        ({"softcap": "off"}, TypeError, r"^softcap must be a float"),
        ({"causal": 1}, TypeError, r"^causal must be a bool, got int"),
        ({"return_lse": None}, TypeError, r"^return_lse must be a bool"),
        ({"deterministic": "yes"}, TypeError, r"^deterministic must be a bool"),
        ({"num_splits": None}, TypeError, r"^num_splits must be an int, got NoneType"),
        ({"pack_gqa": 1}, TypeError, r"^pack_gqa must be a bool"),
        ({"min_seqlen_k": 2.5}, TypeError, r"^min_seqlen_k must be an int or None"),
        ({"max_seqlen_q": 2.5}, TypeError, r"^max_seqlen_q must be an int, a tensor or None, got 2\.5"),
        ({"max_seqlen_k": 0}, ValueError, r"^max_seqlen_k must be in \[1"),
        ({"max_seqlen_k": 20}, ValueError, r"max_seqlen=20 is smaller than the longest document"),
        ({"learnable_sink": torch.zeros(3, dtype=torch.float64)}, ValueError, r"^learnable_sink must be \[H_q\] = \[4\]"),
        ({"learnable_sink": torch.zeros(4, dtype=torch.int32)}, TypeError, r"^learnable_sink must be a floating tensor"),
        ({"learnable_sink": [0.0] * 4}, TypeError, r"^learnable_sink must be a tensor \[H_q\] or None, got list"),
    ],
)
def test_fa4_unsupported_and_bad_arguments_raise_before_any_kernel(kw, exc, match, no_kernel):
    q, k, v = _packed()
    args = dict(q=q, k=k, v=v, cu_seqlens_q=CU, cu_seqlens_k=CU, max_seqlen_q=MAXLEN, max_seqlen_k=MAXLEN)
    with pytest.raises(exc, match=match):
        cute.flash_attn_varlen_func(**{**args, **kw})


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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    "kw",
    [{}, {"causal": True}, {"window_size": (64, 0)}, {"window_size": (32, 16)}, {"window_size": (None, 0)},
     {"causal": True, "window_size": (-1, -1)}, {"causal": True, "softcap": 5.0},
     {"causal": True, "learnable_sink": "float32"}, {"window_size": (48, None), "learnable_sink": "bfloat16"}],
)  # fmt: skip
def test_gpu_same_call_through_fa4(kw):
    """The same call, FA4's flash_attn.cute.flash_attn_varlen_func and ours: out, lse, and the
    gradients of q, k, v (and the sink) through both."""
    fa4 = _import_fa4()
    q, k, v, cu = cuda_packed()
    kw = dict(kw)
    if "learnable_sink" in kw:
        g = torch.Generator(device="cuda").manual_seed(1)
        kw["learnable_sink"] = torch.randn(8, generator=g, device="cuda").to(getattr(torch, kw["learnable_sink"]))
    results = []
    for fn in (fa4.flash_attn_varlen_func, cute.flash_attn_varlen_func):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        sink = kw.get("learnable_sink")
        sink = None if sink is None else sink.detach().clone().requires_grad_()
        call = {**kw, "learnable_sink": sink} if sink is not None else kw
        out, lse = fn(*leaves, None, cu, cu, 600, 600, return_lse=True, **call)
        dout = torch.randn(out.shape, generator=torch.Generator(device="cuda").manual_seed(2), device="cuda")
        wrt = leaves + ([sink] if sink is not None else [])
        grads = torch.autograd.grad(out, wrt, dout.to(out.dtype))
        results.append((out, lse, grads))
    (ref, ref_lse, ref_grads), (out, lse, grads) = results
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse.float(), atol=2e-2, rtol=2e-2)
    for name, a, b in zip(("dq", "dk", "dv", "dsink"), grads, ref_grads):
        torch.testing.assert_close(a.float(), b.float(), atol=5e-2, rtol=5e-2, msg=lambda m, n=name: f"{n}: {m}")
