"""CUDA tests (skipped without a GPU): flash, flex and FA4 paths against the float64 oracle.

Tolerances (documented in docs/kernels.md): relative Frobenius error
``||x - ref|| / ||ref||`` <= 1e-2 for outputs and 2e-2 for gradients in bf16 (4e-3 / 8e-3 in
fp16), lse max abs error <= 2e-2; float32 runs the exact blockwise kernel (<= 1e-5) or, forced,
flex's Triton kernel (<= 1e-4). The FA4 tests skip where FA4 cannot run (not installed, or
not compute capability 9.x/10.x) and say why.
"""

import random

import pytest
import torch

import doc_packed as dp
from doc_packed_testing.gpu_parity import HEADS, MASKS, layouts, parity_errors, rel

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _fa4_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA device"
    from doc_packed.kernels import fa4

    return fa4.unsupported_reason(torch.empty(0, 8, 64, device="cuda", dtype=torch.bfloat16), 2)


FA4_WHY_NOT = _fa4_reason()
needs_fa4 = pytest.mark.skipif(FA4_WHY_NOT is not None, reason=f"FA4 {FA4_WHY_NOT}")
FA4_PARAM = pytest.param("fa4", marks=needs_fa4)

TOL = {torch.bfloat16: 1e-2, torch.float16: 4e-3, torch.float32: 1e-5}


def _check_parity(lengths, S, heads, causal, window, dtype, backend, tol, seed):
    """doc_packed_attn on CUDA against the float64 oracle: out, lse and the three gradients."""
    e = parity_errors(lengths, S, heads, causal, window, dtype, backend, seed)
    assert e["out_dtype"] == dtype and e["finite"]
    assert e["out"] <= tol
    assert e["lse"] <= max(2e-2, tol)
    for name in ("dq", "dk", "dv"):
        assert e[name] <= 2 * tol


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("causal,window", MASKS)
@pytest.mark.parametrize("heads", HEADS)
def test_cuda_parity(dtype, causal, window, heads):
    # flash for fp16/bf16 (forced: auto would run fa4 where it is installed), auto = math for fp32
    backend = "auto" if dtype == torch.float32 else "flash"
    rng = random.Random(7)
    for lengths in layouts(rng, 333):
        _check_parity(lengths, 333, heads, causal, window, dtype, backend, TOL[dtype], seed=1)


@needs_fa4
@pytest.mark.parametrize(
    "dtype,heads,head_dim",
    [(torch.bfloat16, (8, 8), 64), (torch.bfloat16, (8, 2), 64), (torch.bfloat16, (8, 1), 64),
     (torch.float16, (8, 2), 64), (torch.bfloat16, (8, 2), 128)],
)
def test_fa4_parity(dtype, heads, head_dim):
    # GQA 1/4/8, D 64/128, every mask; B = 2 with zero-length and 1-token documents
    rng = random.Random(11)
    for causal, window in MASKS:
        for lengths in layouts(rng, 333):
            e = parity_errors(lengths, 333, heads, causal, window, dtype, "fa4", 3, head_dim)
            assert e["out_dtype"] == dtype and e["finite"]
            assert e["out"] <= TOL[dtype] and e["lse"] <= 2e-2
            for name in ("dq", "dk", "dv"):
                assert e[name] <= 2 * TOL[dtype], (name, e, causal, window, lengths)


def _cp_shaped_problem(backend):
    """A chunk of queries against a longer key range with one segment that sees no keys
    (row_len None: a context-parallel call), run on ``backend``: rows that see nothing give out 0
    and lse -inf, the rest match the float64 math kernel, gradients are finite. Returns
    ``(spec, (q, k, v, dout), out, lse, grads, ref, live)``."""
    from doc_packed import kernels
    from doc_packed.kernels.spec import VarlenSpec

    spec = VarlenSpec([0, 128, 256, 512], [0, 384, 384, 768], True, -1, 0)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, dout = (torch.randn(512, 8, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    k, v = (torch.randn(768, 2, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    ref = kernels.forward(spec, q.double().cpu(), k.double().cpu(), v.double().cpu(), 0.125, "math")
    out, lse = kernels.forward(spec, q, k, v, 0.125, backend)
    assert (out[128:256] == 0).all() and (lse[:, 128:256] == -float("inf")).all()
    live = torch.ones(512, dtype=torch.bool)
    live[128:256] = False
    assert rel(out[live].cpu(), ref[0][live]) <= 1e-2
    assert (lse[:, live].cpu().double() - ref[1][:, live]).abs().max().item() <= 2e-2
    grads = kernels.backward(spec, dout, q, k, v, out, lse, 0.125, backend)
    assert all(torch.isfinite(x).all() for x in grads)
    return spec, (q, k, v, dout), out, lse, grads, ref, live


@needs_fa4
def test_fa4_context_parallel_shape_empty_rows_and_mixed_passes():
    from doc_packed import kernels

    # a chunk of queries against a longer key range, one segment with no keys; row_len None
    # (a context-parallel call): auto runs fa4 there too
    spec, (q, k, v, dout), out, lse, grads, ref, live = _cp_shaped_problem("fa4")
    assert kernels.choose("auto", spec, q, 2) == "fa4"
    assert lse.dtype == torch.float32 and lse.shape == (8, 512)
    want = kernels.backward(spec, dout.double().cpu(), q.double().cpu(), k.double().cpu(),
                            v.double().cpu(), *ref, 0.125, "math")
    for a, b in zip(grads, want):
        assert rel(a.cpu(), b) <= 2e-2
    # (out, lse) of one backend drive another's backward, both ways (flex: tested against flash)
    for other in ("flash",):
        fo, fl = kernels.forward(spec, q, k, v, 0.125, other)
        assert rel(fo[live], out[live]) <= 1e-2
        for a, b in zip(kernels.backward(spec, dout, q, k, v, fo, fl, 0.125, "fa4"), grads):
            assert rel(a, b) <= 2e-2
        for a, b in zip(kernels.backward(spec, dout, q, k, v, out, lse, 0.125, other), grads):
            assert rel(a, b) <= 2e-2


# (lengths of each row, S, (Hq, Hkv), D, D_v, causal, window, softcap, need_lse)
REPLAY_CASES = [
    ([[700, 300, 1048]], 2048, (32, 8), 128, 128, True, (-1, 0), 0.0, True),
    ([[700, 300, 1048]], 2048, (32, 8), 128, 128, True, (-1, 0), 0.0, False),
    ([[2048]], 2048, (16, 16), 128, 128, False, (-1, -1), 0.0, True),
    ([[900, 1148]], 2048, (8, 2), 64, 64, True, (64, 0), 0.0, True),
    ([[1000, 24], [512]], 1024, (8, 2), 128, 128, True, (-1, 0), 0.0, True),  # zero-length tail, B 2
    ([[1500, 548]], 2048, (8, 2), 128, 64, True, (-1, 0), 0.0, True),  # D_v != D
    ([[1500, 548]], 2048, (8, 2), 128, 128, True, (-1, 0), 30.0, True),  # softcap
]


@needs_fa4
@pytest.mark.parametrize("case", REPLAY_CASES)
def test_fa4_launch_replay_is_bitwise_a_full_call(case, monkeypatch):
    """The second forward of a spec launches FA4's compiled kernel directly
    (doc_packed/kernels/fa4_launch.py): bitwise what FA4's full Python path gives; the second
    backward runs FA4's recorded program: what the full path gives, within FA4's own spread."""
    from doc_packed import ops
    from doc_packed.kernels import fa4, fa4_launch

    lengths, S, (hq, hkv), d, dv, causal, window, softcap, need_lse = case
    cu = dp.cu_seqlens_from_lengths(lengths, S, max_docs=4).cuda()
    spec = ops._local_problem(cu, S, causal, *window)
    T, scale = len(lengths) * S, d**-0.5

    def data(seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        mk = lambda h, e: torch.randn(T, h, e, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
        return mk(hq, d), mk(hkv, d), mk(hkv, dv)

    first = data(0)
    fa4.forward(spec, *first, scale, softcap, need_lse=need_lse)  # FA4's Python; the launch is recorded
    key = fa4_launch.key(*first, scale, softcap, need_lse)
    assert spec.cached(("fa4-launches",), dict)[key] is not None, "FA4 4.0.0b36's launch should be replayable"
    q, k, v = data(1)
    out, lse = fa4.forward(spec, q, k, v, scale, softcap, need_lse=need_lse)  # replayed
    monkeypatch.setenv("DOC_PACKED_FA4_REPLAY", "0")
    ref_out, ref_lse = fa4.forward(spec, q, k, v, scale, softcap, need_lse=need_lse)
    assert torch.equal(out, ref_out)
    assert (lse is None) == (ref_lse is None) == (not need_lse)
    if need_lse:
        assert torch.equal(lse, ref_lse)
        # the backward: recorded by its first call, then replayed; FA4's accumulation order
        # (atomics) may differ between its own runs, so within the op's gradient tolerance
        monkeypatch.setenv("DOC_PACKED_FA4_REPLAY", "1")
        g = torch.Generator(device="cuda").manual_seed(2)
        dout = torch.randn(out.shape, device="cuda", dtype=out.dtype, generator=g)
        fa4.backward(spec, dout, *first, *fa4.forward(spec, *first, scale, softcap), scale, softcap)
        programs = spec.cached(("fa4-steps",), dict)
        assert programs and all(isinstance(p, fa4_launch.Steps) for p in programs.values()), (
            "FA4 4.0.0b36's backward should be replayable from its first call"
        )
        got = fa4.backward(spec, dout, q, k, v, out, lse, scale, softcap)  # replayed
        monkeypatch.setenv("DOC_PACKED_FA4_REPLAY", "0")
        want = fa4.backward(spec, dout, q, k, v, out, lse, scale, softcap)
        again = fa4.backward(spec, dout, q, k, v, out, lse, scale, softcap)
        for a, b, c in zip(got, want, again):
            assert a.shape == b.shape and a.dtype == b.dtype
            assert rel(a, b) <= max(1e-3, 2 * rel(c, b))


def _cp_call_spec(rng: random.Random, T_q: int, window: tuple[int, int]):
    """A context-parallel-shaped call: ``T_q`` queries and a key count of its own, in 1-300
    pieces (some empty), bottom-right aligned."""
    from doc_packed.kernels.spec import VarlenSpec

    n = rng.choice([1, 2, 7, 40, 255, 300])
    T_k = rng.randrange(T_q // 2, 3 * T_q)
    cut = lambda T: sorted(rng.randrange(0, T + 1) for _ in range(n - 1))  # noqa: E731
    return VarlenSpec([0, *cut(T_q), T_q], [0, *cut(T_k), T_k], window == (-1, 0), *window)


@needs_fa4
@pytest.mark.parametrize("window", [(-1, 0), (300, 0), (-1, -1)])
def test_fa4_adopted_calls_are_what_fa4_gives(window, monkeypatch):
    """A layout's first forward and backward launched from other layouts' recordings
    (doc_packed/kernels/fa4_forms.py) over many layouts of several kinds (segment counts past
    MANY_SEGMENTS, masks): the forward bitwise FA4's full Python path; the backward the very
    program a recording of that layout holds (allocations, kernels, arguments), and its
    gradients what FA4's full path gives within FA4's own run-to-run spread. From the 21st layout
    on, ``fa4.prepare`` makes both first calls ahead (as ``cp.prepare`` does): they replay."""
    from doc_packed.kernels import fa4, fa4_forms, fa4_launch

    if not fa4._adopts(torch.empty(1, device="cuda")):
        pytest.skip(f"adoption is on for Hopper and FA4 {fa4._ADOPT_RELEASES} only (FA4 {fa4._release()})")
    monkeypatch.setattr(fa4, "_FORMS", fa4_forms.Forms())
    rng, T_q, scale = random.Random(7), 4096, 128**-0.5
    g = torch.Generator(device="cuda").manual_seed(0)
    before, prepared = fa4_launch.counts(), 0
    _, bwd = fa4._interface()
    for i in range(30):
        spec = _cp_call_spec(rng, T_q, window)
        mk = lambda T, h: torch.randn(T, h, 128, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
        q, k, v, dout = mk(T_q, 16), mk(spec.total_k, 4), mk(spec.total_k, 4), mk(T_q, 16)
        monkeypatch.setenv("DOC_PACKED_FA4_REPLAY", "1")
        made, seen = (fa4.prepare(spec, q.device) if i >= 20 else 0), fa4_launch.counts()  # cp.prepare's part
        out, lse = fa4.forward(spec, q, k, v, scale)
        got = fa4.backward(spec, dout, q, k, v, out, lse, scale)
        if made == 2:  # made ahead: both first calls replay what prepare made
            now = fa4_launch.counts()
            assert {n: c - seen.get(n, 0) for n, c in now.items() if c != seen.get(n, 0)} == {
                "forward replayed": 1,
                "backward replayed": 1,
            }
            prepared += 1
        monkeypatch.setenv("DOC_PACKED_FA4_REPLAY", "0")
        ref_out, ref_lse = fa4.forward(spec, q, k, v, scale)
        assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse), (i, len(spec.cu_q) - 1, spec.total_k)
        want = fa4.backward(spec, dout, q, k, v, out, lse, scale)
        again = fa4.backward(spec, dout, q, k, v, out, lse, scale)
        for a, b, c in zip(got, want, again):
            assert rel(a, b) <= max(1e-3, 2 * rel(c, b)), (i, len(spec.cu_q) - 1)
        held = [p for p in spec.cached(("fa4-steps",), dict).values() if isinstance(p, fa4_launch.Steps)]
        if held:
            kwargs = fa4._args(spec, q, scale)
            offsets = (kwargs["cu_seqlens_q"], kwargs["cu_seqlens_k"])
            _, recorded = fa4_launch.record_steps(bwd, (q, k, v, out, dout, lse), offsets, kwargs)
            assert recorded is not None
            assert _program_facts(held[0]) == _program_facts(recorded), (i, len(spec.cu_q) - 1)
    counts = fa4_launch.counts()
    assert counts.get("forward adopted", 0) - before.get("forward adopted", 0) >= 10, counts
    assert counts.get("backward adopted", 0) - before.get("backward adopted", 0) >= 5, counts
    assert prepared >= 5, prepared


def _program_facts(steps):
    """A backward program's allocations, kernels and non-tensor arguments (tensors by slot)."""
    facts = []
    for step in steps.steps:
        if step[0] == "launch":
            _, kernel, fixed, by_slot, by_view = step
            fixed = tuple(("offsets", a.data_ptr()) if isinstance(a, torch.Tensor) else a for a in fixed)
            facts.append(("launch", id(kernel), repr(fixed), by_slot, by_view))
        else:
            facts.append(step)
    return facts, steps.outputs


@needs_fa4
def test_fa4_replay_through_the_op_with_gradients(monkeypatch):
    """Training-shaped use: the same layout every layer, new data; replayed forwards give the
    full path's output bitwise, and gradients within FA4's own run-to-run spread."""
    lengths, S = [[700, 300, 1048]], 2048
    cu = dp.cu_seqlens_from_lengths(lengths, S, max_docs=4).cuda()
    g = torch.Generator(device="cuda").manual_seed(0)
    mk = lambda h: torch.randn(1, S, h, 128, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
    layers = [(mk(32), mk(8), mk(8), mk(32)) for _ in range(3)]

    def run():
        res = []
        for q, k, v, dout in layers:
            qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
            out = dp.doc_packed_attn(qq, kk, vv, cu, backend="fa4", causal=True)
            out.backward(dout)
            res.append((out.detach(), qq.grad, kk.grad, vv.grad))
        return res

    got = run()
    monkeypatch.setenv("DOC_PACKED_FA4_REPLAY", "0")
    want = run()
    for a, b in zip(got, want):
        assert torch.equal(a[0], b[0])
        for x, y in zip(a[1:], b[1:]):
            assert rel(x, y) <= 1e-2


@needs_fa4
def test_fa4_rules_raise_before_the_kernel():
    cu = dp.cu_seqlens_from_lengths([[120]], 120).cuda()  # not % 128: auto never compiles flex
    q = torch.randn(1, 120, 6, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="backend='fa4' needs float16/bfloat16, got torch.float32"):
        dp.doc_packed_attn(q.float(), q.float(), q.float(), cu, backend="fa4", causal=True)
    with pytest.raises(ValueError, match="backend='fa4' needs head dim"):
        q12 = torch.randn(1, 120, 4, 12, device="cuda", dtype=torch.bfloat16)
        dp.doc_packed_attn(q12, q12, q12, cu, backend="fa4", causal=True)
    kv = q[:, :, :2]
    with pytest.raises(ValueError, match="backend='fa4' needs q heads / kv heads a power of two"):
        dp.doc_packed_attn(q, kv, kv, cu, backend="fa4", causal=True)
    from doc_packed import env

    assert env.backend_for(q, kv, cu) != "fa4"  # auto: GQA 3:1 goes elsewhere
    out = dp.doc_packed_attn(q, kv, kv, cu, causal=True)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads", [(8, 2), (4, 1)])
def test_flex_parity(dtype, heads):
    rng = random.Random(5)
    tol = 1e-4 if dtype == torch.float32 else TOL[dtype]
    for causal, window in MASKS:
        for lengths in layouts(rng, 384):
            _check_parity(lengths, 384, heads, causal, window, dtype, "flex", tol, seed=2)


def test_flex_context_parallel_shape_empty_rows_and_mixed_passes():
    from doc_packed import kernels
    from doc_packed.kernels import flex

    spec, (q, k, v, dout), out, lse, grads, _, live = _cp_shaped_problem("flex")
    # flash's (out, lse) drive flex's backward and vice versa (auto may mix them per pass)
    fo, fl = kernels.forward(spec, q, k, v, 0.125, "flash")
    assert rel(fo[live], out[live]) <= 1e-2
    for a, b in zip(flex.backward(spec, dout, q, k, v, fo, fl, 0.125), grads):
        assert rel(a, b) <= 2e-2
    for a, b in zip(kernels.backward(spec, dout, q, k, v, out, lse, 0.125, "flash"), grads):
        assert rel(a, b) <= 2e-2


@pytest.mark.parametrize("backend", ["auto", "flash", "flex", FA4_PARAM])
def test_backend_no_sync_after_first_call(backend):
    from doc_packed import kernels
    from doc_packed.ops import local_spec
    from doc_packed._doc_layout import get_layout

    S = 4096
    cu = dp.cu_seqlens_from_lengths([[1000, 0, 3000, 96]], S, max_docs=8).cuda()
    q = torch.randn(1, S, 16, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, S, 4, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    spec = local_spec(get_layout(cu, S), True, -1, 0)
    want = {"auto": "flex" if FA4_WHY_NOT else "fa4"}.get(backend, backend)
    assert kernels.choose(backend, spec, q.view(S, 16, 128), 4) == want
    dp.doc_packed_attn(q, k, v, cu, backend=backend, causal=True).sum().backward()  # first call: reads cu once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):  # later layers / calls: no host sync
            dp.doc_packed_attn(q, k, v, cu, backend=backend, causal=True).float().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.parametrize("backend", ["flash", "flex", FA4_PARAM])
def test_cuda_compile_fullgraph(backend):
    S = 1024
    cu = dp.cu_seqlens_from_lengths([[300, 724]], S).cuda()
    q = torch.randn(1, S, 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, S, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    f = torch.compile(
        lambda q, k, v, cu: dp.doc_packed_attn(q, k, v, cu, backend=backend, causal=True).float().square().sum(),
        fullgraph=True,
    )
    loss = f(q, k, v, cu)
    g = torch.autograd.grad(loss, (q, k, v))
    ref = dp.doc_packed_attn(q, k, v, cu, backend="flash", causal=True).float().square().sum()
    rg = torch.autograd.grad(ref, (q, k, v))
    assert rel(loss.detach(), ref.detach()) < 1e-3
    for a, b in zip(g, rg):
        assert rel(a, b) < 1e-2


def test_cuda_bad_inputs():
    q = torch.randn(1, 16, 4, 64, device="cuda", dtype=torch.bfloat16)
    cu = dp.cu_seqlens_from_lengths([[16]], 16)
    with pytest.raises(ValueError, match="cu_seqlens is on cpu"):
        dp.doc_packed_attn(q, q, q, cu, causal=True)
    with pytest.raises(TypeError, match="float64 is supported on CPU only"):
        dp.doc_packed_attn(q.double(), q.double(), q.double(), cu.cuda(), causal=True)
    with pytest.raises(ValueError, match="backend='flash'"):
        dp.doc_packed_attn(q.float(), q.float(), q.float(), cu.cuda(), backend="flash", causal=True)
    with pytest.raises(ValueError, match="backend='flex' needs sequence lengths divisible by 128"):
        dp.doc_packed_attn(q, q, q, cu.cuda(), backend="flex", causal=True)
    with pytest.raises(ValueError, match="backend='flex' needs head dim"):
        q48 = torch.randn(1, 128, 4, 48, device="cuda", dtype=torch.bfloat16)
        dp.doc_packed_attn(q48, q48, q48, dp.cu_seqlens_from_lengths([[128]], 128).cuda(), backend="flex", causal=True)
