"""Context-parallel plans made ahead: the next batch's host work done when the caller chooses.

Training knows a batch's ``cu_seqlens`` before the step that uses it. :func:`prepare` does the
host work a new layout needs (validation, the plan, this rank's schedule and its device indices,
queued in one copy, and the schedule's first FA4 launches where earlier layouts' recordings
allow: ``kernels.fa4.prepare``; on the CPU the math kernel's query blocks) at a moment the caller
picks, for instance right after the previous step's work is queued, while the GPU runs it. It
returns ``cu_seqlens`` on the device, registered, so every attention call of the step finds what
it needs without reading the tensor back (a device sync) and without planning. Nothing prepared: the first call of a step plans, as it always did.

The plan itself is a value (:class:`~.plan.ContextParallelPlan`): made anywhere from plain
lists (:func:`~.plan.plan_context_parallel`, e.g. in a DataLoader worker process), printed,
pickled, and handed to :func:`prepare` with ``plan=``; the runtime then runs that plan, and every
rank checks that the others run the same one before any data moves.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import _doc_layout
from ..kernels import fa4, math
from .._checks import check_cu_seqlens, check_window
from .._host import queue_to
from . import _triton, attention, comm
from .plan import ContextParallelPlan, query_cost_of

__all__ = ["prepare", "runtime_counts"]


def prepare(
    cu_seqlens: torch.Tensor,
    cp_group: dist.ProcessGroup | str | None,
    *,
    num_heads: tuple[int, int] | None = None,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    device: torch.device | str | None = None,
    plan: ContextParallelPlan | None = None,
) -> torch.Tensor:
    """Make this rank's context-parallel plan and schedule for ``cu_seqlens`` now, and return
    ``cu_seqlens`` on ``device`` ready for ``doc_packed_attn`` (or a placed model) to use.

    Args:
        cu_seqlens: the whole rows' ``[B, MAX_DOCS + 1]`` layout, on the CPU (a device tensor
            is read back once: a sync, which is what this call exists to avoid).
        cp_group: the context-parallel process group (or its name) the attention runs over;
            None: no context parallelism (only the layout is validated and registered, which
            spares local calls their one read back per new device tensor too).
        num_heads: ``(H_q, H_kv)`` of the attention (any tensor-parallel split of both: the
            plan depends on their ratio); needed with a ``cp_group``.
        causal, window_size: the attention's mask, as passed to ``doc_packed_attn``; layers
            with another mask: call again with the returned tensor (nothing is copied again).
        device: where the attention runs (default: the current accelerator, else the CPU).
        plan: run this plan instead of planning (it must be for this layout, group size and
            mask; e.g. made in a DataLoader worker by ``plan_context_parallel``).

    Returns:
        ``cu_seqlens`` on ``device``, pinned and copied without blocking; on the CPU the tensor
        itself. Calls with any other tensor of the same values find the same plan (after one
        read back of a device tensor).
    """
    cu = check_cu_seqlens(cu_seqlens)
    left, right = check_window(causal, window_size)
    dev = _device(device)
    host = cu.detach()
    if host.device.type == "cpu":
        seq_len = int(host[0, -1])
        layout = _doc_layout.get_layout(host, seq_len)
    else:  # a tensor prepared before (another mask) is found without a read
        seq_len = _seq_len(cu)
        layout = _doc_layout.get_layout(cu, seq_len)
    if cp_group is not None:
        _prepare_group(layout, cp_group, num_heads, causal, left, right, dev, plan)
    elif plan is not None or num_heads is not None:
        raise ValueError("plan and num_heads are for context parallelism: pass cp_group too")
    if host.device.type != "cpu" or dev.type == "cpu":
        return cu
    moved = queue_to(host.contiguous(), dev)
    _doc_layout.register(moved, layout)  # (the host values' layout: read once)
    return moved


def _prepare_group(layout, cp_group, num_heads, causal, left, right, dev, plan) -> None:
    name = cp_group if isinstance(cp_group, str) else getattr(cp_group, "group_name", None)
    if not isinstance(name, str):
        raise TypeError(f"cp_group must be a ProcessGroup, a group name or None, got {type(cp_group).__name__}")
    if num_heads is None:
        raise TypeError(
            "num_heads=(H_q, H_kv) is needed with a cp_group (the plan weighs moving queries by H_q / H_kv)"
        )
    qc = query_cost_of(num_heads, None)
    rank, size = comm.group_info(name)
    key = attention.ScheduleKey(size, rank, causal, left, right, qc, dev)
    if plan is not None:
        _check_plan(plan, layout, size, causal, (left, right), qc)
        attention.install_schedule(layout, key, plan)  # what the calls run
    schedule = attention.schedule_for(layout, key)
    for call in (*schedule.stage_a, *schedule.stage_b):
        if dev.type == "cpu":
            math.prepare(call.spec, dev)  # the math kernel's blocks and bounds
        else:
            fa4.prepare(call.spec, dev)  # their first FA4 launches, from the kinds met so far
    attention.layout_tag(layout)  # what every call's agreement sends, computed once


def runtime_counts() -> dict[str, int]:
    """What this process's context-parallel calls cost the host so far: ``schedules`` built
    (a plan and one rank's schedule each, :func:`prepare`'s included), ``schedules_in_calls``
    (those an attention call had to build: its layout was not prepared), ``device_reads`` of
    a ``cu_seqlens`` that nothing had registered (each one a device sync), the
    ``kernels_compiled`` by FA4 (:func:`doc_packed.kernels.fa4.compiled_kernels`) and by the
    runtime's own Triton kernels (none after the warm-up is the contract), and the
    ``agreements`` calls made with their peers before exchanging, with the microseconds they
    took (``agreement_us``: a rank whose peers are late waits there), and the host time of the
    forward and backward calls: ``first_calls``/``first_call_us`` for the first call of each
    pass on a layout, ``other_calls``/``other_call_us`` for the rest (a prepared layout's first
    call should cost what the others do), and the parts of each: ``*_call_agreement_us`` in the
    agreement (waiting for late peers: a rank that is ahead waits there for the slowest one, so
    the call's own host work is the difference), ``*_call_exchange_us`` issuing the exchanges'
    transfers (and waiting for them where the backend blocks the host: gloo) and
    ``*_call_kernel_us`` in the attention kernels' calls (their Python and launches; on CPU their
    compute)."""
    built, in_calls = attention.schedules_built()
    agreed, agreed_us = comm.agreements()
    times = attention.call_host_times()
    return {
        "schedules": built,
        "schedules_in_calls": in_calls,
        "device_reads": _doc_layout.device_reads(),
        "kernels_compiled": fa4.compiled_kernels() + _triton.compiled_variants(),
        "agreements": agreed,
        "agreement_us": agreed_us,
        "first_calls": times["first"][0],
        "first_call_us": times["first"][1],
        "first_call_agreement_us": times["first"][2],
        "first_call_exchange_us": times["first"][3],
        "first_call_kernel_us": times["first"][4],
        "other_calls": times["other"][0],
        "other_call_us": times["other"][1],
        "other_call_agreement_us": times["other"][2],
        "other_call_exchange_us": times["other"][3],
        "other_call_kernel_us": times["other"][4],
    }


def _seq_len(cu: torch.Tensor) -> int:
    """The row length of a registered device ``cu_seqlens`` (one read when it is not)."""
    hit = _doc_layout.registered_seq_len(cu)
    return hit if hit is not None else int(cu[0, -1])


def _device(device: torch.device | str | None) -> torch.device:
    if device is None:
        acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        device = acc if acc is not None else torch.device("cpu")
    dev = torch.device(device)
    if dev.type != "cpu" and dev.index is None:  # what a tensor on it reports, the runtime's key
        dev = torch.device(dev.type, torch.accelerator.current_device_index())
    return dev


def _check_plan(
    plan: object, layout: _doc_layout.DocLayout, size: int, causal: bool, window: tuple[int, int], qc: float
) -> None:
    if not isinstance(plan, ContextParallelPlan):
        raise TypeError(f"plan must be a ContextParallelPlan (plan_context_parallel's), got {type(plan).__name__}")
    wrong = [
        f"{what} {got!r} (this call: {want!r})"
        for what, got, want in (
            ("cp_size", plan.cp_size, size),
            ("causal", plan.causal, causal),
            ("window", plan.window_size, window),
            ("query_cost", plan.query_cost, qc),
            ("seq_len", plan.seq_len, layout.seq_len),
        )
        if got != want
    ]
    if plan.documents != layout.rows:
        wrong.append("documents (it was made for other cu_seqlens values)")
    if plan.prefixes is not None:
        wrong.append("bidirectional prefixes (prefix_lens calls plan on their first call)")
    if wrong:
        raise ValueError(f"plan does not fit this call: {'; '.join(wrong)}")
