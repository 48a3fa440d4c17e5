"""FlashAttention-4 (pip package ``flash-attn-4``, NVIDIA CuTe DSL) for packed varlen problems.

The packed ``[T, H, D]`` tensors and the spec's segment offsets go to FA4 as they are (no
copies): its varlen entry points take the same layout, the same bottom-right-aligned causal
and window convention as :class:`VarlenSpec`, GQA natively, and return lse as ``[H_q, T_q]``
float32 (natural log), which is every backend's contract here. So a forward on FA4 can feed a
backward on another backend and back.

The package is optional and imported on first use only: :func:`available` asks
``importlib`` whether it is installed without importing it, and ``import doc_packed`` never
imports ``flash_attn``. Both passes call FA4's private ``_flash_attn_fwd`` / ``_flash_attn_bwd``
(no autograd.Function: the op's own autograd already saved ``out`` and ``lse``), by keyword;
the import checks they exist and take those keywords, and raises :class:`Unavailable` naming
the module otherwise. Inputs FA4 cannot take are caught by :func:`unsupported_reason` before
any FA4 code runs, so its ``assert`` statements never fire on them. A forward or backward FA4
has run once for a spec and shapes is launched again without FA4's Python (:mod:`.fa4_launch`).
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
import os
import sys
import warnings

import torch
from torch import Tensor

from . import fa4_forms, fa4_launch
from .spec import Variant, VarlenSpec

MODULE = "flash_attn.cute.interface"
PACKAGE = "flash-attn-4"
INSTALL_HINT = "pip install 'doc-packed[fa4]'"
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
ARCHS = (9, 10)  # compute capability majors: Hopper, Blackwell (datacenter)
_MAX_GQA = 128

_FWD_KEYWORDS = (
    "cu_seqlens_q",
    "cu_seqlens_k",
    "max_seqlen_q",
    "max_seqlen_k",
    "softmax_scale",
    "causal",
    "window_size_left",
    "window_size_right",
    "return_lse",
)
_BWD_KEYWORDS = (
    "softmax_scale",
    "causal",
    "window_size_left",
    "window_size_right",
    "cu_seqlens_q",
    "cu_seqlens_k",
    "max_seqlen_q",
    "max_seqlen_k",
)


class Unavailable(RuntimeError):
    """FA4 is installed but its interface cannot be imported or has moved."""


@functools.cache
def available() -> bool:
    """Whether ``flash_attn/cute/interface.py`` is installed (nothing is imported)."""
    try:
        spec = importlib.util.find_spec("flash_attn")
    except (ImportError, ValueError):
        return False
    paths = getattr(spec, "submodule_search_locations", None) or ()
    return any(os.path.isfile(os.path.join(p, "cute", "interface.py")) for p in paths)


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _head_dim_rule(major: int) -> str:
    return "% 8 == 0 and 8..256" if major == 9 else "% 8 == 0 and 8..128, or 256"


def _head_dim_ok(d: int, major: int) -> bool:
    if d % 8:
        return False
    return 8 <= d <= 256 if major == 9 else (8 <= d <= 128 or d == 256)


def unsupported_reason(q: Tensor, kv_heads: int | None = None) -> str | None:
    """Why FA4 cannot take ``q`` (``[T, H, D]`` or ``[B, S, H, D]``) with ``kv_heads`` K/V heads.

    None when it can. ``kv_heads`` None skips the GQA rule (not known yet).
    """
    if q.device.type != "cuda":
        return f"needs a CUDA tensor, got {q.device.type}"
    if q.dtype not in SUPPORTED_DTYPES:
        return f"needs float16/bfloat16, got {q.dtype}"
    major, minor = _capability(q.device.index if q.device.index is not None else 0)
    if major not in ARCHS:
        return f"needs compute capability 9.x or 10.x, got {major}.{minor}"
    d = q.shape[-1]
    if not _head_dim_ok(d, major):
        return f"needs head dim {_head_dim_rule(major)} on compute capability {major}.x, got {d}"
    if kv_heads is not None:
        ratio = q.shape[-2] // kv_heads
        if ratio > _MAX_GQA or ratio & (ratio - 1):
            return f"needs q heads / kv heads a power of two <= {_MAX_GQA}, got {q.shape[-2]} / {kv_heads}"
    if not available():
        return f"needs the {PACKAGE} package ({INSTALL_HINT})"
    return None


def variant_reason(q: Tensor, spec: VarlenSpec | None, var: Variant) -> str | None:
    """Why FA4 cannot run this variant (after :func:`unsupported_reason` passed): FA4 4.0.0b36's
    head-dim pairs (``_validate_head_dims``), no per-query key intervals (prefixes), and no
    softcap in its Blackwell backward at head dim 256. (Its Hopper GQA backward needs v's head
    dim equal to q's: :func:`backward` repeats K/V heads then.)"""
    if spec is not None and spec.prefix is not None:
        return "takes no bidirectional prefixes (they need per-query key intervals: flex or math)"
    if q.device.type != "cuda":
        return None
    major = _capability(q.device.index if q.device.index is not None else 0)[0]
    d = q.shape[-1]
    if var.v_dim is not None:
        dv = var.v_dim
        if dv % 8:
            return f"needs v's head dim % 8 == 0, got {dv}"
        ok = 8 <= dv <= 256 if major == 9 else (dv <= 128 and d <= 128) or (d, dv) == (192, 128)
        if not ok:
            rule = "8..256" if major == 9 else "both <= 128, or (192, 128)"
            return f"needs head dims (q/k, v) {rule} on compute capability {major}.x, got ({d}, {dv})"
    if var.softcap and major == 10 and d == 256:
        return "takes no softcap at head dim 256 on compute capability 10.x (its backward has none)"
    return None


def window(spec: VarlenSpec) -> tuple[int | None, int | None]:
    """The spec's ``(left, right)`` in FA4's form: -1 (unbounded) becomes None.

    With ``causal`` the spec's right is 0, which FA4 reads as causal (plain or with a left
    window); a non-causal ``(-1, 0)`` is the same mask as causal, and FA4 treats it so.
    """
    return (None if spec.left < 0 else spec.left, None if spec.right < 0 else spec.right)


@functools.cache
def _interface():
    """FA4's ``(_flash_attn_fwd, _flash_attn_bwd)``, imported once, with the keywords we pass."""
    try:
        with warnings.catch_warnings():
            # the CuTe DSL's deprecation notices at import (4.8.1: cutlass.utils.LayoutEnum) must
            # not stop FA4 loading where warnings are errors (auto would fall back without it)
            warnings.simplefilter("ignore", DeprecationWarning)
            mod = importlib.import_module(MODULE)
    except Exception as err:  # ImportError, or the CuTe DSL failing to load its runtime
        raise Unavailable(f"cannot import {MODULE} ({type(err).__name__}: {err}); {INSTALL_HINT}") from err
    fns = []
    for name, keywords in (("_flash_attn_fwd", _FWD_KEYWORDS), ("_flash_attn_bwd", _BWD_KEYWORDS)):
        fn = getattr(mod, name, None)
        if fn is None:
            raise Unavailable(f"{MODULE} has no {name}; doc-packed is tested with {PACKAGE} 4.0.0b36")
        params = inspect.signature(fn).parameters
        missing = [k for k in keywords if k not in params]
        if missing:
            raise Unavailable(
                f"{MODULE}.{name} takes no {', '.join(missing)}; doc-packed is tested with {PACKAGE} 4.0.0b36"
            )
        fns.append(fn)
    return tuple(fns)


def _args(spec: VarlenSpec, q: Tensor, scale: float) -> dict:
    """FA4's keyword arguments for ``spec`` (built once per spec, device and scale)."""
    return spec.cached(("fa4", q.device, scale), lambda: _build_args(spec, q.device, scale))


def _build_args(spec: VarlenSpec, device: torch.device, scale: float) -> dict:
    cu_q, cu_k = spec.cu_tensors(device)
    left, right = window(spec)
    return {
        "cu_seqlens_q": cu_q,
        "cu_seqlens_k": cu_k,
        "max_seqlen_q": max(spec.max_q, MAX_SEQLEN_FLOOR),
        "max_seqlen_k": max(spec.max_k, MAX_SEQLEN_FLOOR),
        "softmax_scale": scale,
        "causal": spec.causal,
        "window_size_left": left,
        "window_size_right": right,
    }


# FA4 takes max_seqlen_q/k as upper bounds of the segment lengths, and compiles another kernel
# when they fall under a tile (4.0.0b36 on SM90, identical code: forward H_q/H_kv * max_q <= 128
# or 192 rows; backward max_q <= 64-128, max_k <= 128). Bounds raised to this floor keep every
# call on one kernel whatever the layout (a few more empty tiles on calls that small).
MAX_SEQLEN_FLOOR = 256
# ... and more than this many segments (empty ones too) selects another scheduler path: both
# are built once by doc_packed.cp's warm-up.
MANY_SEGMENTS = 256


def compiled_kernels() -> int:
    """Kernels FA4 has compiled in this process so far (the entries of its interface's compile
    caches); 0 while FA4 is not imported. A count that grows inside a training step is a
    compile on the critical path (seconds each): :func:`doc_packed.cp.runtime_counts`."""
    mod = sys.modules.get(MODULE)
    if mod is None:
        return 0
    caches = (getattr(f, "__dict__", {}).get("compile_cache") for f in vars(mod).values() if callable(f))
    return sum(len(getattr(c, "cache", {})) for c in caches if c is not None)


def mask_class(spec: VarlenSpec) -> tuple[bool, bool, bool]:
    """FA4's mask class for ``spec``: ``(causal, left window set, right window set)`` after its
    own normalisation (a window (None, 0) is causal; ``causal`` forces right = 0), one compiled
    kernel each. The window's values are runtime arguments."""
    left, right = window(spec)
    if spec.causal:
        right = 0
    if left is None and right == 0:
        return True, False, False
    return False, left is not None, right is not None


def compile_facts(spec: VarlenSpec) -> tuple[tuple[bool, bool, bool], bool] | None:
    """What of ``spec`` selects which FA4 kernels a forward and backward compile (given dtype,
    head dims and H_q / H_kv): its :func:`mask_class` and whether it has more than
    :data:`MANY_SEGMENTS` segments; None for a call that launches nothing (no queries or keys).
    Read from FA4 4.0.0b36's compile keys on SM90, with :data:`MAX_SEQLEN_FLOOR` applied."""
    if spec.total_q == 0 or spec.total_k == 0:
        return None
    return mask_class(spec), len(spec.cu_q) - 1 > MANY_SEGMENTS


def forward(
    spec: VarlenSpec,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    softcap: float = 0.0,
    sinks: Tensor | None = None,
    need_lse: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """``(out [T_q, H_q, D_v], lse [H_q, T_q] float32)``; rows that see nothing: out 0, lse -inf
    (with ``sinks``, FA4's ``learnable_sink``: lse includes the sink, a row that sees nothing has
    lse = sink). ``need_lse=False``: lse is not written and None is returned."""
    replay = sinks is None and fa4_launch.enabled()
    key = fa4_launch.key(q, k, v, scale, softcap, need_lse) if replay else None
    if replay and key is None:
        fa4_launch.tally("forward misaligned")
    launches = None if key is None else spec.cached(("fa4-launches",), dict)  # key -> Launch, or None
    launch = None if launches is None else launches.get(key, _UNSEEN)
    if launch is not None and launch is not _UNSEEN:
        return fa4_launch.replay(launch, q, k, v)
    fwd, _ = _interface()
    kwargs: dict = {"return_lse": need_lse, **_args(spec, q, scale)}
    if softcap:
        kwargs["softcap"] = softcap
    if sinks is not None:
        kwargs["learnable_sink"] = sinks.float()
    if launch is _UNSEEN:  # the first call with this key: another layout's launch, or FA4 runs and is recorded
        assert launches is not None and key is not None
        offsets = (kwargs["cu_seqlens_q"], kwargs["cu_seqlens_k"])
        kind = _kind(spec, q, k, v, (scale, softcap, need_lse))
        form = None if kind is None else _FORMS.launch(kind)
        if form is not None:
            launch = fa4_forms.adopt_launch(form, q.shape[0], q.shape[1], v.shape[-1], offsets, need_lse)
            if len(launches) < _MAX_LAUNCHES:
                launches[key] = launch
            return fa4_launch.replay(launch, q, k, v, "forward adopted")
        (out, lse, *_), launch = fa4_launch.record(fwd, q, k, v, offsets, kwargs)
        if len(launches) < _MAX_LAUNCHES:
            launches[key] = launch
        if kind is not None:
            _FORMS.learn_launch(kind, launch, offsets)
        return out, lse
    out, lse, *_ = fwd(q, k, v, **kwargs)
    return out, lse


_UNSEEN = object()
_MAX_LAUNCHES = 16  # per spec (shapes, dtypes, scales seen with one layout)

# A layout's first forward and backward launched from other layouts' recordings (fa4_forms):
# on Hopper, FA4 4.0.0b36's compiled forward takes no argument that depends on the layout but
# the offsets (no max_seqlen; the grid follows from the tensors' shapes inside the compiled
# call), its backward's program differs between layouts only in its allocations' sizes, and
# which kernels it compiles follows from compile_facts with MAX_SEQLEN_FLOOR applied. Agreement
# between recordings catches a layout argument, not a kernel chosen by a layout the first
# recordings did not show, so adoption is on only where the source was read and the results
# checked on the GPU (tests/test_gpu.py): Hopper, with the FA4 releases below. Blackwell's
# forward takes max_seqlen_q as an argument: no adoption there.
_ADOPT_ARCHS = (9,)
_ADOPT_RELEASES = ("4.0.0b36",)


_FORMS = fa4_forms.Forms()  # what each kind's recordings agree on (fa4_forms)


def _kind(spec: VarlenSpec, q: Tensor, k: Tensor, v: Tensor, scalars: tuple) -> tuple | None:
    """What selects a forward's kernel and every argument but the tensors: what
    :func:`fa4_launch.key` holds less the tensors' lengths (rows), the spec's compile facts and
    window; None where adoption is off (not Hopper, or a call FA4 launches nothing for)."""
    facts = compile_facts(spec)
    if facts is None or not _adopts(q):
        return None
    per_row = (q.shape[1:], q.stride(), k.shape[1:], k.stride(), v.shape[1:], v.stride())
    return (*per_row, q.dtype, q.device, *scalars, facts, window(spec))


def _steps_kind(spec: VarlenSpec, tensors: tuple[Tensor, ...], scale: float, softcap: float) -> tuple | None:
    """A backward's kind, as :func:`_kind`: each tensor's shape without its rows (lse
    ``[H_q, T_q]``: the last dim), dtype, and strides where it is not contiguous."""
    facts = compile_facts(spec)
    if facts is None or not _adopts(tensors[0]):
        return None
    parts: list = [scale, softcap, tensors[0].device, facts, window(spec)]
    for i, t in enumerate(tensors):
        per_row = t.shape[:-1] if i == len(tensors) - 1 else t.shape[1:]
        parts.append((per_row, t.dtype, None if t.is_contiguous() else t.stride()))
    return tuple(parts)


def adoption_status(release: str | None) -> str:
    """Whether a new layout's first calls are adopted from other layouts' recordings with FA4
    ``release`` installed, and why not (:data:`_ADOPT_RELEASES`, ``DOC_PACKED_FA4_ADOPT``)."""
    if os.environ.get("DOC_PACKED_FA4_ADOPT", "1") == "0":
        return "off (DOC_PACKED_FA4_ADOPT=0)"
    if release not in _ADOPT_RELEASES:
        return f"off (checked with {', '.join(_ADOPT_RELEASES)} only)"
    return "on for Hopper GPUs"


def _adopts(q: Tensor) -> bool:
    return _adopts_on(q.device)


def _adopts_on(device: torch.device) -> bool:
    """Whether FA4 calls on ``device`` may be adopted across layouts (:data:`_ADOPT_ARCHS`,
    :data:`_ADOPT_RELEASES`; ``DOC_PACKED_FA4_ADOPT=0`` turns it off)."""
    if device.type != "cuda" or os.environ.get("DOC_PACKED_FA4_ADOPT", "1") == "0":
        return False
    if _release() not in _ADOPT_RELEASES:
        return False
    return _capability(device.index if device.index is not None else 0)[0] in _ADOPT_ARCHS


def prepare(spec: VarlenSpec, device: torch.device) -> int:
    """Make ``spec``'s first FA4 calls on ``device`` ahead of them: for every kind whose
    recordings are trusted (:mod:`.fa4_forms`) and whose mask and compile facts are the spec's,
    the forward launch and backward program its first call would adopt, kept where that call
    finds them (it then costs what a replay does). For a layout's calls before its step
    (``doc_packed.cp.prepare``); returns how many were made."""
    facts = compile_facts(spec)
    if facts is None or not fa4_launch.enabled() or not _adopts_on(device):
        return 0
    where = (facts, window(spec), device)
    offsets = spec.cu_tensors(device)
    return _prepare_forwards(spec, where, offsets) + _prepare_backwards(spec, where, offsets)


def _prepare_forwards(spec: VarlenSpec, where: tuple, offsets: tuple) -> int:
    made, T_q, T_k = 0, spec.total_q, spec.total_k
    launches = spec.cached(("fa4-launches",), dict)
    for kind, form in _FORMS.trusted_launches():
        qs, qst, ks, kst, vs, vst, dtype, dev, scale, softcap, need_lse, facts, win = kind
        if (facts, win, dev) != where:
            continue
        shapes = ((T_q, *qs), qst), ((T_k, *ks), kst), ((T_k, *vs), vst)
        key = fa4_launch.key_of(tuple((torch.Size(n), st) for n, st in shapes), dtype, dev, scale, softcap, need_lse)
        if key not in launches and len(launches) < _MAX_LAUNCHES:
            launches[key] = fa4_forms.adopt_launch(form, T_q, qs[0], vs[-1], offsets, need_lse)
            made += 1
    return made


def _prepare_backwards(spec: VarlenSpec, where: tuple, offsets: tuple) -> int:
    made, T_q, T_k = 0, spec.total_q, spec.total_k
    programs = spec.cached(("fa4-steps",), dict)
    for kind, form in _FORMS.trusted_steps():
        scale, softcap, dev, facts, win, *tensors = kind
        if (facts, win, dev) != where:
            continue
        parts = []
        for i, (per_row, dtype, stride) in enumerate(tensors):  # (q, k, v, out, dout, lse)
            rows = T_k if i in (1, 2) else T_q
            shape = torch.Size((*per_row, rows) if i == len(tensors) - 1 else (rows, *per_row))
            parts.append((shape, stride if stride is not None else fa4_forms.contiguous_stride(shape), dtype))
        key = fa4_launch.steps_key_of(parts, dev, scale, softcap)
        if key in programs or len(programs) >= _MAX_LAUNCHES:
            continue
        program = fa4_forms.adopt_steps(form, (T_q, T_k, len(spec.cu_q)), offsets)
        if program is not None:
            programs[key] = program
            made += 1
    return made


@functools.cache
def _release() -> str | None:
    """The installed FA4's version (None: unknown)."""
    try:
        return importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None


def backward(
    spec: VarlenSpec,
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    scale: float,
    softcap: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` from the saved ``out`` (q's dtype) and natural-log ``lse [H_q, T_q]``
    (which may include sink terms: FA4 then normalises ``P`` as the forward did).

    FA4's Hopper backward takes grouped K/V heads only when v's head dim equals q's: otherwise
    it runs on K/V repeated per q head and the groups' gradients are summed (float32 inside
    ``sum``, one rounding), so ``auto`` keeps FA4 for e.g. 192 / 128 with GQA."""
    group = q.shape[1] // k.shape[1]
    if group > 1 and v.shape[-1] != q.shape[-1] and _gqa_backward_needs_equal_head_dims(q):
        kr, vr = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        dq, dk, dv = _backward(spec, (q, kr, vr, out, dout, lse), scale, softcap)
        T, Hkv = k.shape[0], k.shape[1]
        return dq, dk.view(T, Hkv, group, -1).sum(2), dv.view(T, Hkv, group, -1).sum(2)
    return _backward(spec, (q, k, v, out, dout, lse), scale, softcap)


def _backward(spec: VarlenSpec, tensors: tuple[Tensor, ...], scale: float, softcap: float):
    """FA4's backward on ``(q, k, v, out, dout, lse)``: recorded by its first call per spec and
    key, replayed after (:func:`fa4_launch.replay_steps`), as the forward."""
    replay = fa4_launch.enabled()
    key = fa4_launch.steps_key(tensors, scale, softcap) if replay else None
    if replay and key is None:
        fa4_launch.tally("backward misaligned")
    programs = None if key is None else spec.cached(("fa4-steps",), dict)  # key -> Steps, _RETRY or None
    steps = None if programs is None else programs.get(key, _UNSEEN)
    if isinstance(steps, fa4_launch.Steps):
        dq, dk, dv = fa4_launch.replay_steps(steps, tensors)
        return dq, dk, dv
    _, bwd = _interface()
    kwargs = _args(spec, tensors[0], scale)
    if softcap:
        kwargs = {**kwargs, "softcap": softcap}
    if steps is _UNSEEN or steps is _RETRY:
        assert programs is not None
        offsets = (kwargs["cu_seqlens_q"], kwargs["cu_seqlens_k"])
        kind = _steps_kind(spec, tensors, scale, softcap)
        form = None if kind is None or steps is _RETRY else _FORMS.steps(kind)
        feats = (tensors[0].shape[0], tensors[1].shape[0], offsets[0].numel())
        program = None if form is None else fa4_forms.adopt_steps(form, feats, offsets)
        if program is not None:
            if len(programs) < _MAX_LAUNCHES:
                programs[key] = program
            dq, dk, dv = fa4_launch.replay_steps(program, tensors, "backward adopted")
            return dq, dk, dv
        result, new = fa4_launch.record_steps(bwd, tensors, offsets, kwargs)
        if len(programs) < _MAX_LAUNCHES or key in programs:
            # a first refusal is recorded once more (the first call may also have compiled,
            # and a compiler's tensor work is not the program's); a second one is final
            programs[key] = new if new is not None or steps is _RETRY else _RETRY
        if kind is not None and (new is not None or steps is _RETRY):
            _FORMS.learn_steps(kind, new, feats, offsets)
        return result[:3]
    return bwd(*tensors, **kwargs)[:3]


_RETRY = object()  # refused once: record again on the next call


def _gqa_backward_needs_equal_head_dims(q: Tensor) -> bool:
    """FA4 4.0.0b36's Hopper backward (``flash_bwd_sm90``: ``assert self.same_hdim_kv``)."""
    return q.device.type == "cuda" and _capability(q.device.index if q.device.index is not None else 0)[0] == 9
