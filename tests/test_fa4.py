"""The FA4 backend without a GPU: import guard, argument mapping, support rules, auto's choice.

FlashAttention-4 is absent on CPU CI. Its interface is replaced by a stand-in module whose
``_flash_attn_fwd``/``_flash_attn_bwd`` take FA4's keywords, rebuild the problem they describe
(offsets, lengths, causal, window) and solve it with the math kernel, so the op's results
against the float64 oracle show that what we pass FA4 describes the caller's problem.
The GPU side (the real kernels against the oracle) is in tests/test_gpu.py.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import textwrap
import types

import pytest
import torch
from doc_packed_testing.oracle import random_lengths
from doc_packed_testing.oracle import reference

import doc_packed as dp
from doc_packed import env, kernels
from doc_packed.kernels import fa4, flash, flex
from doc_packed.kernels import math as math_kernel
from doc_packed.kernels.spec import VarlenSpec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _fake_q(dtype=torch.bfloat16, heads=8, head_dim=128, device="cuda"):
    """What the support rules read of q (device, dtype, shape), without a CUDA tensor."""
    return types.SimpleNamespace(
        device=torch.device(device, 0) if device == "cuda" else torch.device(device),
        dtype=dtype,
        shape=(64, heads, head_dim),
    )


@pytest.fixture
def hopper(monkeypatch):
    """FA4 installed, compute capability 9.0; flex and flash take everything."""
    monkeypatch.setattr(fa4, "available", lambda: True)
    monkeypatch.setattr(fa4, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(flex, "unsupported_reason", lambda q, rows: None)
    monkeypatch.setattr(flash, "unsupported_reason", lambda q: None)
    monkeypatch.setattr(kernels, "_broken", {})


LOCAL = VarlenSpec([0, 100, 256], [0, 100, 256], True, -1, 0, row_len=256)
CP = VarlenSpec([0, 128, 128], [0, 384, 512], True, -1, 0)  # context-parallel shape


# ----------------------------------------------------------------------------- import guard


def _run(code: str, pythonpath: str | None = None) -> subprocess.CompletedProcess:
    path = [ROOT] + ([pythonpath] if pythonpath else [])
    env_ = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env_, timeout=300)


def test_import_never_imports_flash_attn(tmp_path):
    # a flash_attn.cute whose import fails loudly: doc_packed, env and a CPU call must not touch it
    cute = tmp_path / "flash_attn" / "cute"
    cute.mkdir(parents=True)
    (cute / "__init__.py").write_text("raise SystemExit('flash_attn.cute was imported')\n")
    (cute / "interface.py").write_text("raise SystemExit('flash_attn.cute.interface was imported')\n")
    code = textwrap.dedent(
        """
        import sys, torch
        import doc_packed as dp
        from doc_packed import env
        from doc_packed.kernels import fa4
        assert fa4.available()
        text = env.report()
        assert "flash-attn-4: installed" in text, text
        q = torch.randn(1, 8, 2, 16)
        dp.doc_packed_attn(q, q, q, dp.cu_seqlens_from_lengths([[8]], 8), causal=True)
        assert not [m for m in sys.modules if m.split(".")[0] == "flash_attn"]
        print("ok")
        """
    )
    res = _run(code, str(tmp_path))
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


def test_available_is_false_without_the_package(monkeypatch):
    fa4.available.cache_clear()
    try:
        monkeypatch.setattr(fa4.importlib.util, "find_spec", lambda name: None)
        assert fa4.available() is False
    finally:
        fa4.available.cache_clear()


def _fake_interface(monkeypatch, fwd=None, bwd=None):
    mod = types.ModuleType(fa4.MODULE)
    if fwd is not None:
        mod._flash_attn_fwd = fwd
    if bwd is not None:
        mod._flash_attn_bwd = bwd
    monkeypatch.setitem(sys.modules, fa4.MODULE, mod)
    _uncached_interface(monkeypatch)
    return mod


def _uncached_interface(monkeypatch):
    """Each call imports again (the real one is cached for the process)."""
    real = fa4._interface
    monkeypatch.setattr(fa4, "_interface", getattr(real, "__wrapped__", real))


def test_interface_missing_or_moved_raises_naming_the_module(monkeypatch):
    _fake_interface(monkeypatch, fwd=_oracle_fwd)
    with pytest.raises(fa4.Unavailable, match=r"flash_attn\.cute\.interface has no _flash_attn_bwd"):
        fa4._interface()

    def old_fwd(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                max_seqlen_k=None, softmax_scale=None, causal=False, window_size=(None, None)):
        pass

    _fake_interface(monkeypatch, fwd=old_fwd, bwd=_oracle_bwd)
    with pytest.raises(fa4.Unavailable, match="_flash_attn_fwd takes no window_size_left, window_size_right, return_lse"):
        fa4._interface()
    monkeypatch.setitem(sys.modules, fa4.MODULE, None)  # import fails
    with pytest.raises(fa4.Unavailable, match=r"cannot import flash_attn\.cute\.interface .*doc-packed\[fa4\]"):
        fa4._interface()


# ----------------------------------------------------------------------------- argument mapping


@pytest.mark.parametrize(
    "causal,left,right,want",
    [
        (True, -1, -1, (None, 0)),    # the spec stores causal as right = 0; FA4 reads it as causal
        (True, 64, -1, (64, 0)),
        (False, -1, -1, (None, None)),
        (False, 32, 16, (32, 16)),
        (False, -1, 5, (None, 5)),
        (False, 7, -1, (7, None)),
        (False, 0, 0, (0, 0)),
    ],
)
def test_window_mapping(causal, left, right, want):
    assert fa4.window(VarlenSpec([0, 8], [0, 8], causal, left, right)) == want


CALLS: list[dict] = []


def _spec_from_fa4_args(kw) -> VarlenSpec:
    """The problem FA4 is asked to solve, read back from its keywords (its conventions)."""
    left = -1 if kw["window_size_left"] is None else kw["window_size_left"]
    right = -1 if kw["window_size_right"] is None else kw["window_size_right"]
    cu_q, cu_k = kw["cu_seqlens_q"].tolist(), kw["cu_seqlens_k"].tolist()
    spec = VarlenSpec(cu_q, cu_k, kw["causal"], left, right)
    floor = fa4.MAX_SEQLEN_FLOOR  # bounds raised to it: one kernel per kind (kernels/fa4.py)
    assert kw["max_seqlen_q"] == max(spec.max_q, floor) and kw["max_seqlen_k"] == max(spec.max_k, floor)
    assert isinstance(kw["max_seqlen_q"], int)  # a host int: no tensor hints, no syncs
    assert kw["cu_seqlens_q"].dtype == torch.int32 and kw["cu_seqlens_q"].is_contiguous()
    return spec


def _oracle_fwd(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                max_seqlen_k=None, softmax_scale=None, causal=False, window_size_left=None,
                window_size_right=None, return_lse=False, **rest):
    kw = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
              max_seqlen_k=max_seqlen_k, causal=causal, window_size_left=window_size_left,
              window_size_right=window_size_right)
    CALLS.append(dict(kw, pass_="fwd", q=q, k=k, return_lse=return_lse, rest=rest))
    out, lse = math_kernel.forward(_spec_from_fa4_args(kw), q, k, v, softmax_scale)
    return out, (lse if return_lse else None), None, None, None  # FA4 writes lse only when asked


def _oracle_bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0,
                window_size_left=None, window_size_right=None, cu_seqlens_q=None,
                cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, deterministic=False,
                **rest):
    kw = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
              max_seqlen_k=max_seqlen_k, causal=causal, window_size_left=window_size_left,
              window_size_right=window_size_right)
    CALLS.append(dict(kw, pass_="bwd", q=q, k=k, lse=lse, rest=rest))
    return math_kernel.backward(_spec_from_fa4_args(kw), dout, q, k, v, out, lse, softmax_scale)


@pytest.fixture
def oracle_fa4(monkeypatch):
    """fa4 takes CPU tensors and runs the stand-in interface."""
    _fake_interface(monkeypatch, fwd=_oracle_fwd, bwd=_oracle_bwd)
    monkeypatch.setattr(fa4, "unsupported_reason", lambda q, kv_heads=None: None)
    monkeypatch.setattr(kernels, "_broken", {})
    CALLS.clear()
    yield CALLS
    CALLS.clear()


@pytest.mark.parametrize(
    "causal,window", [(True, (-1, -1)), (False, (-1, -1)), (True, (5, 0)), (False, (4, 3))]
)
@pytest.mark.parametrize("backend", ["fa4", "auto"])
def test_op_on_fa4_matches_oracle(oracle_fa4, rng, causal, window, backend):
    # B = 2 rows with zero-length and 1-token documents; GQA 4:1
    S, Hq, Hkv, D = 48, 4, 1, 8
    lengths = [random_lengths(rng, S), [1, 0, 0, 20, 1, 26]]
    cu = dp.cu_seqlens_from_lengths(lengths, S, max_docs=12)
    q = torch.randn(2, S, Hq, D, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, S, Hkv, D, dtype=torch.float64, requires_grad=True) for _ in range(2))
    out, lse = dp.doc_packed_attn(q, k, v, cu, causal=causal, window_size=window,
                                  return_lse=True, backend=backend)
    ref_out, ref_lse = reference(q, k, v, cu, causal, window)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    want = torch.autograd.grad(ref_out, (q, k, v), dout)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    fwd, bwd = (c for c in oracle_fa4 if c["pass_"] == "fwd"), [c for c in oracle_fa4 if c["pass_"] == "bwd"]
    fwd = list(fwd)
    assert len(fwd) == 1 and len(bwd) == 1  # no forward recompute in the backward
    call = fwd[0]
    # rows flattened with offsets b * S, zero-length documents dropped
    cu_q = call["cu_seqlens_q"].tolist()
    want_cu = [0]
    for b, row in enumerate(lengths):
        acc = b * S
        for n in row:
            acc += n
            if n:
                want_cu.append(acc)
    assert cu_q == want_cu and call["cu_seqlens_k"].tolist() == want_cu
    assert call["return_lse"] is True and call["causal"] is causal
    assert not call["rest"] and not bwd[0]["rest"]  # nothing beyond the mapped keywords
    # no copies: FA4 sees views of the caller's storage
    assert call["q"].data_ptr() == q.data_ptr() and call["k"].data_ptr() == k.data_ptr()
    assert call["q"].shape == (2 * S, Hq, D)
    assert bwd[0]["lse"].shape == (Hq, 2 * S)


def test_lse_is_asked_of_fa4_only_where_it_is_used(oracle_fa4, rng):
    # FA4 skips writing lse when not asked (up to ~10% of a forward): a call without gradient
    # that drops lse does not ask; return_lse=True and calls that build a graph do
    S, Hq, Hkv, D = 32, 2, 1, 8
    cu = dp.cu_seqlens_from_lengths([random_lengths(rng, S)], S, max_docs=S)
    q, k, v = (torch.randn(1, S, h, D, dtype=torch.float64) for h in (Hq, Hkv, Hkv))
    ref_out, ref_lse = reference(q, k, v, cu)
    with torch.no_grad():
        torch.testing.assert_close(dp.doc_packed_attn(q, k, v, cu, backend="fa4", causal=True), ref_out)
        out, lse = dp.doc_packed_attn(q, k, v, cu, backend="fa4", return_lse=True, causal=True)
    torch.testing.assert_close(lse, ref_lse)
    out = dp.doc_packed_attn(q.requires_grad_(), k, v, cu, backend="fa4", causal=True)
    torch.testing.assert_close(out, ref_out)
    assert [c["return_lse"] for c in oracle_fa4 if c["pass_"] == "fwd"] == [False, True, True]


def test_hopper_gqa_backward_with_a_value_head_dim_unlike_q_runs_on_repeated_kv(oracle_fa4, monkeypatch, rng):
    # FA4's Hopper backward asserts head_dim == head_dim_v with grouped K/V: it gets K/V repeated
    # per q head, and the groups' gradients are summed back (exact against the oracle)
    monkeypatch.setattr(fa4, "_gqa_backward_needs_equal_head_dims", lambda q: True)
    S, Hq, Hkv, D, Dv = 40, 4, 2, 16, 8
    cu = dp.cu_seqlens_from_lengths([random_lengths(rng, S)], S, max_docs=S)
    q = torch.randn(1, S, Hq, D, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, S, Hkv, D, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, S, Hkv, Dv, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(1, S, Hq, Dv, dtype=torch.float64)
    out = dp.doc_packed_attn(q, k, v, cu, backend="fa4", causal=True)
    got = torch.autograd.grad(out, (q, k, v), dout)
    ref_out, _ = reference(q, k, v, cu)
    want = torch.autograd.grad(ref_out, (q, k, v), dout)
    torch.testing.assert_close(out, ref_out)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    (bwd,) = [c for c in oracle_fa4 if c["pass_"] == "bwd"]
    assert bwd["k"].shape[1] == Hq  # repeated per q head


def test_context_parallel_spec_runs_fa4_under_auto(oracle_fa4):
    # separate query/key offsets (a chunk of queries against its keys), one empty key segment
    spec = VarlenSpec([0, 16, 24, 40], [0, 32, 32, 56], True, 6, 0)
    assert kernels.choose("auto", spec, torch.randn(40, 2, 8)) == "fa4"
    q = torch.randn(40, 2, 8, dtype=torch.float64)
    k, v = (torch.randn(56, 1, 8, dtype=torch.float64) for _ in range(2))
    out, lse = kernels.forward(spec, q, k, v, 0.3, "auto")
    want_out, want_lse = kernels.forward(spec, q, k, v, 0.3, "math")
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(lse, want_lse)
    assert oracle_fa4[-1]["window_size_left"] == 6 and oracle_fa4[-1]["window_size_right"] == 0


# ----------------------------------------------------------------------------- support rules


@pytest.mark.parametrize(
    "q,kv_heads,cap,installed,match",
    [
        (_fake_q(device="cpu"), 2, (9, 0), True, "needs a CUDA tensor, got cpu"),
        (_fake_q(dtype=torch.float32), 2, (9, 0), True, r"needs float16/bfloat16, got torch\.float32"),
        (_fake_q(), 2, (8, 0), True, r"needs compute capability 9\.x or 10\.x, got 8\.0"),
        (_fake_q(), 2, (12, 0), True, r"needs compute capability 9\.x or 10\.x, got 12\.0"),
        (_fake_q(head_dim=72 + 4), 2, (9, 0), True, r"needs head dim % 8 == 0 and 8\.\.256 on compute capability 9\.x, got 76"),
        (_fake_q(head_dim=264), 2, (9, 0), True, "got 264"),
        (_fake_q(head_dim=192), 2, (10, 0), True, r"8\.\.128, or 256 on compute capability 10\.x, got 192"),
        (_fake_q(heads=6), 2, (9, 0), True, "q heads / kv heads a power of two <= 128, got 6 / 2"),
        (_fake_q(), 2, (9, 0), False, r"needs the flash-attn-4 package \(pip install 'doc-packed\[fa4\]'\)"),
    ],
)
def test_forced_fa4_raises_the_rule(monkeypatch, q, kv_heads, cap, installed, match):
    monkeypatch.setattr(fa4, "available", lambda: installed)
    monkeypatch.setattr(fa4, "_capability", lambda index: cap)
    with pytest.raises(ValueError, match=match) as err:
        kernels.choose("fa4", LOCAL, q, kv_heads)
    assert str(err.value).startswith("backend='fa4' needs ")


@pytest.mark.parametrize(
    "q,kv_heads,cap",
    [
        (_fake_q(), 8, (9, 0)),
        (_fake_q(dtype=torch.float16, head_dim=64), 1, (9, 0)),
        (_fake_q(head_dim=256), 1, (10, 0)),
        (_fake_q(head_dim=192), 2, (9, 0)),
        (_fake_q(heads=32, head_dim=96), 8, (10, 3)),
    ],
)
def test_fa4_takes(monkeypatch, q, kv_heads, cap):
    monkeypatch.setattr(fa4, "available", lambda: True)
    monkeypatch.setattr(fa4, "_capability", lambda index: cap)
    assert fa4.unsupported_reason(q, kv_heads) is None
    assert kernels.choose("fa4", CP, q, kv_heads) == "fa4"


def test_forced_fa4_on_cpu_raises_before_any_kernel():
    q = torch.randn(1, 16, 4, 64, dtype=torch.bfloat16)
    cu = dp.cu_seqlens_from_lengths([[16]], 16)
    with pytest.raises(ValueError, match="backend='fa4' needs a CUDA tensor, got cpu"):
        dp.doc_packed_attn(q, q, q, cu, backend="fa4", causal=True)
    with pytest.raises(ValueError, match="backend='fa4' needs a CUDA tensor, got cpu"):
        env.backend_for(q, q, cu, backend="fa4")


def test_unknown_backend_lists_the_table():
    q = torch.randn(1, 16, 4, 64)
    cu = dp.cu_seqlens_from_lengths([[16]], 16)
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'auto-isolated', 'auto-invariant', 'fa4', 'flex', 'flash', 'math'\), got 'fa3'"):
        dp.doc_packed_attn(q, q, q, cu, backend="fa3", causal=True)


# ----------------------------------------------------------------------------- auto's choice


def test_auto_prefers_fa4_on_hopper_and_blackwell(hopper, monkeypatch):
    q = _fake_q()
    assert kernels.choose("auto", LOCAL, q, 2) == "fa4"
    assert kernels.choose("auto", CP, q, 2) == "fa4"  # FA4 does not recompile per layout
    monkeypatch.setattr(fa4, "_capability", lambda index: (10, 0))
    assert kernels.choose("auto", LOCAL, q, 2) == "fa4"


@pytest.mark.parametrize(
    "change,local,cp",
    [
        (dict(installed=False), "flex", "flash"),
        (dict(cap=(8, 0)), "flex", "flash"),
        (dict(dtype=torch.float32), "flex", "flash"),  # flash is mocked to take fp32 here
        (dict(heads=6), "flex", "flash"),  # GQA 3:1
        (dict(head_dim=192, cap=(10, 0)), "flex", "flash"),
    ],
)
def test_auto_falls_back_where_fa4_cannot(hopper, monkeypatch, change, local, cp):
    monkeypatch.setattr(fa4, "available", lambda: change.get("installed", True))
    monkeypatch.setattr(fa4, "_capability", lambda index: change.get("cap", (9, 0)))
    q = _fake_q(dtype=change.get("dtype", torch.bfloat16), heads=change.get("heads", 8),
                head_dim=change.get("head_dim", 128))
    assert kernels.choose("auto", LOCAL, q, 2) == local
    assert kernels.choose("auto", CP, q, 2) == cp


def test_auto_on_cpu_is_math_whatever_is_installed(monkeypatch):
    monkeypatch.setattr(fa4, "available", lambda: True)
    q = torch.randn(64, 8, 128, dtype=torch.bfloat16)
    assert kernels.choose("auto", LOCAL, q, 2) == "math"
    assert kernels.choose("auto", CP, q, 2) == "math"
    cu = dp.cu_seqlens_from_lengths([[10, 6]], 16)
    q4 = torch.randn(1, 16, 4, 64)
    assert env.backend_for(q4, q4[:, :, :1], cu) == "math"


def test_auto_warns_and_moves_on_when_fa4_cannot_load(monkeypatch):
    # fa4 looks usable but its interface cannot be imported: auto warns once, runs the next
    # backend from then on; a forced fa4 raises the import error naming the module
    monkeypatch.setattr(fa4, "unsupported_reason", lambda q, kv_heads=None: None)
    monkeypatch.setattr(kernels, "_broken", {})
    monkeypatch.setitem(sys.modules, fa4.MODULE, None)
    _uncached_interface(monkeypatch)
    q = torch.randn(256, 2, 16)
    spec = VarlenSpec([0, 256], [0, 256], True, -1, 0, row_len=256)
    assert kernels.choose("auto", spec, q, 2) == "fa4"
    with pytest.warns(RuntimeWarning, match="backend 'fa4' failed .*cannot import flash_attn.cute.interface.*uses 'math'"):
        out, _ = kernels.forward(spec, q, q, q, 0.25, "auto")
    torch.testing.assert_close(out, kernels.forward(spec, q, q, q, 0.25, "math")[0])
    assert kernels.choose("auto", spec, q, 2) == "math"
    with pytest.raises(fa4.Unavailable, match="cannot import flash_attn.cute.interface"):
        kernels.forward(spec, q, q, q, 0.25, "fa4")


def test_backend_for_reports_auto_choice(oracle_fa4):
    cu = dp.cu_seqlens_from_lengths([[10, 0, 6]], 16, max_docs=4)
    q = torch.randn(1, 16, 4, 64)
    k = torch.randn(1, 16, 2, 64)
    assert env.backend_for(q, k, cu) == "fa4"
    assert env.backend_for(q, k, cu, backend="math") == "math"
    with pytest.raises(ValueError, match="window_size"):
        env.backend_for(q, k, cu, window_size=(-2, 0))


def test_env_report_says_why_not(monkeypatch):
    monkeypatch.setattr(fa4, "available", lambda: False)
    text = env.report()
    assert f"torch {torch.__version__}" in text
    assert "flash-attn-4: not installed (pip install 'doc-packed[fa4]')" in text
    assert "  fa4: not usable: needs a CUDA tensor, got cpu" in text
    assert "  math: usable" in text
    why = env.backend_reasons("cpu", torch.float32, 64, (4, 1))
    assert list(why) == ["fa4", "flex", "flash", "math"] and why["math"] is None
    assert why["fa4"] == "needs a CUDA tensor, got cpu"


def test_python_m_env_runs():
    res = subprocess.run([sys.executable, "-m", "doc_packed.env"], capture_output=True, text=True,
                         cwd=ROOT, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "fa4: " in res.stdout and "auto would run " in res.stdout


def test_interface_loads_where_warnings_are_errors(tmp_path, monkeypatch):
    """A deprecation notice at FA4's import (the CuTe DSL 4.8.1 emits one) must not make FA4
    unavailable under ``-W error``: auto would silently fall back to a slower kernel."""
    import sys
    import warnings

    pkg = tmp_path / "flash_attn" / "cute"
    pkg.mkdir(parents=True)
    (tmp_path / "flash_attn" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    fwd_kw = ", ".join(f"{k}=None" for k in fa4._FWD_KEYWORDS)
    bwd_kw = ", ".join(f"{k}=None" for k in fa4._BWD_KEYWORDS)
    (pkg / "interface.py").write_text(
        "import warnings\n"
        "warnings.warn('cutlass.utils.LayoutEnum is deprecated', DeprecationWarning)\n"
        f"def _flash_attn_fwd(q, k, v, {fwd_kw}): pass\n"
        f"def _flash_attn_bwd(q, k, v, out, dout, lse, {bwd_kw}): pass\n"
    )
    for name in [m for m in sys.modules if m == "flash_attn" or m.startswith("flash_attn.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(tmp_path))
    _uncached_interface(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fwd, bwd = fa4._interface()
    assert fwd.__name__ == "_flash_attn_fwd" and bwd.__name__ == "_flash_attn_bwd"


def test_env_report_says_whether_forward_replay_is_on(monkeypatch):
    monkeypatch.setattr(fa4, "available", lambda: True)
    assert "launch replay (forward and backward) on" in env.report()
    monkeypatch.setenv("DOC_PACKED_FA4_REPLAY", "0")
    assert "launch replay (forward and backward) off (DOC_PACKED_FA4_REPLAY=0)" in env.report()


def test_env_report_says_whether_first_calls_are_adopted(monkeypatch):
    monkeypatch.setattr(fa4, "available", lambda: True)
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "4.0.0b36")
    assert "adopted from other layouts' recordings: on for Hopper GPUs" in env.report()
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "4.0.1")
    assert "recordings: off (checked with 4.0.0b36 only)" in env.report()
    monkeypatch.setenv("DOC_PACKED_FA4_ADOPT", "0")
    assert "recordings: off (DOC_PACKED_FA4_ADOPT=0)" in env.report()


def test_compiled_kernels_counts_fa4_compile_cache_entries(monkeypatch):
    """runtime_counts()["kernels_compiled"] follows the entries of FA4's compile caches (what a
    bench reads per step to see a compile on the critical path), and is 0 before FA4 loads."""
    monkeypatch.delitem(sys.modules, fa4.MODULE, raising=False)
    assert fa4.compiled_kernels() == 0 == dp.cp.runtime_counts()["kernels_compiled"]

    class Cache:
        def __init__(self):
            self.cache = {}

    def entry():
        pass

    fwd, bwd = entry, lambda: None
    fwd.compile_cache, bwd.compile_cache = Cache(), Cache()
    mod = types.ModuleType(fa4.MODULE)
    mod._flash_attn_fwd, mod._flash_attn_bwd, mod.helper = fwd, bwd, len
    monkeypatch.setitem(sys.modules, fa4.MODULE, mod)
    fwd.compile_cache.cache[("causal", 128)] = object()
    assert fa4.compiled_kernels() == 1
    bwd.compile_cache.cache.update({1: 0, 2: 0})
    assert dp.cp.runtime_counts()["kernels_compiled"] == 3
