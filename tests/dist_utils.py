"""Spawn real gloo process groups from pytest and collect each rank's result."""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world_size, port, outdir, fn, args):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    try:
        result = fn(rank, world_size, *args)
        with open(os.path.join(outdir, f"{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
        dist.barrier()  # no rank tears gloo down while a peer still talks to it
    except BaseException:
        with open(os.path.join(outdir, f"{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()
    # Skip interpreter teardown: gloo's worker threads can abort a clean process at exit
    # ("terminate called without an active exception", seen on torch 2.11 and 2.13) after
    # every result has been written and every rank has passed the barrier.
    os._exit(0)


def run_ranks(fn, world_size: int, *args):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return their results.

    ``fn`` must be importable (module level). A failure on any rank raises with its traceback.
    """
    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.get_context("spawn")
        port = _free_port()
        procs = [
            ctx.Process(target=_entry, args=(r, world_size, port, outdir, fn, args))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=240)
        errors = []
        for r, p in enumerate(procs):
            if p.is_alive():
                p.kill()
                errors.append(f"rank {r} timed out (hang?)")
            err = os.path.join(outdir, f"{r}.err")
            if os.path.exists(err):
                errors.append(f"rank {r}:\n" + open(err).read())
            elif p.exitcode != 0 and not p.is_alive():
                errors.append(f"rank {r} exited with {p.exitcode}")
        if errors:
            raise RuntimeError("\n".join(errors))
        results = []
        for r in range(world_size):
            with open(os.path.join(outdir, f"{r}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results
