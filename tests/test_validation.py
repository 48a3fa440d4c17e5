"""Every bad-input rule raises a clear ValueError/TypeError naming the argument."""

import pytest
import torch

import doc_packed as dp

B, S, H, D = 2, 16, 4, 8


def ok():
    q = torch.randn(B, S, H, D)
    k = torch.randn(B, S, 2, D)
    v = torch.randn(B, S, 2, D)
    cu = dp.cu_seqlens_from_lengths([[4, 12], [16]], S, max_docs=3)
    return q, k, v, cu


def call(q, k, v, cu, **kw):
    return dp.doc_packed_attn(q, k, v, cu, **{"causal": True, **kw})


def test_valid_baseline():
    assert call(*ok()).shape == (B, S, H, D)


@pytest.mark.parametrize(
    "mutate,exc,match",
    [
        (lambda q, k, v, cu: (q.tolist(), k, v, cu), TypeError, "q must be a torch.Tensor"),
        (lambda q, k, v, cu: (q[0], k, v, cu), ValueError, "q must be 4-D"),
        (lambda q, k, v, cu: (q, k[:, :-1], v[:, :-1], cu), ValueError, "share q's"),
        (lambda q, k, v, cu: (q, k, v[:, :, :1], cu), ValueError, "must share"),
        (lambda q, k, v, cu: (q, k[..., :4], v[..., :4], cu), ValueError, "head dim"),
        (lambda q, k, v, cu: (q[:, :, :3], k, v, cu), ValueError, "multiple of k/v heads"),
        (lambda q, k, v, cu: (q.int(), k, v, cu), TypeError, "q has dtype"),
        (lambda q, k, v, cu: (q, k.double(), v, cu), TypeError, "share one dtype"),
        (lambda q, k, v, cu: (q, k, v, cu.short()), TypeError, "cu_seqlens must be int32 or int64"),
        (lambda q, k, v, cu: (q, k, v, cu[0]), ValueError, r"cu_seqlens must be \[B, MAX_DOCS \+ 1\]"),
        (lambda q, k, v, cu: (q, k, v, cu[:, :1]), ValueError, r"MAX_DOCS >= 1"),
        (lambda q, k, v, cu: (q, k, v, cu[:1]), ValueError, "cu_seqlens has 1 rows"),
        (lambda q, k, v, cu: (q.transpose(2, 3).contiguous().transpose(2, 3), k, v, cu), ValueError, "head dim must be contiguous"),
        (lambda q, k, v, cu: (q[:, :0], k[:, :0], v[:, :0], cu), ValueError, r"S \(tokens per row\) = 0"),
    ],
)
def test_tensor_rules(mutate, exc, match):
    with pytest.raises(exc, match=match):
        call(*mutate(*ok()))


def _cu(rows):
    return torch.tensor(rows, dtype=torch.int32)


@pytest.mark.parametrize(
    "rows,match",
    [
        ([[1, 4, 16], [0, 16, 16]], r"cu_seqlens\[0\] must start at 0"),
        ([[0, 8, 4], [0, 16, 16]], r"cu_seqlens\[0\] must be non-decreasing"),
        ([[0, 4, 16], [0, 17, 16]], r"cu_seqlens\[1\] entry 1 is 17, past the sequence length 16"),
        ([[0, 4, 12], [0, 16, 16]], r"cu_seqlens\[0\] must end at the sequence length 16"),
    ],
)
def test_cu_seqlens_value_rules(rows, match):
    q, k, v, _ = ok()
    with pytest.raises(ValueError, match=match):
        call(q, k, v, _cu(rows))


@pytest.mark.parametrize(
    "kw,exc,match",
    [
        (dict(window_size=(-2, 0)), ValueError, "must be >= 0, or -1"),
        (dict(window_size=(3, -5), causal=False), ValueError, "must be >= 0, or -1"),
        (dict(window_size=(3, 2)), ValueError, "causal=True"),
        (dict(window_size=(3,)), TypeError, "pair of ints"),
        (dict(window_size=(1.5, 0)), TypeError, "pair of ints"),
        (dict(causal=1), TypeError, "causal must be a bool"),
        (dict(scale=-1.0), ValueError, "scale must be a positive"),
        (dict(scale="x"), TypeError, "scale must be a float"),
        (dict(backend="cudnn"), ValueError, "backend must be one of"),
        (dict(backend="flash"), ValueError, "backend='flash' needs a CUDA tensor"),
        (dict(seq_len=32), ValueError, "seq_len is only"),
    ],
)
def test_argument_rules(kw, exc, match):
    with pytest.raises(exc, match=match):
        call(*ok(), **kw)


def test_in_place_change_of_cu_seqlens_is_revalidated():
    q, k, v, cu = ok()
    call(q, k, v, cu)  # cached as valid
    cu[0, 1] = 20  # in-place write bumps the version counter
    with pytest.raises(ValueError, match="past the sequence length"):
        call(q, k, v, cu)


def test_sequence_shard_without_group_is_an_error():
    q, k, v, cu = ok()
    with pytest.raises(ValueError, match="no context-parallel group"):
        torch.ops.doc_packed.attn_fwd(q[:, :8], k[:, :8], v[:, :8], cu, S, True, -1, 0, 1.0, "auto", None)


def test_layout_helpers():
    cu = dp.cu_seqlens_from_lengths([[3, 0, 2], [7]], 7, max_docs=4)
    assert cu.tolist() == [[0, 3, 5, 7, 7], [0, 7, 7, 7, 7]]
    assert dp.data.document_ids(cu, 7).tolist() == [[0, 0, 0, 1, 1, 2, 2], [0] * 7]
    assert dp.positions(cu, 7).tolist() == [[0, 1, 2, 0, 1, 0, 1], list(range(7))]
    with pytest.raises(ValueError, match="more than seq_len"):
        dp.cu_seqlens_from_lengths([[8]], 7)
    with pytest.raises(ValueError, match="max_docs=1 is smaller"):
        dp.cu_seqlens_from_lengths([[3, 4]], 7, max_docs=1)
    docs = [torch.arange(n, dtype=torch.float32) + 100 * i for i, n in enumerate([5, 9, 3, 2])]
    rows, cu = dp.pack_documents(docs, 10, pad_value=-1)
    assert rows.shape == (2, 10) and cu.shape[0] == 2
    # every document appears contiguously, bounded by cu_seqlens
    seen = []
    for b in range(2):
        bounds = cu[b].tolist()
        for s, e in zip(bounds[:-1], bounds[1:]):
            if e > s:
                seen.append(rows[b, s:e].tolist())
    for d in docs:
        assert d.tolist() in seen
    with pytest.raises(ValueError, match="more than seq_len"):
        dp.pack_documents([torch.zeros(11)], 10, split_long=False)


def test_validation_is_remembered_per_signature_and_only_for_valid_calls(monkeypatch):
    from doc_packed import api

    q, k, v, cu = ok()
    seen = []
    real = api._validated
    monkeypatch.setattr(api, "_validated", lambda *a: seen.append(a) or real(*a))
    monkeypatch.setattr(api, "_VALIDATED", {})
    call(q, k, v, cu)
    call(q.clone(), k.clone(), v.clone(), cu.clone())  # same signature: remembered
    assert len(seen) == 1
    # whatever differs is validated again, and a failure is never remembered
    with pytest.raises(TypeError, match="causal must be a bool"):
        call(q, k, v, cu, causal=1)  # == True, but not a bool
    with pytest.raises(TypeError, match="causal must be a bool"):
        call(q, k, v, cu, causal=1)
    with pytest.raises(ValueError, match="head dim must be contiguous"):
        call(q.transpose(2, 3).contiguous().transpose(2, 3), k, v, cu)  # same shape, other strides
    with pytest.raises(ValueError, match="must be >= 0, or -1"):
        call(q, k, v, cu, window_size=[-2, 0])  # unhashable: validated every time
    with dp.planning(doc_len=512):  # the planning block is part of the signature
        call(q, k, v, cu)
    assert len(seen) == 6
    assert len(api._VALIDATED) == 2
