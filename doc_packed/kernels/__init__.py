"""Kernel dispatch for packed varlen attention problems (:class:`VarlenSpec`).

Backends, in the order ``auto`` tries them (:data:`TABLE`):
- ``"fa4"``: FlashAttention-4 (optional package ``flash-attn-4``; CUDA compute capability 9.x or
  10.x, fp16/bf16, head dim % 8 == 0 up to 256 (10.x: up to 128, or 256), q heads / kv heads a
  power of two).
- ``"flex"``: flex_attention's Triton kernels with a closed-form BlockMask (CUDA, fp16/bf16/
  fp32, head dim a power of two in 16..256, row lengths divisible by 128). Local calls only
  under ``auto``: context-parallel kernel calls change shape every step and flex compiles once
  per shape (FA4 and flash do not recompile per layout).
- ``"flash"``: torch's flash varlen kernel (CUDA, fp16/bf16, head dim % 8 == 0 and <= 256).
- ``"math"``: exact blockwise plain-torch kernel (any device and dtype; the CPU path).

``auto`` runs the first that takes the problem (see :func:`choose`); a forced backend that
cannot raises ``ValueError`` naming the rule. Variants (:class:`Variant` and the spec's
``prefix``) are part of "takes the problem": softcap runs on fa4, flex and math; a value head dim
unlike q's on fa4 (its head-dim pairs), flex (both powers of two) and math; bidirectional prefixes
(per-query key intervals) on flex and math only. Sinks are applied around every backend (their
term joins the lse after the kernel: :func:`doc_packed.ops.forward_impl`). Every backend produces and consumes the same
``(out, lse)``, so passes may differ.

Two stricter automatic modes keep ``auto``'s order but skip backends without a property
(docs/contract.md, sections 4 and 5):
- ``"auto-isolated"``: only backends that keep a NaN/Inf inside its document (not flex, whose
  blocks straddle documents): fa4, flash, math.
- ``"auto-invariant"``: only batch-invariant backends, whose bits for a document depend on
  that document alone: math (flash's and FA4's backward accumulate non-deterministically).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from types import ModuleType
from typing import NamedTuple

import torch

from . import fa4, flash, flex, math
from .spec import Variant, VarlenSpec, lse_dtype

__all__ = [
    "AUTO_MODES",
    "BACKENDS",
    "TABLE",
    "Backend",
    "Variant",
    "add_sinks",
    "VarlenSpec",
    "backward",
    "check_backend",
    "choose",
    "forward",
    "lse_dtype",
    "max_logits",
    "reasons",
]


class Backend(NamedTuple):
    """One kernel backend: its module (``forward``/``backward``) and when it applies."""

    name: str
    module: ModuleType
    # why it cannot take (q [T, H, D] or [B, S, H, D], spec or None, kv heads or None, variant);
    # None: it can
    why_not: Callable[[torch.Tensor, VarlenSpec | None, int | None, Variant], str | None]
    any_shape: bool  # ``auto`` may pick it for context-parallel calls (new shapes every step)
    fallback_on: tuple[type[Exception], ...]  # errors after which ``auto`` stops using it
    isolated: bool  # a NaN/Inf stays in its document (forward and backward)
    invariant: bool  # batch-invariant: a document's bits depend on that document alone
    sinks: bool = False  # its forward takes ``sinks=`` (in-kernel); else they join after it
    lse_optional: bool = False  # its forward takes ``need_lse=False`` and then skips writing lse


# ``auto``'s order: FA4 measured fastest on Hopper in every layout we ran, flex next (faster
# than torch's varlen kernel everywhere on H100/H200; docs/kernels.md, "Measured")
TABLE: tuple[Backend, ...] = (
    Backend(
        name="fa4",
        module=fa4,
        why_not=lambda q, spec, kv, var: fa4.unsupported_reason(q, kv) or fa4.variant_reason(q, spec, var),
        any_shape=True,
        fallback_on=(fa4.Unavailable,),
        isolated=True,
        invariant=False,
        sinks=True,
        lse_optional=True,
    ),
    Backend(
        name="flex",
        module=flex,
        why_not=lambda q, spec, kv, var: (
            flex.unsupported_reason(q, None if spec is None else flex.problem_rows(spec)) or flex.variant_reason(var)
        ),
        any_shape=False,
        fallback_on=(flex.CompileError,),
        isolated=False,
        invariant=False,
    ),
    Backend(
        name="flash",
        module=flash,
        why_not=lambda q, spec, kv, var: flash.unsupported_reason(q) or _flash_variant_reason(spec, var),
        any_shape=True,
        fallback_on=(),
        isolated=True,
        invariant=False,
    ),
    Backend(
        name="math",
        module=math,
        why_not=lambda q, spec, kv, var: None,
        any_shape=True,
        fallback_on=(),
        isolated=True,
        invariant=True,
    ),
)
# automatic modes -> the property a backend needs to be picked (None: any)
AUTO_MODES: dict[str, str | None] = {"auto": None, "auto-isolated": "isolated", "auto-invariant": "invariant"}
BACKENDS = (*AUTO_MODES, *(b.name for b in TABLE))


def _flash_variant_reason(spec: VarlenSpec | None, var: Variant) -> str | None:
    if var.softcap:
        return "takes no softcap (torch's flash varlen kernel has none)"
    if var.v_dim is not None:
        return "needs v's head dim equal to q's"
    if spec is not None and spec.prefix is not None:
        return "takes no bidirectional prefixes (per-query key intervals)"
    return None


_broken: dict[str, Exception] = {}  # backends that failed to load/compile under ``auto``


def _entry(name: str) -> Backend:
    for b in TABLE:
        if b.name == name:
            return b
    raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")


def reasons(
    q: torch.Tensor, spec: VarlenSpec | None = None, kv_heads: int | None = None, variant: Variant = Variant()
) -> dict[str, str | None]:
    """Per backend, why it cannot take ``q`` (and ``spec``/``kv_heads``/``variant`` when given);
    None: it can."""
    return {b.name: b.why_not(q, spec, kv_heads, variant) for b in TABLE}


def check_backend(backend: str, q: torch.Tensor, kv_heads: int | None = None, variant: Variant = Variant()) -> None:
    """Raise if ``backend`` is unknown or a forced backend cannot take ``q`` at all."""
    if backend in AUTO_MODES:
        return
    why = _entry(backend).why_not(q, None, kv_heads, variant)
    if why is not None:
        raise ValueError(f"backend={backend!r} {why}")


def choose(
    backend: str, spec: VarlenSpec, q: torch.Tensor, kv_heads: int | None = None, variant: Variant = Variant()
) -> str:
    """The concrete backend that runs ``spec`` (``q`` is packed ``[T, H, D]``).

    ``auto``: the first backend of :data:`TABLE` that takes the problem, skipping flex for
    context-parallel calls (``spec.row_len is None``) and any backend that failed to load or
    compile earlier; ``auto-isolated`` / ``auto-invariant`` also skip backends without that
    property. A forced backend that cannot take it raises ``ValueError`` with the rule.
    """
    if backend not in AUTO_MODES:
        why = _entry(backend).why_not(q, spec, kv_heads, variant)
        if why is not None:
            raise ValueError(f"backend={backend!r} {why}")
        return backend
    local = spec.row_len is not None
    needs = AUTO_MODES[backend]
    for b in TABLE:
        if needs is not None and not getattr(b, needs):
            continue
        if b.name not in _broken and (local or b.any_shape) and b.why_not(q, spec, kv_heads, variant) is None:
            return b.name
    return "math"  # pragma: no cover - math takes everything


def add_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The sink term joins finished rows (once per query): ``lse' = logaddexp(lse, sink)`` and
    ``out' = out * exp(lse - lse')``, on packed ``out [T, H, Dv]`` and ``lse [H, T]``."""
    new = torch.logaddexp(lse, sinks.to(lse.dtype)[:, None])
    w = torch.exp(lse - new).t()[..., None]
    return (out.to(lse.dtype) * w).to(out.dtype), new


def _chosen(backend: str, spec: VarlenSpec, q: torch.Tensor, kv_heads: int, variant: Variant) -> str:
    """:func:`choose`, memoised until a backend breaks (the support rules read metadata only):
    per spec for local calls (flex reads their row lengths), and across specs for an automatic
    mode's context-parallel calls, where the rules read nothing of the spec but whether it has
    bidirectional prefixes (flex is skipped; fa4 and flash read only ``spec.prefix``), so a new
    layout's first call chooses as fast as its later ones."""
    key = ("backend", backend, q.dtype, q.device, q.shape[1:], kv_heads, variant, len(_broken))
    if spec.row_len is not None or backend not in AUTO_MODES:
        return spec.cached(key, lambda: choose(backend, spec, q, kv_heads, variant))
    shared = (*key, spec.prefix is None)
    name = _CP_CHOICES.get(shared)
    if name is None:
        name = _CP_CHOICES[shared] = choose(backend, spec, q, kv_heads, variant)
    return name


# an automatic mode's choice for context-parallel calls, by everything it reads (:func:`_chosen`)
_CP_CHOICES: dict[tuple, str] = {}


def _run(
    pass_: str,
    backend: str,
    spec: VarlenSpec,
    q: torch.Tensor,
    kv_heads: int,
    args: tuple,
    variant: Variant,
    sinks: torch.Tensor | None = None,
    need_lse: bool = True,
):
    name = _chosen(backend, spec, q, kv_heads, variant)
    # softcap only where asked: a backend without it (flash) is never chosen for it
    kwargs = {"softcap": variant.softcap} if variant.softcap else {}
    while True:
        entry = _entry(name)
        try:
            if not need_lse and entry.lse_optional and (sinks is None or entry.sinks):
                extra = {} if sinks is None else {"sinks": sinks}
                return getattr(entry.module, pass_)(spec, *args, need_lse=False, **extra, **kwargs)
            if sinks is None:
                return getattr(entry.module, pass_)(spec, *args, **kwargs)
            if entry.sinks:
                return getattr(entry.module, pass_)(spec, *args, sinks=sinks, **kwargs)
            out, lse = getattr(entry.module, pass_)(spec, *args, **kwargs)
            return add_sinks(out, lse, sinks)
        except entry.fallback_on as err:
            if backend not in AUTO_MODES:
                raise
            _broken[name] = err
            name = choose(backend, spec, q, kv_heads, variant)
            warnings.warn(
                f"doc_packed: backend {entry.name!r} failed ({err}); backend={backend!r} uses {name!r} from now on",
                RuntimeWarning,
                stacklevel=4,
            )


def forward(
    spec: VarlenSpec, q, k, v, scale: float, backend: str, softcap: float = 0.0, sinks=None, need_lse: bool = True
):
    """``(out [T_q, H_q, D_v], lse [H_q, T_q])`` of a packed problem (``softcap`` 0.0: none;
    ``sinks [H_q]``: in the kernel where it takes them, else joined after it; lse includes them).
    ``need_lse=False``: the caller drops lse, so a backend that can skip writing it (FA4: up to
    ~10% of a forward) returns None instead."""
    if spec.total_q == 0:
        out = q.new_empty((*q.shape[:2], v.shape[-1]))
        return out, q.new_empty((q.shape[1], 0), dtype=lse_dtype(q.dtype))
    return _run("forward", backend, spec, q, k.shape[1], (q, k, v, scale), Variant.of(q, v, softcap), sinks, need_lse)


def backward(spec: VarlenSpec, dout, q, k, v, out, lse, scale: float, backend: str, softcap: float = 0.0):
    """``(dq, dk, dv)`` of a packed problem from the saved ``out`` and ``lse``."""
    if spec.total_q == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    return _run("backward", backend, spec, q, k.shape[1], (dout, q, k, v, out, lse, scale), Variant.of(q, v, softcap))


def max_logits(spec: VarlenSpec, q, k, scale: float, softcap: float = 0.0, backend: str = "auto") -> torch.Tensor:
    """``[H_q]`` max logits of a packed problem, one extra pass: flex's forward with its row max
    (``OUTPUT_MAX``) where flex takes the problem (``auto`` on a local call, or forced), else
    the math kernel's blockwise ``Q K^T`` (any device; docs/kernels.md)."""
    if spec.total_q == 0:
        return torch.full((q.shape[1],), -float("inf"), dtype=lse_dtype(q.dtype), device=q.device)
    # "flex max logits" broken (e.g. a torch whose flex returns no row max) leaves flex's
    # attention passes alone: only this pass falls back to the math kernel
    use_flex = backend == "flex" or (
        backend == "auto" and spec.row_len is not None and not {"flex", "flex max logits"} & _broken.keys()
    )
    if use_flex and flex.unsupported_reason(q, flex.problem_rows(spec)) is None:
        try:
            return flex.max_logits(spec, q, k, scale, softcap)
        except flex.CompileError as err:
            if backend == "flex":
                raise
            _broken["flex max logits"] = err
    return math.max_logits(spec, q, k, scale, softcap)
