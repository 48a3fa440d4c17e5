"""Nothing silently wrong: the fault classes of the single-process op (docs/contract.md).

5. Validation: clear errors naming the argument, also under torch.compile(fullgraph=True).

Every test compares with an independent reference: the exact error (under torch.compile: the
eager error, word for word), or the float64 dense oracle (tests/oracle.py).
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import doc_packed as dp
from oracle import reference


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
