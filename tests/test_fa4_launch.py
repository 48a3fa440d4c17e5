"""FA4 forward launch replay (doc_packed/kernels/fa4_launch.py) against a stand-in FA4 on CPU.

The stand-in has FA4's shape: a JIT cache handing out a compiled kernel, called with
(q, k, v, out, lse, scale, cu_q, cu_k, ...). Replay must give what a full call gives on new
inputs, refuse every first call it cannot reproduce, and keep no tensor of the recorded call.
The real FA4 is checked on GPU (tests/test_gpu_fa4.py, replay against DOC_PACKED_FA4_REPLAY=0).
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from doc_packed.kernels import fa4, fa4_launch
from doc_packed.kernels.spec import VarlenSpec


class _JITCache(dict):
    def __getitem__(self, key):
        return dict.__getitem__(self, key)


def _kernel(q, k, v, out, lse, scale, cu_q, cu_k, *rest):
    """A deterministic stand-in 'attention' reading every input (and the offsets)."""
    w = (cu_k[1:] - cu_k[:-1]).float().sum()
    out.copy_(q * scale + k.mean(1, keepdim=True).expand_as(q) + v.sum() + w)
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
            cache[key](q.detach(), k.detach(), v.detach(), out, lse, softmax_scale, cu_seqlens_q, cu_seqlens_k, None, made)
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
        (dict(launches=2), "two launches (split-KV and combine)"),
        (dict(launches=0), "no launch (an empty problem)"),
        (dict(extra_tensor=True), "a tensor FA4 made for the call"),
    ],
)
def test_first_calls_that_cannot_be_reproduced_are_not_replayed(fake, why):
    fwd, _ = _fake_fa4(**fake)
    cu = torch.tensor([0, 64], dtype=torch.int32)
    q, k, v = _qkv(0)
    (out, *_), launch = fa4_launch.record(fwd, q, k, v, (cu,), _kwargs(cu))
    assert launch is None, why
    assert out.shape == q.shape  # FA4's own result still comes back


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
