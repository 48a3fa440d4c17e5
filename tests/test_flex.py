"""The flex backend's host-side parts on CPU: the closed-form BlockMask and the traced passes.

The Triton kernels need a GPU (tests/test_gpu.py); here the traced forward/backward graphs run
eagerly (flex's dense math path), which checks everything around the kernel: the interval
mask_mod, the lse conventions (log2 inside flex, natural log outside, -inf for empty rows),
[T, H, D] <-> [B, H, L, D] views, GQA and context-parallel-shaped problems (queries against a
different key set). The block classification is checked against torch's own
``create_block_mask`` evaluated densely.
"""

import random

import pytest
import torch
from doc_packed_testing.oracle import random_lengths
from hypothesis import given, settings
from hypothesis import strategies as st
from doc_packed_testing.oracle import reference

import doc_packed as dp
from doc_packed import kernels
from doc_packed.kernels import flex
from doc_packed.kernels.spec import VarlenSpec

BLOCK = flex.BLOCK


def dense_spec_mask(cu_q, cu_k, causal, left, right, Tq, Tk):
    """[Tq, Tk] bool from the VarlenSpec definition, token by token (independent of the code)."""
    m = torch.zeros(Tq, Tk, dtype=torch.bool)
    for s in range(len(cu_q) - 1):
        lq, lk = cu_q[s + 1] - cu_q[s], cu_k[s + 1] - cu_k[s]
        for i in range(lq):
            for j in range(lk):
                d = i + (lk - lq)
                ok = left < 0 or j >= d - left
                ok &= j <= d if causal else (right < 0 or j <= d + right)
                m[cu_q[s] + i, cu_k[s] + j] = ok
    return m


def torch_block_sets(mask: torch.Tensor, B: int, Lq: int, Lk: int):
    """(partial, full) [B, nQ, nKV] from torch's create_block_mask on a dense mask."""
    from torch.nn.attention.flex_attention import create_block_mask

    rows = mask.view(B, Lq, B, Lk).diagonal(dim1=0, dim2=2).permute(2, 0, 1).contiguous()
    bm = create_block_mask(
        lambda b, h, q, kv: rows[b, q, kv], B, None, Lq, Lk, device="cpu", BLOCK_SIZE=BLOCK
    )
    nq, nk = Lq // BLOCK, Lk // BLOCK

    def dense(num, idx):
        out = torch.zeros(B, nq, nk, dtype=torch.bool)
        for b in range(B):
            for i in range(nq):
                out[b, i, idx[b, 0, i, : num[b, 0, i]].long()] = True
        return out

    return dense(bm.kv_num_blocks, bm.kv_indices), dense(bm.full_kv_num_blocks, bm.full_kv_indices)


def local_spec(rows, S, causal, left, right):
    cu = [0]
    for b, lengths in enumerate(rows):
        acc = b * S
        for n in lengths:
            acc += n
            cu.append(acc)
    return VarlenSpec(cu, cu, causal, left, right, row_len=S)


MASKS = [(True, -1, 0), (False, -1, -1), (True, 200, 0), (False, 100, 37), (True, 0, 0)]


def _check_tables(spec):
    B, Lq, Lk = flex.problem_rows(spec)
    lo, hi, partial, full = flex.block_tables(spec)
    dense = dense_spec_mask(spec.cu_q, spec.cu_k, spec.causal, spec.left, spec.right, spec.total_q, spec.total_k)
    if spec.row_len is not None:  # rows are independent: the dense mask is block diagonal
        want_p, want_f = torch_block_sets(dense, B, Lq, Lk)
    else:
        want_p, want_f = torch_block_sets(dense, 1, Lq, Lk)
    assert torch.equal(full, want_f)
    # partial blocks may over-approximate (masked by mask_mod), never miss a visible pair
    assert not (want_p & ~partial).any()
    assert not (partial & full).any()
    # the interval buffers reproduce the dense mask exactly
    kv = torch.arange(Lk)
    got = (kv >= lo[..., None]) & (kv <= hi[..., None])
    want = dense.view(B, Lq, B, Lk).diagonal(dim1=0, dim2=2).permute(2, 0, 1)
    assert torch.equal(got, want)
    return partial, want_p


@pytest.mark.parametrize("causal,left,right", MASKS)
def test_block_tables_match_create_block_mask(causal, left, right):
    rng = random.Random(3)
    S = 640
    rows = [[S], random_lengths(rng, S), [1] * 5 + [0, 130, S - 135]]
    partial, want_p = _check_tables(local_spec(rows, S, causal, left, right))
    if left < 0:  # without windows every row's key set is a contiguous hull: exact
        assert torch.equal(partial, want_p)


@pytest.mark.parametrize("causal,left,right", MASKS)
def test_block_tables_context_parallel_shape(causal, left, right):
    # queries are chunks of their documents (bottom-right aligned), keys the documents' prefixes
    cu_q = [0, 100, 100, 356, 512]
    cu_k = [0, 300, 340, 896, 1024]
    _check_tables(VarlenSpec(cu_q, cu_k, causal, left, right))


@pytest.mark.slow
@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    rows=st.integers(1, 3),
    blocks=st.integers(1, 4),
    mask=st.sampled_from(MASKS),
)
def test_block_tables_property(seed, rows, blocks, mask):
    rng = random.Random(seed)
    S = blocks * BLOCK
    _check_tables(local_spec([random_lengths(rng, S) for _ in range(rows)], S, *mask))


def _problem(seed, T_q, T_k, Hq, Hkv, D):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T_q, Hq, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(T_k, Hkv, D, generator=g, dtype=torch.float64) for _ in range(2))
    return q, k, v, torch.randn(T_q, Hq, D, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("causal,left,right", MASKS)
@pytest.mark.parametrize("heads", [(4, 4), (4, 1)])
def test_traced_passes_match_oracle(causal, left, right, heads):
    rng = random.Random(11)
    S, B, D = 256, 2, 16
    lengths = [random_lengths(rng, S), [S // 2, 0, S // 2]]
    cu = dp.cu_seqlens_from_lengths(lengths, S, max_docs=S)
    spec = local_spec(lengths, S, causal, left, right)
    q, k, v, dout = _problem(0, B * S, B * S, heads[0], heads[1], D)
    window = (left, right)
    rq, rk, rv = (t.view(B, S, *t.shape[1:]).clone().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = reference(rq, rk, rv, cu, causal, window, scale=0.3)
    ref_grads = torch.autograd.grad(ref_out, (rq, rk, rv), dout.view(ref_out.shape))
    out, lse = flex.forward(spec, q, k, v, 0.3, compile_graph=False)
    torch.testing.assert_close(out.view(ref_out.shape), ref_out)
    torch.testing.assert_close(lse.view(heads[0], B, S).transpose(0, 1), ref_lse)
    grads = flex.backward(spec, dout, q, k, v, out, lse, 0.3, compile_graph=False)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got.view(want.shape), want)
    # the math kernel's (out, lse) feed flex's backward: passes can use different backends
    out_m, lse_m = kernels.forward(spec, q, k, v, 0.3, "math")
    torch.testing.assert_close(lse_m, lse)
    for got, want in zip(flex.backward(spec, dout, q, k, v, out_m, lse_m, 0.3, compile_graph=False), grads):
        torch.testing.assert_close(got, want)


def test_traced_passes_context_parallel_shape_and_empty_rows():
    # segment 1 has queries but no keys: those rows see nothing (out 0, lse -inf, no NaN)
    cu_q, cu_k = [0, 100, 228, 384], [0, 300, 300, 512]
    spec = VarlenSpec(cu_q, cu_k, True, -1, 0)
    q, k, v, dout = _problem(1, 384, 512, 4, 2, 16)
    out, lse = flex.forward(spec, q, k, v, 0.25, compile_graph=False)
    want_out, want_lse = kernels.forward(spec, q, k, v, 0.25, "math")
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(lse, want_lse)
    assert (lse[:, 100:228] == -float("inf")).all() and (out[100:228] == 0).all()
    grads = flex.backward(spec, dout, q, k, v, out, lse, 0.25, compile_graph=False)
    want = kernels.backward(spec, dout, q, k, v, want_out, want_lse, 0.25, "math")
    for got, w in zip(grads, want):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, w)


def test_auto_choice_and_forced_flex_rules():
    q = torch.randn(4, 2, 16)
    spec = local_spec([[512]], 512, True, -1, 0)
    assert kernels.choose("auto", spec, q) == "math"  # CPU: the exact kernel
    cp_spec = VarlenSpec([0, 128], [0, 256], True, -1, 0)
    assert kernels.choose("auto", cp_spec, q) == "math"
    with pytest.raises(ValueError, match="backend='flex' needs a CUDA tensor"):
        kernels.choose("flex", spec, q)
    with pytest.raises(ValueError, match="backend must be one of"):
        kernels.choose("triton", spec, q)


def test_column_tables_match_torch_transpose():
    from torch.nn.attention.flex_attention import BlockMask

    rng = random.Random(9)
    S = 1024
    spec = local_spec([random_lengths(rng, S), [S]], S, False, 300, 2)
    mask = flex.block_mask(spec, torch.device("cpu"))
    bm = BlockMask.from_kv_blocks(*mask.tensors[:4], BLOCK_SIZE=BLOCK, seq_lengths=(S, S))
    ours = mask.rebuild(mask.tensors)
    names = ("q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")
    theirs = [getattr(bm, n) for n in names]
    got = [ours[mask.pos[4 + i]] for i in range(4)]
    for a, b in zip(got, theirs):
        assert torch.equal(a, b)


def test_block_tables_are_contiguous_int32():
    # the Triton kernels index the tables assuming dense rows; a strided table gave wrong
    # gradients on GPU before this was enforced
    spec = local_spec([[100, 412], [512]], 512, True, -1, 0)
    mask = flex.block_mask(spec, torch.device("cpu"))
    assert len(mask.tensors) >= 8
    for t in mask.tensors:
        assert t.dtype == torch.int32 and t.is_contiguous()


def test_auto_falls_back_when_flex_cannot_compile(monkeypatch):
    # pretend flex and flash both take the input; flex fails to compile -> auto warns once,
    # runs the next backend, and does not try flex again; a forced flex raises
    q = torch.randn(256, 2, 16)
    spec = local_spec([[256]], 256, True, -1, 0)
    calls = []

    def broken(*args, **kwargs):
        calls.append("flex")
        raise flex.CompileError("no triton")

    monkeypatch.setattr(kernels, "_broken", {})
    monkeypatch.setattr(flex, "unsupported_reason", lambda q, rows: None)
    monkeypatch.setattr(flex, "forward", broken)
    monkeypatch.setattr(kernels.flash, "supports", lambda q: False)
    assert kernels.choose("auto", spec, q) == "flex"
    with pytest.warns(RuntimeWarning, match="backend 'flex' failed"):
        out, lse = kernels.forward(spec, q, q, q, 0.25, "auto")
    want, _ = kernels.forward(spec, q, q, q, 0.25, "math")
    torch.testing.assert_close(out, want)
    assert kernels.choose("auto", spec, q) == "math" and calls == ["flex"]
    with pytest.raises(flex.CompileError):
        kernels.forward(spec, q, q, q, 0.25, "flex")
