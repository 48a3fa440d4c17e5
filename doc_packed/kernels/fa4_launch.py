"""FA4's passes launched again without its Python: the compiled kernels, recorded once per problem.

FA4's ``_flash_attn_fwd`` spends ~60 us of Python per call on an H200's host (argument checks,
tile and scheduler choice, a ~70-field compile key) before a launch that takes ~5-10 us
(docs/kernels.md, "FA4 launch replay"). What it decides depends only on what :func:`key` holds (the
spec, q/k/v shapes, strides and dtype, device, scale, softcap, whether lse is written), so the
first call for a key runs FA4 as usual while watching its JIT cache hand out the compiled
kernel (:func:`record`), and keeps that launch's arguments with the per-call tensors left out.
Later calls with the same key launch the same compiled kernel on their own q, k, v and fresh
out/lse (:func:`replay`).

A first call that did anything else is never replayed: no launch (empty problems), more than
one (split-KV and its combine), or a launch whose arguments are not exactly (q, k, v, out, lse)
first and otherwise only the spec's offsets and values (FA4's own scheduler metadata, a copy FA4
made of a non-contiguous input), or an entry point without FA4's ``compile_cache``. Sinks are not replayed (their float32 copy is made per call).
``DOC_PACKED_FA4_REPLAY=0`` turns replay off. FA4's arguments are private to it: a release that
reorders them fails the checks and is simply not replayed. What each call did (replayed, recorded,
refused and why) is counted: :func:`counts`.

A layout's first call can skip FA4's Python too: :mod:`.fa4_forms` makes a recording of one
layout into the launch or program of another layout of the same kind.

The backward (``_flash_attn_bwd``: ~80 us of Python around five launches, a preprocess, the main
kernel and three conversions, on torch scratch it allocates and partly zeroes) is recorded as a
:class:`Steps` program (:func:`record_steps`, :func:`replay_steps`): FA4 runs once under a
``TorchDispatchMode`` that sees every tensor op, so the program holds exactly its allocations
(shape, strides, dtype, zeroed or not), its launches in order with each tensor argument traced
to an input, an allocation or one of the spec's offsets (views by storage, strides and offset),
and which allocations are returned. Any other tensor op (a copy, arithmetic), a tensor argument
of unknown origin, or an argument object holding tensors, and the call is never replayed.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from .. import _compat

__all__ = [
    "Launch",
    "Steps",
    "counts",
    "enabled",
    "key",
    "key_of",
    "record",
    "record_steps",
    "replay",
    "replay_steps",
    "steps_key",
    "steps_key_of",
    "tally",
]

_ALIGN = 16  # bytes: FA4 compiles its q/k/v/out tensors assuming this alignment
_lock = threading.Lock()
_COUNTS: dict[str, int] = {}  # "<pass> <what happened>" -> calls (see counts())


def tally(what: str) -> None:
    """Count one FA4 call under ``what`` (:func:`counts`)."""
    _COUNTS[what] = _COUNTS.get(what, 0) + 1


def counts() -> dict[str, int]:
    """What this process's FA4 calls did so far, by pass: ``"forward replayed"``, ``"forward
    recorded"`` (a first call whose launch is kept), ``"forward not replayable: <why>"`` (a first
    call whose launch cannot be replayed), ``"forward misaligned"`` (an input not on a 16-byte
    boundary: FA4 runs, nothing is recorded), the same for ``"backward"``; calls with replay off
    or with sinks are not counted; ``"forward adopted"`` / ``"backward adopted"``: a layout's
    first call launched from other layouts' recordings (:mod:`.fa4_forms`)."""
    return dict(_COUNTS)


def enabled() -> bool:
    """Replay is on unless ``DOC_PACKED_FA4_REPLAY=0``."""
    return os.environ.get("DOC_PACKED_FA4_REPLAY", "1") != "0"


class Launch(NamedTuple):
    """One recorded FA4 forward launch: the compiled kernel and its arguments, with the
    positions 0-4 (q, k, v, out, lse) emptied; out's and lse's shapes and dtypes."""

    fn: Callable[..., Any]
    args: tuple
    out_shape: tuple[int, ...]
    out_dtype: torch.dtype
    lse_shape: tuple[int, ...] | None


def key(q: Tensor, k: Tensor, v: Tensor, scale: float, softcap: float, need_lse: bool) -> tuple | None:
    """What (besides the spec) FA4's choices depend on; None when replay cannot serve the call
    (misaligned inputs)."""
    for t in (q, k, v):
        if t.data_ptr() % _ALIGN:
            return None
    tensors = ((q.shape, q.stride()), (k.shape, k.stride()), (v.shape, v.stride()))
    return key_of(tensors, q.dtype, q.device, scale, softcap, need_lse)


def key_of(tensors: tuple, dtype: torch.dtype, device: torch.device, scale: float, softcap: float, need_lse: bool):
    """:func:`key` of a call on q, k, v of these ``(shape, stride)`` (aligned), without the
    tensors: for a call made ahead of its tensors (``kernels.fa4.prepare``)."""
    (qs, qst), (ks, kst), (vs, vst) = tensors
    return ("fa4-launch", qs, qst, ks, kst, vs, vst, dtype, device, scale, softcap, need_lse)


def record(fwd: Callable[..., Any], q: Tensor, k: Tensor, v: Tensor, offsets: tuple, kwargs: dict):
    """``(fwd(q, k, v, **kwargs), launch)``: FA4's own result, and the launch it made when it
    can be replayed (else None). ``offsets``: the tensors the spec passed (cu_seqlens)."""
    cache = getattr(fwd, "compile_cache", None)
    if cache is None:  # not FA4's JIT-cached entry point: nothing to watch
        return fwd(q, k, v, **kwargs), None
    seen: list[tuple[Callable[..., Any], tuple]] = []

    def spy(original, cache, compile_key):
        fn = original(cache, compile_key)

        def launch(*args):
            seen.append((fn, args))
            return fn(*args)

        return launch

    with _lock, _spying(type(cache), spy):
        result = fwd(q, k, v, **kwargs)
    launch = _launch(seen, (q, k, v), result[0], result[1], offsets)
    tally("forward recorded" if isinstance(launch, Launch) else f"forward not replayable: {launch}")
    return result, launch if isinstance(launch, Launch) else None


class _spying:
    """Inside the block, ``cls.__getitem__(cache, key)`` is ``spy(original, cache, key)``
    (FA4's JIT caches share a class); entered under ``_lock``."""

    def __init__(self, cls: type, spy: Callable[..., Any]):
        self.cls, self.spy = cls, spy

    def __enter__(self) -> None:
        original = self.original = getattr(self.cls, "__getitem__")
        setattr(self.cls, "__getitem__", lambda cache, key: self.spy(original, cache, key))

    def __exit__(self, *exc: object) -> None:
        setattr(self.cls, "__getitem__", self.original)


def _same(a: object, t: Tensor) -> bool:
    return isinstance(a, Tensor) and a.data_ptr() == t.data_ptr() and a.shape == t.shape and a.stride() == t.stride()


def _launch(seen, inputs: tuple, out: Tensor, lse: Tensor | None, offsets: tuple) -> Launch | str:
    """The replayable launch of a recorded forward, or why there is none."""
    if len(seen) != 1:
        return f"{len(seen)} launches"
    if not out.is_contiguous() or (lse is not None and not lse.is_contiguous()):
        return "non-contiguous out or lse"
    fn, args = seen[0]
    if len(args) < 5 or not all(_same(a, t) for a, t in zip(args[:3], inputs)) or not _same(args[3], out):
        return "launch arguments are not (q, k, v, out, ...)"
    if (lse is None) != (args[4] is None) or (lse is not None and not _same(args[4], lse)):
        return "launch arguments are not (q, k, v, out, lse, ...)"
    if any(isinstance(a, Tensor) and not any(a is o for o in offsets) for a in args[5:]):
        return "a tensor made for this call"  # (scheduler metadata, a copy)
    lse_shape = None if lse is None else tuple(lse.shape)
    return Launch(fn, (None,) * 5 + tuple(args[5:]), tuple(out.shape), out.dtype, lse_shape)


def replay(
    launch: Launch, q: Tensor, k: Tensor, v: Tensor, what: str = "forward replayed"
) -> tuple[Tensor, Tensor | None]:
    """``(out, lse)`` of the recorded kernel on ``q, k, v`` (same key as when recorded); the
    call is counted under ``what``."""
    tally(what)
    out = torch.empty(launch.out_shape, dtype=launch.out_dtype, device=q.device)
    lse = None if launch.lse_shape is None else torch.empty(launch.lse_shape, dtype=torch.float32, device=q.device)
    tensors = [t.detach() if t.requires_grad else t for t in (q, k, v)]
    launch.fn(*tensors, out, lse, *launch.args[5:])
    return out, lse


# ----------------------------------------------------------------------------- programs (backward)


class Steps(NamedTuple):
    """A recorded FA4 call as a program over slots: the call's tensors first, then one slot per
    allocation. ``steps``: ``("new", shape, stride, dtype, zeroed)``, ``("zero", slot)`` or
    ``("launch", fn, fixed_args, slot_args, view_args)``; ``outputs``: the slots returned."""

    steps: tuple
    outputs: tuple[int, ...]


def steps_key(tensors: tuple[Tensor, ...], scale: float, softcap: float) -> tuple | None:
    """What (besides the spec) FA4's choices depend on for a call on ``tensors``; None when a
    tensor is misaligned (its compiled kernels assume 16-byte starts)."""
    if any(t.data_ptr() % _ALIGN for t in tensors):
        return None
    return steps_key_of([(t.shape, t.stride(), t.dtype) for t in tensors], tensors[0].device, scale, softcap)


def steps_key_of(tensors: list, device: torch.device, scale: float, softcap: float) -> tuple:
    """:func:`steps_key` of a call on tensors of these ``(shape, stride, dtype)`` (aligned),
    without the tensors (``kernels.fa4.prepare``)."""
    parts: list = ["fa4-steps", scale, softcap]
    for shape, stride, dtype in tensors:
        parts += [shape, stride, dtype]
    parts.append(device)
    return tuple(parts)


_NEW = {"aten::empty.memory_format", "aten::empty_strided", "aten::empty_like", "aten::new_empty"}
_NEW_ZEROED = {"aten::zeros", "aten::zeros_like", "aten::new_zeros"}


@functools.cache
def _watch_class() -> type:
    """A dispatch mode that lists every tensor op of the watched call outside its launches
    (``paused``), in order with the launches (``events``); built on first use."""

    class _Watch(_compat.dispatch_mode_class()):  # type: ignore[misc]
        def __init__(self, events: list):
            super().__init__()
            self.events = events
            self.paused = False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if not self.paused:
                self.events.append(("op", func, args, out))
            return out

    return _Watch


def record_steps(fn: Callable[..., Any], inputs: tuple[Tensor, ...], offsets: tuple, kwargs: dict):
    """``(fn(*inputs, **kwargs), steps)``: FA4's own result and, when it can be replayed, the
    program it ran (else None). ``offsets``: the spec's tensors among ``kwargs``."""
    cache = getattr(fn, "compile_cache", None)
    if cache is None:
        return fn(*inputs, **kwargs), None
    events: list = []
    watch = _watch_class()(events)

    def spy(original, cache, compile_key):
        kernel = original(cache, compile_key)

        def launch(*args):
            events.append(("launch", kernel, args))
            watch.paused = True  # a compiled kernel's own work is not the program's
            try:
                return kernel(*args)
            finally:
                watch.paused = False

        return launch

    with _lock, _spying(type(cache), spy), watch:
        result = fn(*inputs, **kwargs)
    outs = result if isinstance(result, tuple) else (result,)
    program = _program(events, inputs, offsets, outs)
    tally("backward recorded" if isinstance(program, Steps) else f"backward not replayable: {program}")
    return result, program if isinstance(program, Steps) else None


def _holds_tensor(obj: object, depth: int = 0) -> bool:
    if isinstance(obj, Tensor):
        return True
    if depth > 3:
        return False
    if isinstance(obj, (tuple, list)):
        return any(_holds_tensor(x, depth + 1) for x in obj)
    if isinstance(obj, dict):
        return any(_holds_tensor(x, depth + 1) for x in obj.values())
    fields = getattr(obj, "__dict__", None)
    return isinstance(fields, dict) and any(_holds_tensor(x, depth + 1) for x in fields.values())


def _storage(t: Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _program(events: list, inputs: tuple[Tensor, ...], offsets: tuple, outs: tuple) -> Steps | str:
    """The replayable program of a recorded backward, or why there is none."""
    if any(_same(a, b) for i, a in enumerate(inputs) for b in inputs[i + 1 :]):
        return "one tensor passed twice"  # (v = k): its slot would stand for both next time
    slots: list[Tensor] = list(inputs)  # tensors by slot (kept only while building)
    steps: list = []
    launched = False

    def slot_of(t: Tensor) -> tuple | None:
        """``(slot,)`` for a slot's tensor itself, ``(slot, offset, shape, stride)`` for a view
        of one slot's storage, None when unknown or ambiguous."""
        for i, s in enumerate(slots):
            if _same(t, s):
                return (i,)
        owners = [i for i, s in enumerate(slots) if _storage(s) == _storage(t)]
        if len(owners) != 1:
            return None
        i = owners[0]
        return (i, t.storage_offset() - slots[i].storage_offset(), tuple(t.shape), t.stride())

    for event in events:
        if event[0] == "launch":
            _, kernel, args = event
            fixed: list = list(args)
            by_slot: list[tuple] = []
            by_view: list[tuple] = []
            for pos, a in enumerate(args):
                if isinstance(a, Tensor):
                    if any(a is o or _same(a, o) for o in offsets):
                        continue  # the spec's offsets: the same tensors on every call
                    where = slot_of(a)
                    if where is None:
                        return "a launch argument of unknown origin"
                    fixed[pos] = None
                    (by_slot if len(where) == 1 else by_view).append((pos, *where))
                elif _holds_tensor(a):
                    return "a launch argument holding tensors"
            steps.append(("launch", kernel, tuple(fixed), tuple(by_slot), tuple(by_view)))
            launched = True
            continue
        _, func, args, out = event
        name = func.name()
        if name in _NEW or name in _NEW_ZEROED:
            if not isinstance(out, Tensor) or out.storage_offset() != 0 or out.device != inputs[0].device:
                return f"an allocation it cannot repeat ({name})"
            steps.append(("new", tuple(out.shape), out.stride(), out.dtype, name in _NEW_ZEROED))
            slots.append(out)
        elif name == "aten::zero_" or (name == "aten::fill_.Scalar" and args[1] == 0):
            where = slot_of(args[0])
            if where is None or len(where) != 1 or where[0] < len(inputs):
                return "zeroing part of a buffer, or an input"
            steps.append(("zero", where[0]))
        elif not func.is_view:
            return f"a tensor op ({name})"  # arithmetic or a copy: not a fixed program of launches
    if not launched:
        return "no launch"
    out_slots = []
    for t in outs:
        where = None if not isinstance(t, Tensor) else slot_of(t)
        if where is None or len(where) != 1 or where[0] < len(inputs):
            return "an output that is not one of its allocations"
        out_slots.append(where[0])
    return Steps(tuple(steps), tuple(out_slots))


def replay_steps(steps: Steps, inputs: tuple[Tensor, ...], what: str = "backward replayed") -> tuple[Tensor, ...]:
    """The recorded program on new ``inputs`` (same key as when recorded): its outputs; the
    call is counted under ``what``."""
    tally(what)
    env: list[Tensor] = [t.detach() if t.requires_grad else t for t in inputs]
    device = inputs[0].device
    for step in steps.steps:
        kind = step[0]
        if kind == "launch":
            _, kernel, fixed, by_slot, by_view = step
            args = list(fixed)
            for pos, i in by_slot:
                args[pos] = env[i]
            for pos, i, offset, shape, stride in by_view:
                base = env[i]
                args[pos] = base.as_strided(shape, stride, base.storage_offset() + offset)
            kernel(*args)
        elif kind == "new":
            _, shape, stride, dtype, zeroed = step
            t = torch.empty_strided(shape, stride, dtype=dtype, device=device)
            env.append(t.zero_() if zeroed else t)
        else:
            env[step[1]].zero_()
    return tuple(env[i] for i in steps.outputs)
