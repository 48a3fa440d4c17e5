"""docs/coming_from.md, one test per mapping: our call against a reference that implements the
other library's documented convention (torch's own flex/SDPA on the CPU where they run there;
an explicit mask written from the library's docstring otherwise). GPU tests at the end compare
with torch's varlen_attn and flash-attention's flash_attn_varlen_func themselves."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import doc_packed as dp
from doc_packed_testing.gpu_parity import cuda_packed
from peer_oracles import flash_oracle

# ----------------------------------------------------------------------------- references


def flash_varlen_reference(q, k, v, cu, causal, window, scale=None):
    """flash_attn_varlen_func's documented semantics (self-attention, seqlen_q == seqlen_k):
    query i of a sequence sees keys j with i - window[0] <= j <= i + window[1] (-1: unbounded),
    and with causal=True also j <= i; "window_size[1] is ignored when causal" (flash sets it to
    0). Returns out [T, H, D] and softmax_lse [H, T], natural log (tests/peer_oracles.py)."""
    return flash_oracle(q, k, v, cu, cu, causal=causal, window=window, scale=scale)


def _flex(q, k, v, mask_mod, B, S):
    """torch's flex_attention on [B, H, S, D] (eager on the CPU): out and its natural-log lse."""
    from torch.nn.attention import flex_attention as fa

    bm = fa.create_block_mask(mask_mod, B=B, H=None, Q_LEN=S, KV_LEN=S, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "called without torch.compile()": fine for a reference
        if hasattr(fa, "AuxRequest"):
            out, aux = fa.flex_attention(q, k, v, block_mask=bm, enable_gqa=True, return_aux=fa.AuxRequest(lse=True))
            return out, aux.lse
        return fa.flex_attention(q, k, v, block_mask=bm, enable_gqa=True, return_lse=True)


def torchtitan_document_ids(tokens, eos_id):
    """torchtitan get_document_mask_mod: EOS closes its document; ``seq_idx`` per token."""
    eos = tokens == eos_id
    eos[:, -1] = True
    acc = torch.cumsum(eos.long(), dim=1)
    seq_idx = torch.zeros_like(acc)
    seq_idx[:, 1:] = acc[:, :-1]
    return seq_idx


def torchtitan_varlen_cu(tokens, eos_id):
    """torchtitan create_varlen_metadata_for_document: every row's documents (cut after each EOS,
    empty ones dropped) packed into one [B * S] sequence; (cu [N + 1] int32, max length)."""
    B, S = tokens.shape
    parts, offset = [], 0
    for b in range(B):
        eos = (tokens[b] == eos_id).nonzero(as_tuple=True)[0].to(torch.int32)
        row = torch.unique_consecutive(
            torch.cat([torch.tensor([0], dtype=torch.int32), eos + 1, torch.tensor([S], dtype=torch.int32)])
        )
        parts.append(row[:-1] + offset)
        offset += S
    cu = torch.cat(parts + [torch.tensor([offset], dtype=torch.int32)])
    return cu, int(cu.diff().max())


def _packed(T, Hq, Hkv, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(T, h, D, generator=g, dtype=torch.float64) for h in (Hq, Hkv, Hkv)]


CU = torch.tensor([0, 7, 7, 30, 31, 48], dtype=torch.int32)

# ----------------------------------------------------------------------------- flash-attention


@pytest.mark.parametrize(
    "causal,window",
    [(True, (-1, -1)), (False, (-1, -1)), (True, (6, 0)), (True, (4, -1)), (False, (3, 5)), (False, (0, 0))],
)
def test_flash_varlen_mapping(causal, window):
    """flash_attn_varlen_func(q, k, v, cu, cu, max_s, max_s, softmax_scale=s, causal=c,
    window_size=w) == doc_packed_attn_varlen(q, k, v, cu, max_s, scale=s, causal=c,
    window_size=w); lse [H, T] as flash's softmax_lse."""
    q, k, v = _packed(48, 4, 2)
    out, lse = dp.doc_packed_attn_varlen(q, k, v, CU, 23, causal=causal, window_size=window, scale=0.2, return_lse=True)
    ref_out, ref_lse = flash_varlen_reference(q, k, v, CU, causal, window, scale=0.2)
    torch.testing.assert_close(out, ref_out, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(lse, ref_lse, atol=1e-10, rtol=1e-10)


def test_flash_causal_right_window_raises_where_flash_ignores_it():
    """flash: causal=True, window_size=(4, 3) runs as (4, 0). We raise; pass (4, 0)."""
    q, k, v = _packed(48, 2, 2)
    with pytest.raises(ValueError, match=r"right window 3 > 0 but causal=True"):
        dp.doc_packed_attn_varlen(q, k, v, CU, 23, causal=True, window_size=(4, 3))
    ours = dp.doc_packed_attn_varlen(q, k, v, CU, 23, causal=True, window_size=(4, 0))
    flash, _ = flash_varlen_reference(q, k, v, CU, True, (4, 3))
    torch.testing.assert_close(ours, flash, atol=1e-10, rtol=1e-10)


def test_torch_varlen_window_as_causal():
    """torch varlen_attn has no is_causal: window_size=(-1, 0) is causal, (W, 0) a causal
    window of W keys before the query. Ours takes either spelling."""
    q, k, v = _packed(48, 4, 1)
    as_window = dp.doc_packed_attn_varlen(q, k, v, CU, 23, causal=False, window_size=(-1, 0))
    as_causal = dp.doc_packed_attn_varlen(q, k, v, CU, 23, causal=True)
    ref, _ = flash_varlen_reference(q, k, v, CU, False, (-1, 0))
    torch.testing.assert_close(as_window, ref, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(as_causal, ref, atol=1e-10, rtol=1e-10)
    windowed = dp.doc_packed_attn_varlen(q, k, v, CU, 23, causal=False, window_size=(5, 0))
    torch.testing.assert_close(windowed, flash_varlen_reference(q, k, v, CU, True, (5, 0))[0], atol=1e-10, rtol=1e-10)


# ----------------------------------------------------------------------------- SDPA / flex, torchtitan


def _rows(B, S, Hq, Hkv, D=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, h, S, D, generator=g, dtype=torch.float64) for h in (Hq, Hkv, Hkv)]


def test_sdpa_layout_and_is_causal():
    """SDPA(q, k, v, is_causal=True) on [B, H, S, D], one document per row ==
    doc_packed_attn(q.transpose(1, 2), ..., cu_seqlens [[0, S]] * B).transpose(1, 2)."""
    B, S = 2, 33
    q, k, v = _rows(B, S, 4, 4)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    cu = dp.cu_seqlens_from_lengths([[S]] * B, S)
    ours = dp.doc_packed_attn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), cu, causal=True).transpose(1, 2)
    torch.testing.assert_close(ours, ref, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("W", [1, 4, 9])
def test_torchtitan_flex_document_and_sliding_window(W):
    """torchtitan: get_document_mask_mod(tokens, eos_id) & get_sliding_window_mask_mod(W)
    (``kv <= q and q - kv < W``: W keys counting the query itself) under flex ==
    doc_packed_attn(..., cu_seqlens_from_eos(tokens, eos_id), window_size=(W - 1, 0)), and
    flex's lse [B, H, S] == ours."""
    B, S, eos_id = 2, 40, 0
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 5, (B, S), generator=g)
    q, k, v = _rows(B, S, 4, 2)
    seq_idx = torchtitan_document_ids(tokens, eos_id)

    def mask_mod(b, h, qi, ki):
        return (seq_idx[b, qi] == seq_idx[b, ki]) & (ki <= qi) & (qi - ki < W)

    ref_out, ref_lse = _flex(q, k, v, mask_mod, B, S)
    cu = dp.cu_seqlens_from_eos(tokens, eos_id)
    out, lse = dp.doc_packed_attn(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), cu, window_size=(W - 1, 0), return_lse=True, causal=True
    )
    torch.testing.assert_close(out.transpose(1, 2), ref_out, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(lse, ref_lse, atol=1e-10, rtol=1e-10)
    off_by_one = dp.doc_packed_attn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), cu, window_size=(W, 0), causal=True)
    assert (off_by_one.transpose(1, 2) - ref_out).abs().max() > 1e-3  # (W, 0) sees one key more


def test_torchtitan_varlen_metadata():
    """torchtitan's varlen path packs all rows into one sequence with
    create_varlen_metadata_for_document; our rows entry with cu_seqlens_from_eos (or our varlen
    entry with their cu) computes the same attention."""
    B, S, eos_id = 3, 32, 7
    g = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, 8, (B, S), generator=g)
    tokens[1, -1] = eos_id  # a row ending with EOS
    tokens[2] = 1  # a row without EOS
    q, k, v = _rows(B, S, 4, 2)
    cu_tt, max_tt = torchtitan_varlen_cu(tokens, eos_id)
    flat = lambda t: t.transpose(1, 2).flatten(0, 1)  # noqa: E731  (torchtitan's xq.transpose(1, 2).flatten(0, 1))
    ref, _ = flash_varlen_reference(flat(q), flat(k), flat(v), cu_tt, False, (-1, 0))
    theirs = dp.doc_packed_attn_varlen(flat(q), flat(k), flat(v), cu_tt, max_tt, causal=True)
    rows = dp.doc_packed_attn(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dp.cu_seqlens_from_eos(tokens, eos_id), causal=True
    )
    torch.testing.assert_close(theirs, ref, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(rows.flatten(0, 1), ref, atol=1e-10, rtol=1e-10)


# ----------------------------------------------------------------------------- on a GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("window", [(-1, 0), (64, 0), (-1, -1), (32, 16)])
@pytest.mark.parametrize("backend", ["auto", "flash"])
def test_gpu_torch_varlen_attn(window, backend):
    """torch.nn.attention.varlen.varlen_attn(q, k, v, cu, cu, m, m, window_size=w,
    enable_gqa=True, return_aux=AuxRequest(lse=True)) against ours (causal=False, same window):
    out and lse ([H, T]) within bf16 rounding."""
    import inspect

    from torch.nn.attention import varlen

    q, k, v, cu = cuda_packed()
    kw = {"enable_gqa": True} if "enable_gqa" in inspect.signature(varlen.varlen_attn).parameters else {}
    ref_out, ref_lse = varlen.varlen_attn(
        q, k, v, cu, cu, 600, 600, window_size=window, return_aux=varlen.AuxRequest(lse=True), **kw
    )
    out, lse = dp.doc_packed_attn_varlen(
        q, k, v, cu, 600, causal=False, window_size=window, return_lse=True, backend=backend
    )
    assert lse.shape == ref_lse.shape == (8, 1024)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (True, (64, 0)), (False, (32, 16))])
def test_gpu_flash_attn_varlen_func(causal, window):
    """flash_attn_varlen_func itself (flash-attn 2, else FA4's cute interface, whichever is
    installed) against ours with the same arguments: out, and lse [H, T]."""
    q, k, v, cu = cuda_packed()
    try:
        from flash_attn import flash_attn_varlen_func

        ref, ref_lse, _ = flash_attn_varlen_func(
            q, k, v, cu, cu, 600, 600, causal=causal, window_size=window, return_attn_probs=True
        )
    except ImportError:
        try:
            from flash_attn.cute import flash_attn_varlen_func
        except ImportError:
            pytest.skip("flash-attn is not installed")
        cute_window = tuple(None if w < 0 else w for w in window)  # FA4 spells unbounded None
        # FA4 takes them by keyword (its fourth positional is ``qv``)
        ref, ref_lse = flash_attn_varlen_func(
            q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=600, max_seqlen_k=600, causal=causal,
            window_size=cute_window, return_lse=True,
        )
    out, lse = dp.doc_packed_attn_varlen(q, k, v, cu, 600, causal=causal, window_size=window, return_lse=True)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    if ref_lse is not None:
        assert lse.shape == ref_lse.shape == (8, 1024)
        torch.testing.assert_close(lse, ref_lse.float(), atol=2e-2, rtol=2e-2)
