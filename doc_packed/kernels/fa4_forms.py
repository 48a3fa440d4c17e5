"""FA4 recordings carried across layouts: a layout's first call launched without FA4's Python.

:mod:`.fa4_launch` records FA4's launches once per problem (spec) and replays them for later
layers. A training step meets new problems every layout, and their first calls still ran FA4's
Python and were recorded (host time per call on an H200: forward 196 us, backward 623 us,
against 32 and 111 us replayed; docs/kernels.md). Problems of one *kind* (FA4's compile facts,
the mask's window, the tensors' per-row shapes, dtypes and scalars: the caller's key) differ
only in their row counts and offsets, so a recording of one is a form for the others:

* **forward** (:func:`adopt_launch`): on Hopper with FA4 4.0.0b36 the compiled forward takes
  nothing of the layout but its offsets (the grid follows from the tensors inside the compiled
  call), so the same kernel is launched with the new offsets, q, k, v, and out / lse of the new
  row counts;
* **backward** (:func:`adopt_steps`): the recorded program (allocations, launches) is the same
  but for its allocations' sizes, which FA4 derives from the row counts ``T_q``, ``T_k`` and
  the number of offsets ``L``. Each size is explained by what the kind's recordings agree on:
  a constant, ``c * T`` or ``c * round_up(T + L * b - 1, b)`` (FA4's padded accumulators, ``b``
  a tile size) for ``T`` in ``(T_q, T_k)``; a program is adopted only when every explanation
  left predicts the same size for the new problem.

A kind is trusted once :data:`AGREE` (backward: :data:`AGREE_STEPS`) recordings agreed (the
same kernels and every other argument, every allocation contiguous and explained); one
recording that disagrees, or a first call FA4 could not have replayed, ends it for the kind.
Agreement catches a layout argument or size rule, not a kernel chosen by a layout the
recordings did not show: the caller (``kernels.fa4``) turns this on only where FA4's source was
read and the results checked on the GPU, and uses the trusted forms for first calls and ahead
of them (``fa4.prepare``, run by ``doc_packed.cp.prepare``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from .fa4_launch import Launch, Steps

__all__ = ["AGREE", "AGREE_STEPS", "Forms", "adopt_launch", "adopt_steps", "contiguous_stride"]

AGREE = 2  # forward recordings of different problems that must agree before a kind is adopted
AGREE_STEPS = 3  # backward: one more, to narrow the size rules
_MAX_KINDS = 64
_TILES = tuple(range(16, 257, 16))  # tile sizes FA4 may pad an accumulator to (rows)


class _LaunchForm(NamedTuple):
    fn: Callable[..., Any]
    args: tuple  # q, k, v, out, lse and the offsets emptied
    at: tuple[int, ...]  # argument positions of the offsets, in the order passed
    out_dtype: torch.dtype


def _launch_form(launch: Launch, offsets: tuple) -> _LaunchForm | None:
    at = _positions(launch.args, offsets)
    if at is None:
        return None
    return _LaunchForm(launch.fn, _blank(launch.args, at), at, launch.out_dtype)


def _positions(args: tuple, offsets: tuple) -> tuple[int, ...] | None:
    """Where each offsets tensor is among ``args`` (by identity); None unless exactly once each."""
    at = []
    for t in offsets:
        where = [i for i, a in enumerate(args) if a is t]
        if len(where) != 1:
            return None
        at.append(where[0])
    return tuple(at)


def _blank(args: tuple, at: tuple[int, ...]) -> tuple:
    return tuple(None if i in at else a for i, a in enumerate(args))


def _put(args: tuple, at: tuple[int, ...], offsets: tuple) -> tuple:
    out = list(args)
    for pos, t in zip(at, offsets):
        out[pos] = t
    return tuple(out)


def _equal(a: object, b: object) -> bool:
    try:
        return bool(a == b)
    except (TypeError, ValueError, RuntimeError):  # an argument without a plain equality
        return False


def adopt_launch(form: _LaunchForm, T: int, H: int, D_v: int, offsets: tuple, need_lse: bool) -> Launch:
    """The forward :class:`Launch` of ``form`` for a call of ``T`` queries, ``H`` query heads and
    value head dim ``D_v`` with ``offsets``: out ``[T, H, D_v]``, lse ``[H, T]``."""
    args = _put(form.args, form.at, offsets)
    return Launch(form.fn, args, (T, H, D_v), form.out_dtype, (H, T) if need_lse else None)


# ----------------------------------------------------------------------------- backward programs


def _round_up(T: int, L: int, b: int) -> int:
    return (T + L * b - 1) // b * b


def _explanations(value: int, feats: tuple[int, int, int]) -> set[tuple]:
    """Every rule of :mod:`this module <.fa4_forms>`'s doc that gives ``value`` for ``feats``."""
    T_q, T_k, L = feats
    found: set[tuple] = {("const", value)}
    for which, T in ((0, T_q), (1, T_k)):
        if T and value % T == 0:
            found.add(("rows", which, value // T))
        for b in _TILES:
            p = _round_up(T, L, b)
            if p and value % p == 0:
                found.add(("tile", which, b, value // p))
    return found


def _predict(rule: tuple, feats: tuple[int, int, int]) -> int:
    if rule[0] == "const":
        return rule[1]
    if rule[0] == "rows":
        return rule[2] * feats[rule[1]]
    return rule[3] * _round_up(feats[rule[1]], feats[2], rule[2])


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides torch gives a contiguous tensor of ``shape``."""
    want, acc = [], 1
    for n in reversed(shape):
        want.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(want))


def _contiguous(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    return contiguous_stride(shape) == tuple(stride) or 0 in shape


class _StepsForm:
    """A backward kind: its program with sizes and offsets emptied, and per allocation size the
    rules every recording so far agrees with."""

    __slots__ = ("rules", "skeleton")

    def __init__(self, skeleton: tuple, rules: list[set[tuple]]):
        self.skeleton, self.rules = skeleton, rules


def _skeleton(steps: Steps, offsets: tuple) -> tuple[tuple, list[int]] | None:
    """``steps`` with the offsets emptied from its launches and its allocations' sizes taken
    out, and those sizes in order; None when an allocation is not contiguous, a launch reads a
    view of an allocation (its offset and strides would need rules too)."""
    skeleton: list = []
    sizes: list[int] = []
    for step in steps.steps:
        if step[0] == "new":
            _, shape, stride, dtype, zeroed = step
            if not _contiguous(shape, stride):
                return None
            skeleton.append(("new", len(shape), dtype, zeroed))
            sizes.extend(shape)
        elif step[0] == "launch":
            _, kernel, fixed, by_slot, by_view = step
            if by_view:
                return None
            at, which = [], []
            for i, a in enumerate(fixed):
                js = [j for j, t in enumerate(offsets) if a is t]
                if js:
                    at.append(i)
                    which.append(js[0])
            skeleton.append(("launch", kernel, _blank(fixed, tuple(at)), by_slot, tuple(at), tuple(which)))
        else:
            skeleton.append(step)
    return (tuple(skeleton), steps.outputs), sizes


def _same_skeleton(a: tuple, b: tuple) -> bool:
    (sa, oa), (sb, ob) = a, b
    if oa != ob or len(sa) != len(sb):
        return False
    for x, y in zip(sa, sb):
        if x[0] != y[0]:
            return False
        if x[0] == "launch":
            if x[1] is not y[1] or x[3:] != y[3:] or not _equal(x[2], y[2]):
                return False
        elif x != y:
            return False
    return True


def adopt_steps(form: _StepsForm, feats: tuple[int, int, int], offsets: tuple) -> Steps | None:
    """The program of ``form`` for a backward with ``feats`` = ``(T_q, T_k, L)`` (q and k rows,
    the number of offsets) and ``offsets``; None when the recordings so far leave a size
    undecided (rules that predict different sizes)."""
    sizes = []
    for rules in form.rules:
        predicted = {_predict(r, feats) for r in rules}
        if len(predicted) != 1:
            return None
        sizes.append(predicted.pop())
    steps: list = []
    it = iter(sizes)
    skeleton, outputs = form.skeleton
    for step in skeleton:
        if step[0] == "new":
            _, ndim, dtype, zeroed = step
            shape = tuple(next(it) for _ in range(ndim))
            steps.append(("new", shape, contiguous_stride(shape), dtype, zeroed))
        elif step[0] == "launch":
            _, kernel, fixed, by_slot, at, which = step
            steps.append(("launch", kernel, _put(fixed, at, tuple(offsets[j] for j in which)), by_slot, ()))
        else:
            steps.append(step)
    return Steps(tuple(steps), outputs)


# ----------------------------------------------------------------------------- kinds


class Forms:
    """What the recordings of each kind agree on, forward and backward (kinds are the caller's
    keys); ``None`` for a kind that disagreed."""

    def __init__(self) -> None:
        self._launch: dict[tuple, tuple[_LaunchForm, int] | None] = {}
        self._steps: dict[tuple, tuple[_StepsForm, int] | None] = {}

    def launch(self, kind: tuple) -> _LaunchForm | None:
        """The kind's forward form once :data:`AGREE` recordings agreed, else None."""
        entry = self._launch.get(kind)
        return entry[0] if entry is not None and entry[1] >= AGREE else None

    def learn_launch(self, kind: tuple, launch: Launch | None, offsets: tuple) -> None:
        """Count a forward recording of ``kind`` (None: a first call that was not replayable)."""
        form = None if launch is None else _launch_form(launch, offsets)
        if kind not in self._launch:
            if len(self._launch) < _MAX_KINDS:
                self._launch[kind] = None if form is None else (form, 1)
            return
        entry = self._launch[kind]
        if entry is None:
            return
        old, n = entry
        same = (
            form is not None
            and form.fn is old.fn
            and form.at == old.at
            and form.out_dtype == old.out_dtype
            and _equal(form.args, old.args)
        )
        self._launch[kind] = (old, n + 1) if same else None

    def trusted_launches(self) -> list[tuple[tuple, _LaunchForm]]:
        """Every forward kind adopted now, with its form."""
        return [(k, e[0]) for k, e in list(self._launch.items()) if e is not None and e[1] >= AGREE]

    def trusted_steps(self) -> list[tuple[tuple, _StepsForm]]:
        """Every backward kind adopted now, with its form."""
        return [(k, e[0]) for k, e in list(self._steps.items()) if e is not None and e[1] >= AGREE_STEPS]

    def steps(self, kind: tuple) -> _StepsForm | None:
        """The kind's backward form once :data:`AGREE_STEPS` recordings agreed, else None."""
        entry = self._steps.get(kind)
        return entry[0] if entry is not None and entry[1] >= AGREE_STEPS else None

    def learn_steps(self, kind: tuple, steps: Steps | None, feats: tuple[int, int, int], offsets: tuple) -> None:
        """Count a backward recording of ``kind`` with ``feats`` = ``(T_q, T_k, L)`` (None: FA4's
        call was not a fixed program)."""
        made = None if steps is None else _skeleton(steps, offsets)
        if kind not in self._steps:
            if len(self._steps) < _MAX_KINDS:
                if made is None:
                    self._steps[kind] = None
                else:
                    self._steps[kind] = (_StepsForm(made[0], [_explanations(v, feats) for v in made[1]]), 1)
            return
        entry = self._steps[kind]
        if entry is None:
            return
        form, n = entry
        if made is None or not _same_skeleton(made[0], form.skeleton) or len(made[1]) != len(form.rules):
            self._steps[kind] = None
            return
        rules = [r & _explanations(v, feats) for r, v in zip(form.rules, made[1])]
        if not all(rules):
            self._steps[kind] = None
            return
        form.rules = rules
        self._steps[kind] = (form, n + 1)
