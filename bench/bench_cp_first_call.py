"""Host time of a step's first context-parallel call: a new layout against a layout seen before.

The runtime splits its calls into each pass's first call on a layout and the later layers'
(``doc_packed.cp.runtime_counts``), and training measured the first ones 1.1-1.3x slower on the
host (bench_e2e). This asks whether that is the new layout or the first call of a step. One GPU,
one rank of a CP group emulated at a time (``bench.bench_cp_emulate``'s stand-ins: collectives as
copies of the same bytes, the agreement skipped), ``--layers`` attention layers forward and
backward through the op, every step's layout handed to ``doc_packed.cp.prepare`` while the step
before runs (as a data loader does), the device drained after each step (no launch-queue
back-pressure in these timings). Two runs of ``--steps`` steps each, in turn (``--rounds``):

- ``new``: a new layout every step (what training pays);
- ``reused``: one layout every step, so each pass's first call of a step finds its layout known
  (the anchor: everything a step's first call costs except the new layout);
- ``fa4``: the same steps through FA4's own entry points (``_flash_attn_fwd`` / ``_flash_attn_bwd``
  in an autograd function, a new layout of this rank's chunk every step, no context parallelism;
  on CPU, the dry run, the package's math kernel stands in): how much slower the first call of a
  step is when none of our code runs in it.

Per call: host wall and thread-CPU microseconds, medians. The ratio that answers the question is
the first call of a step with a new layout over the first call with the layout reused; a later
layer's call is printed beside both. ``--profile``: the new-layout steps once more under cProfile,
per call, and the functions whose own time differs most between first and later calls.
Usage: ``python -m bench.bench_cp_first_call [--sizes 2x32768,1x131072] [--cp 2] [--steps 20]``.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import dataclasses
import gc
import os
import pstats
import random
import statistics
import time

import torch

import doc_packed as dp
from bench import bench_cp_emulate as emu
from bench._harness import add_dry_run, device_name, sync, wrapped_cp_passes
from doc_packed import cp
from doc_packed.cp import attention

HQ, HKV, D = 16, 4, 128
SCALE = D**-0.5
PASSES = ("forward", "backward")


@dataclasses.dataclass
class _Call:
    run: str  # "new" or "reused"
    pass_: str
    position: int  # 0: the pass's first call in its step
    wall_us: float
    cpu_us: float


class _Timed:
    """``doc_packed.cp.attention.forward`` / ``backward`` timed call by call while active (the op
    looks them up at each call); with ``profile`` on, each call's cProfile is kept by whether it
    was the runtime's first call of its pass on the layout."""

    def __init__(self):
        self.calls: list[_Call] = []
        self.run, self.profile = "", False
        self.position: collections.Counter = collections.Counter()
        self.own_us: dict[str, collections.Counter] = {"first": collections.Counter(), "later": collections.Counter()}
        self.profiled: collections.Counter = collections.Counter()

    def __enter__(self):
        self._wrapped = wrapped_cp_passes(self._wrap)
        self._wrapped.__enter__()
        return self

    def __exit__(self, *exc):
        self._wrapped.__exit__(*exc)

    def timed(self, name: str, fn, *args):
        """``fn(*args)`` timed as the next call of pass ``name``."""
        c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
        result = fn(*args)
        wall, cpu = time.perf_counter_ns() - t0, time.thread_time_ns() - c0
        self.calls.append(_Call(self.run, name, self.position[name], wall / 1e3, cpu / 1e3))
        self.position[name] += 1
        return result

    def _wrap(self, name, fn):
        def call(*args):
            if not self.profile:
                return self.timed(name, fn, *args)
            firsts = attention.call_host_times()["first"][0]
            prof = cProfile.Profile()
            prof.enable()
            result = fn(*args)
            prof.disable()
            kind = "first" if attention.call_host_times()["first"][0] > firsts else "later"
            self.profiled[(name, kind)] += 1
            for (path, line, func), (_, _, own, _, _) in pstats.Stats(prof).stats.items():  # type: ignore[attr-defined]
                self.own_us[kind][(name, f"{os.path.basename(path)}:{line}:{func}")] += own * 1e6
            self.position[name] += 1
            return result

        return call


def _anchor_passes(device: torch.device):
    """(forward, backward) of the anchor on a flat chunk with offsets ``cu`` (device int32) and
    longest segment ``T``: FA4's own entry points on CUDA; the package's math kernel on CPU."""
    if device.type == "cuda":
        from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd

        def keywords(cu, T):
            return dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=T, max_seqlen_k=T, softmax_scale=SCALE,
                        causal=True, window_size_left=None, window_size_right=None)  # fmt: skip

        def fwd(q, k, v, cu, T):
            return _flash_attn_fwd(q, k, v, return_lse=True, **keywords(cu, T))[:2]

        def bwd(dout, q, k, v, out, lse, cu, T):
            return _flash_attn_bwd(q, k, v, out, dout, lse, **keywords(cu, T))[:3]

        return fwd, bwd
    from doc_packed import kernels

    spec = lambda cu: kernels.VarlenSpec(cu.tolist(), cu.tolist(), True, -1, 0)  # noqa: E731
    fwd = lambda q, k, v, cu, T: kernels.forward(spec(cu), q, k, v, SCALE, "auto")  # noqa: E731
    bwd = lambda dout, q, k, v, out, lse, cu, T: kernels.backward(spec(cu), dout, q, k, v, out, lse, SCALE, "auto")  # noqa: E731
    return fwd, bwd


class _Anchor(torch.autograd.Function):
    """One anchor layer: its forward and backward calls timed as the CP op's are (the backward
    on autograd's thread, as the op's)."""

    @staticmethod
    def forward(ctx, q, k, v, cu, T, passes, timed):
        out, lse = timed.timed("forward", passes[0], q, k, v, cu, T)
        ctx.save_for_backward(q, k, v, out, lse, cu)
        ctx.T, ctx.passes, ctx.timed = T, passes, timed
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu = ctx.saved_tensors
        dq, dk, dv = ctx.timed.timed("backward", ctx.passes[1], dout.contiguous(), q, k, v, out, lse, cu, ctx.T)
        return dq, dk, dv, None, None, None, None


def _steps(
    timed: _Timed, run: str, n: int, B: int, S: int, c: int, layers: int, layouts, device, dtype, collect: bool = False
) -> None:
    """``n`` steps of ``layers`` attention layers on this emulated rank's chunk, each step's
    layout prepared while the step before runs; ``layouts()`` gives the next layout. ``collect``:
    one ``gc.collect(1)`` after each step (the automatic collector off, as torchtitan runs it).
    Run ``fa4``: the anchor's layers instead, on the chunk's own documents (rows joined)."""
    timed.run = run
    anchor = _anchor_passes(device) if run == "fa4" else None
    rng = random.Random(n)

    def next_layout():
        if anchor is None:
            return cp.prepare(layouts(), emu.GROUP, num_heads=(HQ, HKV), device=device)
        T, cu = S // c, [0]
        for _ in range(B):  # each row of the chunk: new lognormal documents, the rows joined
            for x in dp.data.lognormal_lengths(T, min(2048, T // 4), rng):
                cu.append(cu[-1] + x)
        return torch.tensor(cu, dtype=torch.int32).to(device, non_blocking=True)

    flat = lambda t: t.view(B * (S // c), *t.shape[2:])  # noqa: E731  (the anchor's rows joined)
    ready = next_layout()
    for _ in range(n):
        timed.position.clear()
        x = torch.randn(B, S // c, HQ, D, device=device, dtype=dtype, requires_grad=True)
        k, v = (torch.randn(B, S // c, HKV, D, device=device, dtype=dtype) for _ in range(2))
        h = x
        for _ in range(layers):
            if anchor is None:
                h, _ = torch.ops.doc_packed.attn_fwd(h, k, v, ready, S, True, -1, 0, SCALE, "auto", emu.GROUP)
            else:
                h = _Anchor.apply(flat(h), flat(k), flat(v), ready, S // c, anchor, timed).view(B, S // c, HQ, D)
        ready = next_layout()  # the next step's
        h.float().sum().backward()
        sync(device)
        if collect:
            gc.collect(1)


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def measure(B: int, S: int, c: int, rank: int, args, device, dtype) -> tuple[list[dict], list[str]]:
    """Rows of the table for one size and rank, and the profile's lines (``--profile``)."""
    emu._install(emu._CopyComm(rank, c))
    rng = random.Random(hash((B, S, rank)) & 0xFFFF)
    mean_doc = min(2048, S // 4)

    def new():
        lengths = [dp.data.lognormal_lengths(S, mean_doc, rng) for _ in range(B)]
        return dp.cu_seqlens_from_lengths(lengths, S, max_docs=S // 8)

    fixed = new()
    dims = (B, S, c, args.layers)
    manual = args.gc == "manual"
    with _Timed() as timed:
        _steps(timed, "warm-up", args.warmup, *dims, new, device, dtype)
        _steps(timed, "fa4", args.warmup, *dims, new, device, dtype)  # the anchor's kernels built
        timed.calls.clear()
        if manual:
            gc.collect()
            gc.freeze()  # what warm-up left is not scanned again
            gc.disable()
        try:
            for _ in range(args.rounds):
                _steps(timed, "new", args.steps, *dims, new, device, dtype, manual)
                _steps(timed, "reused", args.steps, *dims, lambda: fixed, device, dtype, manual)
                _steps(timed, "fa4", args.steps, *dims, new, device, dtype, manual)
            lines = []
            if args.profile:
                timed.profile = True
                _steps(timed, "new", args.steps, *dims, new, device, dtype, manual)
                lines = _profile_lines(timed, f"{B} x {S}, rank {rank} of {c}")
        finally:
            if manual:
                gc.enable()
                gc.unfreeze()
    rows = []
    for pass_ in PASSES:
        pick = lambda run, first: [  # noqa: E731
            x for x in timed.calls if x.run == run and x.pass_ == pass_ and (x.position == 0) == first
        ]
        row = {"size": f"{B} x {S}", "rank": rank, "pass": pass_}
        for run in ("new", "reused", "fa4"):
            for first in (True, False):
                calls = pick(run, first)
                tag = f"{run} {'first' if first else 'later'}"
                row[f"{tag} wall_us"] = _median([x.wall_us for x in calls])
                row[f"{tag} cpu_us"] = _median([x.cpu_us for x in calls])
        rows.append(row)
    return rows, lines


def _profile_lines(timed: _Timed, label: str, top: int = 12) -> list[str]:
    diffs = []
    for key in set(timed.own_us["first"]) | set(timed.own_us["later"]):
        a = timed.own_us["first"][key] / max(1, timed.profiled[(key[0], "first")])
        b = timed.own_us["later"][key] / max(1, timed.profiled[(key[0], "later")])
        diffs.append((a - b, key, a, b))
    diffs.sort(key=lambda d: -d[0])
    lines = [f"cProfile, {label}: own us per call, a layout's first call - later calls (largest {top})"]
    lines += [f"  {k[0]:8s} {d:+7.1f}  ({a:7.1f} / {b:7.1f})  {k[1]}" for d, k, a, b in diffs[:top]]
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="2x32768,1x131072", help="B x S per run, comma-separated")
    ap.add_argument("--cp", type=int, default=2, help="the emulated group's size (every rank is timed)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20, help="steps per run and round")
    ap.add_argument("--warmup", type=int, default=6, help="steps before timing (kernels built, caches filled)")
    ap.add_argument("--rounds", type=int, default=2, help="new and reused runs, in turn, this many times")
    ap.add_argument("--profile", action="store_true", help="cProfile the new-layout steps once more")
    ap.add_argument(
        "--gc",
        choices=("auto", "manual"),
        default="auto",
        help="auto: Python's collector as it is; manual: after warm-up everything frozen, the automatic "
        "collector off and one gc.collect(1) after each step (torchtitan's way)",
    )
    add_dry_run(ap, "one row of 1024 tokens at CP 2 on CPU (float32), two steps per run: checks the script runs")
    args = ap.parse_args(argv)
    device, dtype = torch.device("cuda"), torch.bfloat16
    sizes = [tuple(int(x) for x in s.split("x")) for s in args.sizes.split(",")]
    if args.dry_run:
        global HQ, HKV, D
        HQ, HKV, D = 4, 2, 16
        device, dtype, sizes = torch.device("cpu"), torch.float32, [(1, 1024)]
        args.steps, args.warmup, args.rounds, args.layers = 2, 1, 1, 2
    emu.ARGS = argparse.Namespace(**{**vars(emu.ARGS), "overlap": device.type == "cuda"})
    rows, lines = [], []
    for B, S in sizes:
        for rank in range(args.cp):
            got, profile = measure(B, S, args.cp, rank, args, device, dtype)
            rows += got
            lines += profile
    emu._install(None)
    anchor = "FA4's _flash_attn_fwd / _flash_attn_bwd" if device.type == "cuda" else "the math kernel (CPU stand-in)"
    print(
        f"# {device_name(device)}, torch {torch.__version__}; anchor: {anchor}; CP {args.cp} emulated, Hq/Hkv {HQ}/{HKV}, D {D}, "
        f"{args.layers} layers, {args.steps} steps x {args.rounds} rounds per run, garbage collector {args.gc}; "
        "medians, host us per call"
    )
    print(
        "| B x S | rank | pass | first call, new layout: wall (CPU) | first call, layout reused: wall (CPU) "
        "| later layers, new: wall | later layers, reused: wall | new / reused, first calls | first / later, new "
        "| first / later, reused | anchor: first, later: wall | anchor: first / later | first - later: new, anchor |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        nf, rf, nl, rl, af, al = (
            r[f"{k} wall_us"] for k in ("new first", "reused first", "new later", "reused later", "fa4 first", "fa4 later")
        )
        print(
            f"| {r['size']} | {r['rank']} | {r['pass']} | {nf:.0f} ({r['new first cpu_us']:.0f}) "
            f"| {rf:.0f} ({r['reused first cpu_us']:.0f}) | {nl:.0f} | {rl:.0f} | {nf / rf:.2f} | {nf / nl:.2f} "
            f"| {rf / rl:.2f} | {af:.0f}, {al:.0f} | {af / al:.2f} | {nf - nl:+.0f}, {af - al:+.0f} |"
        )
    for line in lines:
        print(line)


if __name__ == "__main__":
    main()
