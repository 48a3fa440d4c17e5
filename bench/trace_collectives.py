"""Split each collective's device time into waiting for peers and moving bytes, from every rank's trace.

An NCCL kernel starts when its rank reaches the collective and ends when the transfer among its
group is done, so its device time includes the wait for the slowest peer. ``bench_e2e --profile
DIR --trace-steps K`` writes one Chrome trace per rank of the same step; ranks of one host share
the clock the traces are stamped with. Every rank runs the same collectives in the same order
(SPMD), so the i-th NCCL kernel of each rank is the same call; the members of a call's group end
together, so the ranks whose i-th kernel ends within ``--together-us`` of each other are a group.
For each call: ``wait`` = the latest member's start - this rank's start, ``moving`` = the end -
the latest member's start (the transfer once everyone is there). Printed per kernel kind and rank,
beside the kernel's whole device time (the anchor: what the profiler's table reports).

Usage: ``python -m bench.trace_collectives DIR/trace_<mode>_<threads>threads_step<K>_rank*.json``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import tempfile

from bench._harness import add_dry_run


def _nccl_kernels(path: str) -> list[tuple[str, float, float]]:
    """(kind, start us, end us) of the trace's NCCL kernels, in start order."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    out = []
    for e in events:
        if e.get("cat") == "kernel" and e.get("name", "").startswith("ncclDevKernel"):
            kind = re.sub(r"\(.*", "", e["name"]).removeprefix("ncclDevKernel_")
            out.append((kind, float(e["ts"]), float(e["ts"]) + float(e["dur"])))
    return sorted(out, key=lambda k: k[1])


def split(ranks: list[list[tuple[str, float, float]]], together_us: float) -> list[list[dict]]:
    """Per rank, per call: kind, device us, wait us, moving us (see the module doc)."""
    n = min(len(r) for r in ranks)
    rows: list[list[dict]] = [[] for _ in ranks]
    for i in range(n):
        calls = [r[i] for r in ranks]
        for me, (kind, start, end) in enumerate(calls):
            group = [c for c in calls if c[0] == kind and abs(c[2] - end) <= together_us]
            last = max(c[1] for c in group)
            rows[me].append({"kind": kind, "us": end - start, "wait": last - start, "moving": end - last})
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="*", help="one trace per rank of the same step, in rank order")
    ap.add_argument("--together-us", type=float, default=30.0, help="ends this close: one group")
    ap.add_argument("--top", type=int, default=8, help="also list the calls that waited longest")
    add_dry_run(ap, "two made-up ranks' traces (rank 1 reaches each call 100 us late)")
    args = ap.parse_args(argv)
    if args.dry_run:
        args.traces = _made_up(tempfile.mkdtemp())
    if not args.traces:
        ap.error("give one trace per rank")
    ranks = [_nccl_kernels(p) for p in args.traces]
    counts = [len(r) for r in ranks]
    print(
        f"NCCL kernels per rank: {counts}" + ("" if len(set(counts)) == 1 else " (unequal: matched up to the fewest)")
    )
    rows = split(ranks, args.together_us)
    print("| rank | kernel | calls | device us | waiting for peers us | moving us | moving / device |")
    print("|---|---|---|---|---|---|---|")
    for r, calls in enumerate(rows):
        by = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0])
        for c in calls:
            s = by[c["kind"]]
            s[0] += 1
            s[1] += c["us"]
            s[2] += c["wait"]
            s[3] += c["moving"]
        for kind, (n, us, wait, moving) in sorted(by.items(), key=lambda kv: -kv[1][1]):
            print(f"| {r} | {kind} | {n} | {us:.0f} | {wait:.0f} | {moving:.0f} | {moving / us if us else 0:.2f} |")
    worst = sorted(
        ((c["wait"], r, i, c["kind"]) for r, calls in enumerate(rows) for i, c in enumerate(calls)), reverse=True
    )
    print(
        "longest waits (us, rank, call index, kernel):",
        "; ".join(f"{w:.0f} r{r} #{i} {k}" for w, r, i, k in worst[: args.top]),
    )


def _made_up(folder: str) -> list[str]:
    """Two ranks' traces of three all-to-alls, rank 1 arriving 100 us after rank 0 each time."""
    paths = []
    for r in (0, 1):
        events = [{"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5}]
        for i in range(3):
            start = 1000 * i + 100 * r
            events.append(
                {"cat": "kernel", "name": "ncclDevKernel_SendRecv(x)", "ts": start, "dur": 1000 * i + 150 - start}
            )
        paths.append(os.path.join(folder, f"rank{r}.json"))
        with open(paths[-1], "w") as f:
            json.dump({"traceEvents": events}, f)
    return paths


if __name__ == "__main__":
    main()
