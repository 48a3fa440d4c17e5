"""cu_seqlens_from_document_ids / cu_seqlens_from_eos against plain-Python references."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import doc_packed as dp


def ref_from_ids(row: list[int]) -> list[int]:
    """Boundaries of the runs of equal ids, written token by token."""
    bounds = [0]
    for p in range(1, len(row)):
        if row[p] != row[p - 1]:
            bounds.append(p)
    return bounds + [len(row)]


def ref_from_eos(row: list[bool]) -> list[int]:
    """Each EOS closes its document; the rest of the row is one more document."""
    bounds, start = [0], 0
    for p, is_eos in enumerate(row):
        if is_eos:
            bounds.append(p + 1)
            start = p + 1
    if start < len(row):
        bounds.append(len(row))
    return bounds


def padded(rows: list[list[int]], max_docs: int, S: int) -> list[list[int]]:
    return [r + [S] * (max_docs + 1 - len(r)) for r in rows]


ids_rows = st.integers(1, 40).flatmap(
    lambda S: st.lists(st.lists(st.integers(0, 3), min_size=S, max_size=S), min_size=1, max_size=4)
)


@settings(max_examples=150, deadline=None)
@given(rows=ids_rows, extra=st.integers(0, 3), dtype=st.sampled_from([torch.int64, torch.int32, torch.uint8]))
def test_document_ids_batched(rows, extra, dtype):
    S = len(rows[0])
    want = [ref_from_ids(r) for r in rows]
    most = max(len(w) - 1 for w in want)
    got = dp.cu_seqlens_from_document_ids(torch.tensor(rows, dtype=dtype))
    assert got.dtype == torch.int32 and got.tolist() == padded(want, most, S)
    got = dp.cu_seqlens_from_document_ids(torch.tensor(rows, dtype=dtype), max_docs=most + extra)
    assert got.tolist() == padded(want, most + extra, S)
    one = dp.cu_seqlens_from_document_ids(torch.tensor(rows[0], dtype=dtype))
    assert one.dim() == 1 and one.tolist() == want[0]


@settings(max_examples=150, deadline=None)
@given(rows=ids_rows, eos=st.integers(0, 3), extra=st.integers(0, 3))
def test_eos_batched(rows, eos, extra):
    S = len(rows[0])
    tokens = torch.tensor(rows)
    want = [ref_from_eos([t == eos for t in r]) for r in rows]
    most = max(len(w) - 1 for w in want)
    assert dp.cu_seqlens_from_eos(tokens, eos).tolist() == padded(want, most, S)
    assert dp.cu_seqlens_from_eos(tokens == eos, max_docs=most + extra).tolist() == padded(want, most + extra, S)
    assert dp.cu_seqlens_from_eos(tokens[0], eos).tolist() == want[0]


def test_eos_conventions_by_example():
    eos = 9
    # EOS is the last token of its document; no empty document after a final EOS
    assert dp.cu_seqlens_from_eos(torch.tensor([5, 1, 9, 4, 9]), eos).tolist() == [0, 3, 5]
    # tokens after the last EOS form one more document; a row without EOS is one document
    assert dp.cu_seqlens_from_eos(torch.tensor([[5, 9, 4, 4], [1, 2, 3, 4]]), eos).tolist() == [[0, 2, 4], [0, 4, 4]]
    # two EOS in a row: the second is a 1-token document; an EOS first is a 1-token document
    assert dp.cu_seqlens_from_eos(torch.tensor([9, 9, 9, 1]), eos).tolist() == [0, 1, 2, 3, 4]
    # fixed slots for uniform shapes across ranks and steps
    assert dp.cu_seqlens_from_eos(torch.tensor([1, 9, 1]), eos, max_docs=4).tolist() == [0, 2, 3, 3, 3]


def test_matches_torchtitans_document_ids():
    """torchtitan's document mask: ``mask = batch == eos_id; mask[:, -1] = True;
    acc = cumsum(mask); seq_idx[:, 1:] = acc[:, :-1]`` (the EOS in the document it closes).
    Our boundaries give the same document id for every token."""
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 4, (5, 33), generator=g)
    eos = 0
    mask = tokens == eos
    mask[:, -1] = True
    acc = torch.cumsum(mask.long(), dim=1)
    seq_idx = torch.zeros_like(acc)
    seq_idx[:, 1:] = acc[:, :-1]
    cu = dp.cu_seqlens_from_eos(tokens, eos)
    assert torch.equal(dp.data.document_ids(cu, 33), seq_idx)


def test_output_feeds_the_op():
    tokens = torch.tensor([[3, 3, 0, 5, 0, 2, 2, 2], [1, 0, 1, 1, 1, 1, 0, 1]])
    cu = dp.cu_seqlens_from_eos(tokens, 0, max_docs=4)
    q = torch.randn(2, 8, 2, 4, dtype=torch.float64)
    from doc_packed_testing.oracle import reference

    out = dp.doc_packed_attn(q, q, q, cu, causal=True)
    ref, _ = reference(q, q, q, cu)
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize(
    "call,exc,match",
    [
        (lambda: dp.cu_seqlens_from_document_ids([0, 0, 1]), TypeError, "doc_ids must be a torch.Tensor"),
        (lambda: dp.cu_seqlens_from_document_ids(torch.zeros(3)), TypeError, "integers or bools, got torch.float32"),
        (
            lambda: dp.cu_seqlens_from_document_ids(torch.zeros(2, 2, 2, dtype=torch.long)),
            ValueError,
            r"\[S\] or \[B, S\]",
        ),
        (lambda: dp.cu_seqlens_from_document_ids(torch.zeros(2, 0, dtype=torch.long)), ValueError, "B, S >= 1"),
        (
            lambda: dp.cu_seqlens_from_document_ids(torch.tensor([0, 1, 2]), max_docs=2),
            ValueError,
            "3 documents, more than max_docs=2",
        ),
        (
            lambda: dp.cu_seqlens_from_document_ids(torch.tensor([0, 1]), max_docs=0),
            ValueError,
            "max_docs must be >= 1",
        ),
        (
            lambda: dp.cu_seqlens_from_document_ids(torch.tensor([0, 1]), max_docs=2.0),
            TypeError,
            "max_docs must be an int",
        ),
        (lambda: dp.cu_seqlens_from_eos(torch.tensor([1, 2])), TypeError, "needs eos_id"),
        (lambda: dp.cu_seqlens_from_eos(torch.tensor([1, 2]), eos_id=True), TypeError, "eos_id must be an int"),
        (lambda: dp.cu_seqlens_from_eos(torch.tensor([1.0, 2.0]), eos_id=1), TypeError, "integers or bools"),
    ],
)
def test_errors(call, exc, match):
    with pytest.raises(exc, match=match):
        call()
