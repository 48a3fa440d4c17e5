"""What every benchmark shares: one timer (:func:`timed_ms`), one way to start ranks
(:func:`spawn_ranks`, :func:`init_process_group`) and the dry-run flag (:func:`add_dry_run`)."""

from __future__ import annotations

import argparse
import contextlib
import queue as queues
import socket
import statistics
import time
import traceback
from datetime import timedelta
from collections.abc import Iterator
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DRY_RUN_HELP = "tiny sizes on CPU: checks that the script runs (tests/test_bench.py); the figures mean nothing"


def add_dry_run(parser: argparse.ArgumentParser, help: str = DRY_RUN_HELP) -> None:
    """``--dry-run`` on ``parser`` (each script says what its dry run shrinks)."""
    parser.add_argument("--dry-run", action="store_true", help=help)


def sync(device: torch.device | str | None = None) -> None:
    """Wait for ``device`` (default: the current CUDA device, where there is one); CPU: nothing."""
    kind = torch.device(device).type if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cuda":
        torch.cuda.synchronize()


def device_name(device: torch.device | str | None = None) -> str:
    """The GPU's name, or ``"CPU"`` (dry runs)."""
    kind = torch.device(device).type if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    return torch.cuda.get_device_name() if kind == "cuda" else "CPU"


def timed_ms(
    fn: Callable[[], Any],
    *,
    iters: int = 10,
    warmup: int = 3,
    calls: int = 1,
    clock: str = "device",
    sync_each: bool = True,
    setup: Callable[[], Any] | None = None,
    stat: str = "median",
    barrier: bool = False,
    device: torch.device | str | None = None,
) -> float:
    """Milliseconds per call of ``fn``: ``iters`` measurements of ``calls`` calls in a row, after
    ``warmup`` calls; the ``stat`` ("median", "mean" or "min") of the measurements, per call.

    ``clock``: "device", the GPU's time between two CUDA events (on CPU: wall time); "wall",
    wall time with the device synchronised at both ends; "host", wall time until the calls
    return (the device synchronised before the start only): the host's cost.
    ``sync_each=False`` (device clock): nothing waits between measurements, so the host runs
    ahead as in training (events are read at the end). ``setup()`` runs before each measurement,
    untimed. ``barrier``: every rank of the default process group starts and ends together.
    """
    if clock not in ("device", "wall", "host") or stat not in ("median", "mean", "min"):
        raise ValueError(f"clock {clock!r} / stat {stat!r}: clock is device, wall or host; stat median, mean or min")
    on_gpu = (torch.device(device).type if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda"
    group = barrier and dist.is_initialized()
    for _ in range(warmup):
        fn()
    sync(device if on_gpu else "cpu")
    events, times = [], []
    for _ in range(iters):
        if setup is not None:
            setup()
        if clock != "device" or not on_gpu or sync_each:
            sync(device if on_gpu else "cpu")
        if group:
            dist.barrier()
        if clock == "device" and on_gpu:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(calls):
                fn()
            b.record()
            events.append((a, b))
            if sync_each:
                torch.cuda.synchronize()
            continue
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        if clock != "host":
            sync(device if on_gpu else "cpu")
        if group:
            dist.barrier()
        times.append((time.perf_counter() - t0) * 1e3)
    if events:
        torch.cuda.synchronize()
        times = [a.elapsed_time(b) for a, b in events]
    reduce = {"median": statistics.median, "mean": statistics.fmean, "min": min}[stat]
    return reduce(times) / calls


@contextlib.contextmanager
def wrapped_cp_passes(wrap: Callable[[str, Callable[..., Any]], Callable[..., Any]]) -> Iterator[None]:
    """Inside the block, ``doc_packed.cp.attention.forward`` and ``backward`` are
    ``wrap(name, original)`` (the op looks them up at each call); restored on exit."""
    from doc_packed.cp import attention

    saved = {name: getattr(attention, name) for name in ("forward", "backward")}
    for name, fn in saved.items():
        setattr(attention, name, wrap(name, fn))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(attention, name, fn)


def free_port() -> int:
    """A TCP port free on this host now (for the ranks' store)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_process_group(rank: int, world: int, port: int, backend: str = "gloo", timeout_s: float = 120) -> None:
    """Join the ranks of :func:`spawn_ranks` (rank 0 hosts the store on ``port``)."""
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=timedelta(seconds=timeout_s))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))


def _rank_entry(fn, rank, world, port, args, queue) -> None:
    try:
        queue.put((rank, True, fn(rank, world, port, *args)))
    except BaseException as e:  # noqa: BLE001 - sent to the parent, which raises it
        queue.put((rank, False, f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}"))
        raise


def spawn_ranks(fn: Callable[..., Any], world: int, *args: Any, port: int | None = None) -> list[Any]:
    """Run ``fn(rank, world, port, *args)`` in ``world`` fresh processes (``spawn``: ``fn`` must be
    importable, at module level) and return what each rank returned, by rank. ``port``: free
    for the ranks' store (:func:`init_process_group`). A rank that raises fails the whole run
    with its traceback; one that dies without a word (a crash, a kill) fails it by exit code."""
    ctx = mp.get_context("spawn")
    port = free_port() if port is None else port
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank_entry, args=(fn, r, world, port, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        while len(results) < world:
            try:
                rank, ok, value = queue.get(timeout=1.0)
            except queues.Empty:  # see whether a rank died silently
                dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
                if dead:
                    raise RuntimeError(f"rank(s) exited without a result: {dead}") from None
                continue
            if not ok:
                raise RuntimeError(value)
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]
