"""Context parallelism waits for a transfer only where stage B needs its data: stage A's kernels
are issued between starting the exchange (K/V and moved queries, one AllToAll-V) and waiting for it."""

import torch

import doc_packed as dp
from doc_packed import kernels
from doc_packed.cp import attention, comm


def _events(monkeypatch, rank: int, size: int, S: int, lengths):
    log: list[str] = []
    pending = set()

    def landed(fields):
        rows = lambda f: max((a + n for runs in f.recv for a, n in runs), default=0)  # noqa: E731
        return [torch.randn((rows(f), *f.rows.shape[1:]), dtype=torch.float64).to(f.rows.dtype) if f.into is None else f.into for f in fields]

    def start(fields, group):
        ex = comm.Exchange(received=landed(fields))
        pending.add(id(ex))
        log.append("start")
        return ex

    def wait(ex):
        log.append("wait" if id(ex) in pending else "wait?")
        return ex.received

    def blocking(fields, group):
        log.append("exchange")
        return landed(fields)

    real_fwd, real_bwd = kernels.forward, kernels.backward

    def fwd(spec, *a, **k):
        log.append("kernel")
        return real_fwd(spec, *a, **k)

    def bwd(spec, *a, **k):
        log.append("kernel")
        return real_bwd(spec, *a, **k)

    monkeypatch.setattr(comm, "group_info", lambda name: (rank, size))
    monkeypatch.setattr(comm, "check_agreement", lambda *a, **k: None)
    monkeypatch.setattr(comm, "start_exchange", start)
    monkeypatch.setattr(comm, "wait_exchange", wait)
    monkeypatch.setattr(comm, "exchange", blocking)
    monkeypatch.setattr(attention.kernels, "forward", fwd)
    monkeypatch.setattr(attention.kernels, "backward", bwd)
    cu = dp.cu_seqlens_from_lengths([lengths], S)
    L = S // size
    q = torch.randn(1, L, 2, 8, dtype=torch.float64)
    k = torch.randn(1, L, 1, 8, dtype=torch.float64)
    flags = (cu, S, True, -1, 0, 0.3, "math", f"overlap-test-{size}")
    out, lse = torch.ops.doc_packed.attn_fwd(q, k, k, *flags)
    fwd_log = list(log)
    log.clear()
    torch.ops.doc_packed.attn_bwd(torch.randn_like(out), q, k, k, out, lse, *flags)
    return fwd_log, list(log)


def test_stage_a_runs_between_start_and_wait(monkeypatch):
    # one document over 2 ranks: rank 1 needs rank 0's keys; the planner moves queries too
    fwd_log, bwd_log = _events(monkeypatch, 1, 2, 64, [64])
    for log in (fwd_log, bwd_log):
        first_wait = log.index("wait")
        assert "start" in log[:first_wait]
        assert log[log.index("start") : first_wait].count("kernel") >= 1, log  # stage A in flight
        assert "kernel" in log[first_wait:], log  # stage B after the data landed
        assert "wait?" not in log
        # one exchange out, started before stage A; the only blocking one (home) after stage B
        assert log.count("start") == 1 and log.count("wait") == 1, log
        assert log.count("exchange") == 1 and log.index("exchange") > len(log) - 1 - log[::-1].index("kernel"), log
