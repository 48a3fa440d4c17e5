"""Rank bodies for the context-parallel fault suite (tests/test_cp_faults.py on gloo ranks,
tests/test_cp_faults_nccl.py on NCCL ranks; module level so spawn can import them). Each returns
plain data (errors, messages, counts) for the test to check.

Data is made on the CPU (seeded, so the same on every rank and backend) in :data:`DTYPE` and
moved to the rank's device (``dist_utils.DEVICE``: cpu on gloo, ``cuda:<rank>`` on NCCL); the
float64 oracle runs on the CPU. :func:`configured` sets :data:`DTYPE` (float32 on CUDA, where the
package takes no float64). :func:`count_collectives` and :func:`companion_group` are gloo-only:
they patch the agreement's channel and time CPU collectives on the group itself."""

from __future__ import annotations

import contextlib
import math
import random
import time

import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode

import dist_utils
import doc_packed as dp
from doc_packed import _doc_layout
from doc_packed.cp import attention, comm
from doc_packed.cp import plan as cp_plan
from doc_packed_testing.oracle import reference

GROUP = None  # the group the bodies use (WORLD unless a body sets it)
DTYPE = torch.float64  # the bodies' q, k, v (a case's "dtype" overrides it)


def _group():
    return GROUP if GROUP is not None else dist.group.WORLD


def _device() -> torch.device:
    return dist_utils.DEVICE


def configured(rank, world, dtype, fn, *args):
    """``fn(rank, world, *args)`` with the bodies' data in ``dtype``."""
    global DTYPE
    DTYPE = dtype
    return fn(rank, world, *args)


def _on_device(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` on the rank's device (a copy on the CPU too: a leaf of its own)."""
    return t.to(_device(), copy=True)


def _shard(t: torch.Tensor, rank: int, world: int, dim: int = 1) -> torch.Tensor:
    """``torch.chunk`` along the sequence dim; a rank past the last chunk holds nothing."""
    chunks = t.chunk(world, dim=dim)
    return chunks[rank] if rank < len(chunks) else t.narrow(dim, 0, 0)


def _data(seed, B, S, Hq, Hkv, D, dtype=None):
    """``q, k, v, dout, dlse`` on the CPU in ``dtype`` (:data:`DTYPE` if None)."""
    dtype = DTYPE if dtype is None else dtype
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, Hq, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, S, Hkv, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, S, Hkv, D, generator=g, dtype=torch.float64)
    dout = torch.randn(B, S, Hq, D, generator=g, dtype=torch.float64)
    dlse = torch.randn(B, Hq, S, generator=g, dtype=torch.float64)
    return [t.to(dtype) for t in (q, k, v, dout, dlse)]


def cp_step(rank, world, case, *, lse_loss=True, check=True):
    """One context-parallel forward and backward of ``case`` (``lengths``, ``S``, ``Hq``, ``Hkv``,
    ``D``, optional ``causal``, ``window``, ``dtype``, ``seed``, ``cu_dtype``, or ``cu`` itself),
    the loss using lse too; returns the max error against the float64 oracle (None when ``check``
    is False)."""
    pairs = _cp_pairs(rank, world, case, lse_loss=lse_loss)
    if not check:
        return None
    errs = [(a - b).abs().max().item() if a.numel() else 0.0 for a, b in pairs]
    for a, b in pairs:  # shapes too: an empty shard returns empty tensors of the right shape
        assert a.shape == b.shape, (a.shape, b.shape)
    return max(errs) if not any(math.isnan(e) for e in errs) else math.nan  # max() may drop a NaN


def _cp_pairs(rank, world, case, *, lse_loss=True, poison=None):
    """The context-parallel step of :func:`cp_step`: ``[(got, oracle)]`` for out, lse, dq, dk, dv,
    this rank's shards, both float64 on the CPU. ``poison``: ``(b, s, h)``, a global position of
    q that is NaN in the run (the oracle sees the clean q)."""
    S, causal, window = case["S"], case.get("causal", True), case.get("window", (-1, -1))
    cu = case.get("cu")
    if cu is None:
        cu = dp.cu_seqlens_from_lengths(case["lengths"], S).to(case.get("cu_dtype", torch.int32))
    q, k, v, dout, dlse = _data(case.get("seed", 0), cu.shape[0], S, case["Hq"], case["Hkv"], case["D"], case.get("dtype"))
    run_q = q
    if poison is not None:
        run_q = q.clone()
        run_q[poison] = float("nan")
    lq, lk, lv = (_on_device(_shard(t, rank, world)).requires_grad_() for t in (run_q, k, v))
    # count_flops: under FlopCounterMode (the custom op and its flop formula run, not the eager path)
    with FlopCounterMode(display=False) if case.get("count_flops") else contextlib.nullcontext():
        out, lse = dp.doc_packed_attn(
            lq, lk, lv, cu.to(_device()), causal=causal, window_size=window, return_lse=True, cp_group=_group(),
            seq_len=S, scale=case.get("scale"),
        )
        loss = (out * _on_device(_shard(dout, rank, world))).sum()
        if lse_loss:
            loss = loss + (lse * _on_device(_shard(dlse, rank, world, dim=2))).sum()
        grads = torch.autograd.grad(loss, (lq, lk, lv))
    rq, rk, rv = (t.double().clone().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = reference(rq, rk, rv, cu.cpu(), causal, window, case.get("scale"))
    ref_loss = (ref_out * dout.double()).sum() + ((ref_lse * dlse.double()).sum() if lse_loss else 0)
    ref_grads = torch.autograd.grad(ref_loss, (rq, rk, rv))
    pairs = [(out, _shard(ref_out, rank, world)), (lse, _shard(ref_lse, rank, world, dim=2))]
    pairs += [(g, _shard(r, rank, world)) for g, r in zip(grads, ref_grads)]
    return [(a.detach().double().cpu(), b.detach()) for a, b in pairs]


def shard_parity(rank, world, cases):
    """:func:`cp_step` for each case: one-token and empty shards, lse in the loss."""
    return [cp_step(rank, world, c) for c in cases]


class _PlanCounter:
    """Counts this rank's plan builds (planning is local: a rank may re-plan alone)."""

    def __init__(self):
        self.n = 0
        self.real = cp_plan.build_plan

    def __call__(self, *a, **k):
        self.n += 1
        return self.real(*a, **k)


def divergent_history(rank, world, kinds):
    """Per kind, two context-parallel steps on one layout (a new layout per kind); between them
    rank 0 alone does ``kind``:

    - ``local_calls``: 40 local (non-CP) calls on other layouts (evicts its layout cache)
    - ``thousands``: 2000 local calls on distinct layouts (the cache stays bounded)
    - ``clear``: forgets every cached layout, plan and schedule
    - ``add_zero``: ``cu.add_(0)`` (a version bump, same values)

    Both steps use one ``cu_seqlens`` tensor. Returns per kind (errors of both steps, plans built
    by this rank, cached layouts after)."""
    counter = _PlanCounter()
    cp_plan.build_plan = counter  # runtime_plan (cp/plan.py) builds through it
    S, out = 48, {}
    for i, kind in enumerate(kinds):
        counter.n = 0
        cu = dp.cu_seqlens_from_lengths([[13 + i, 20, 15 - i], [48]], S).to(_device())
        case = dict(lengths=None, cu=cu, S=S, Hq=4, Hkv=2, D=8, causal=True)
        errs = [cp_step(rank, world, case)]
        if rank == 0:
            n = {"local_calls": 40, "thousands": 2000}.get(kind, 0)
            cuts = [(a, b) for a in range(1, 63) for b in range(a + 1, 64)][:n]  # distinct layouts
            x = _on_device(torch.randn(1, 64, 1, 4, dtype=DTYPE))
            for a, b in cuts:
                dp.doc_packed_attn(x, x, x, dp.cu_seqlens_from_lengths([[a, b - a, 64 - b]], 64).to(x.device), causal=True)
            if kind == "clear":
                _doc_layout.clear_cache()
            if kind == "add_zero":
                cu.add_(0)
        errs.append(cp_step(rank, world, case))
        out[kind] = (errs, counter.n, len(_doc_layout._layouts))
    return out


def later_divergence(rank, world, whats):
    """For each ``what``: a call all ranks agree on (planned, cached), then one where rank 1
    differs in ``what``, then an agreed call again (the group must still be in step). Returns
    per ``what``: (first error, the divergent call's message or None, its exception type, the
    last call's error)."""
    base = dict(lengths=[[10, 22], [32]], S=32, Hq=4, Hkv=2, D=8, causal=False, window=(5, 3))
    changes = {
        "head_dim": dict(D=16),
        # float64 where the data is float32 would fail rank 1's own checks on CUDA instead
        "dtype": dict(dtype=torch.float32 if DTYPE == torch.float64 else torch.bfloat16),
        "q_heads": dict(Hq=2),
        "kv_heads": dict(Hkv=4),
        "causal": dict(causal=True, window=(5, 0)),
        "window": dict(window=(6, 3)),
        "scale": dict(scale=0.5),
        "cu_seqlens": dict(lengths=[[11, 21], [32]]),
        "seq_len": dict(lengths=[[10, 22, 8], [40]], S=40),
    }
    out = {}
    for what in whats:
        first = cp_step(rank, world, base)
        case = dict(base, **(changes[what] if rank == 1 else {}))
        message, kind = None, None
        try:
            cp_step(rank, world, case)
        except ValueError as e:
            message, kind = str(e), type(e).__name__
        out[what] = (first, message, kind, cp_step(rank, world, base))
    return out


def pass_divergence(rank, world):
    """Rank 0 runs a backward while rank 1 runs a forward (a program whose ranks fell out of
    step): both raise the same error naming the pass. Then an agreed step runs exactly."""
    base = dict(lengths=[[10, 22]], S=32, Hq=2, Hkv=1, D=8)
    q, k, v, *_ = _data(0, 1, 32, 2, 1, 8)
    cu = dp.cu_seqlens_from_lengths(base["lengths"], 32).to(_device())
    lq, lk, lv = (_on_device(_shard(t, rank, world)).requires_grad_() for t in (q, k, v))
    message = None
    try:
        if rank == 0:
            out = dp.doc_packed_attn(lq, lk, lv, cu, cp_group=_group(), seq_len=32, causal=True)
            # the forward above is agreed by rank 1's forward below; now rank 0 goes backward
            out.sum().backward()
        else:
            dp.doc_packed_attn(lq, lk, lv, cu, cp_group=_group(), seq_len=32, causal=True)
            dp.doc_packed_attn(lq, lk, lv, cu, cp_group=_group(), seq_len=32, causal=True)
    except ValueError as e:
        message = str(e)
    return message, cp_step(rank, world, base)


def rank_local_fault(rank, world, whats):
    """For each ``what``: rank 1 alone passes a bad input of that kind (every rank when ``what``
    ends in ``_all``), then a clean step runs. Returns per ``what``: ((message, exception type)
    or None, the clean step's error)."""
    out = {}
    for what in whats:
        out[what] = _local_fault(rank, world, what)
    return out


def _local_fault(rank, world, what):
    S = 32
    bad = rank == 1 or what.endswith("_all")
    kind = what.removesuffix("_all")
    q, k, v, *_ = _data(0, 1, S, 2, 2, 8)
    dev = _device()
    cu = dp.cu_seqlens_from_lengths([[10, 22]], S).to(dev)
    kwargs = dict(cp_group=_group(), seq_len=S)
    lq, lk, lv = (_on_device(_shard(t, rank, world)) for t in (q, k, v))
    if bad:
        if kind == "int64":
            cu = cu.long()
        elif kind == "decreasing":
            cu = torch.tensor([[0, 12, 10, 32]], dtype=torch.int32, device=dev)
        elif kind == "past_end":
            cu = torch.tensor([[0, 40, 32]], dtype=torch.int32, device=dev)
        elif kind == "shard_length":
            lq, lk, lv = (t[:, :-1] for t in (lq, lk, lv))
        elif kind == "batch":
            cu = dp.cu_seqlens_from_lengths([[10, 22], [32]], S).to(dev)
        elif kind == "q_dtype":
            lq = lq.to(torch.int32)
        elif kind == "window":
            kwargs["window_size"] = (-2, 0)
        elif kind == "backend":
            kwargs["backend"] = "flash"  # CPU, or float32/64 on CUDA: rejected by doc_packed_attn's checks
        elif kind == "k_heads":
            lk = lk[:, :, :1].expand(-1, -1, 3, -1)
    result = None
    try:
        dp.doc_packed_attn(lq, lk, lv, cu, **{"causal": True, **kwargs})
    except (TypeError, ValueError) as e:
        result = (str(e), type(e).__name__)
    return result, cp_step(rank, world, dict(lengths=[[10, 22]], S=S, Hq=2, Hkv=2, D=8))


def count_collectives(rank, world, companion=False):
    """Collectives and bytes of one cached context-parallel forward and backward, counted where
    they enter torch.distributed (the agreement) and doc_packed's comm (the data), plus the
    agreement's cost in microseconds (median of 200 calls). Gloo only (CPU collectives on the
    group itself)."""
    if companion:
        comm._has_cpu_backend = lambda pg: False
    counts = {"agree_calls": 0, "agree_bytes_sent": 0, "agree_bytes_received": 0, "data": 0}
    real_gather = comm._Channel._gather

    def gather(self, rows, x):
        counts["agree_calls"] += 1
        counts["agree_bytes_sent"] += x.numel() * x.element_size()
        counts["agree_bytes_received"] += sum(o.numel() * o.element_size() for o in rows)
        return real_gather(self, rows, x)

    def data(real):
        def f(*a, **k):
            counts["data"] += 1
            return real(*a, **k)

        return f

    comm._Channel._gather = gather  # every collective of the agreement goes through here
    comm.start_exchange = data(comm.start_exchange)  # every exchange starts here (exchange() too)
    case = dict(lengths=[[20, 44]], S=64, Hq=4, Hkv=2, D=8)
    cp_step(rank, world, case, lse_loss=False, check=False)  # plans (and makes the companion)
    for key in counts:
        counts[key] = 0
    err = cp_step(rank, world, case, lse_loss=False)
    measured = dict(counts)
    q = torch.zeros(1, 64 // world, 4, 8, dtype=torch.float64)
    sch = attention.get_schedule(q, q[:, :, :2], dp.cu_seqlens_from_lengths([[20, 44]], 64), 64, True, -1, 0, _group().group_name)
    group = _group().group_name
    fields = {"pass": "forward", "seq_len": 64, "window": (-1, 0), "dtype": torch.float64}
    times = []
    for _ in range(200):
        t0 = time.perf_counter()
        comm.check_agreement(group, "a timing call", fields)
        times.append(time.perf_counter() - t0)
    raw = []  # the bare gloo all-gather of the same 3 words, for comparison
    words, rows = torch.zeros(3, dtype=torch.int64), list(torch.zeros(world, 3, dtype=torch.int64).unbind(0))
    for _ in range(200):
        t0 = time.perf_counter()
        dist.all_gather(rows, words, group=_group())
        raw.append(time.perf_counter() - t0)
    times.sort()
    raw.sort()
    return measured, sch.collectives, err, times[len(times) // 2] * 1e6, raw[len(raw) // 2] * 1e6


def companion_group(rank, world):
    """The agreement on a gloo companion group (what a group without a CPU backend, e.g. NCCL,
    uses), over two CP groups of 2 ranks made concurrently: exact steps, then a disagreement
    raised on both ranks of one group, then an exact step again. Gloo only: a pure NCCL group
    takes the companion path anyway (see :func:`agreement_channel`)."""
    global GROUP
    comm._has_cpu_backend = lambda pg: False
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    GROUP = groups[rank // 2]
    r, w = rank % 2, 2
    case = dict(lengths=[[7, 25], [32]], S=32, Hq=2, Hkv=1, D=8)
    errs = [cp_step(r, w, case)]
    message = None
    try:
        cp_step(r, w, dict(case, causal=not (rank == 3)))
    except ValueError as e:
        message = str(e)
    errs.append(cp_step(r, w, case))
    made = comm._channels[GROUP.group_name][1].backend is not None
    return errs, message, made


def many_layouts(rank, world, steps, seed):
    """``steps`` context-parallel steps, each on a new random layout (the plans of all but the
    last 32 layouts are evicted): every step exact; the layout cache stays bounded."""
    rng = random.Random(seed)  # same on every rank
    S, worst = 24, 0.0
    for _ in range(steps):
        lengths, left = [], S
        while left:
            n = min(left, rng.randint(1, 10))
            lengths.append(n)
            left -= n
        causal = rng.random() < 0.5
        worst = max(worst, cp_step(rank, world, dict(lengths=[lengths], S=S, Hq=2, Hkv=1, D=4, causal=causal)))
    return worst, len(_doc_layout._layouts)


def agreement_channel(rank, world):
    """One step, then whether the group's agreement runs on a gloo companion (a group without a
    CPU backend, e.g. pure NCCL) and the group's backend config; with the step's error."""
    err = cp_step(rank, world, dict(lengths=[[7, 25]], S=32, Hq=2, Hkv=1, D=8))
    channel = comm._channels[_group().group_name][1]
    return err, channel.backend is not None, dist.get_backend_config(_group())


def nan_in_one_document(rank, world, case, poison):
    """A context-parallel step whose q is NaN at ``poison`` ``(b, s, h)`` (a position of one
    document). Returns this rank's (max error against the oracle over the tokens of every other
    document, whether all of those are finite, how many values of the poisoned document are not
    finite): out and dq by query token, lse by query token, dk and dv by key token."""
    pairs = _cp_pairs(rank, world, case, poison=poison)
    b, s, _ = poison
    cu = dp.cu_seqlens_from_lengths(case["lengths"], case["S"]) if case.get("cu") is None else case["cu"].cpu()
    bounds = cu[b].tolist()
    doc = next(d for d in range(len(bounds) - 1) if bounds[d] <= s < bounds[d + 1])
    poisoned = torch.zeros(cu.shape[0], case["S"], dtype=torch.bool)  # [B, S]: the poisoned document
    poisoned[b, bounds[doc] : bounds[doc + 1]] = True
    mine = _shard(poisoned, rank, world)  # [B, S_local]
    err, finite, hit = 0.0, True, 0
    for i, (got, want) in enumerate(pairs):
        # token masks broadcast to [B, S_local, H, D] (out, dq, dk, dv) or [B, H, S_local] (lse)
        m = mine[:, None, :] if i == 1 else mine[:, :, None, None]
        m = m.expand_as(got)
        clean_got, clean_want = got[~m], want[~m]
        finite = finite and bool(torch.isfinite(clean_got).all())
        if clean_got.numel():
            err = max(err, (clean_got - clean_want).abs().max().item())
        hit += int((~torch.isfinite(got[m])).sum())
    return err, finite, hit
