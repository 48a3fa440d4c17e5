"""Time two versions of the packer against each other, alternately (CPU only).

The machine is shared and its load changes by the second, so wall time and single runs lie.
This loads each given version as its own module: a copy of the ``doc_packed/data`` package (a
folder), or ``doc_packed/packing.py`` of a commit before the package (one file). For every cell
of ``bench_packing``'s timing grid (1M tokens of documents: 8 rows of 128k or one row of 1M, CP
2/8/64/1024) it runs ``pack_order`` once per version in turn, ``--reps`` times, on one thread,
and prints the least process CPU time of each version; "(rows differ)" where the versions' rows
are not the same.

Usage (the version before a change from git, this one from the tree):
    mkdir -p /tmp/before && git archive <commit> doc_packed/data | tar -x -C /tmp/before
    python -m bench.bench_packing_ab /tmp/before/doc_packed/data doc_packed/data
    python -m bench.bench_packing_ab A B --cells powerlaw:8x128k:64 lognormal-512:8x128k:16
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

import torch

from bench._harness import add_dry_run
from bench.cp_model import make_layout

DISTS = ["lognormal-512", "lognormal-2k", "lognormal-8k", "powerlaw", "long+short"]
CPS = [2, 8, 64, 1024]


def _load(path: str, k: int):
    """A version as a module of ``doc_packed`` (its relative imports resolve against the installed
    package): a folder as the package ``doc_packed._data_ab<k>``, a file as one module."""
    name = f"doc_packed._packing_ab{k}"
    if os.path.isdir(path):
        name = f"doc_packed._data_ab{k}"
        init = os.path.join(path, "__init__.py")
        spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[path])
    else:
        spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"cannot load {path}")
    mod = importlib.util.module_from_spec(spec)
    mod.__package__ = name if os.path.isdir(path) else "doc_packed"
    sys.modules[name] = mod  # a package's own modules import it by name
    spec.loader.exec_module(mod)
    return mod


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("versions", nargs="*", help="doc_packed/data folders or packing.py files, timed in turn")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--cells", nargs="*", help="dist:8x128k|1x1M:cp (default: the whole grid)")
    add_dry_run(p, "this tree's doc_packed/data against itself, one cell (8 x 128k, CP 2), one rep")
    args = p.parse_args(argv)
    if args.dry_run:
        here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "doc_packed", "data")
        args.versions, args.reps, args.cells = args.versions or [here, here], 1, [f"{DISTS[0]}:8x128k:2"]
    if not args.versions:
        p.error("give the versions to time (doc_packed/data folders or packing.py files)")
    torch.set_num_threads(1)
    mods = [_load(path, k) for k, path in enumerate(args.versions)]
    if args.cells:
        cells = [tuple(c.split(":")) for c in args.cells]
    else:
        cells = [(d, g, str(c)) for d in DISTS for g in ("8x128k", "1x1M") for c in CPS]
    print(f"# least process CPU ms of {args.reps}, alternately; load {os.getloadavg()[0]:.2f}")
    for dist, grid, cp in cells:
        S, B = (1 << 17, 8) if grid == "8x128k" else (1 << 20, 1)
        layout = make_layout(dist, 1 << 20, B, 2026)
        lengths = [e - s for row in layout.rows for s, e in row]
        times: list[list[float]] = [[] for _ in mods]
        outs = []
        for rep in range(args.reps):
            for k, mod in enumerate(mods):
                t0 = time.process_time()
                out = mod.pack_order(lengths, S, cp_size=int(cp))
                times[k].append(time.process_time() - t0)
                if rep == 0:
                    outs.append(out)
        same = all(o == outs[0] for o in outs)
        ms = " -> ".join(f"{min(t) * 1e3:6.1f}" for t in times)
        print(f"{dist:14s} {grid:7s} cp {cp:>5s}: {ms}{'' if same else '  (rows differ)'}", flush=True)
    print(f"# load {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
