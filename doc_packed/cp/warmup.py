"""Kernels a context-parallel schedule can ask for, built before a training step needs them.

Every new document layout gives each rank new kernel calls. FA4 compiles a kernel the first time
it meets a new *kind* of call (:func:`doc_packed.kernels.fa4.compile_facts`: the mask's class
and whether the call has more than 256 segments), and each compile took 2.5-7 s in the middle of
training (docs/context_parallel.md, "Warm-up"). The kinds a schedule can produce are known from
the attention's mask alone (:func:`~.schedule.call_masks`), so the first context-parallel call
per device, dtype, head dims, head ratio, mask and softcap runs each kind once on tiny inputs,
forward and backward, and no later layout compiles anything. Backends without a compiler
(flash, math) skip it.

The runtime's own Triton kernels (the lse merge and the partial dK/dV sums) compile once per
dtype and head shape (``_triton.jit_once``), but only when a schedule first needs them, and a
rank's first layouts may need neither: on 4 x H200 rank 0's first merge came at the fifth
layout, a 0.8 s compile inside a timed step. They are run once here too, on CUDA, whatever the
attention backend, with the torch ops around the kernels (:func:`_warm_runtime`): CUDA loads a
torch kernel's module at its first launch, 20-173 ms of host each for the runtime's gathers and
scatters, which came at the first layout that moved a query.
"""

from __future__ import annotations

import torch

from .. import kernels
from ..kernels import VarlenSpec
from ..kernels.fa4 import MANY_SEGMENTS
from .lse_merge import merge_
from .partials import add_partials_
from .schedule import call_masks

__all__ = ["warm_specs", "warmup"]

_done: set[tuple] = set()
_runtime_ran: set[tuple] = set()  # (device, dtypes, head counts, dims) the runtime's ops ran for


def warm_specs(causal: bool, left: int, right: int) -> list[VarlenSpec]:
    """Tiny specs covering every kind of call a schedule for this mask can make: each of its
    call masks with one segment and with ``MANY_SEGMENTS + 1`` (the extra ones empty)."""
    specs = []
    for c, wl, wr in call_masks(causal, left, right):
        for empty in (0, MANY_SEGMENTS):
            cu = [0, 2] + [2] * empty
            specs.append(VarlenSpec(cu, cu, c, wl, wr))
    return specs


def warmup(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    left: int,
    right: int,
    backend: str = "auto",
    softcap: float = 0.0,
) -> int:
    """Build, once per process, every kernel a context-parallel schedule for this call's mask can
    ask for: ``q``/``k``/``v`` are a call's ``[B, L, H, D]`` shards (only their dtype, device, head
    counts and dims are read). Returns the kernel calls it made (0: done before, or a backend
    that compiles nothing)."""
    Hq, Hkv, D, Dv = q.shape[2], k.shape[2], q.shape[3], v.shape[3]
    if q.is_cuda:
        _warm_runtime(q, k, v)
    key = (q.device, q.dtype, Hq // Hkv, D, Dv, causal, left, right, backend, softcap)
    if key in _done:
        return 0
    _done.add(key)
    specs = warm_specs(causal, left, right)
    qs = q.new_zeros((2, Hq, D))
    if kernels.choose(backend, specs[0], qs, Hkv, kernels.Variant.of(q, v, softcap)) != "fa4":
        return 0
    g = torch.Generator(device=q.device).manual_seed(0)
    made = 0
    with torch.no_grad():
        for spec in specs:
            n = spec.total_q
            qt, kt = (torch.randn((n, h, D), generator=g, device=q.device, dtype=q.dtype) for h in (Hq, Hkv))
            vt = torch.randn((n, Hkv, Dv), generator=g, device=q.device, dtype=q.dtype)
            scale = D**-0.5
            out, lse = kernels.forward(spec, qt, kt, vt, scale, backend, softcap)
            kernels.backward(spec, torch.randn_like(out), qt, kt, vt, out, lse, scale, backend, softcap)
            made += 2
    return made


def _warm_runtime(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Run, once per process and call shape, each torch op the runtime's schedules can make on
    the device, on a few rows of the call's dtypes and head shapes: the merge and the partial
    sums (Triton: their one compile) and the glue around the kernels (zeroing, slicing copies,
    gathers and scatters of moved and partial rows, lse transposes).

    With CUDA's lazy module loading (its default) the first launch of a torch kernel loads its
    module from torch's library, and the glue's index kernels are ones a model may never run: on
    2 x H200 the first gather of a moved query's rows took 173 ms of host, in the middle of a
    training step at the first layout that moved one (docs/end_to_end.md, "The host stalls at
    2 x 32k"). The index ops run with a short and a long index (CUDA picks another kernel past
    16 indices). ``tests/test_cp_prepare.py`` checks that this covers every op kind the runtime
    dispatches over random layouts."""
    Hq, Hkv, D, Dv = q.shape[2], k.shape[2], q.shape[3], v.shape[3]
    key = (q.device, q.dtype, k.dtype, v.dtype, Hq, Hkv, D, Dv)
    if key in _runtime_ran:
        return
    _runtime_ran.add(key)
    acc = kernels.lse_dtype(q.dtype)
    for n in (2, 40):
        idx = torch.arange(n, device=q.device)
        # forward: a query buffer's output and lse, merged and put back by rows
        out = torch.zeros((n, Hq, Dv), dtype=q.dtype, device=q.device)
        lse = torch.full((Hq, n), float("-inf"), dtype=acc, device=q.device)
        o_rows, l_rows = out.index_select(0, idx), lse.index_select(1, idx)
        merge_(o_rows, l_rows, torch.zeros_like(o_rows), torch.zeros_like(l_rows))
        out[:n] = o_rows
        lse[:, :n] = l_rows
        out.index_copy_(0, idx, o_rows)
        lse.index_copy_(1, idx, l_rows)
        l_home = lse.t().contiguous()  # moved rows' lse travels as rows
        lse.index_copy_(1, idx, l_home.t())
        lse.reshape(Hq, 2, n // 2).transpose(0, 1).contiguous()  # [B, H_q, L]: the op's lse
        # backward: a transposed output gradient made contiguous, moved rows' lse gathered as
        # rows, a call's lse columns, gradients summed by rows
        out.view(2, n // 2, Hq, Dv).transpose(0, 1).contiguous()
        lse.t().index_select(0, idx)
        lse[:, 1:].contiguous()
        for heads, dim, dtype in ((Hq, D, q.dtype), (Hkv, D, k.dtype), (Hkv, Dv, v.dtype)):
            grad = torch.zeros((n, heads, dim), dtype=dtype, device=q.device)
            part = grad.clone()
            grad[:n].add_(part)
            grad.index_add_(0, idx + 0, part.index_select(0, idx))
        if Dv == D and v.dtype == k.dtype:  # the partials travel stacked ([rows, 2, H_kv, D])
            dk, dv = k.new_zeros((n, Hkv, D)), v.new_zeros((n, Hkv, Dv))
            stacked = torch.stack([dk, dv], 1)
            grid = stacked.new_empty(stacked.shape)
            grid.index_fill_(0, idx, 0)
            add_partials_(dk, dv, grid, [(0, 1, 0, n)])
