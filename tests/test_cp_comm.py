"""The context-parallel exchange (doc_packed.cp.comm) on gloo ranks: several fields in one
AllToAll-V, sent as runs of rows, each landing whole in its own buffer."""

import pytest
import torch
import torch.distributed as dist

from cp_cases import exchange_fields


def _check_landed(results):
    for got, want, split, want_split, empty in results:
        assert len(got) == len(want) == 4 and empty == []
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and g.shape == w.shape and g.is_contiguous()
            assert torch.equal(g, w)
        assert torch.equal(split[0], want_split)


@pytest.mark.parametrize("world", [2, 3])
def test_exchange_lands_every_field_from_every_peer(run_ranks, world):
    _check_landed(run_ranks(exchange_fields, world))


def _no_nccl_pair() -> str | None:
    if not dist.is_nccl_available():
        return "needs torch.distributed with NCCL"
    if torch.cuda.device_count() < 2:
        return f"needs 2 CUDA devices (one per NCCL rank), found {torch.cuda.device_count()}"
    return None


@pytest.mark.gpu
@pytest.mark.skipif(_no_nccl_pair() is not None, reason=_no_nccl_pair() or "")
@pytest.mark.parametrize("new_group", [False, True], ids=["default-group", "lazy-group"])
def test_exchange_on_nccl(run_ranks, new_group):
    """The same fields between 2 NCCL ranks on their GPUs, as one batch of point-to-point
    transfers: on the default group, and on a group no collective has created a communicator
    for (the exchange's one-time warm-up makes it)."""
    _check_landed(run_ranks(exchange_fields, 2, new_group, backend="nccl"))


def test_device_communicator_made_once_per_group(monkeypatch):
    """Before its first exchange on a group, a device rank makes the group's communicator with
    one collective that every rank joins (NCCL creates it lazily, and a batch of transfers that
    leaves a rank out would hang it); once per group and device type, again for a new group
    under the same name; never for CPU tensors."""
    from doc_packed.cp import comm

    calls = []
    monkeypatch.setattr(comm.dist, "all_reduce", lambda t, group: calls.append(("all_reduce", t.device.type, group)))
    monkeypatch.setattr(comm.dist, "get_world_size", lambda group: 3)

    def all_to_all_single(out, inp, group):  # one element to and from every rank: every pair connects
        assert out.numel() == inp.numel() == 3
        calls.append(("all_to_all", inp.device.type, group))

    monkeypatch.setattr(comm.dist, "all_to_all_single", all_to_all_single)
    monkeypatch.setattr(comm, "_warm", {})
    pg_a, pg_b = object(), object()
    meta = torch.device("meta")  # a non-CPU device on a CPU-only machine
    comm._ensure_communicator("g", pg_a, torch.device("cpu"))
    assert calls == []
    comm._ensure_communicator("g", pg_a, meta)
    comm._ensure_communicator("g", pg_a, meta)
    made_a = [("all_reduce", "meta", pg_a), ("all_to_all", "meta", pg_a)]
    assert calls == made_a
    comm._ensure_communicator("g", pg_b, meta)  # the name now resolves to another group
    assert calls == made_a + [("all_reduce", "meta", pg_b), ("all_to_all", "meta", pg_b)]


def test_batch_goes_straight_to_a_coalescing_backend_in_order(monkeypatch):
    """On a backend that batches point-to-point ops itself (NCCL) the exchange's ops go to the
    group between its start and end of coalescing, in the batch's order, to the peers' group
    ranks, and the one coalesced work is what the caller waits on (the NCCL path itself runs in
    ``test_exchange_on_nccl``)."""
    from doc_packed import _compat

    log: list = []

    class Group:
        def _start_coalescing(self, device):
            log.append(("start", device.type))

        def send(self, tensors, peer, tag):
            log.append(("send", tensors[0], peer, tag))

        def recv(self, tensors, peer, tag):
            log.append(("recv", tensors[0], peer, tag))

        def _end_coalescing(self, device):
            log.append(("end", device.type))
            return "work"

    pg, meta = Group(), torch.device("meta")
    monkeypatch.setitem(_compat._coalesces, (pg, "meta"), True)
    a, b, c = torch.empty(2, device=meta), torch.empty(3, device=meta), torch.empty(1, device=meta)
    works = _compat.post_point_to_point(pg, meta, [(True, a, 1, 0), (False, b, 1, 0), (True, c, 2, 1)])  # type: ignore[arg-type]
    assert works == ["work"]
    assert log == [("start", "meta"), ("send", a, 1, 0), ("recv", b, 1, 0), ("send", c, 2, 1), ("end", "meta")]
