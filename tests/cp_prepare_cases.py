"""Rank bodies for tests/test_cp_prepare.py (module level so spawn can import them)."""

from __future__ import annotations

import os
import pickle
import random
import statistics
import time

import torch
import torch.distributed as dist

import doc_packed as dp
from doc_packed_testing.oracle import random_lengths
from doc_packed import cp
from doc_packed._doc_layout import get_layout
from doc_packed.cp import attention
from doc_packed.kernels import math
from doc_packed_testing.oracle import reference

HQ, HKV, D = 4, 2, 8


def _run(rank, world, cu, S, causal, window, seed):
    """Context-parallel forward and backward of one layout: max error against the oracle."""
    g = torch.Generator().manual_seed(seed)
    B = cu.shape[0]
    q, k, v, dout = (torch.randn(B, S, h, D, generator=g, dtype=torch.float64) for h in (HQ, HKV, HKV, HQ))
    rq, rk, rv = (t.clone().requires_grad_() for t in (q, k, v))
    ref, _ = reference(rq, rk, rv, cu, causal, window)
    ref_grads = torch.autograd.grad(ref, (rq, rk, rv), dout)
    part = lambda t: t.chunk(world, dim=1)[rank]  # noqa: E731
    lq, lk, lv = (part(t).clone().requires_grad_() for t in (q, k, v))
    out = dp.doc_packed_attn(lq, lk, lv, cu, causal=causal, window_size=window, cp_group=dist.group.WORLD)
    grads = torch.autograd.grad(out, (lq, lk, lv), part(dout))
    return max((out - part(ref)).abs().max().item(), *[(a - part(b)).abs().max().item() for a, b in zip(grads, ref_grads)])


def prepared(rank, world):
    """Prepared layouts plan nothing in the call; a handed plan runs as given; both exact."""
    S, rng = 64, random.Random(5)
    group = dist.group.WORLD
    report = []
    agreed0 = cp.runtime_counts()["agreements"]
    planned = [0]  # the CPU kernel's query blocks planned inside the calls (prepare makes them ahead)
    plan_blocks = math._plan_blocks

    def counted(spec):
        planned[0] += 1
        return plan_blocks(spec)

    for i, (causal, window) in enumerate([(True, (-1, -1)), (True, (9, 0)), (False, (6, 11))]):
        cu = dp.cu_seqlens_from_lengths([random_lengths(rng, S), random_lengths(rng, S)], S, max_docs=S)
        before, in_calls = cp.runtime_counts()["schedules"], cp.runtime_counts()["schedules_in_calls"]
        ready = cp.prepare(cu, group, num_heads=(HQ, HKV), causal=causal, window_size=window, device="cpu")
        made = cp.runtime_counts()["schedules"] - before
        math._plan_blocks = counted
        try:
            err = _run(rank, world, ready, S, causal, window, i)
        finally:
            math._plan_blocks = plan_blocks
        report.append(("prepared", made, cp.runtime_counts()["schedules_in_calls"] - in_calls, err))
        report.append(("math blocks planned in calls", planned[0], 0, 0.0))
    counts = cp.runtime_counts()
    report.append(("agreements", counts["agreements"] - agreed0, counts["agreement_us"], 0.0))
    # a plan made from plain lists (a DataLoader worker's way), pickled, handed back: it runs
    cu = dp.cu_seqlens_from_lengths([[40, 24], [7, 50, 7]], S, max_docs=4)
    plan = dp.plan_context_parallel(cu.tolist(), world, num_heads=(HQ, HKV), tolerance=0.5, row_cost=None)
    plan = pickle.loads(pickle.dumps(plan))
    cp.prepare(cu, group, num_heads=(HQ, HKV), device="cpu", plan=plan)
    err = _run(rank, world, cu, S, True, (-1, -1), 7)
    sch = attention.get_schedule(torch.zeros(2, S // world, HQ, D), torch.zeros(2, S // world, HKV, D), cu, S, True, -1, 0, group.group_name)
    runtime = dp.plan_context_parallel(cu, world, num_heads=(HQ, HKV))
    report.append(("handed", sch.plan_tag == hash((plan.q_ranges, plan.kv_ranges)), plan.q_ranges != runtime.q_ranges, err))
    return report


def disagreeing_plans(rank, world):
    """Rank 0 runs a handed plan, the others the runtime's: every rank raises, nothing moves."""
    S = 64
    cu = dp.cu_seqlens_from_lengths([[60, 4]], S)
    if rank == 0:
        plan = dp.plan_context_parallel(cu.tolist(), world, num_heads=(HQ, HKV), tolerance=1.0, row_cost=None)
        cp.prepare(cu, dist.group.WORLD, num_heads=(HQ, HKV), device="cpu", plan=plan)
    try:
        _run(rank, world, cu, S, True, (-1, -1), 0)
    except ValueError as e:
        return str(e)
    return None


def layout_host_ms(rank, world, layouts, S, rounds):
    """Per new layout, the host work the first context-parallel call of a step does (layout,
    plan, this rank's schedule, the agreement's tag), with an intra-op pool as wide as the host
    (torch's default where the launcher sets nothing) and with one thread, alternating round by
    round after two unmeasured layouts: (threads, median ms) per setting, each layout new."""
    settings = (max(2, os.cpu_count() or 1), 1)
    times: list[list[float]] = [[], []]
    for i in range(2 * rounds + 2):
        which = i % 2
        torch.set_num_threads(settings[which])
        rng = random.Random(i)
        cu = dp.cu_seqlens_from_lengths([dp.data.lognormal_lengths(S, 2048, rng) for _ in range(layouts)], S, max_docs=S // 8)
        dist.barrier()  # every rank works at once, as in training
        t0 = time.perf_counter()
        layout = get_layout(cu, S)
        attention.schedule_for(layout, (world, rank, True, -1, 0, 4.0, torch.device("cpu")))
        attention.layout_tag(layout)
        if i >= 2:
            times[which].append((time.perf_counter() - t0) * 1e3)
    return [(threads, statistics.median(t)) for threads, t in zip(settings, times)]


LATE_S = 0.2  # how late the last rank comes to each layout's first call in call_host_times


def call_host_times(rank, world):
    """Three attention layers on each of two prepared layouts: the runtime counts each pass's
    first call on a layout apart from the later ones (its host time is reported separately),
    and the agreement's share of it. The last rank comes :data:`LATE_S` late to each layout's
    first call, so the others wait for it in that call's agreement."""
    S, rng, group = 64, random.Random(11), dist.group.WORLD
    dist.barrier()  # the ranks start together: the only lateness is the one made below
    c0 = cp.runtime_counts()
    for i in range(2):
        cu = dp.cu_seqlens_from_lengths([random_lengths(rng, S)], S, max_docs=S)
        ready = cp.prepare(cu, group, num_heads=(HQ, HKV), device="cpu")
        g = torch.Generator().manual_seed(i)
        x = torch.randn(1, S // world, HQ, D, generator=g, requires_grad=True)
        k, v = (torch.randn(1, S // world, HKV, D, generator=g) for _ in range(2))
        h = x
        if rank == world - 1:
            time.sleep(LATE_S)
        for _ in range(3):  # layers: same layout, same group
            h = dp.doc_packed_attn(h, k, v, ready, causal=True, cp_group=group)
        h.sum().backward()
    c1 = cp.runtime_counts()
    keys = ("first_calls", "other_calls", "first_call_us", "other_call_us")
    keys += tuple(f"{w}_call_{part}_us" for w in ("first", "other") for part in ("agreement", "exchange", "kernel"))
    return {key: c1[key] - c0[key] for key in keys}


class _Kinds:
    """Records the kinds of torch ops (:func:`_op_kind`) that functions wrapped by
    :meth:`recorded` dispatch, outside the attention kernels, the Triton reductions and the
    agreement (hidden while active): what the runtime's own glue runs on the device, whose CUDA
    kernels must be loaded before a training step needs them."""

    def __init__(self):
        from doc_packed import kernels
        from doc_packed.cp import comm, warmup

        self.seen: set = set()
        hidden = [(kernels, "forward"), (kernels, "backward"), (attention, "merge_"), (attention, "add_partials_")]
        self.hidden = hidden + [(warmup, "merge_"), (warmup, "add_partials_"), (comm, "check_agreement")]

    def __enter__(self):
        from torch.utils._python_dispatch import _disable_current_modes

        def quiet(f):
            def call(*a, **kw):
                with _disable_current_modes():
                    return f(*a, **kw)

            return call

        self.saved = [getattr(m, name) for m, name in self.hidden]
        for (m, name), f in zip(self.hidden, self.saved):
            setattr(m, name, quiet(f))
        return self

    def __exit__(self, *exc):
        for (m, name), f in zip(self.hidden, self.saved):
            setattr(m, name, f)

    def recorded(self, fn):
        from torch.utils._python_dispatch import TorchDispatchMode

        seen = self.seen

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kind = _op_kind(func, args)
                if kind is not None:
                    seen.add(kind)
                return func(*args, **(kwargs or {}))

        def call(*args):
            with Mode():
                return fn(*args)

        return call


def _op_kind(func, args):
    """An op's kind as a CUDA kernel sees it: its name, each tensor argument's dtype, rank and
    contiguity, and the dimension of an index op; None for views, allocations and the
    process group's own ops (no kernel of ours)."""
    name = func.name()
    if func.is_view or name.startswith(("c10d::", "_c10d_functional::")) or "empty" in name or name == "aten::_unsafe_view":
        return None
    tensors = tuple((a.dtype, a.dim(), a.is_contiguous()) for a in args if isinstance(a, torch.Tensor))
    dim = args[1] if "index" in name and len(args) > 1 and isinstance(args[1], int) else None
    return name, tensors, dim


def runtime_op_kinds(rank, world, dtype_name, layouts):
    """The op kinds the runtime's glue runs over ``layouts`` random layouts (causal, windowed,
    bidirectional; forward and backward) in ``dtype_name``, and the warm-up's."""
    from doc_packed.cp.warmup import _warm_runtime

    dtype = getattr(torch, dtype_name)
    S, rng, group = 64, random.Random(17), dist.group.WORLD
    masks = [(True, (-1, -1)), (True, (7, 0)), (False, (5, 9)), (False, (-1, -1))]
    with _Kinds() as runtime:
        forward, backward = attention.forward, attention.backward
        attention.forward, attention.backward = runtime.recorded(forward), runtime.recorded(backward)
        try:
            for i in range(layouts):
                causal, window = masks[i % len(masks)]
                cu = dp.cu_seqlens_from_lengths([random_lengths(rng, S), random_lengths(rng, S)], S, max_docs=S)
                g = torch.Generator().manual_seed(i)
                q, k, v = (torch.randn(2, S // world, h, D, generator=g).to(dtype).requires_grad_() for h in (HQ, HKV, HKV))
                out = dp.doc_packed_attn(q, k, v, cu, causal=causal, window_size=window, cp_group=group)
                out.sum().backward()
        finally:
            attention.forward, attention.backward = forward, backward
    with _Kinds() as warm:
        warm.recorded(_warm_runtime)(q, k, v)
    return runtime.seen, warm.seen
