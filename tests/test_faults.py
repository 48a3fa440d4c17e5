"""Nothing silently wrong: the fault classes of the single-process op (docs/contract.md).

1. A NaN/Inf in one document stays in that document (forward and backward).
2. Batch invariance: a document's bits do not depend on the other documents or where it sits.
3. Precision at the edges: saturated softmax in fp16/bf16, queries that see exactly one key.
4. The layout cache is never stale, whatever way cu_seqlens is written; the per-layout memo is bounded.
5. Validation: clear errors naming the argument, also under torch.compile(fullgraph=True).

Every test compares with an independent reference: the document computed alone (a call that
holds nothing else), the float64 dense oracle (doc_packed_testing/oracle.py), or the exact error.
"""

from __future__ import annotations

import math
import random
import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import doc_packed as dp
from doc_packed import _doc_layout
from doc_packed.kernels import VarlenSpec
from doc_packed.kernels import math as math_kernel
from doc_packed_testing.oracle import dense_mask, reference

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
MASKS = [(True, (-1, -1)), (False, (-1, -1)), (True, (3, 0)), (False, (2, 5)), (False, (0, 0))]


@pytest.fixture(autouse=True)
def _threads(request):
    """One intra-op thread unless a test asks for more with a ``threads`` parameter: the problems
    are tiny, and two OMP threads per process made this module ~10x slower on a loaded 2-core host
    (barrier waits). The threaded kernels keep a test of their own."""
    before = torch.get_num_threads()
    callspec = getattr(request.node, "callspec", None)
    torch.set_num_threads(callspec.params.get("threads", 1) if callspec else 1)
    yield
    torch.set_num_threads(before)


def _cu(rows: list[list[int]]) -> torch.Tensor:
    """cu_seqlens from per-row document lengths (zero-length documents kept where they are)."""
    width = max(len(r) for r in rows) + 1
    out = []
    for r in rows:
        b = [0]
        for n in r:
            b.append(b[-1] + n)
        out.append(b + [b[-1]] * (width - len(b)))
    return torch.tensor(out, dtype=torch.int32)


def _docs(cu: torch.Tensor) -> list[tuple[int, int, int]]:
    """(row, start, end) of every non-empty document."""
    return [(b, s, e) for b, row in enumerate(cu.tolist()) for s, e in zip(row[:-1], row[1:]) if e > s]


def _run(q, k, v, cu, dout, causal, window):
    """(out, lse, dq, dk, dv) of one call, out's gradient ``dout``."""
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out, lse = dp.doc_packed_attn(q, k, v, cu, causal=causal, window_size=window, return_lse=True)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    return out.detach(), lse.detach(), dq, dk, dv


def _alone(q, k, v, dout, b, s, e, causal, window):
    """The same call on document ``[s, e)`` of row ``b`` alone (a fresh one-document batch)."""
    piece = [x[b : b + 1, s:e].clone() for x in (q, k, v, dout)]
    return _run(*piece[:3], _cu([[e - s]]), piece[3], causal, window)


def _same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{what}: {m}")


def _check_per_document(q, k, v, dout, cu, causal, window, clean_docs=None):
    """Every document of the packed call equals, bit for bit, the document computed alone."""
    out, lse, dq, dk, dv = _run(q, k, v, cu, dout, causal, window)
    for b, s, e in _docs(cu):
        a_out, a_lse, a_dq, a_dk, a_dv = _alone(q, k, v, dout, b, s, e, causal, window)
        where = f"row {b} document [{s}, {e})"
        _same_bits(out[b, s:e], a_out[0], f"out of {where}")
        _same_bits(lse[b, :, s:e], a_lse[0], f"lse of {where}")
        for name, g, a in (("dq", dq, a_dq), ("dk", dk, a_dk), ("dv", dv, a_dv)):
            _same_bits(g[b, s:e], a[0], f"{name} of {where}")
        if clean_docs is not None and (b, s, e) in clean_docs:
            for name, t in (("out", out[b, s:e]), ("dq", dq[b, s:e]), ("dk", dk[b, s:e]), ("dv", dv[b, s:e])):
                assert torch.isfinite(t).all(), f"{name} of the clean {where} is not finite"


# ----------------------------------------------------------------------------- 1. NaN/Inf stays in its document


def test_nan_in_one_row_leaves_the_other_row_alone():
    # the case: before the fix every output of row 1 was NaN
    q, k, v = torch.randn(3, 2, 4, 1, 8).unbind(0)
    v[0, 3] = float("nan")
    cu = torch.tensor([[0, 4], [0, 4]], dtype=torch.int32)
    dout = torch.randn(2, 4, 1, 8)
    _check_per_document(q, k, v, dout, cu, True, (-1, -1), clean_docs={(1, 0, 4)})
    out = dp.doc_packed_attn(q, k, v, cu, causal=True)
    ref, _ = reference(q[1:], k[1:], v[1:], cu[1:])
    torch.testing.assert_close(out[1:].double(), ref, atol=1e-5, rtol=1e-5)


@settings(max_examples=30, deadline=None)
@given(
    data=st.data(),
    B=st.integers(1, 3),
    dtype=st.sampled_from(DTYPES),
    mask=st.sampled_from(MASKS),
    target=st.sampled_from(["q", "k", "v", "dout"]),
    bad=st.sampled_from([math.nan, math.inf, -math.inf]),
    spread=st.sampled_from(["element", "token", "document"]),
)
def test_property_bad_values_stay_in_their_document(data, B, dtype, mask, target, bad, spread):
    rows = [data.draw(st.lists(st.integers(0, 9), min_size=1, max_size=5)) for _ in range(B)]
    S = max(1, max(sum(r) for r in rows))
    rows = [r + [S - sum(r)] for r in rows]
    cu = _cu(rows)
    docs = _docs(cu)
    seed = data.draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    Hq, Hkv = data.draw(st.sampled_from([(2, 1), (2, 2), (4, 2)]))
    D = 8
    q = torch.randn(B, S, Hq, D, generator=g).to(dtype)
    k, v = (torch.randn(B, S, Hkv, D, generator=g).to(dtype) for _ in range(2))
    dout = torch.randn(B, S, Hq, D, generator=g).to(dtype)
    tensors = {"q": q, "k": k, "v": v, "dout": dout}
    b, s, e = docs[data.draw(st.integers(0, len(docs) - 1))]
    t = data.draw(st.integers(s, e - 1))
    x = tensors[target]
    if spread == "element":
        x[b, t, data.draw(st.integers(0, x.shape[2] - 1)), data.draw(st.integers(0, D - 1))] = bad
    elif spread == "token":
        x[b, t] = bad
    else:
        x[b, s:e] = bad
    clean = {d for d in docs if d != (b, s, e)}
    _check_per_document(q, k, v, dout, cu, *mask, clean_docs=clean)


# ----------------------------------------------------------------------------- 2. batch invariance


# documents longer than a query block (128) and a key tile (512), short ones, a one-token one
_DOC_LENGTHS = [130, 64, 1, 600, 7]
_ARRANGEMENTS = [
    [[0, 1, 2, 3, 4]],  # one row, in order
    [[3, 4, 2], [1, 0]],  # two rows, other order
    [[4, 0], [2, 1, 3]],
    [[1], [3], [0, 2, 4]],
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (4, 4)), (True, (300, 0)), (False, (-1, 20))])
def test_documents_bits_do_not_depend_on_the_batch(dtype, causal, window):
    _check_arrangements(dtype, causal, window)


@pytest.mark.slow  # about 1 s on an idle 2-core host, but two OMP threads wait on each other when it is busy
@pytest.mark.parametrize("threads", [2])
@pytest.mark.parametrize("dtype,causal,window", [(torch.float32, True, (300, 0)), (torch.float16, False, (4, 4))])
def test_documents_bits_do_not_depend_on_the_batch_threaded(threads, dtype, causal, window):
    # intra-op threads split elementwise ops and reductions into per-thread chunks of the block's
    # tensors: the chunks depend on the block's shape, so on the document only
    assert torch.get_num_threads() == threads
    _check_arrangements(dtype, causal, window)


def _check_arrangements(dtype, causal, window):
    g = torch.Generator().manual_seed(7)
    Hq, Hkv, D = 2, 1, 32
    docs = [
        [torch.randn(n, h, D, generator=g).to(dtype) for h in (Hq, Hkv, Hkv, Hq)]  # q, k, v, dout
        for n in _DOC_LENGTHS
    ]
    alone = [_run(*(x[None] for x in d[:3]), _cu([[d[0].shape[0]]]), d[3][None], causal, window) for d in docs]
    S = 1000
    for arrangement in _ARRANGEMENTS:
        # each row is filled to S with a filler document of its own (random values)
        rows = [[_DOC_LENGTHS[i] for i in r] for r in arrangement]
        tensors = []
        for j in range(4):
            per_row = []
            for r in arrangement:
                parts = [docs[i][j] for i in r]
                fill = S - sum(p.shape[0] for p in parts)
                parts.append(torch.randn(fill, *parts[0].shape[1:], generator=g).to(dtype))
                per_row.append(torch.cat(parts))
            tensors.append(torch.stack(per_row))
        cu = _cu([r + [S - sum(r)] for r in rows])
        out, lse, dq, dk, dv = _run(*tensors[:3], cu, tensors[3], causal, window)
        for b, r in enumerate(arrangement):
            s = 0
            for i in r:
                e = s + _DOC_LENGTHS[i]
                a = alone[i]
                where = f"document {i} at row {b} [{s}, {e}) of {arrangement}"
                _same_bits(out[b, s:e], a[0][0], f"out of {where}")
                _same_bits(lse[b, :, s:e], a[1][0], f"lse of {where}")
                for name, got, want in (("dq", dq, a[2]), ("dk", dk, a[3]), ("dv", dv, a[4])):
                    _same_bits(got[b, s:e], want[0], f"{name} of {where}")
                s = e
    # and the document computed alone is right (the float64 oracle)
    if dtype == torch.float64:
        for d, a in zip(docs, alone):
            ref, ref_lse = reference(*(x[None] for x in d[:3]), _cu([[d[0].shape[0]]]), causal, window)
            torch.testing.assert_close(a[0], ref, atol=1e-10, rtol=1e-10)
            torch.testing.assert_close(a[1], ref_lse, atol=1e-10, rtol=1e-10)


# ----------------------------------------------------------------------------- 3. precision at the edges


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "rows,causal,window",
    [
        ([[1] * 24, [1] * 24], True, (-1, -1)),  # one-token documents
        ([[5, 19], [24]], True, (0, 0)),  # every query sees itself only
        ([[5, 19], [24]], False, (0, 0)),
        ([[1, 23], [1] * 24], False, (0, -1)),  # causal=False, right unbounded, left 0: not one key
    ],
)
def test_one_visible_key_gives_exact_zero_dq_dk(dtype, rows, causal, window):
    S = 24
    cu = _cu(rows)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, S, h, 8, generator=g).to(dtype) for h in (4, 2, 2))
    dout = torch.randn(2, S, 4, 8, generator=g).to(dtype)
    out, _, dq, dk, dv = _run(q, k, v, cu, dout, causal, window)
    mask_rows = [dense_mask(cu[b].tolist(), S, causal, window) for b in range(2)]
    one_key = torch.stack([m.sum(1) == 1 for m in mask_rows])  # [B, S] queries that see one key
    # oracle for everything (float64 from the same inputs)
    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    ref, _ = reference(q64, k64, v64, cu, causal, window)
    want = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
    tol = {torch.float16: 4e-3, torch.bfloat16: 3e-2, torch.float32: 1e-5, torch.float64: 1e-10}[dtype]
    for got, w in zip((out, dq, dk, dv), (ref, *want)):
        torch.testing.assert_close(got.double(), w, atol=tol, rtol=tol)
    if window == (0, -1):
        assert not one_key.all()
        return
    assert one_key.all()
    # p = 1 exactly: out is the one value row, and dq, dk are exactly zero (not rounding noise)
    assert torch.equal(out, v.repeat_interleave(2, dim=2))
    assert torch.count_nonzero(dq) == 0 and torch.count_nonzero(dk) == 0


def _saturated(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    B, S, H, D = 2, 96, 4, 32
    q, k, v, dout = (torch.randn(B, S, H, D, generator=g) for _ in range(4))
    q, k, v, dout = (x.to(dtype) for x in (5 * q, 5 * k, v, dout))  # inputs x5: softmax near one-hot
    cu = _cu([[40, 56], [96]])
    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    ref, _ = reference(q64, k64, v64, cu)
    want = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
    return q, k, v, dout, cu, want


def _floor_ratio(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> float:
    """Frobenius error of ``got`` over that of the exact gradient rounded to ``dtype`` (the best
    any result in that dtype can do)."""
    floor = (want.to(dtype).double() - want).norm()
    return float((got.double() - want).norm() / floor)


# Why 1.1: the kernel accumulates in fp32, whose relative error (~1e-6) is far below the unit
# roundoff of fp16 (2**-11) and bf16 (2**-8). So the error left should be the final rounding of the
# gradient to q's dtype, i.e. the exact gradient's own rounding error, give or take where fp32 noise
# moves a value across a rounding boundary (a few percent at most). Before the fix delta came from
# the output rounded to fp16/bf16 and dq/dk were ~4x that floor in this setting.
_FLOOR = 1.1


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("seed", [0, 1])
def test_saturated_softmax_gradients_at_the_rounding_floor(dtype, seed):
    q, k, v, dout, cu, want = _saturated(dtype, seed)
    _, _, *got = _run(q, k, v, cu, dout, True, (-1, -1))
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert _floor_ratio(g, w, dtype) <= _FLOOR, name


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_saturated_backward_from_an_accumulator_out_keeps_the_kernel_contract(dtype):
    # a whole-row spec without row_len is the context-parallel form: delta comes from the out
    # passed in; given the accumulator's fp32 out (what a caller holding it may pass), the
    # gradients reach the same floor
    q, k, v, dout, cu, want = _saturated(dtype)
    B, S, H, D = q.shape
    flat = lambda x: x.reshape(B * S, *x.shape[2:])  # noqa: E731
    spec = VarlenSpec([0, 40, 96, 192], [0, 40, 96, 192], True, -1, 0)
    fq, fk, fv, fdo = (flat(x) for x in (q, k, v, dout))
    out32, lse = math_kernel.forward(spec, fq.float(), fk.float(), fv.float(), D**-0.5)
    got = math_kernel.backward(spec, fdo, fq, fk, fv, out32, lse, D**-0.5)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert _floor_ratio(g, flat(w), dtype) <= _FLOOR, name


def test_backward_recomputing_tiles_gives_the_same_bits(monkeypatch):
    # past _BWD_KEEP_BYTES the backward recomputes P and dP in its second pass instead of keeping
    # them: the same arithmetic on the same operands, so the same bits, at the oracle's floor
    q, k, v, dout, cu, want = _saturated(torch.float16)
    B, S, H, D = q.shape
    flat = [x.reshape(B * S, *x.shape[2:]) for x in (q, k, v, dout)]
    monkeypatch.setattr(math_kernel, "BLOCK_K", 16)  # several key tiles per query block
    results = []
    for keep in (math_kernel._BWD_KEEP_BYTES, 0):
        monkeypatch.setattr(math_kernel, "_BWD_KEEP_BYTES", keep)
        spec = VarlenSpec([0, 40, 96, 192], [0, 40, 96, 192], False, -1, 30, row_len=S)  # a fresh plan
        out, lse = math_kernel.forward(spec, *flat[:3], D**-0.5)
        results.append(math_kernel.backward(spec, flat[3], *flat[:3], out, lse, D**-0.5))
    for name, a, b in zip(("dq", "dk", "dv"), *results):
        _same_bits(a, b, f"{name}: kept vs recomputed")
    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    ref, _ = reference(q64, k64, v64, cu, False, (-1, 30))
    grads = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
    for name, g, w in zip(("dq", "dk", "dv"), results[0], grads):
        assert _floor_ratio(g, w.reshape(B * S, *w.shape[2:]), torch.float16) <= _FLOOR, name


# ----------------------------------------------------------------------------- 4. the layout cache


def _write_inplace(cu, row, col, value):
    cu[row, col] = value


def _write_under_inference_mode(cu, row, col, value):
    with torch.inference_mode():
        cu[row, col] = value


def _write_data(cu, row, col, value):
    cu.data[row, col] = value


def _write_numpy(cu, row, col, value):
    cu.numpy()[row, col] = value


def _write_dlpack(cu, row, col, value):
    torch.from_dlpack(cu.__dlpack__())[row, col] = value


def _write_storage(cu, row, col, value):
    view = torch.empty(0, dtype=cu.dtype).set_(cu.untyped_storage(), 0, cu.shape, cu.stride())
    with torch.no_grad():
        view[row, col] = value


WRITES = [_write_inplace, _write_under_inference_mode, _write_data, _write_numpy, _write_dlpack, _write_storage]


def _cache_inputs(inference: bool):
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 16, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    if inference:
        with torch.inference_mode():
            cu = torch.tensor([[0, 4, 10, 16], [0, 16, 16, 16]], dtype=torch.int32)
    else:
        cu = torch.tensor([[0, 4, 10, 16], [0, 16, 16, 16]], dtype=torch.int32)
    return q, k, v, cu


# (how it is written, whether it is an inference tensor: created under inference_mode, no version
# counter, writable only there)
WRITE_CASES = [(w, False) for w in WRITES] + [(_write_under_inference_mode, True)]


@pytest.mark.parametrize(
    "write,inference", WRITE_CASES, ids=[w.__name__[7:] + ("-inference-tensor" if i else "") for w, i in WRITE_CASES]
)
def test_a_write_to_cu_seqlens_is_always_seen(write, inference):
    q, k, v, cu = _cache_inputs(inference)
    for causal, window in ((True, (-1, -1)), (False, (2, 1))):
        dp.doc_packed_attn(q, k, v, cu, causal=causal, window_size=window)  # cached
        write(cu, 0, 1, 9 if cu[0, 1] == 4 else 4)  # a valid new layout
        out = dp.doc_packed_attn(q, k, v, cu, causal=causal, window_size=window)
        ref, _ = reference(q, k, v, cu.clone(), causal, window)
        torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    assert cu[0, 1] == 4
    write(cu, 0, 2, 3)  # invalid: decreasing
    with pytest.raises(ValueError, match=r"cu_seqlens\[0\] must be non-decreasing, but entry 2 \(3\) < entry 1 \(4\)"):
        dp.doc_packed_attn(q, k, v, cu, causal=True)
    write(cu, 0, 2, 10)  # valid again
    torch.testing.assert_close(dp.doc_packed_attn(q, k, v, cu, causal=True), reference(q, k, v, cu.clone())[0], atol=1e-10, rtol=0)


def test_equal_values_share_one_layout_and_invalid_values_are_never_cached():
    cu = torch.tensor([[0, 3, 8]], dtype=torch.int32)
    a = _doc_layout.get_layout(cu, 8)
    assert _doc_layout.get_layout(cu.clone(), 8) is a  # keyed on values: another tensor, same entry
    bad = torch.tensor([[0, 9, 8]], dtype=torch.int32)
    for _ in range(2):  # the second call is not a hit on anything
        with pytest.raises(ValueError, match="past the sequence length 8"):
            _doc_layout.get_layout(bad, 8)


def test_values_past_the_hashed_head_still_key_the_cache():
    """Keys hash each row's first ``_HASHED`` entries only: layouts that agree there and differ
    later (a write through NumPy: no version bump) are still told apart, each validated."""
    n = _doc_layout._HASHED + 8
    S = 2 * n
    cu = torch.tensor([list(range(0, 2 * n, 2)) + [S], list(range(0, 2 * n, 2)) + [S]], dtype=torch.int32)
    a = _doc_layout.get_layout(cu, S)
    cu.numpy()[1, n - 1] += 1  # past the hashed head of row 1: its last document one token shorter
    b = _doc_layout.get_layout(cu, S)
    assert b is not a and a.rows[1][-2:] == ((2 * n - 4, 2 * n - 2), (2 * n - 2, S))
    assert b.rows[0] == a.rows[0] and b.rows[1][-2:] == ((2 * n - 4, 2 * n - 1), (2 * n - 1, S))
    cu.numpy()[1, n - 1] = S + 1  # past seq_len, beyond the head: never a hit on b
    with pytest.raises(ValueError, match=rf"cu_seqlens\[1\] entry {n - 1} is {S + 1}, past the sequence length {S}"):
        _doc_layout.get_layout(cu, S)
    cu.numpy()[1, n - 1] = 2 * n - 2
    assert _doc_layout.get_layout(cu, S) is a


@settings(max_examples=300, deadline=None)
@given(
    rows=st.lists(st.lists(st.integers(-2, 9), min_size=1, max_size=7), min_size=1, max_size=3),
    seq_len=st.integers(0, 9),
    dtype=st.sampled_from([torch.int32, torch.int64]),
)
def test_layout_reads_agree_with_the_rules_row_by_row(rows, seq_len, dtype):
    """A ``cu_seqlens`` is valid exactly when every row starts at 0, never decreases and ends at
    ``seq_len`` (checked here entry by entry), and its documents are the rising steps of each row."""
    width = max(map(len, rows))
    rows = [r + r[-1:] * (width - len(r)) for r in rows]
    valid = all(r[0] == 0 and r[-1] == seq_len and all(x <= y for x, y in zip(r, r[1:])) for r in rows)
    _doc_layout.clear_cache()
    cu = torch.tensor(rows, dtype=dtype)
    if not valid:
        with pytest.raises(ValueError, match=r"cu_seqlens\[\d+\]"):
            _doc_layout.get_layout(cu, seq_len)
        return
    docs = tuple(tuple((x, y) for x, y in zip(r, r[1:]) if y > x) for r in rows)
    assert _doc_layout.get_layout(cu, seq_len).rows == docs
    assert _doc_layout.DocLayout(rows, seq_len).rows == docs


def test_per_layout_memo_is_bounded():
    B, S = 2, 64
    cu = dp.cu_seqlens_from_lengths([[20, 44], [64]], S)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, S, h, 4, generator=g, dtype=torch.float64) for h in (2, 1, 1))
    layout = _doc_layout.get_layout(cu, S)
    first = dp.doc_packed_attn(q, k, v, cu, window_size=(0, 0), causal=True)
    for left in range(1, 401):  # 400 distinct windows on one layout
        dp.doc_packed_attn(q, k, v, cu, window_size=(left, 0), causal=True)
        assert len(layout._derived) <= _doc_layout._DERIVED_SIZE
    assert _doc_layout.get_layout(cu, S) is layout
    # the evicted entry is rebuilt, not wrong
    again = dp.doc_packed_attn(q, k, v, cu, window_size=(0, 0), causal=True)
    assert torch.equal(again, first)
    torch.testing.assert_close(again, reference(q, k, v, cu, True, (0, 0))[0], atol=1e-12, rtol=0)


def test_random_rows_round_trip_through_the_value_keyed_cache():
    # many random layouts through the op: each result matches the oracle for its own values
    rng = random.Random(11)
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(2, 20, h, 4, generator=g, dtype=torch.float64) for h in (2, 1, 1))
    cu = torch.zeros(2, 6, dtype=torch.int32)
    for _ in range(40):  # one tensor, rewritten in place through NumPy (no version bump) each time
        rows = []
        for _b in range(2):
            cuts = sorted(rng.randint(0, 20) for _ in range(4))
            rows.append([0, *cuts, 20])
        cu.numpy()[:] = np.array(rows, dtype=np.int32)
        out = dp.doc_packed_attn(q, k, v, cu, causal=False, window_size=(1, 2))
        ref, _ = reference(q, k, v, torch.tensor(rows, dtype=torch.int32), False, (1, 2))
        torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)


def test_next_steps_registered_tensor_is_found_like_the_current_one(monkeypatch):
    """``prepare`` registers the next step's device ``cu_seqlens`` while a step runs: that step's
    later calls and the next step's first call both find their tensor without building its
    identity key, each gets its own layout, and a torch write to either is still seen. (Meta
    tensors stand in for CUDA ones: identity keys, no values to read.)"""
    _doc_layout.clear_cache()
    S = 16
    host = [dp.cu_seqlens_from_lengths(rows, S, max_docs=3) for rows in ([[4, 12]], [[16]], [[8, 8]])]
    layouts = [_doc_layout.get_layout(h, S) for h in host]  # validated from the host values
    cus = [torch.empty((1, 4 + i), dtype=torch.int32, device="meta") for i in range(3)]  # distinct keys
    keys = []
    real_key = _doc_layout._identity_key
    monkeypatch.setattr(_doc_layout, "_identity_key", lambda cu, s: keys.append(cu) or real_key(cu, s))

    _doc_layout.register(cus[0], layouts[0])
    assert _doc_layout.get_layout(cus[0], S) is layouts[0]  # step 0's first call
    for step in (1, 2):
        _doc_layout.register(cus[step], layouts[step])  # the next step's, made during this one
        keys.clear()
        assert _doc_layout.get_layout(cus[step - 1], S) is layouts[step - 1]  # this step's later layers
        assert _doc_layout.get_layout(cus[step], S) is layouts[step]  # the next step's first call
        assert _doc_layout.get_layout(cus[step], S) is layouts[step]  # and its later layers
        assert keys == [], "found by the recent tensors, not by a rebuilt identity key"
    cus[2].add_(0)  # a torch write: the version moves on, the tensor must be looked up again
    with pytest.raises(NotImplementedError):  # (read back: a meta tensor has no values to read)
        _doc_layout.get_layout(cus[2], S)
    assert keys, "a written tensor is not taken from the recent tensors"
    _doc_layout.clear_cache()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_cache_sees_versioned_writes_and_never_caches_inference_tensors():
    q, k, v = (torch.randn(2, 16, h, 8, device="cuda") for h in (4, 2, 2))
    cu = torch.tensor([[0, 4, 10, 16], [0, 16, 16, 16]], dtype=torch.int32, device="cuda")

    def check(cu):
        out = dp.doc_packed_attn(q, k, v, cu, backend="math", causal=True)
        ref, _ = reference(q.cpu(), k.cpu(), v.cpu(), cu.cpu())
        torch.testing.assert_close(out.cpu().double(), ref, atol=1e-5, rtol=1e-5)

    check(cu)
    cu[0, 1] = 9  # a torch write bumps the version counter
    check(cu)
    cu[0, 2] = 3
    with pytest.raises(ValueError, match=r"must be non-decreasing, but entry 2 \(3\) < entry 1 \(9\)"):
        dp.doc_packed_attn(q, k, v, cu, backend="math", causal=True)
    with torch.inference_mode():  # inference tensors have no version counter: read every call
        icu = torch.tensor([[0, 4, 10, 16], [0, 16, 16, 16]], dtype=torch.int32, device="cuda")
        check(icu)
        icu[0, 1] = 7
        check(icu)
        icu[0, 2] = 3
        with pytest.raises(ValueError, match=r"must be non-decreasing, but entry 2 \(3\) < entry 1 \(7\)"):
            dp.doc_packed_attn(q, k, v, icu, backend="math", causal=True)


# ----------------------------------------------------------------------------- 5. validation


def _ok():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 16, h, 8, generator=g) for h in (4, 2, 2))
    return q, k, v, dp.cu_seqlens_from_lengths([[4, 12], [16]], 16, max_docs=3)


CALL_ERRORS = [
    (
        dict(window_size=(2**64, 0)),
        ValueError,
        "window_size=(18446744073709551616, 0): each side must be at most 2**31 - 1",
    ),
    (dict(window_size=(2**31, 0)), ValueError, "each side must be at most 2**31 - 1"),
    (dict(window_size=(3, 2**40), causal=False), ValueError, "each side must be at most 2**31 - 1"),
    (dict(window_size=(-2, 0)), ValueError, "window_size=(-2, 0): each side must be >= 0, or -1 for unbounded"),
    (dict(window_size=(1.5, 0)), TypeError, "window_size must be a pair of ints (left, right), got (1.5, 0)"),
    (dict(window_size=(3, 2)), ValueError, "has a right window 2 > 0 but causal=True"),
    (dict(causal=1), TypeError, "causal must be a bool, got int"),
    (dict(scale=float("nan")), ValueError, "scale must be a positive finite float, got nan"),
    (dict(scale=10**400), ValueError, "scale must be a positive finite float, got an int too large for a float"),
    (dict(scale=-1.0), ValueError, "scale must be a positive finite float, got -1.0"),
    (dict(backend="cudnn"), ValueError, "backend must be one of"),
    (dict(seq_len=32), ValueError, "seq_len=32 differs from q's sequence length 16"),
    (dict(planning_doc_len=2**64), ValueError, "planning_doc_len must be a positive int (at most 2**31 - 1)"),
    (dict(planning_doc_len=0), ValueError, "planning_doc_len must be a positive int"),
]
TENSOR_ERRORS = [
    (
        lambda q, k, v, cu: (q[:, :, :0], k[:, :, :1], v[:, :, :1], cu),
        ValueError,
        "q [B, S, H_q, D] has H_q (heads) = 0: shape (2, 16, 0, 8)",
    ),
    (lambda q, k, v, cu: (q[:, :, :3], k, v, cu), ValueError, "q has 3 heads and k/v have 2"),
    (lambda q, k, v, cu: (q.int(), k, v, cu), TypeError, "q has dtype torch.int32"),
    (lambda q, k, v, cu: (q, k, v, cu.float()), TypeError, "cu_seqlens must be int32 or int64, got torch.float32"),
    (
        lambda q, k, v, cu: (q, k, v, cu[:, :1]),
        ValueError,
        "cu_seqlens must be [B, MAX_DOCS + 1] with B >= 1 and MAX_DOCS >= 1",
    ),
    (
        lambda q, k, v, cu: (q, k, v, torch.tensor([[0, 8, 4], [0, 16, 16]], dtype=torch.int32)),
        ValueError,
        "cu_seqlens[0] must be non-decreasing",
    ),
]


def _msg(text: str) -> str:
    return re.escape(text)


@pytest.mark.parametrize("kw,exc,text", CALL_ERRORS)
def test_argument_errors(kw, exc, text):
    with pytest.raises(exc, match=_msg(text)):
        dp.doc_packed_attn(*_ok(), **{"causal": True, **kw})


@pytest.mark.parametrize("mutate,exc,text", TENSOR_ERRORS)
def test_tensor_errors(mutate, exc, text):
    with pytest.raises(exc, match=_msg(text)):
        dp.doc_packed_attn(*mutate(*_ok()), causal=True)


def _eager_error(fn, *args):
    try:
        fn(*args)
    except (TypeError, ValueError) as err:
        return type(err), str(err)
    raise AssertionError("no error in eager mode")


@pytest.mark.parametrize("case", range(len(CALL_ERRORS) + len(TENSOR_ERRORS)))
def test_errors_under_compile_fullgraph_are_ours(case):
    import torch._dynamo

    torch._dynamo.reset()
    if case < len(CALL_ERRORS):
        kw, _, _ = CALL_ERRORS[case]
        args = _ok()
    else:
        mutate, _, _ = TENSOR_ERRORS[case - len(CALL_ERRORS)]
        kw, args = {}, mutate(*_ok())

    def step(q, k, v, cu):
        return dp.doc_packed_attn(q, k, v, cu, **{"causal": True, **kw}).float().sum()

    want = _eager_error(step, *args)
    compiled = torch.compile(step, fullgraph=True, backend="eager")
    with pytest.raises(want[0]) as info:
        compiled(*args)
    assert (type(info.value), str(info.value)) == want  # the same error, word for word


def test_a_compiled_function_still_runs_valid_calls_after_an_invalid_one():
    import torch._dynamo

    torch._dynamo.reset()

    def step(q, k, v, cu, left):
        return dp.doc_packed_attn(q, k, v, cu, window_size=(left, 0), causal=True)

    compiled = torch.compile(step, fullgraph=True, backend="eager")
    q, k, v, cu = _ok()
    with pytest.raises(ValueError, match="each side must be >= 0"):
        compiled(q, k, v, cu, -3)
    ref, _ = reference(q, k, v, cu, True, (3, 0))
    torch.testing.assert_close(compiled(q, k, v, cu, 3).double(), ref, atol=1e-5, rtol=1e-5)


PLAN_ERRORS = [
    (
        dict(cu=torch.tensor([[0, 30, 64]], dtype=torch.float32)),
        TypeError,
        "cu_seqlens must be int32 or int64, got torch.float32",
    ),
    (dict(cu=torch.tensor([[0, 30, 2**40]], dtype=torch.int64)), ValueError, "rows end at 1099511627776, past 2**31 - 1"),
    (dict(cu=torch.zeros(0, 3, dtype=torch.int32)), ValueError, "with B >= 1 and MAX_DOCS >= 1, got (0, 3)"),
    (dict(cu=[[0, 30.5, 64]]), TypeError, "cu_seqlens must be a tensor or rows of ints, got [a list]"),
    (dict(cu=[[0, True, 64]]), TypeError, "cu_seqlens must hold ints, not bools"),
    (dict(cu=[[0, 30, 2**40]]), ValueError, "cu_seqlens entries must be in [0, 2**31 - 1] (int32)"),
    (dict(cu=[[0, 40, 30, 64]]), ValueError, "cu_seqlens[0] must be non-decreasing"),
    (dict(cp_size=True), TypeError, "cp_size must be an int, got True"),
    (dict(cp_size=2.0), TypeError, "cp_size must be an int, got 2.0"),
    (dict(cp_size=0), ValueError, "cp_size must be >= 1, got 0"),
    (dict(query_cost=float("nan")), ValueError, "query_cost must be finite and >= 0, got nan"),
    (dict(query_cost=-1.0), ValueError, "query_cost must be finite and >= 0, got -1.0"),
    (dict(query_cost="1"), TypeError, "query_cost must be a float, got '1'"),
    (dict(tolerance=float("nan")), ValueError, "tolerance must be finite and >= 0, got nan"),
    (dict(tolerance=-0.5), ValueError, "tolerance must be finite and >= 0, got -0.5"),
    (dict(tolerance=float("inf")), ValueError, "tolerance must be finite and >= 0, got inf"),
    (dict(window_size=(2**64, 0)), ValueError, "each side must be at most 2**31 - 1"),
]


@pytest.mark.parametrize("kw,exc,text", PLAN_ERRORS)
def test_plan_context_parallel_argument_errors(kw, exc, text):
    args = dict(cu=dp.cu_seqlens_from_lengths([[30, 34]], 64), cp_size=2)
    args.update(kw)
    cu, cp_size = args.pop("cu"), args.pop("cp_size")
    with pytest.raises(exc, match=_msg(text)):
        dp.plan_context_parallel(cu, cp_size, **args)


def test_plan_context_parallel_accepts_rows_of_integers_of_any_kind():
    # lists, tuples and NumPy rows name the same layout as the tensor, and give the same plan
    cu = dp.cu_seqlens_from_lengths([[30, 34], [64]], 64)
    want = dp.plan_context_parallel(cu, 2)
    for rows in (cu.tolist(), [tuple(r) for r in cu.tolist()], cu.numpy(), [np.array(r) for r in cu.tolist()]):
        assert dp.plan_context_parallel(rows, 2) == want
