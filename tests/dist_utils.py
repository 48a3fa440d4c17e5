"""Run a function on real gloo (or NCCL) ranks (spawned processes) and collect each rank's result.

Tests use it through the ``run_ranks`` fixture (conftest.py). How a run goes:

1. The parent spawns ``world_size`` processes. Each connects to a TCPStore that rank 0 hosts
   and joins a gloo group, or with ``backend="nccl"`` an NCCL group, one GPU per rank (rank r
   on ``cuda:r``, NVLink multicast off: ``NCCL_NVLS_ENABLE=0``); :data:`DEVICE` is then the
   rank's GPU. Startup (spawn, imports, rendezvous) may take ``STARTUP_TIMEOUT``.
2. Once every rank has joined, the group has ``timeout`` seconds. Collectives on the default
   group give up after ``timeout / 2``, so a rank stuck in one (a peer never came) raises with
   its own traceback. After a rank fails the others get ``GRACE`` seconds (they usually fail
   at once, in their next collective). Ranks still running at the deadline are named as hung,
   their Python stacks dumped (faulthandler, on SIGUSR1) and they are killed. Collectives on
   mesh sub-groups keep torch's default timeout (30 min): the deadline catches those. On NCCL
   a timed-out collective makes torch's watchdog abort the rank (reported as SIGABRT, with
   its stacks).
3. Each rank writes its result, meets the others at a barrier (no rank tears gloo down while
   a peer still talks to it), destroys its groups, collects garbage and exits normally.
4. If any rank raised, hung, died of a signal or exited without a result, the parent raises
   :class:`RanksFailed` with each such rank's traceback (what it raised) or Python stacks
   (faulthandler's, for a hang or a fatal signal).

The rank function must be importable (module level): spawn pickles it by name.
"""

from __future__ import annotations

import faulthandler
import gc
import multiprocessing.connection
import os
import pickle
import signal
import socket
import tempfile
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEFAULT_TIMEOUT = 300.0  # seconds a group may run once formed
STARTUP_TIMEOUT = 120.0  # spawn, imports, rendezvous: 5-20 s for 2-4 ranks on a busy 2-core machine
GRACE = 10.0  # seconds the other ranks get after one failed
STACK_WAIT = 2.0  # seconds a rank gets to write its stacks after SIGUSR1, before it is killed
BACKENDS = ("gloo", "nccl")

# In a rank: the device its collectives take tensors on (cpu on gloo, cuda:<rank> on NCCL).
DEVICE = torch.device("cpu")


class RanksFailed(RuntimeError):
    """Some ranks failed. ``reports[rank]``: how, with its traceback or stacks. ``hung``: the
    ranks killed while still running. ``elapsed``: seconds from the group's forming to the
    parent's giving up (None if it never formed)."""

    def __init__(self, header: str, reports: dict[int, str], hung: list[int], elapsed: float | None):
        self.reports, self.hung, self.elapsed = reports, hung, elapsed
        super().__init__("\n\n".join([header] + [f"rank {r} {text}" for r, text in sorted(reports.items())]))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _path(workdir: str, rank: int, what: str) -> str:
    """A rank's files: ``up`` (it joined the group), ``result`` (its pickled return value),
    ``done`` (it destroyed its groups), ``error`` (the traceback of what it raised), ``stack``
    (what faulthandler wrote)."""
    return os.path.join(workdir, f"rank{rank}.{what}")


def _write(path: str, data: bytes) -> None:
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.replace(path + ".tmp", path)  # the parent never reads half a file


def _read(path: str) -> str | None:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return None


def _entry(rank, world_size, port, workdir, timeout, backend, payload):
    global DEVICE
    torch.set_num_threads(1)
    # Every thread's Python stack on a fatal signal (segfault, abort), and on SIGUSR1, which
    # the parent sends to a rank it is about to kill as hung. faulthandler needs the file open
    # for the life of the process.
    stack_file = open(_path(workdir, rank, "stack"), "w")
    faulthandler.enable(stack_file, all_threads=True)
    faulthandler.register(signal.SIGUSR1, stack_file, all_threads=True)
    try:
        init = {}
        if backend == "nccl":
            os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast stays off (read at NCCL init)
            DEVICE = torch.device("cuda", rank)
            torch.cuda.set_device(DEVICE)
            init["device_id"] = DEVICE  # binds the group to this GPU (barrier, eager NCCL init)
        # The store waits for every rank as long as startup may take; the group's own timeout,
        # which bounds each collective, can then be short.
        store = dist.TCPStore(
            "127.0.0.1", port, world_size, is_master=rank == 0, timeout=timedelta(seconds=STARTUP_TIMEOUT)
        )
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout / 2), **init
        )
        try:
            _write(_path(workdir, rank, "up"), b"")
            fn, args = pickle.loads(payload)  # here, so an unimportable fn is reported like any error
            result = fn(rank, world_size, *args)
            _write(_path(workdir, rank, "result"), pickle.dumps(result))
            dist.barrier()  # no rank tears gloo down while a peer still talks to it
        finally:
            dist.destroy_process_group()  # every group, the mesh sub-groups too
            del store
    except BaseException:
        _write(_path(workdir, rank, "error"), traceback.format_exc().encode())
        raise
    # A gloo ProcessGroup that outlives destroy_process_group (held by a reference cycle, say
    # a compiled graph's guards) is freed here, its worker threads joined, while the interpreter
    # is whole; freed during interpreter teardown instead, it can abort the process
    # ("terminate called without an active exception", pytorch/pytorch#65513). This harness
    # used to skip teardown with os._exit(0) for that; on torch 2.13 the abort did not recur in
    # ~170 groups without it. Should a rank die after this point, the parent says so.
    gc.collect()
    _write(_path(workdir, rank, "done"), b"")


def run_ranks(
    fn,
    world_size: int,
    *args,
    timeout: float = DEFAULT_TIMEOUT,
    workdir: str | None = None,
    backend: str = "gloo",
):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return their results (a
    list, by rank). Raise :class:`RanksFailed` if any rank failed, hung or exited abnormally.

    ``timeout``: seconds the ranks may run once they have all joined the group (see the module
    docstring). ``workdir``: where the ranks write their files (a temporary directory if None).
    ``backend``: the default group's, ``"gloo"`` (CPU) or ``"nccl"`` (one GPU per rank: needs
    ``world_size`` GPUs; ``fn`` finds its GPU in :data:`DEVICE`).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise ValueError(f"backend='nccl' needs one GPU per rank: {world_size} ranks, {torch.cuda.device_count()} GPUs")
    if workdir is None:
        with tempfile.TemporaryDirectory(prefix="ranks-") as tmp:
            return _run(fn, world_size, args, timeout, tmp, backend, keeps_files=False)
    os.makedirs(workdir, exist_ok=True)
    return _run(fn, world_size, args, timeout, workdir, backend, keeps_files=True)


def _run(fn, world_size, args, timeout, workdir, backend, keeps_files):
    payload = pickle.dumps((fn, args))
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [
        ctx.Process(target=_entry, args=(r, world_size, port, workdir, timeout, backend, payload), name=f"rank{r}")
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    try:
        hung, why, formed_at = _wait(procs, workdir, timeout)
    finally:
        for p in procs:  # whatever happened, no rank outlives the call
            if p.is_alive():
                p.kill()
            p.join()
    elapsed = None if formed_at is None else time.monotonic() - formed_at
    reports = {r: _report(r, p.exitcode, workdir, why if r in hung else None) for r, p in enumerate(procs)}
    reports = {r: text for r, text in reports.items() if text is not None}
    if reports:
        header = (
            f"{fn.__module__}.{fn.__qualname__} on {world_size} {backend} ranks (timeout {timeout:g} s): "
            f"{len(reports)} rank(s) failed" + (f"; rank files in {workdir}" if keeps_files else "")
        )
        raise RanksFailed(header, reports, sorted(hung), elapsed)
    results = []
    for r in range(world_size):
        with open(_path(workdir, r, "result"), "rb") as f:
            results.append(pickle.load(f))
    return results


def _wait(procs, workdir, timeout):
    """Wait for the ranks to exit or a deadline to pass; kill those still running then.
    Return (the ranks killed, why, when the group formed or None)."""
    deadline = time.monotonic() + STARTUP_TIMEOUT
    why = f"had not joined the group {STARTUP_TIMEOUT:g} s after spawning"
    formed_at = failed = None
    while True:
        now = time.monotonic()
        alive = [p for p in procs if p.exitcode is None]
        if not alive:
            return set(), None, formed_at
        if formed_at is None and all(os.path.exists(_path(workdir, r, "up")) for r in range(len(procs))):
            formed_at, deadline = now, now + timeout
            why = f"still running at the group's deadline ({timeout:g} s after it formed)"
        if failed is None:
            failed = next((r for r, p in enumerate(procs) if p.exitcode not in (None, 0)), None)
            if failed is not None and now + GRACE < deadline:
                deadline, why = now + GRACE, f"still running {GRACE:g} s after rank {failed} failed"
        if now >= deadline:
            break
        multiprocessing.connection.wait([p.sentinel for p in alive], timeout=min(0.2, deadline - now))
    running = [r for r, p in enumerate(procs) if p.exitcode is None]
    for r in running:
        os.kill(procs[r].pid, signal.SIGUSR1)  # faulthandler writes its stacks
    time.sleep(STACK_WAIT)
    hung = {r for r in running if procs[r].exitcode is None}  # not those that just finished
    for r in hung:
        procs[r].kill()
    return hung, why, formed_at


def _report(rank: int, exitcode: int, workdir: str, hung_why: str | None) -> str | None:
    """What went wrong on ``rank``, or None if nothing did."""
    error = _read(_path(workdir, rank, "error"))
    stacks = _read(_path(workdir, rank, "stack")) or "(none written)\n"
    if hung_why is not None:
        raised = "" if error is None else f" It had raised:\n{error}"
        return f"hung: {hung_why}; killed.{raised}\nIts Python stacks:\n{stacks}"
    if error is not None:
        return f"raised:\n{error}"
    if exitcode != 0:
        how = f"signal {signal.Signals(-exitcode).name}" if exitcode < 0 else f"exit code {exitcode}"
        if os.path.exists(_path(workdir, rank, "done")):
            when = "after its result and the group's teardown, at interpreter exit"
        elif os.path.exists(_path(workdir, rank, "result")):
            when = "after writing its result, before its groups were destroyed"
        else:
            when = "before writing its result"
        return f"died ({how}) {when}. Its Python stacks:\n{stacks}"
    if not os.path.exists(_path(workdir, rank, "result")):
        return "exited without a result"
    return None
