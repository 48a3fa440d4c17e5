"""The context-parallel runtime's reductions on CUDA (skipped without a GPU): the lse merge (the
Triton kernel and the torch ops it replaces, both against the float64 merge, on strided buffers
and the rows a merge must leave alone: no key on either side, NaN, +inf), and the partial dK/dV
sums (tests/test_cp_merge.py's cases on the GPU)."""

import pytest
import torch

from doc_packed.cp import lse_merge
from test_cp_merge import RUNS, check_partials

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

EPS = {torch.bfloat16: 2**-8, torch.float16: 2**-11, torch.float32: 2**-23}


def _case(dtype, n, H, D, strided):
    """Two sides of ``n`` rows; with ``strided`` each lives in a slice of a larger buffer (rows
    of ``[N, H, D]``, columns of ``[H, N]``), as the result buffers' slices do."""
    g = torch.Generator().manual_seed(n + D)
    o = [torch.randn(n, H, D, generator=g) for _ in range(2)]
    lse = [torch.randn(H, n, generator=g, dtype=torch.float64) * 4 for _ in range(2)]
    for x, l in zip(o, lse):
        x[5], l[:, 5] = 0, -float("inf")  # row 5: neither side saw a key
    o[0][7], lse[0][:, 7] = 0, -float("inf")  # row 7: only the second side did
    o[1][9], lse[1][:, 9] = 0, -float("inf")  # row 9: only the first
    lse[1][2, 11] = float("nan")  # row 11, head 2: NaN stays
    lse[0][1, 13] = float("inf")  # row 13, head 1: +inf stays (NaN out, as the torch ops give)
    lse[0][:, 15] = lse[1][:, 15] = 3.0  # equal lse: log 2 above
    o = [x.to(dtype).double() for x in o]  # the reference merges the inputs as the kernel reads them
    lse = [l.float().double() for l in lse]
    ref_lse = torch.logaddexp(*lse)
    base = ref_lse.nan_to_num(nan=float("nan"), posinf=float("inf"), neginf=0.0)
    w = [torch.exp(l - base).t()[..., None] for l in lse]
    ref_out = o[0] * w[0] + o[1] * w[1]
    acc = torch.float32

    def put(t, rows_dim):
        if not strided:
            return t.cuda()
        shape = list(t.shape)
        shape[rows_dim] += 6
        big = torch.full(shape, 7.0, dtype=t.dtype, device="cuda")
        view = big.narrow(rows_dim, 3, n)
        view.copy_(t)
        return view

    sides = [(put(x.to(dtype), 0), put(l.to(acc), 1)) for x, l in zip(o, lse)]
    return sides, ref_out, ref_lse


def _check(out, lse, ref_out, ref_lse, dtype):
    out, lse = out.double().cpu(), lse.double().cpu()
    finite = torch.isfinite(ref_out)
    assert torch.equal(torch.isnan(out), torch.isnan(ref_out))
    assert torch.equal(torch.isnan(lse), torch.isnan(ref_lse))
    assert torch.equal(lse.isneginf(), ref_lse.isneginf()) and torch.equal(lse.isposinf(), ref_lse.isposinf())
    assert (out[5] == 0).all() and lse[:, 5].isneginf().all()
    ok = torch.isfinite(ref_lse)
    assert (lse[ok] - ref_lse[ok]).abs().max() <= 1e-5 * (1 + ref_lse[ok].abs().max())
    # one rounding of the float32 sum into the output dtype, plus float32's own error
    err = (out[finite] - ref_out[finite]).abs()
    assert (err <= EPS[dtype] * ref_out[finite].abs() + 1e-6 * (1 + ref_out[finite].abs())).all(), err.max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("D", [128, 96])
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("path", ["triton", "torch"])
def test_merge_matches_float64(dtype, D, strided, path):
    if path == "triton" and lse_merge._triton_merge() is None:
        pytest.skip("Triton is not importable")
    ((a_out, a_lse), (b_out, b_lse)), ref_out, ref_lse = _case(dtype, 300, 4, D, strided)
    before = a_out.data_ptr(), a_lse.data_ptr()
    (lse_merge.merge_ if path == "triton" else lse_merge._torch_merge)(a_out, a_lse, b_out, b_lse)
    assert (a_out.data_ptr(), a_lse.data_ptr()) == before
    _check(a_out, a_lse, ref_out, ref_lse, dtype)
    if strided:  # the rows around the slices are untouched
        assert (a_out._base[:3] == 7).all() and (a_out._base[-3:] == 7).all()
        assert (a_lse._base[:, :3] == 7).all() and (a_lse._base[:, -3:] == 7).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", list(RUNS))
@pytest.mark.parametrize("width", [(2, 4), (8, 128)], ids=["narrow", "Hkv8-D128"])
def test_partials_summed_once_on_cuda(dtype, case, width):
    check_partials(dtype, case, torch.device("cuda"), *width)


def test_runtime_kernels_compile_once_for_every_layout():
    """The merge and the partial sums see slices at every row offset and row count a layout
    brings (pointer alignments, counts of 1, multiples of 16 and not): after each kernel's first
    compile, none compiles again (each new variant was a 0.3-0.8 s stall of a training step)."""
    from doc_packed.cp import _triton, partials

    H, D, dtype = 4, 128, torch.bfloat16

    def merge(n, off):
        o, ob = (torch.randn(n + off + 8, H, D, device="cuda", dtype=dtype)[off : off + n] for _ in range(2))
        lse, lseb = (torch.randn(H, n + off + 9, device="cuda")[:, off : off + n] for _ in range(2))
        lse_merge.merge_(o, lse, ob, lseb)
        # the other layouts a kernel's buffers come in: heads-major out (stride D between rows,
        # n * D between heads), rows-major lse (stride H between rows), single rows
        o_t = torch.randn(H, n + off, D, device="cuda", dtype=dtype)[:, off:].transpose(0, 1)
        lse_t = torch.randn(n + off, H, device="cuda")[off:].t()
        want_o, want_l = o_t.clone(), lse_t.clone()
        lse_merge._torch_merge(want_o, want_l, ob, lseb)
        lse_merge.merge_(o_t, lse_t, ob, lseb)
        torch.testing.assert_close(lse_t, want_l)  # strided buffers merged as the torch ops do
        torch.testing.assert_close(o_t, want_o, atol=1e-2, rtol=1e-2)
        lse_merge.merge_(o, lse, o_t, lse_t)

    def add(g, k, r0, n):
        dk, dv = torch.zeros(2, 70, 2, D, device="cuda", dtype=dtype)
        back = torch.randn(g + k * n + 3, 2, 2, D, device="cuda", dtype=dtype)[3:]
        partials.add_partials_(dk, dv, back, [(g, k, r0, n)])

    merge(16, 0)
    add(0, 1, 0, 16)
    first = _triton.compiled_variants()
    assert first >= 2, "the Triton merge and partial sums did not run"
    for n in (1, 2, 3, 15, 16, 17, 33, 64):
        for off in (0, 1, 2, 3, 5, 16):
            merge(n, off)
            add(off, 1 + off % 3, 7 * off, n)
    torch.cuda.synchronize()
    assert _triton.compiled_variants() == first


def test_cp_warmup_compiles_the_runtime_kernels():
    """The first context-parallel call's warm-up compiles the merge and the partial sums for its
    dtype and head shape, so a rank whose first layouts need neither does not compile them inside
    a later step (rank 0's first merge came at its fifth layout on 4 x H200: a 0.8 s stall). In a
    fresh process: a variant is per dtype and block sizes, which other tests here compile too."""
    import subprocess
    import sys

    code = """
import torch
from doc_packed.cp import _triton, lse_merge, partials
from doc_packed.cp.warmup import warmup
Hq, Hkv, D, dtype = 6, 3, 96, torch.float16
q = torch.zeros(1, 4, Hq, D, device="cuda", dtype=dtype)
k = torch.zeros(1, 4, Hkv, D, device="cuda", dtype=dtype)
assert _triton.compiled_variants() == 0
warmup(q, k, k, True, -1, 0, "math")  # a backend with nothing of its own to build
assert _triton.compiled_variants() == 2, _triton.compiled_variants()
for n, off in ((1, 0), (37, 3), (300, 17)):
    o = torch.randn(n + off, Hq, D, device="cuda", dtype=dtype)[off:]
    lse = torch.randn(Hq, n + off, device="cuda")[:, off:]
    lse_merge.merge_(o, lse, torch.randn_like(o), torch.randn_like(lse))
    dk, dv = torch.zeros(2, 400, Hkv, D, device="cuda", dtype=dtype)
    back = torch.randn(off + 2 * n, 2, Hkv, D, device="cuda", dtype=dtype)
    partials.add_partials_(dk, dv, back, [(off, 2, off, n)])
torch.cuda.synchronize()
assert _triton.compiled_variants() == 2, _triton.compiled_variants()
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
