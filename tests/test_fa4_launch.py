"""FA4 forward launch replay (doc_packed/kernels/fa4_launch.py) against a stand-in FA4 on CPU.

The stand-in has FA4's shape: a JIT cache handing out a compiled kernel, called with
(q, k, v, out, lse, scale, cu_q, cu_k, ...). Replay must give what a full call gives on new
inputs, refuse every first call it cannot reproduce, and keep no tensor of the recorded call.
The real FA4 is checked on GPU (tests/test_gpu_fa4.py, replay against DOC_PACKED_FA4_REPLAY=0).
"""

from __future__ import annotations

import gc
import weakref
from typing import NamedTuple

import pytest
import torch

from doc_packed.kernels import fa4, fa4_forms, fa4_launch
from doc_packed.kernels.spec import VarlenSpec


class _JITCache(dict):
    def __getitem__(self, key):
        return dict.__getitem__(self, key)


def _kernel(q, k, v, out, lse, scale, cu_q, cu_k, *rest):
    """A deterministic stand-in 'attention' reading every input (and the offsets)."""
    w = (cu_q.float() * 1e-3).sum() + (cu_k.float() * 1e-2).sum()  # the offsets' values, not only T
    out.copy_(q * scale + k.mean((0, 1)) + v.sum() + w)
    if lse is not None:
        lse.copy_((q.sum(-1) * scale).t())


def _fake_fa4(launches: int = 1, extra_tensor: bool = False):
    cache = _JITCache()
    calls = {"python": 0}

    def fwd(q, k, v, *, cu_seqlens_q, cu_seqlens_k, softmax_scale, return_lse, **_):
        calls["python"] += 1
        key = (q.shape, return_lse)
        if key not in cache:
            dict.__setitem__(cache, key, _kernel)
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[1], q.shape[0]) if return_lse else None
        made = torch.zeros(2) if extra_tensor else None  # like FA4's per-call scheduler metadata
        for _ in range(launches):
            cache[key](
                q.detach(), k.detach(), v.detach(), out, lse, softmax_scale, cu_seqlens_q, cu_seqlens_k, None, made
            )
        return out, lse, None, None, None

    fwd.compile_cache = cache  # type: ignore[attr-defined]
    return fwd, calls


def _qkv(seed: int, T: int = 64, H: int = 4, D: int = 8):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(T, H, D, generator=g) for _ in range(3))


def _kwargs(cu, need_lse=True):
    return dict(cu_seqlens_q=cu, cu_seqlens_k=cu, softmax_scale=0.5, return_lse=need_lse)


@pytest.mark.parametrize("need_lse", [True, False])
def test_replay_matches_a_full_call_on_new_inputs(need_lse):
    fwd, _ = _fake_fa4()
    cu = torch.tensor([0, 20, 64], dtype=torch.int32)
    q, k, v = _qkv(0)
    (out, lse, *_), launch = fa4_launch.record(fwd, q, k, v, (cu,), _kwargs(cu, need_lse))
    assert launch is not None
    q2, k2, v2 = _qkv(1)
    ref_out, ref_lse, *_ = fwd(q2, k2, v2, **_kwargs(cu, need_lse))
    got_out, got_lse = fa4_launch.replay(launch, q2, k2, v2)
    assert torch.equal(got_out, ref_out) and got_out.data_ptr() != out.data_ptr()
    assert (got_lse is None) == (not need_lse)
    if need_lse:
        assert torch.equal(got_lse, ref_lse)


@pytest.mark.parametrize(
    "fake, why",
    [
        (dict(launches=2), "2 launches"),
        (dict(launches=0), "0 launches"),
        (dict(extra_tensor=True), "a tensor made for this call"),
    ],
)
def test_first_calls_that_cannot_be_reproduced_are_not_replayed(fake, why):
    """(two launches: split-KV and its combine; none: an empty problem; a tensor FA4 made for
    the call: its scheduler metadata.) The refusal is counted under its reason."""
    fwd, _ = _fake_fa4(**fake)
    cu = torch.tensor([0, 64], dtype=torch.int32)
    q, k, v = _qkv(0)
    before = fa4_launch.counts()
    (out, *_), launch = fa4_launch.record(fwd, q, k, v, (cu,), _kwargs(cu))
    assert launch is None, why
    assert out.shape == q.shape  # FA4's own result still comes back
    _assert_counted(before, f"forward not replayable: {why}")


def _assert_counted(before: dict, what: str) -> None:
    """One more call counted under ``what`` since ``before``, and under nothing else."""
    after = fa4_launch.counts()
    assert {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)} == {what: 1}


def test_offsets_other_than_the_specs_are_not_replayed():
    fwd, _ = _fake_fa4()
    cu = torch.tensor([0, 64], dtype=torch.int32)
    q, k, v = _qkv(0)
    _, launch = fa4_launch.record(fwd, q, k, v, (cu.clone(),), _kwargs(cu))
    assert launch is None


def test_the_recorded_call_keeps_no_tensor_alive():
    fwd, _ = _fake_fa4()
    cu = torch.tensor([0, 64], dtype=torch.int32)
    q, k, v = _qkv(0)
    (out, lse, *_), launch = fa4_launch.record(fwd, q, k, v, (cu,), _kwargs(cu))
    refs = [weakref.ref(t) for t in (q, k, v, out, lse)]
    del q, k, v, out, lse
    gc.collect()
    assert launch is not None and all(r() is None for r in refs)


def test_misaligned_inputs_have_no_key():
    q, k, v = _qkv(0)
    assert fa4_launch.key(q, k, v, 0.5, 0.0, True) is not None
    shifted = torch.randn(q.numel() + 1)[1:].view(q.shape)  # 4 bytes past an aligned start
    assert fa4_launch.key(shifted, k, v, 0.5, 0.0, True) is None


def test_forward_records_once_per_spec_and_key_then_skips_fa4s_python(monkeypatch):
    fwd, calls = _fake_fa4()
    monkeypatch.setattr(fa4, "_interface", lambda: (fwd, None))
    spec = VarlenSpec([0, 24, 64], [0, 24, 64], True, -1, 0, row_len=64)
    outs = []
    for seed in range(3):
        q, k, v = _qkv(seed)
        outs.append((fa4.forward(spec, q, k, v, 0.5), fwd(q, k, v, **fa4._args(spec, q, 0.5), return_lse=True)))
    assert calls["python"] == 1 + 3  # FA4's Python ran for the first forward only (+ the references)
    for (out, lse), (ref_out, ref_lse, *_) in outs:
        assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    q, k, v = _qkv(4)
    fa4.forward(spec, q, k, v, 0.25)  # another scale: another key, recorded by a full call
    assert calls["python"] == 5
    monkeypatch.setenv("DOC_PACKED_FA4_REPLAY", "0")
    fa4.forward(spec, q, k, v, 0.5)
    assert calls["python"] == 6


# ----------------------------------------------------------------------------- across layouts


def _layout(seed: int, T_q: int = 64):
    """A random layout of one kind: causal, 1-6 segments over T_q queries and a key count of
    its own (as a context-parallel call's received keys), and fresh q/k/v on those lengths."""
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 7, (1,), generator=g))
    T_k = int(torch.randint(T_q, 2 * T_q, (1,), generator=g))
    cut_q = sorted(torch.randperm(T_q - 1, generator=g)[: n - 1].add(1).tolist())
    cut_k = sorted(torch.randperm(T_k - 1, generator=g)[: n - 1].add(1).tolist())
    spec = VarlenSpec([0, *cut_q, T_q], [0, *cut_k, T_k], True, -1, 0)
    q, k, v = (torch.randn(T, 4, 8, generator=g) for T in (T_q, T_k, T_k))
    return spec, q, k, v


@pytest.fixture
def adopting(monkeypatch):
    """fa4.forward on the CPU stand-in as on Hopper (adoption on), with no kinds learnt yet."""
    monkeypatch.setattr(fa4, "_adopts_on", lambda device: True)
    monkeypatch.setattr(fa4, "_FORMS", fa4_forms.Forms())


def test_a_layouts_first_forward_is_adopted_once_two_layouts_agreed(monkeypatch, adopting):
    """Two layouts record the same launch; every later layout's first call (new offsets, a new
    key count) launches it without FA4's Python and gives what FA4 gives."""
    fwd, calls = _fake_fa4()
    monkeypatch.setattr(fa4, "_interface", lambda: (fwd, None))
    before = fa4_launch.counts()
    for seed in range(8):
        spec, q, k, v = _layout(seed)
        python = calls["python"]
        out, lse = fa4.forward(spec, q, k, v, 0.5)
        assert calls["python"] == python + (seed < 2)  # FA4's Python for the first two layouts only
        ref_out, ref_lse, *_ = fwd(q, k, v, **fa4._args(spec, q, 0.5), return_lse=True)
        assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
        q2 = torch.randn_like(q)  # the spec's own launch now
        again, _ = fa4.forward(spec, q2, k, v, 0.5)
        assert torch.equal(again, fwd(q2, k, v, **fa4._args(spec, q, 0.5), return_lse=True)[0])
    after = fa4_launch.counts()
    assert after.get("forward adopted", 0) - before.get("forward adopted", 0) == 6
    assert after.get("forward recorded", 0) - before.get("forward recorded", 0) == 2
    assert after.get("forward replayed", 0) - before.get("forward replayed", 0) == 8


def _fake_fa4_by_length(threshold: int):
    """A stand-in whose compiled kernel depends on the longest segment (as Blackwell's takes
    max_seqlen_q): one object below ``threshold``, another above."""
    fwd, calls = _fake_fa4()
    cache = fwd.compile_cache

    def by_length(q, k, v, *, cu_seqlens_q, cu_seqlens_k, softmax_scale, return_lse, max_seqlen_q, **_):
        calls["python"] += 1
        key = (max_seqlen_q > threshold, return_lse)
        if key not in cache:
            dict.__setitem__(cache, key, lambda *a: _kernel(*a))
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[1], q.shape[0]) if return_lse else None
        cache[key](q.detach(), k.detach(), v.detach(), out, lse, softmax_scale, cu_seqlens_q, cu_seqlens_k, None)
        return out, lse, None, None, None

    by_length.compile_cache = cache  # type: ignore[attr-defined]
    return by_length, calls


def test_a_kind_whose_layouts_launched_different_kernels_is_never_adopted(monkeypatch, adopting):
    fwd, calls = _fake_fa4_by_length(threshold=fa4.MAX_SEQLEN_FLOOR)
    monkeypatch.setattr(fa4, "_interface", lambda: (fwd, None))
    short = VarlenSpec([0, 32, 64], [0, 40, 80], True, -1, 0)
    long = VarlenSpec([0, 300], [0, 310], True, -1, 0)
    for spec in (short, long):
        fa4.forward(spec, torch.randn(spec.total_q, 4, 8), *(torch.randn(spec.total_k, 4, 8) for _ in "kv"), 0.5)
    assert calls["python"] == 2 and list(fa4._FORMS._launch.values()) == [None]  # they disagreed
    for seed in range(3):
        spec, q, k, v = _layout(seed)
        out, lse = fa4.forward(spec, q, k, v, 0.5)
        assert calls["python"] == 3 + 2 * seed  # not adopted: FA4 ran (then the reference)
        ref_out, *_ = fwd(q, k, v, **fa4._args(spec, q, 0.5), return_lse=True)
        assert torch.equal(out, ref_out)


def test_a_refused_recording_ends_adoption_for_its_kind(monkeypatch, adopting):
    fwd, calls = _fake_fa4()
    monkeypatch.setattr(fa4, "_interface", lambda: (fwd, None))
    for seed in range(2):
        spec, q, k, v = _layout(seed)
        fa4.forward(spec, q, k, v, 0.5)
    refusing, _ = _fake_fa4(extra_tensor=True)
    monkeypatch.setattr(fa4, "_interface", lambda: (refusing, None))
    spec, q, k, v = _layout(2)
    fa4.forward(spec, q, k, v, 0.5)  # adopted: FA4 does not run, so nothing is learnt
    assert calls["python"] == 2
    kind = next(iter(fa4._FORMS._launch))
    fa4._FORMS.learn_launch(kind, None, ())  # what a refused recording of the kind reports
    monkeypatch.setattr(fa4, "_interface", lambda: (fwd, None))
    spec, q, k, v = _layout(3)
    fa4.forward(spec, q, k, v, 0.5)
    assert calls["python"] == 3 and fa4._FORMS._launch[kind] is None


@pytest.mark.parametrize(
    "other",
    [
        dict(causal=False, left=-1, right=-1),  # another mask class
        dict(causal=True, left=16, right=0),  # a window: its sizes are kernel arguments
        dict(scale=0.25),
        dict(dtype=torch.float64),
        dict(heads=2),
    ],
)
def test_adoption_stays_within_a_kind(monkeypatch, adopting, other):
    fwd, calls = _fake_fa4()
    monkeypatch.setattr(fa4, "_interface", lambda: (fwd, None))
    for seed in range(2):
        spec, q, k, v = _layout(seed)
        fa4.forward(spec, q, k, v, 0.5)
    spec, q, k, v = _layout(2)
    mask = {n: other.get(n, getattr(spec, n)) for n in ("causal", "left", "right")}
    spec = VarlenSpec(spec.cu_q, spec.cu_k, mask["causal"], mask["left"], mask["right"])
    dtype, heads = other.get("dtype", q.dtype), other.get("heads", 4)
    q, k, v = (t[:, :heads].to(dtype) for t in (q, k, v))
    fa4.forward(spec, q, k, v, other.get("scale", 0.5))
    assert calls["python"] == 3  # another kind: FA4 runs and records


def test_no_adoption_off_hopper(monkeypatch):
    """On the CPU (as on Blackwell, whose forward takes max_seqlen_q) every layout records."""
    monkeypatch.setattr(fa4, "_FORMS", fa4_forms.Forms())
    fwd, calls = _fake_fa4()
    monkeypatch.setattr(fa4, "_interface", lambda: (fwd, None))
    for seed in range(4):
        fa4.forward(*_layout(seed), 0.5)
    assert calls["python"] == 4 and fa4._FORMS._launch == {}


# ----------------------------------------------------------------------------- backward programs


class _Aux:
    """Like FA4's AuxData: an argument object that may hold tensors."""

    def __init__(self, tensors=None):
        self.tensors = tensors


def _pre(out, dout, dpsum, lse, dq_accum, cu_q):
    dpsum.copy_((out * dout).sum(-1).t())
    dq_accum.fill_(float("nan"))  # the padding: a view at the wrong offset would read it
    dq_accum[32 : 32 + out.numel()].zero_()


def _main(q, k, v, dout, lse, dpsum, dq_accum, dk_accum, dv_accum, scale, cu_q, cu_k, aux):
    n = (cu_k[1:] - cu_k[:-1]).float().sum()
    dq_accum.view(q.shape).add_(dout * scale + k.mean(1, keepdim=True) + lse.t()[..., None] + dpsum.t()[..., None])
    dk_accum.add_(q.sum(1, keepdim=True).expand_as(k) * scale + n)
    dv_accum.add_(dout.sum(1, keepdim=True).expand_as(v) + v)


def _post(accum, grad, scale):
    grad.copy_(accum.view(grad.shape) * scale)


def _fake_fa4_bwd(compute_op: bool = False, foreign: torch.Tensor | None = None, aux_tensor: bool = False):
    """FA4's backward in shape: scratch allocated (some zeroed), five launches in order, some on
    an offset view of an allocation, ``k.detach()`` passed, (dq, dk, dv) returned."""
    cache = _JITCache()
    calls = {"python": 0}
    for name, kernel in (("pre", _pre), ("main", _main), ("post", _post)):
        dict.__setitem__(cache, name, kernel)

    def bwd(q, k, v, out, dout, lse, *, cu_seqlens_q, cu_seqlens_k, softmax_scale, **_):
        calls["python"] += 1
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        dq_accum = torch.empty(q.numel() + 64)  # padded, as FA4 rounds its accumulators
        dq_rows = dq_accum[32 : 32 + q.numel()].view(-1, q.shape[-1])  # launched as an offset view
        dpsum = torch.empty(q.shape[1], q.shape[0])
        dk_accum, dv_accum = torch.zeros(k.shape), torch.zeros(v.shape)
        if compute_op:
            dout = dout * 1.0  # arithmetic FA4 might do on an input: not a fixed program
        cache["pre"](out, dout, dpsum, lse, dq_accum, cu_seqlens_q)
        extra = foreign if foreign is not None else dk_accum
        aux = _Aux([dq] if aux_tensor else None)
        cache["main"](
            q, k.detach(), v, dout, lse, dpsum, dq_rows, extra, dv_accum, softmax_scale, cu_seqlens_q, cu_seqlens_k, aux
        )
        cache["post"](dq_rows, dq.view(-1, q.shape[-1]), softmax_scale)
        cache["post"](dk_accum, dk, 1.0)
        cache["post"](dv_accum, dv, 1.0)
        return dq, dk, dv

    bwd.compile_cache = cache  # type: ignore[attr-defined]
    return bwd, calls


def _bwd_inputs(seed: int, T: int = 64, Hq: int = 4, Hkv: int = 2, D: int = 8):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, Hq, D, generator=g)
    kv = torch.randn(T, 2, Hkv, D, generator=g)  # k and v share a storage, as CP's received rows do
    out, dout = torch.randn(T, Hq, D, generator=g), torch.randn(T, Hq, D, generator=g)
    lse = torch.randn(Hq, T, generator=g)
    return q, kv[:, 0], kv[:, 1], out, dout, lse


def _bwd_kwargs(cu):
    return dict(cu_seqlens_q=cu, cu_seqlens_k=cu, softmax_scale=0.5)


def test_backward_program_replays_a_full_call_on_new_inputs():
    bwd, _ = _fake_fa4_bwd()
    cu = torch.tensor([0, 20, 64], dtype=torch.int32)
    first = _bwd_inputs(0)
    result, steps = fa4_launch.record_steps(bwd, first, (cu,), _bwd_kwargs(cu))
    assert steps is not None
    kinds = [s[0] for s in steps.steps]
    assert kinds.count("launch") == 5 and kinds.count("new") == 7
    assert [s[4] for s in steps.steps if s[0] == "new"] == [False] * 5 + [True] * 2  # zeroed: dk/dv_accum
    for seed in (1, 2):
        new = _bwd_inputs(seed)
        ref = bwd(*new, **_bwd_kwargs(cu))
        got = fa4_launch.replay_steps(steps, new)
        assert len(got) == 3
        for a, b in zip(got, ref):
            assert torch.equal(a, b)
        assert all(a.data_ptr() != b.data_ptr() for a, b in zip(got, result))


def test_backward_replay_zeroes_what_fa4_zeroed():
    bwd, _ = _fake_fa4_bwd()
    cu = torch.tensor([0, 64], dtype=torch.int32)
    _, steps = fa4_launch.record_steps(bwd, _bwd_inputs(0), (cu,), _bwd_kwargs(cu))
    garbage = [torch.full((4096,), float("nan")) for _ in range(8)]  # dirty the allocator's pool
    del garbage
    new = _bwd_inputs(3)
    got = fa4_launch.replay_steps(steps, new)
    assert all(torch.isfinite(g).all() for g in got)
    assert torch.equal(got[2], bwd(*new, **_bwd_kwargs(cu))[2])  # dv reads the zeroed dv_accum


@pytest.mark.parametrize(
    "fake, why",
    [
        (dict(compute_op=True), "a tensor op ("),
        (dict(foreign=torch.zeros(64, 2, 8)), "a launch argument of unknown origin"),
        (dict(aux_tensor=True), "a launch argument holding tensors"),
    ],
)
def test_backward_calls_that_are_not_a_fixed_program_are_not_replayed(fake, why):
    """(an arithmetic op on an input; a tensor of unknown origin, a cache of FA4's; an argument
    object holding a tensor.) The refusal is counted under its reason."""
    bwd, _ = _fake_fa4_bwd(**fake)
    cu = torch.tensor([0, 64], dtype=torch.int32)
    before = fa4_launch.counts()
    result, steps = fa4_launch.record_steps(bwd, _bwd_inputs(0), (cu,), _bwd_kwargs(cu))
    assert steps is None, why
    assert result[0].shape == (64, 4, 8)  # FA4's own result still comes back
    after = fa4_launch.counts()
    new = {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}
    assert len(new) == 1 and next(iter(new)).startswith(f"backward not replayable: {why}"), new


def test_a_tensor_passed_twice_is_not_recorded():
    """v = k (the lse gradient's backward passes keys as values): a program recorded so would
    pass k for v on a later call with the same key and distinct tensors."""
    bwd, _ = _fake_fa4_bwd()
    cu = torch.tensor([0, 64], dtype=torch.int32)
    q, k, _, out, dout, lse = _bwd_inputs(0)
    k = k.contiguous()
    _, steps = fa4_launch.record_steps(bwd, (q, k, k, out, dout, lse), (cu,), _bwd_kwargs(cu))
    assert steps is None


def test_backward_program_keeps_no_tensor_of_the_recorded_call():
    bwd, _ = _fake_fa4_bwd()
    cu = torch.tensor([0, 64], dtype=torch.int32)
    inputs = _bwd_inputs(0)
    result, steps = fa4_launch.record_steps(bwd, inputs, (cu,), _bwd_kwargs(cu))
    refs = [weakref.ref(t) for t in (*inputs, *result)]
    del inputs, result
    gc.collect()
    assert steps is not None and all(r() is None for r in refs)


def test_steps_key_covers_layouts_and_refuses_misaligned_inputs():
    inputs = _bwd_inputs(0)
    key = fa4_launch.steps_key(inputs, 0.5, 0.0)
    assert key is not None and key != fa4_launch.steps_key(inputs, 0.25, 0.0)
    assert key != fa4_launch.steps_key((inputs[0].transpose(0, 1).contiguous().transpose(0, 1), *inputs[1:]), 0.5, 0.0)
    q = inputs[0]
    shifted = torch.randn(q.numel() + 1)[1:].view(q.shape)
    assert fa4_launch.steps_key((shifted, *inputs[1:]), 0.5, 0.0) is None


def test_backward_records_once_per_spec_and_key_then_skips_fa4s_python(monkeypatch):
    bwd, calls = _fake_fa4_bwd()
    monkeypatch.setattr(fa4, "_interface", lambda: (None, bwd))
    spec = VarlenSpec([0, 24, 64], [0, 24, 64], True, -1, 0, row_len=64)
    for seed in range(3):
        q, k, v, out, dout, lse = _bwd_inputs(seed)
        got = fa4.backward(spec, dout, q, k, v, out, lse, 0.5)
        ref = bwd(q, k, v, out, dout, lse, **fa4._args(spec, q, 0.5))
        assert all(torch.equal(a, b) for a, b in zip(got, ref))
    assert calls["python"] == 1 + 3  # FA4's Python ran for the first backward only (+ the references)
    fa4.backward(spec, dout, q, k, v, out, lse, 0.25)  # another scale: recorded by a full call
    assert calls["python"] == 5
    monkeypatch.setenv("DOC_PACKED_FA4_REPLAY", "0")
    fa4.backward(spec, dout, q, k, v, out, lse, 0.5)
    assert calls["python"] == 6


def test_a_refused_backward_is_recorded_once_more_then_left_to_fa4(monkeypatch):
    """The first call for a key may also compile; a refusal then is retried once, a second
    refusal is final (FA4's full path from then on)."""
    bwd, calls = _fake_fa4_bwd(compute_op=True)  # never a fixed program
    monkeypatch.setattr(fa4, "_interface", lambda: (None, bwd))
    seen = []
    real = fa4_launch.record_steps
    monkeypatch.setattr(fa4_launch, "record_steps", lambda *a: seen.append(1) or real(*a))
    spec = VarlenSpec([0, 64], [0, 64], True, -1, 0, row_len=64)
    q, k, v, out, dout, lse = _bwd_inputs(0)
    for _ in range(4):
        fa4.backward(spec, dout, q, k, v, out, lse, 0.5)
    assert len(seen) == 2 and calls["python"] == 4
    assert spec.cached(("fa4-steps",), dict) == {fa4_launch.steps_key((q, k, v, out, dout, lse), 0.5, 0.0): None}


# ----------------------------------------------------------------------------- backward across layouts


class _AuxData(NamedTuple):  # FA4's argument object: compared by value
    tensors: tuple | None = None


def _pre_v(out, dout, dpsum, lse, cu_q):
    T = out.shape[0]
    dpsum.fill_(float("nan"))  # the padding: a kernel reading past T_q would spread it
    dpsum[:, :T] = (out * dout).sum(-1).t() + lse + cu_q[-1]


def _main_v(q, k, v, dout, dpsum, dq_accum, dk_accum, dv_accum, scale, cu_q, cu_k, aux):
    (T_q, H, D), T_k, Hkv = q.shape, k.shape[0], k.shape[1]
    dq_accum.view(H, -1, D)[:, :T_q] = (dout * scale).transpose(0, 1) + dpsum[:, :T_q, None]
    dk_accum.view(Hkv, -1, D)[:, :T_k] += q.mean((0, 1)) + (cu_k.float() * 1e-2).sum()
    dv_accum.view(Hkv, -1, D)[:, :T_k] += v.transpose(0, 1)


def _post_v(accum, grad, scale):
    T, H, D = grad.shape
    grad.copy_(accum.view(H, -1, D)[:, :T].transpose(0, 1) * scale)


def _fake_fa4_bwd_varlen(pad_q=None):
    """FA4's varlen backward in shape: dq/dk/dv like the inputs, float32 accumulators padded to
    tiles by the row count and the number of offsets (``pad_q``: another rule for dq's), whole
    allocations launched with the offsets and an argument object compared by value."""
    cache = _JITCache()
    calls = {"python": 0}
    for name, kernel in (("pre", _pre_v), ("main", _main_v), ("post", _post_v)):
        dict.__setitem__(cache, name, kernel)

    def bwd(q, k, v, out, dout, lse, *, cu_seqlens_q, cu_seqlens_k, softmax_scale, max_seqlen_q, **_):
        calls["python"] += 1
        (T_q, H, D), T_k, Hkv, L = q.shape, k.shape[0], k.shape[1], cu_seqlens_q.numel()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        pq = (T_q + L * 64 - 1) // 64 * 64 if pad_q is None else pad_q(max_seqlen_q)
        pk = (T_k + L * 128 - 1) // 128 * 128
        dq_accum, dpsum = torch.empty(H, pq * D), torch.empty(H, pq)
        dk_accum, dv_accum = torch.zeros(Hkv, pk * D), torch.zeros(Hkv, pk * D)
        cache["pre"](out, dout, dpsum, lse, cu_seqlens_q)
        args = (dout, dpsum, dq_accum, dk_accum, dv_accum, softmax_scale, cu_seqlens_q, cu_seqlens_k, _AuxData())
        cache["main"](q.detach(), k.detach(), v.detach(), *args)
        cache["post"](dq_accum, dq, softmax_scale)
        cache["post"](dk_accum, dk, 1.0)
        cache["post"](dv_accum, dv, 1.0)
        return dq, dk, dv

    bwd.compile_cache = cache  # type: ignore[attr-defined]
    return bwd, calls


def _bwd_layout(seed: int):
    spec, q, k, v = _layout(seed)
    g = torch.Generator().manual_seed(1000 + seed)
    out, dout = torch.randn(q.shape, generator=g), torch.randn(q.shape, generator=g)
    lse = torch.randn(q.shape[1], q.shape[0], generator=g)
    return spec, (q, k, v, out, dout, lse)


def test_a_layouts_first_backward_is_adopted_once_three_layouts_agreed(monkeypatch, adopting):
    """Three layouts (row counts and offsets of their own) record the same program but for
    its sizes; every later layout's first backward runs the program sized by the rules they
    agree on, without FA4's Python: what FA4 gives, and the program a recording would hold."""
    bwd, calls = _fake_fa4_bwd_varlen()
    monkeypatch.setattr(fa4, "_interface", lambda: (None, bwd))
    before = fa4_launch.counts()
    for seed in range(8):
        spec, (q, k, v, out, dout, lse) = _bwd_layout(seed)
        python = calls["python"]
        got = fa4.backward(spec, dout, q, k, v, out, lse, 0.5)
        assert calls["python"] == python + (seed < fa4_forms.AGREE_STEPS)
        ref = bwd(q, k, v, out, dout, lse, **fa4._args(spec, q, 0.5))
        assert all(torch.equal(a, b) for a, b in zip(got, ref))
        if seed >= fa4_forms.AGREE_STEPS:
            (held,) = spec.cached(("fa4-steps",), dict).values()
            kwargs = fa4._args(spec, q, 0.5)
            offsets = (kwargs["cu_seqlens_q"], kwargs["cu_seqlens_k"])
            _, recorded = fa4_launch.record_steps(bwd, (q, k, v, out, dout, lse), offsets, kwargs)
            assert [s[1:] for s in held.steps if s[0] == "new"] == [s[1:] for s in recorded.steps if s[0] == "new"]
    after = fa4_launch.counts()
    assert after.get("backward adopted", 0) - before.get("backward adopted", 0) == 8 - fa4_forms.AGREE_STEPS


def test_a_backward_size_no_rule_explains_ends_adoption(monkeypatch, adopting):
    """dq's accumulator sized by the longest segment (a rule the forms do not have): the
    recordings disagree, and FA4 runs for every layout."""
    bwd, calls = _fake_fa4_bwd_varlen(pad_q=lambda max_q: 64 + 8 * max_q)
    monkeypatch.setattr(fa4, "_interface", lambda: (None, bwd))
    monkeypatch.setattr(fa4, "MAX_SEQLEN_FLOOR", 0)  # max_seqlen_q: the longest segment
    for seed in range(6):
        spec, (q, k, v, out, dout, lse) = _bwd_layout(seed)
        got = fa4.backward(spec, dout, q, k, v, out, lse, 0.5)
        ref = bwd(q, k, v, out, dout, lse, **fa4._args(spec, q, 0.5))
        assert all(torch.equal(a, b) for a, b in zip(got, ref))
    assert calls["python"] == 12 and list(fa4._FORMS._steps.values()) == [None]


def test_prepare_makes_a_layouts_first_calls_ahead(monkeypatch, adopting):
    """Once kinds are trusted, ``fa4.prepare`` (what ``cp.prepare`` runs for a schedule's calls)
    leaves a new layout's forward launch and backward program where its first calls find them:
    those calls replay, without FA4's Python and without adopting, and give what FA4 gives."""
    fwd, f_calls = _fake_fa4()
    bwd, b_calls = _fake_fa4_bwd_varlen()
    monkeypatch.setattr(fa4, "_interface", lambda: (fwd, bwd))
    for seed in range(fa4_forms.AGREE_STEPS):
        spec, (q, k, v, out, dout, lse) = _bwd_layout(seed)
        fa4.forward(spec, q, k, v, 0.5)
        fa4.backward(spec, dout, q, k, v, out, lse, 0.5)
    spec, (q, k, v, out, dout, lse) = _bwd_layout(50)
    assert fa4.prepare(spec, q.device) == 2  # one forward kind, one backward kind
    before, python = fa4_launch.counts(), (f_calls["python"], b_calls["python"])
    got_out, got_lse = fa4.forward(spec, q, k, v, 0.5)
    got = fa4.backward(spec, dout, q, k, v, out, lse, 0.5)
    after = fa4_launch.counts()
    assert (f_calls["python"], b_calls["python"]) == python
    assert {n: c - before.get(n, 0) for n, c in after.items() if c != before.get(n, 0)} == {
        "forward replayed": 1,
        "backward replayed": 1,
    }
    ref_out, ref_lse, *_ = fwd(q, k, v, **fa4._args(spec, q, 0.5), return_lse=True)
    assert torch.equal(got_out, ref_out) and torch.equal(got_lse, ref_lse)
    ref = bwd(q, k, v, out, dout, lse, **fa4._args(spec, q, 0.5))
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


def test_prepare_makes_nothing_for_another_mask_or_untrusted_kinds(monkeypatch, adopting):
    fwd, _ = _fake_fa4()
    monkeypatch.setattr(fa4, "_interface", lambda: (fwd, None))
    spec, q, k, v = _layout(0)
    fa4.forward(spec, q, k, v, 0.5)  # one recording: not trusted yet
    assert fa4.prepare(_layout(1)[0], q.device) == 0
    fa4.forward(*_layout(1), 0.5)
    assert fa4.prepare(_layout(2)[0], q.device) == 1
    other = _layout(3)[0]
    windowed = VarlenSpec(other.cu_q, other.cu_k, True, 16, 0)
    assert fa4.prepare(windowed, q.device) == 0
