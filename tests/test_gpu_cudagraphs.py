"""CUDA tests of ``doc_packed_attn`` inside a CUDA-graphed compile (skipped without a GPU).

``torch.compile(mode="reduce-overhead")`` records a graph's kernels once and replays them. Our
ops do host work per call that a replay would skip (the layout read from ``cu_seqlens``, the
kernel's per-layout offsets, a context-parallel call's agreement and exchange), so a replay with
new ``cu_seqlens`` values would silently run the recorded layout. The ops carry
``torch.Tag.cudagraph_unsafe``: Inductor runs them outside the recorded graphs (graph
partitions) or does not record the graph. Checked here: a compiled function fed a new layout
at every call, recorded and replayed, gives the eager answers (out and gradients), against
the float64 oracle's tolerances of tests/test_gpu.py, and the op receives the caller's
``cu_seqlens`` (found by identity, read back once), not a graph's copy of it.

Run: ``pytest -q -m gpu tests/test_gpu_cudagraphs.py``.
"""

import pytest
import torch

import doc_packed as dp
from doc_packed import _doc_layout
from doc_packed_testing.gpu_parity import rel

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

S, HQ, HKV, D = 512, 4, 2, 64
LAYOUTS = [[[512]], [[100, 412]], [[7, 200, 305]], [[256, 256]], [[1, 1, 510]], [[300, 212]]]


def _cu(lengths) -> torch.Tensor:
    return dp.cu_seqlens_from_lengths(lengths, S, max_docs=8).cuda()


def _inputs(seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, S, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, S, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(1, S, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    return q, k, v


def _layer(x, w, cu):
    """A projection around the attention, so the graph has recordable kernels on both sides."""
    q, k, v = x @ w[0], (x[..., :HKV, :] @ w[1]), (x[..., :HKV, :] @ w[2])
    return dp.doc_packed_attn(q, k, v, cu, causal=True) @ w[3]


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune-no-cudagraphs"])
def test_compiled_with_new_layout_each_call_matches_eager(mode):
    """Eight calls, each with other ``cu_seqlens`` values (warm-up, recording and replays of a
    CUDA-graphed compile): out and every gradient as the eager call's."""
    torch._dynamo.reset()
    x = torch.randn(1, S, HQ, D, device="cuda", dtype=torch.bfloat16)
    w = [torch.randn(D, D, device="cuda", dtype=torch.bfloat16) * D**-0.5 for _ in range(4)]
    compiled = torch.compile(_layer, mode=mode, fullgraph=True)
    for i in range(8):
        cu = _cu(LAYOUTS[i % len(LAYOUTS)])
        reads = _doc_layout.device_reads()
        xs = x.detach().clone().requires_grad_()
        ws = [t.detach().clone().requires_grad_() for t in w]
        got = compiled(xs, ws, cu)
        dout = torch.randn_like(got)
        got.backward(dout)
        got_grads = [xs.grad, *(t.grad for t in ws)]
        xr = x.detach().clone().requires_grad_()
        wr = [t.detach().clone().requires_grad_() for t in w]
        ref = _layer(xr, wr, cu)
        ref.backward(dout)
        assert rel(got.float(), ref.float()) <= 1e-2, (i, LAYOUTS[i % len(LAYOUTS)])
        # the compiled call read the new tensor once; its backward and the eager call found it by
        # identity: the calls between the recorded graphs get the caller's cu_seqlens, not a copy
        assert _doc_layout.device_reads() - reads == 1, i
        for j, (g, r) in enumerate(zip(got_grads, [xr.grad, *(t.grad for t in wr)])):
            assert rel(g.float(), r.float()) <= 2e-2, (i, j)


def test_recorded_partitions_hold_nccl_collectives():
    """A functional all-reduce (NCCL, one rank) on each side of the attention in a CUDA-graphed
    compile: recorded and replayed with the op between partitions, new layouts each call, the
    eager answer (the collectives a placed module's graphs hold are recorded the same way)."""
    import torch.distributed as dist
    from torch.distributed import _functional_collectives as funcol

    if not dist.is_nccl_available():
        pytest.skip("no NCCL")
    made = not dist.is_initialized()
    if made:
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        group = dist.group.WORLD

        def f(x, w, cu):
            y = funcol.all_reduce(x @ w, "sum", group)
            q, k, v = y, y[..., :HKV, :], y[..., :HKV, :]
            return funcol.all_reduce(dp.doc_packed_attn(q, k, v, cu, causal=True), "sum", group)

        torch._dynamo.reset()
        compiled = torch.compile(f, mode="reduce-overhead", fullgraph=True)
        x = torch.randn(1, S, HQ, D, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(D, D, device="cuda", dtype=torch.bfloat16) * D**-0.5
        for i in range(6):
            cu = _cu(LAYOUTS[i % len(LAYOUTS)])
            got, ref = compiled(x, w, cu), f(x, w, cu)
            assert rel(got.float(), ref.float()) <= 1e-2, i
    finally:
        if made:
            dist.destroy_process_group()
