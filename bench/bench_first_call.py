"""Host time of FA4 calls on a layout's first call against later calls, one GPU.

A context-parallel step meets new kernel problems (specs) every layout: each one's first
forward and backward runs FA4's Python and is recorded; later layers replay the recording
(doc_packed/kernels/fa4_launch.py). On Hopper a first call is instead adopted from other
layouts' recordings (doc_packed/kernels/fa4_forms.py). Each problem's offsets are on the
device before its first call, as a context-parallel schedule queues them with its indices.
This times, per call on the host (no synchronisation inside the timed call; the device drained
between calls), over ``--layouts`` new context-parallel-shaped problems, alternating: first
calls recorded (``DOC_PACKED_FA4_ADOPT=0``), adopted, and made ahead by ``kernels.fa4.prepare``
(what ``doc_packed.cp.prepare`` does before a step; the prepare itself untimed), against a later call replayed (the
anchor), forward and backward. Usage: ``python -m bench.bench_first_call [--layouts 40]
[--tq 8192]``.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import torch

from bench._harness import device_name
from doc_packed.kernels import fa4, fa4_launch
from doc_packed.kernels.spec import VarlenSpec

HQ, HKV, D = 16, 4, 128


def _spec(rng: random.Random, T_q: int) -> VarlenSpec:
    n = rng.randrange(1, 64)
    T_k = rng.randrange(T_q // 2, 2 * T_q)
    cut = lambda T: sorted(rng.randrange(0, T + 1) for _ in range(n - 1))  # noqa: E731
    return VarlenSpec([0, *cut(T_q), T_q], [0, *cut(T_k), T_k], True, -1, 0)


def _host_us(fn) -> tuple[float, object]:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    result = fn()
    us = (time.perf_counter() - t0) * 1e6
    torch.cuda.synchronize()
    return us, result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", type=int, default=40)
    ap.add_argument("--tq", type=int, default=8192)
    args = ap.parse_args(argv)
    rng, scale = random.Random(0), D**-0.5
    mk = lambda T, h: torch.randn(T, h, D, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    times: dict[str, list[float]] = {}
    for i in range(args.layouts + 6):  # the first six: compiles and the kinds' agreement
        spec = _spec(rng, args.tq)
        q, k, v = mk(args.tq, HQ), mk(spec.total_k, HKV), mk(spec.total_k, HKV)
        spec.cu_tensors(q.device)  # queued ahead, as a schedule's offsets are
        # alternate on like layouts: first calls recorded, adopted, and made ahead by prepare (untimed,
        # as doc_packed.cp.prepare makes them before the step)
        how = ("recorded", "adopted", "prepared")[i % 3]
        os.environ["DOC_PACKED_FA4_ADOPT"] = "0" if how == "recorded" else "1"
        if how == "prepared":
            fa4.prepare(spec, q.device)
        first, (out, lse) = _host_us(lambda: fa4.forward(spec, q, k, v, scale))
        later, _ = _host_us(lambda: fa4.forward(spec, q, k, v, scale))
        dout = torch.randn_like(out)
        bwd_first, _ = _host_us(lambda: fa4.backward(spec, dout, q, k, v, out, lse, scale))
        bwd_later, _ = _host_us(lambda: fa4.backward(spec, dout, q, k, v, out, lse, scale))
        if i < 6:
            continue
        rows = {
            f"forward, first ({how})": first,
            "forward, later (replayed)": later,
            f"backward, first ({how})": bwd_first,
            "backward, later (replayed)": bwd_later,
        }
        for name, us in rows.items():
            times.setdefault(name, []).append(us)
    os.environ.pop("DOC_PACKED_FA4_ADOPT", None)
    anchor = {"forward": statistics.median(times["forward, later (replayed)"])}
    anchor["backward"] = statistics.median(times["backward, later (replayed)"])
    print(f"# FA4 host time per call, {device_name()}, torch {torch.__version__}, FA4 {fa4._release()}")
    print(f"# T_q {args.tq}, Hq/Hkv {HQ}/{HKV}, D {D}, causal, 1-63 pieces; {args.layouts} new layouts")
    print("| call | n | median us | p90 us | / later call of its pass |")
    print("|---|---|---|---|---|")
    for name, us in times.items():
        us = sorted(us)
        med = statistics.median(us)
        print(
            f"| {name} | {len(us)} | {med:.0f} | {us[int(0.9 * (len(us) - 1))]:.0f} | {med / anchor[name.split(',')[0]]:.2f} |"
        )
    print("counts:", fa4_launch.counts())


if __name__ == "__main__":
    main()
