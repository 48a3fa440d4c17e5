"""Collective rates per group of a multi-GPU host, beside the step model's rates.

The step model (:mod:`shardings.step_model`) prices every collective of a host at one rate per
kind (``shardings/h200_rates.json``, measured on a 2 x H200 host at 256 MB). A host whose GPUs
are not all linked alike (pairs on NVLink, PCIe or fewer links between them) moves bytes at a
rate that depends on *which* ranks talk: a mesh dimension's groups can be several times slower
than another's. This script measures, on every 2-rank pair of the host alone, on each mesh
dimension's groups running at once (as a training step runs them) and on the whole world:
``all_to_all_single``, ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` at several
sizes, as the step model counts them (bytes each rank receives / time), and prints each beside
the model's rate (the anchor) with their ratio.

Usage: ``python -m bench.measure_collectives --gpus 4 [--mesh 2 2] [--sizes-mb 8 32 128]``.
``--dry-run``: gloo ranks on the CPU, tiny sizes (the figures mean nothing).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics

import torch
import torch.distributed as dist

from bench._harness import add_dry_run, init_process_group, spawn_ranks, timed_ms
from shardings.step_model import Rates

KINDS = ("all_to_all", "all_gather", "reduce_scatter")


def _groups(world: int, mesh: tuple[int, ...]) -> list[tuple[str, list[list[int]]]]:
    """(label, groups run at once): each pair alone, each mesh dim's groups together, the world."""
    out: list[tuple[str, list[list[int]]]] = [
        (f"pair {a}-{b}", [[a, b]]) for a, b in itertools.combinations(range(world), 2)
    ]
    ranks = torch.arange(world).reshape(mesh)
    for d in range(len(mesh)):
        if mesh[d] > 1 and len(mesh) > 1:
            groups = ranks.movedim(d, -1).reshape(-1, mesh[d]).tolist()
            out.append((f"mesh dim {d}: " + " ".join("{" + ",".join(map(str, g)) + "}" for g in groups), groups))
    out.append((f"world of {world}", [list(range(world))]))
    return out


def _one(kind: str, nbytes: int, group: dist.ProcessGroup, n: int, device: torch.device, iters: int) -> float:
    """Microseconds of one ``kind`` among ``n`` ranks in which each rank receives ``nbytes``
    from its peers (bf16 buffers)."""
    chunk = max(1, nbytes // 2 // (n - 1))  # elements each peer sends a rank
    full = torch.empty(chunk * n, dtype=torch.bfloat16, device=device)
    part = torch.empty(chunk, dtype=torch.bfloat16, device=device)
    if kind == "all_to_all":  # a rank's buffer: one chunk per rank
        other = torch.empty_like(full)
        fn = lambda: dist.all_to_all_single(other, full, group=group)  # noqa: E731
    elif kind == "all_gather":
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # (torch 2.13 renamed it)
        fn = lambda: gather(full, part, group=group)  # noqa: E731
    else:  # reduce_scatter: all_gather's bytes, reduced
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        fn = lambda: scatter(part, full, group=group)  # noqa: E731
    return 1e3 * timed_ms(fn, iters=iters, warmup=3, device=device)  # the collective syncs its group


def _rank(rank: int, world: int, port: int, mesh: tuple[int, ...], sizes_mb: list[float], iters: int, dry: bool):
    device = torch.device("cpu") if dry else torch.device("cuda", rank)
    if not dry:
        torch.cuda.set_device(device)
    init_process_group(rank, world, port, "gloo" if dry else "nccl")
    rows = []
    for label, groups in _groups(world, mesh):
        made = [dist.new_group(g) for g in groups]  # every rank makes every group, in one order
        mine = next((pg for g, pg in zip(groups, made) if rank in g), None)
        n = len(groups[0])
        for kind, mb in itertools.product(KINDS, sizes_mb):
            nbytes = int(mb * 2**20)
            us = _one(kind, nbytes, mine, n, device, iters) if mine is not None else float("nan")
            rows.append({"group": label, "kind": kind, "mb": mb, "us": us})
        dist.barrier()
    dist.destroy_process_group()
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--mesh", type=int, nargs="+", default=None, help="mesh shape (default: 2 x gpus/2)")
    ap.add_argument("--sizes-mb", type=float, nargs="+", default=[8, 32, 128])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", default=None, help="also write the rows here")
    add_dry_run(ap)
    args = ap.parse_args(argv)
    if args.dry_run:
        args.gpus, args.sizes_mb, args.iters = 4, [0.01], 2
    world = args.gpus
    if world < 2:
        raise SystemExit(f"needs 2 or more GPUs, got {world}")
    mesh = tuple(args.mesh) if args.mesh else ((2, world // 2) if world >= 4 and world % 2 == 0 else (world,))
    if torch.Size(mesh).numel() != world:
        raise SystemExit(f"--mesh {mesh} does not hold {world} ranks")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    per_rank = spawn_ranks(_rank, world, mesh, args.sizes_mb, args.iters, args.dry_run)
    rates = Rates.load()
    print(
        f"{world} ranks, mesh {mesh}, {'gloo CPU (dry run)' if args.dry_run else torch.cuda.get_device_name()}, torch {torch.__version__}"
    )
    print("GB/s = bytes each rank receives / time (the step model's measure); the slowest rank of a group counts")
    print("| group | kind | MB received | us | GB/s | model GB/s | measured / model |")
    print("|---|---|---|---|---|---|---|")
    out = []
    for i, row in enumerate(per_rank[0]):
        us = max(r[i]["us"] for r in per_rank if r[i]["us"] == r[i]["us"])  # the slowest member
        gbps = row["mb"] * 2**20 / (us * 1e3)
        model = rates.coll(f"{row['kind']}_gbps")
        out.append({**row, "us": us, "gbps": gbps, "model_gbps": model})
        print(
            f"| {row['group']} | {row['kind']} | {row['mb']:g} | {us:.0f} | {gbps:.3g} | {model:.0f} | {gbps / model:.3g} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    print(
        "median measured / model over all rows:", f"{statistics.median(r['gbps'] / r['model_gbps'] for r in out):.2f}"
    )


if __name__ == "__main__":
    main()
