"""Context-parallel host work per new layout: made ahead (prepare), thread-independent, no
kernel compiles after the warm-up (FA4's compile facts on CPU; the real FA4 on a GPU)."""

import pickle
import random

import pytest
import torch

import doc_packed as dp
from cp_prepare_cases import LATE_S, call_host_times, disagreeing_plans, layout_host_ms, prepared, runtime_op_kinds
from doc_packed import cp, kernels
from doc_packed._doc_layout import get_layout
from doc_packed.cp import attention
from doc_packed.cp.plan import runtime_plan
from doc_packed.cp.schedule import build_schedule, call_masks
from doc_packed.cp.warmup import warm_specs
from doc_packed.kernels import fa4


def test_plan_context_parallel_is_the_runtime_plan_and_a_value():
    S = 4096
    cu = dp.cu_seqlens_from_lengths([dp.data.lognormal_lengths(S, 300, seed=3)], S)
    plan = dp.plan_context_parallel(cu, 4, num_heads=(16, 4))
    assert plan is runtime_plan(get_layout(cu, S), 4, True, -1, 0, 4.0)  # what the runtime runs
    assert plan.query_cost == 4.0 and plan.row_cost == cp.ROW_COST and plan.tolerance == cp.TOLERANCE
    again = pickle.loads(pickle.dumps(plan))
    assert again == plan and again.documents == get_layout(cu, S).rows
    assert dp.plan_context_parallel(cu.tolist(), 4, query_cost=4.0) == plan  # lists, no tensor: same plan
    with pytest.raises(TypeError, match="not both"):
        dp.plan_context_parallel(cu, 4, num_heads=(16, 4), query_cost=4.0)
    with pytest.raises(ValueError, match="multiple of H_kv"):
        dp.plan_context_parallel(cu, 4, num_heads=(6, 4))


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]
        ),
    ],
)
def test_schedule_host_work_runs_no_torch_compute(device):
    """Building a layout's plan and schedule dispatches no torch op but views of its one index
    copy: nothing that could fan out over the intra-op thread pool. On CUDA the copy goes from
    pinned memory that NumPy fills (``Tensor.pin_memory()``'s own copy is a torch CPU op that
    spreads over the pool above 32768 elements)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = set()

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.add(func.name())
            return func(*args, **(kwargs or {}))

    S = 32768
    cu = dp.cu_seqlens_from_lengths([dp.data.lognormal_lengths(S, 2048, seed=b) for b in range(4)], S, max_docs=S // 8)
    with Ops():
        layout = get_layout(cu, S)
        for r in range(4):
            sch = attention.schedule_for(layout, (4, r, True, -1, 0, 4.0, torch.device(device)))
            assert sch.stage_b  # a real schedule: keys and queries move
        attention.layout_tag(layout)
    allowed = {"aten::slice.Tensor", "aten::detach", "aten::lift_fresh", "aten::_to_copy", "aten::alias"}
    allowed.add("aten::split_with_sizes")  # the slots' views of the index copy, made at once
    if device == "cuda":
        allowed.add("aten::empty.memory_format")  # the pinned buffer NumPy fills
    assert seen <= allowed, seen


@pytest.mark.slow
def test_per_layout_host_time_does_not_depend_on_threads(run_ranks):
    """4 ranks at once (more threads than cores at the default setting): the per-layout host
    path at default threads within 1.5x of one thread (it was 24-300x on 64 cores: torch CPU ops)."""
    results = run_ranks(layout_host_ms, 4, 4, 32768, 12)
    for rank, ((threads, default_ms), (_, one_ms)) in enumerate(results):
        assert default_ms <= 1.5 * one_ms + 2.0, (
            f"rank {rank}: {default_ms:.2f} ms at {threads} threads, {one_ms:.2f} at 1"
        )


def test_first_call_of_a_layout_is_timed_apart(run_ranks):
    """runtime_counts splits the forward and backward calls' host time: the first of each pass
    on a layout (where a new layout's costs land) against the later layers' calls, and says how
    much of it went to the exchanges and the kernels, and how much was the agreement's wait:
    rank 0 waits there for rank 1, which comes late to each layout's first call, and that wait is
    not the call's own work."""
    late_us = int(LATE_S * 1e6)
    for rank, got in enumerate(run_ranks(call_host_times, 2)):
        assert (got["first_calls"], got["other_calls"]) == (4, 8), (rank, got)  # 2 layouts x 2 passes; x 2 more layers
        assert got["first_call_us"] > 0 and got["other_call_us"] > 0, (rank, got)
        for which in ("first", "other"):
            parts = [got[f"{which}_call_{part}_us"] for part in ("agreement", "exchange", "kernel")]
            # every call exchanges (the layouts move keys) and runs kernels; the parts do not overlap
            assert parts[1] > 0 and parts[2] > 0 and min(parts) >= 0, (rank, which, got)
            assert sum(parts) <= got[f"{which}_call_us"], (rank, which, got)
        waited = got["first_call_agreement_us"]
        if rank == 0:  # waited for rank 1 in each of the two layouts' first forward
            assert waited >= 2 * late_us * 0.75, (rank, got)
            assert got["first_call_us"] - waited < late_us, (rank, got)  # the rest is the calls' work
        else:
            assert waited < late_us, (rank, got)


@pytest.mark.slow
def test_prepared_layouts_plan_nothing_in_the_call(run_ranks):
    for rank, report in enumerate(run_ranks(prepared, 2)):
        for kind, a, b, err in report:
            assert err < 1e-10, (rank, kind, err)
            if kind == "agreements":  # one before each exchange: forward and backward of 3 calls
                assert a >= 6 and b >= 0, f"rank {rank}: {a} agreements counted, {b} us"
            elif kind == "prepared":
                assert (a, b) == (1, 0), f"rank {rank}: prepare built {a} schedules, the call {b}"
            elif kind == "math blocks planned in calls":  # prepare made them: the first call reads them
                assert a == 0, f"rank {rank}: {a} specs' query blocks planned inside the calls"
            else:
                assert a and b, f"rank {rank}: the handed plan (a different one) was not the one run"


@pytest.mark.slow
def test_ranks_running_different_plans_refuse_together(run_ranks):
    errors = run_ranks(disagreeing_plans, 2)
    assert all(e is not None and "plan" in e for e in errors), errors


def test_prepare_checks_the_plan():
    cu = dp.cu_seqlens_from_lengths([[40, 24]], 64)
    other = dp.plan_context_parallel([[0, 30, 64]], 2)
    with pytest.raises(TypeError, match="cp_group"):
        cp.prepare(cu, 3, num_heads=(4, 2))  # type: ignore[arg-type]
    from doc_packed.cp import prepared as prep

    layout = get_layout(cu, 64)
    with pytest.raises(ValueError, match="other cu_seqlens values"):
        prep._check_plan(other, layout, 2, True, (-1, 0), 1.0)
    with pytest.raises(ValueError, match="cp_size 2 .this call: 4"):
        prep._check_plan(dp.plan_context_parallel(cu, 2), layout, 4, True, (-1, 0), 1.0)


def test_warm_up_runs_every_op_kind_of_the_runtime(run_ranks):
    """The runtime's own torch ops (around the attention kernels) over 24 random layouts, forward
    and backward, in bf16: each kind (op, its tensors' dtypes, ranks and contiguity, an index
    op's dimension) also runs in the warm-up, so CUDA has loaded its kernel before a training
    step's layout first needs it (a 173 ms load inside a step on 2 x H200)."""
    for rank, (runtime, warm) in enumerate(run_ranks(runtime_op_kinds, 2, "bfloat16", 24)):
        assert {"aten::index_select", "aten::index_copy_", "aten::index_add_"} <= {k[0] for k in runtime}, runtime
        assert runtime <= warm, (rank, sorted(runtime - warm, key=str))


@pytest.mark.parametrize(
    "causal,window", [(True, (-1, -1)), (True, (100, 0)), (False, (-1, -1)), (False, (50, 30)), (False, (-1, 20))]
)
def test_no_kernel_kind_beyond_the_warm_up(causal, window):
    """FA4 stand-in on CPU: over 50 random layouts and CP 2-8, every kernel call of every rank's
    schedule is of a kind (FA4 4.0.0b36's compile facts) the warm-up built."""
    left, right = window[0], 0 if causal else window[1]
    warmed = {fa4.compile_facts(s) for s in warm_specs(causal, left, right)}
    assert len(warm_specs(causal, left, right)) == 2 * len(call_masks(causal, left, right))
    rng = random.Random(hash((causal, window)) & 0xFFFF)
    seen = set()
    for _ in range(50):
        S = rng.choice([512, 2048, 8192])
        mean = rng.choice([8, 64, 300, S])
        lengths = [dp.data.lognormal_lengths(S, mean, rng) for _ in range(rng.choice([1, 2]))]
        cu = dp.cu_seqlens_from_lengths(lengths, S)
        c = rng.choice([2, 4, 8])
        plan = runtime_plan(get_layout(cu, S), c, causal, left, right, 2.0)
        for r in range(c):
            for call in (*(sch := build_schedule(plan, r, torch.device("cpu"))).stage_a, *sch.stage_b):
                facts = fa4.compile_facts(call.spec)
                if facts is not None:
                    seen.add(facts)
    assert seen <= warmed, seen - warmed
    assert len(seen) >= 2  # the layouts did produce several kinds


def test_device_offsets_start_on_16_bytes():
    """FA4's backward copies offsets that do not start on a 16-byte boundary (a copy per call,
    and the call is then never replayed): every spec's device offsets, a context-parallel
    schedule's (views of its one index copy) and a local spec's (one copy of both), start on one,
    whatever the number of segments before them."""
    rng = random.Random(7)
    for _ in range(20):
        S = rng.choice([512, 2048])
        lengths = [dp.data.lognormal_lengths(S, rng.choice([8, 64, 300]), rng) for _ in range(rng.choice([1, 2, 3]))]
        cu = dp.cu_seqlens_from_lengths(lengths, S, max_docs=max(map(len, lengths)) + rng.randrange(4))
        layout = get_layout(cu, S)
        c = rng.choice([2, 3, 4])
        plan = runtime_plan(layout, c, True, -1, 0, 2.0)
        schedules = [build_schedule(plan, r, torch.device("cpu")) for r in range(c)]
        specs = [call.spec for sch in schedules for call in (*sch.stage_a, *sch.stage_b)]
        specs.append(dp.ops.local_spec(layout, True, -1, 0))
        for spec in specs:
            for t in spec.cu_tensors(torch.device("cpu")):
                assert t.dtype == torch.int32 and t.storage_offset() * 4 % 16 == 0, (spec, t.storage_offset())
        assert len(specs) > c


def test_fa4_bounds_never_under_a_tile():
    """Every spec FA4 gets passes max_seqlen_q/k of at least MAX_SEQLEN_FLOOR (one kernel per
    kind, whatever the layout), still upper bounds of the real lengths."""
    from doc_packed.kernels import VarlenSpec

    spec = VarlenSpec([0, 3, 5], [0, 10, 12], True, -1, 0)
    args = fa4._build_args(spec, torch.device("cpu"), 0.1)
    assert (args["max_seqlen_q"], args["max_seqlen_k"]) == (fa4.MAX_SEQLEN_FLOOR,) * 2
    big = VarlenSpec([0, 1000], [0, 1000], True, -1, 0)
    assert fa4._build_args(big, torch.device("cpu"), 0.1)["max_seqlen_q"] == 1000


def test_warmup_skips_backends_without_a_compiler():
    q = torch.zeros(1, 8, 4, 8)
    k = torch.zeros(1, 8, 2, 8)
    from doc_packed.cp.warmup import warmup

    assert warmup(q, k, k, True, -1, 0) == 0  # CPU: the math kernel, nothing to build


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not fa4.available(), reason="needs a GPU with FA4")
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the CuTe DSL's, while FA4 compiles
def test_fa4_compiles_nothing_after_warm_up_on_gpu():
    """The real FA4: after the warm-up, 50 random layouts' schedules (CP 4, every rank's calls,
    forward and backward) add no entry to any of FA4's compile caches."""
    import importlib

    fa4._interface()  # imported as the runtime does (the CuTe DSL's import-time notices filtered)
    iface = importlib.import_module(fa4.MODULE)
    caches = {
        name: f.__dict__["compile_cache"]
        for name, f in vars(iface).items()
        if callable(f) and "compile_cache" in getattr(f, "__dict__", {})
    }

    def compiled():
        return {(name, key) for name, c in caches.items() for key in getattr(c, "cache", {})}

    dev = torch.device("cuda")
    Hq, Hkv, D = 16, 4, 128
    q = torch.randn(1, 64, Hq, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(1, 64, Hkv, D, device=dev, dtype=torch.bfloat16)
    from doc_packed.cp.warmup import warmup

    warmup(q, k, k, True, -1, 0)
    after_warmup = compiled()
    assert after_warmup, f"the warm-up built nothing (FA4's caches: {sorted(caches)})"
    rng = random.Random(0)
    for _ in range(50):
        S = rng.choice([8192, 32768])
        cu = dp.cu_seqlens_from_lengths([dp.data.lognormal_lengths(S, rng.choice([64, 512, 2048]), rng)], S)
        plan = runtime_plan(get_layout(cu, S), 4, True, -1, 0, Hq / Hkv)
        for r in range(4):
            sch = build_schedule(plan, r, dev)
            for call in (*sch.stage_a, *sch.stage_b):
                nq, nk = call.q1 - call.q0, call.k1 - call.k0
                qq = torch.randn(nq, Hq, D, device=dev, dtype=torch.bfloat16)
                kk = torch.randn(nk, Hkv, D, device=dev, dtype=torch.bfloat16)
                out, lse = kernels.forward(call.spec, qq, kk, kk, D**-0.5, "fa4")
                kernels.backward(call.spec, out, qq, kk, kk, out, lse, D**-0.5, "fa4")
    new = compiled() - after_warmup
    assert not new, f"{len(new)} kernels compiled after the warm-up: {sorted(new, key=str)[:6]}"
