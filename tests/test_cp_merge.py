"""The per-layer helpers of cp/attention.py on one process: the lse merge."""

import pytest
import torch

from doc_packed.cp.attention import _Rows
from doc_packed.cp.schedule import LOCAL, Call
from doc_packed.kernels import VarlenSpec, lse_dtype


def _call(q0, q1, rows, merge):
    spec = VarlenSpec([0, q1 - q0], [0, 1], False, -1, -1)
    return Call(LOCAL, LOCAL, q0, q1, 0, 1, spec, rows, int(rows.numel()), torch.arange(1), merge)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("slice_rows", [True, False])
def test_merge_matches_float64_lse_merge(dtype, slice_rows):
    """Two calls over overlapping rows merge to the float64 log-sum-exp combination; rows no call
    saw stay out 0 / lse -inf, and a NaN lse stays NaN."""
    torch.manual_seed(0)
    n, H, D = 12, 3, 4
    acc = lse_dtype(dtype)
    o1, o2 = torch.randn(n, H, D).to(dtype), torch.randn(8, H, D).to(dtype)
    l1, l2 = torch.randn(H, n, dtype=acc) * 3, torch.randn(H, 8, dtype=acc) * 3
    l1[:, 2], o1[2] = -float("inf"), 0  # row 2: the first call saw no key
    l1[:, 10], l2[:, 6], o1[10], o2[6] = -float("inf"), -float("inf"), 0, 0  # row 10 (2nd: 4 + 6): none did
    l2[1, 3] = float("nan")
    buf = _Rows(n, H, D, dtype, torch.device("cpu"))
    buf.write(_call(0, n, torch.arange(n), False), o1.clone(), l1.clone())
    rows = torch.arange(8) if slice_rows else torch.tensor([0, 1, 3, 6])  # second call: rows 4.. of its slice
    keep = torch.zeros(8, dtype=torch.bool)
    keep[rows] = True
    buf.write(_call(4, 12, rows, True), o2.clone(), l2.clone())
    out, lse = buf.result()
    # float64 reference over the rows the second call computed
    L1, L2 = l1.double(), torch.where(keep, l2.double(), -float("inf"))
    want_lse = L1.clone()
    want_lse[:, 4:] = torch.logaddexp(L1[:, 4:], L2)
    w1 = torch.exp(L1[:, 4:] - want_lse[:, 4:]).nan_to_num(0.0).t()[..., None]
    w2 = torch.exp(L2 - want_lse[:, 4:]).nan_to_num(0.0).t()[..., None]
    want = o1.double().clone()
    want[4:] = o1.double()[4:] * w1 + o2.double() * w2
    nan = want_lse.isnan()
    assert torch.equal(lse.isnan(), nan) and bool(out[4 + 3, 1].isnan().all())
    tol = {torch.bfloat16: 2e-2, torch.float32: 1e-5, torch.float64: 1e-12}[dtype]
    ok = ~nan.t()
    torch.testing.assert_close(lse.double()[~nan], want_lse[~nan], rtol=tol, atol=tol)
    torch.testing.assert_close(out.double()[ok], want[ok], rtol=tol, atol=tol)
    assert bool((out[10] == 0).all()) and bool(lse[:, 10].isneginf().all())


RUNS = {
    "disjoint": [(0, 5), (9, 3), (5, 4)],
    "one range to three peers in a row": [(2, 6), (2, 6), (2, 6), (10, 2)],
    "same range, not in a row": [(2, 6), (10, 2), (2, 6)],
    "overlapping": [(0, 8), (4, 8), (20, 3)],
    "nested prefixes": [(3, 9), (3, 9), (3, 5), (3, 2)],
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
@pytest.mark.parametrize("case", list(RUNS))
def test_partials_come_home_summed_once(dtype, case):
    """dK/dV partials of rows sent to several peers, landed where the schedule puts them, add up
    to the float64 sum, rounded once."""
    check_partials(dtype, case, torch.device("cpu"))


def check_partials(dtype, case, device, H=2, D=4):
    """The partials test's body on ``device`` (tests/test_gpu_cp_merge.py runs it on CUDA)."""
    from doc_packed.cp.partials import add_partials_
    from doc_packed.cp.schedule import _home_grid

    runs = RUNS[case]
    land, rows_back, gap_runs, sums, shared = _home_grid(runs)
    gaps = [r for a, e in gap_runs for r in range(a, e)]
    assert shared == (case != "disjoint")
    # every partial lands in its own rows, the rest of the buffer is exactly the gaps
    taken = [r for (_, n), at in zip(runs, land) for r in range(at, at + n)]
    assert sorted(taken + gaps) == list(range(rows_back))
    assert rows_back == sum(k * n for _, k, _, n in sums) >= sum(n for _, n in runs)
    torch.manual_seed(1)
    rows = 24
    dk, dv = torch.randn(rows, H, D).to(dtype), torch.randn(rows, H, D).to(dtype)
    partial = [torch.randn(n, 2, H, D).to(dtype) for _, n in runs]
    want = torch.stack([dk, dv], 1).double()
    for (r0, n), part in zip(runs, partial):
        want[r0 : r0 + n] += part.double()
    back = torch.full((rows_back, 2, H, D), float("nan"), dtype=dtype)  # landed runs and zeroed gaps only
    back[gaps] = 0
    for at, part in zip(land, partial):
        back[at : at + part.shape[0]] = part
    dk, dv, back = dk.to(device), dv.to(device), back.to(device)
    add_partials_(dk, dv, back, sums)
    got = torch.stack([dk, dv], 1).cpu()
    if dtype == torch.float64:
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    else:  # one rounding of a float32 sum: the nearest bf16 or its neighbour
        torch.testing.assert_close(got.double(), want.to(dtype).double(), rtol=2**-7, atol=0)


def test_runtime_kernels_specialize_no_runtime_argument():
    """The CUDA merge and partial-sum kernels take per-layout slices, counts and strides: none of
    their runtime arguments may be specialized on value or pointer alignment (a new combination
    is a Triton compile inside a training step; a hand-kept list once missed a stride)."""
    triton = pytest.importorskip("triton", reason="Triton is not installed (the kernels are CUDA-only)")
    import inspect

    from doc_packed.cp import lse_merge, partials

    alignment = "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters
    for kernel in (lse_merge._kernel(), partials._kernel()):
        runtime = [p for p in kernel.params if not p.is_constexpr]
        assert len(runtime) >= 8, kernel
        for p in runtime:
            assert p.do_not_specialize, f"{kernel}: {p.name} is specialized on its value"
            if alignment:
                assert p.do_not_specialize_on_alignment, f"{kernel}: {p.name} is specialized on its alignment"
