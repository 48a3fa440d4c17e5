"""Nothing silently wrong: the fault classes of the single-process op (docs/contract.md).

4. The layout cache is never stale, whatever way cu_seqlens is written; the per-layout memo is bounded.
5. Validation: clear errors naming the argument, also under torch.compile(fullgraph=True).

Every test compares with an independent reference: the float64 dense oracle (tests/oracle.py), or
the exact error (under torch.compile: the eager error, word for word).
"""

from __future__ import annotations

import random
import re

import numpy as np
import pytest
import torch

import doc_packed as dp
from doc_packed import _doc_layout
from oracle import reference


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
        dp.doc_packed_attn(q, k, v, cu)
    write(cu, 0, 2, 10)  # valid again
    torch.testing.assert_close(dp.doc_packed_attn(q, k, v, cu), reference(q, k, v, cu.clone())[0], atol=1e-10, rtol=0)


def test_equal_values_share_one_layout_and_invalid_values_are_never_cached():
    cu = torch.tensor([[0, 3, 8]], dtype=torch.int32)
    a = _doc_layout.get_layout(cu, 8)
    assert _doc_layout.get_layout(cu.clone(), 8) is a  # keyed on values: another tensor, same entry
    bad = torch.tensor([[0, 9, 8]], dtype=torch.int32)
    for _ in range(2):  # the second call is not a hit on anything
        with pytest.raises(ValueError, match="past the sequence length 8"):
            _doc_layout.get_layout(bad, 8)


def test_per_layout_memo_is_bounded():
    B, S = 2, 64
    cu = dp.cu_seqlens_from_lengths([[20, 44], [64]], S)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, S, h, 4, generator=g, dtype=torch.float64) for h in (2, 1, 1))
    layout = _doc_layout.get_layout(cu, S)
    first = dp.doc_packed_attn(q, k, v, cu, window_size=(0, 0))
    for left in range(1, 401):  # 400 distinct windows on one layout
        dp.doc_packed_attn(q, k, v, cu, window_size=(left, 0))
        assert len(layout._derived) <= _doc_layout._DERIVED_SIZE
    assert _doc_layout.get_layout(cu, S) is layout
    # the evicted entry is rebuilt, not wrong
    again = dp.doc_packed_attn(q, k, v, cu, window_size=(0, 0))
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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_cache_sees_versioned_writes_and_never_caches_inference_tensors():
    q, k, v = (torch.randn(2, 16, h, 8, device="cuda") for h in (4, 2, 2))
    cu = torch.tensor([[0, 4, 10, 16], [0, 16, 16, 16]], dtype=torch.int32, device="cuda")

    def check(cu):
        out = dp.doc_packed_attn(q, k, v, cu, backend="math")
        ref, _ = reference(q.cpu(), k.cpu(), v.cpu(), cu.cpu())
        torch.testing.assert_close(out.cpu().double(), ref, atol=1e-5, rtol=1e-5)

    check(cu)
    cu[0, 1] = 9  # a torch write bumps the version counter
    check(cu)
    cu[0, 2] = 3
    with pytest.raises(ValueError, match=r"must be non-decreasing, but entry 2 \(3\) < entry 1 \(9\)"):
        dp.doc_packed_attn(q, k, v, cu, backend="math")
    with torch.inference_mode():  # inference tensors have no version counter: read every call
        icu = torch.tensor([[0, 4, 10, 16], [0, 16, 16, 16]], dtype=torch.int32, device="cuda")
        check(icu)
        icu[0, 1] = 7
        check(icu)
        icu[0, 2] = 3
        with pytest.raises(ValueError, match=r"must be non-decreasing, but entry 2 \(3\) < entry 1 \(7\)"):
            dp.doc_packed_attn(q, k, v, icu, backend="math")


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
        "q has an empty dimension: shape (2, 16, 0, 8)",
    ),
    (lambda q, k, v, cu: (q[:, :, :3], k, v, cu), ValueError, "q has 3 heads and k/v have 2"),
    (lambda q, k, v, cu: (q.int(), k, v, cu), TypeError, "q has dtype torch.int32"),
    (lambda q, k, v, cu: (q, k, v, cu.long()), TypeError, "cu_seqlens must be int32, got torch.int64"),
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
        dp.doc_packed_attn(*_ok(), **kw)


@pytest.mark.parametrize("mutate,exc,text", TENSOR_ERRORS)
def test_tensor_errors(mutate, exc, text):
    with pytest.raises(exc, match=_msg(text)):
        dp.doc_packed_attn(*mutate(*_ok()))


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
        return dp.doc_packed_attn(q, k, v, cu, **kw).float().sum()

    want = _eager_error(step, *args)
    compiled = torch.compile(step, fullgraph=True, backend="eager")
    with pytest.raises(want[0]) as info:
        compiled(*args)
    assert (type(info.value), str(info.value)) == want  # the same error, word for word


def test_a_compiled_function_still_runs_valid_calls_after_an_invalid_one():
    import torch._dynamo

    torch._dynamo.reset()

    def step(q, k, v, cu, left):
        return dp.doc_packed_attn(q, k, v, cu, window_size=(left, 0))

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
        "cu_seqlens must be int32, got torch.float32",
    ),
    (dict(cu=torch.tensor([[0, 30, 64]], dtype=torch.int64)), TypeError, "cu_seqlens must be int32, got torch.int64"),
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
