"""A compiled training step that sees a new packing every step (new document count, new
max_seqlen) compiles once: counted with dynamo's own counter of graphs it compiled.

The rows API takes ``cu_seqlens [B, MAX_DOCS + 1]`` (a fixed shape; unused slots repeat S). The
packed entries take ``[N + 1]``: padded to a fixed N with zero-length documents, or marked
dynamic, one graph serves every layout; left alone, dynamo's automatic dynamic shapes compile a
second graph at the first new count and none after (docs/coming_from.md, "torch.compile")."""

import pytest
import torch
from torch._dynamo.utils import counters

import doc_packed as dp
from doc_packed import compat
from doc_packed.compat import cute

T, MAX_DOCS = 64, 16
LAYOUTS = [[64], [10, 54], [5, 20, 39], [1, 1, 1, 61], [30, 30, 4], [4] * 16, [33, 31]]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _cu(lengths, pad_to=None):
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    if pad_to is not None:  # zero-length documents at the end: the tail repeats T
        cu = torch.cat([cu, cu[-1:].expand(pad_to + 1 - cu.shape[0])])
    return cu


def _qkv(seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, 4, 8, generator=g, requires_grad=True)
    k, v = (torch.randn(T, 2, 8, generator=g, requires_grad=True) for _ in range(2))
    return q, k, v


def _train(step, make_cu):
    """Run ``step`` compiled over every layout (forward and backward), check each step against
    the eager call, and return how many graphs dynamo compiled."""
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    for i, lengths in enumerate(LAYOUTS):
        q, k, v = _qkv(i)
        cu = make_cu(lengths)
        loss = compiled(q, k, v, cu, max(lengths))
        grads = torch.autograd.grad(loss, (q, k, v))
        want = step(q, k, v, cu, max(lengths))
        torch.testing.assert_close(loss, want)
        for a, b in zip(grads, torch.autograd.grad(want, (q, k, v))):
            torch.testing.assert_close(a, b)
    return counters["stats"]["unique_graphs"]


def _varlen(q, k, v, cu, max_seqlen):
    return dp.doc_packed_attn_varlen(q, k, v, cu, max_seqlen, causal=True).square().sum()


def test_varlen_padded_cu_seqlens_compiles_once():
    assert _train(_varlen, lambda n: _cu(n, pad_to=MAX_DOCS)) == 1


def test_varlen_dynamic_cu_seqlens_compiles_once():
    def make(lengths):
        cu = _cu(lengths)
        torch._dynamo.mark_dynamic(cu, 0)
        return cu

    assert _train(_varlen, make) == 1


def test_varlen_unpadded_compiles_at_most_twice():
    """Nothing done: the first new document count recompiles once with a dynamic size (dynamo's
    automatic dynamic shapes); max_seqlen never causes one (it is not read under compile)."""
    assert _train(_varlen, _cu) <= 2


def test_rows_entry_compiles_once():
    def step(q, k, v, cu, _max):
        return dp.doc_packed_attn(q[None], k[None], v[None], cu, causal=False, window_size=(6, 2)).square().sum()

    assert _train(step, lambda n: _cu(n, pad_to=MAX_DOCS)[None]) == 1


def test_compat_flash_compiles_once():
    def step(q, k, v, cu, m):
        return compat.flash_attn_varlen_func(q, k, v, cu, cu, m, m, causal=True).square().sum()

    assert _train(step, lambda n: _cu(n, pad_to=MAX_DOCS)) == 1


def test_compat_fa4_compiles_once():
    def step(q, k, v, cu, m):
        out, lse = cute.flash_attn_varlen_func(q, k, v, None, cu, cu, m, m, causal=True, return_lse=True)
        return out.square().sum() + lse.sum()

    assert _train(step, lambda n: _cu(n, pad_to=MAX_DOCS)) == 1


def test_compat_torch_compiles_once_and_checks_boundaries_in_the_graph():
    def step(q, k, v, cu, m):
        return compat.varlen_attn(q, k, v, cu, cu.clone(), m, m, window_size=(-1, 0)).square().sum()

    assert _train(step, lambda n: _cu(n, pad_to=MAX_DOCS)) == 1

    def mismatched(q, k, v, cu, m):
        return compat.varlen_attn(q, k, v, cu, cu.flip(0), m, m).sum()

    with pytest.raises(RuntimeError, match="cu_seq_q and cu_seq_k differ"):
        torch.compile(mismatched, fullgraph=True, backend="aot_eager")(*_qkv(0), _cu([30, 34]), 34)
