"""A small Llama-like transformer that calls :func:`doc_packed_attn`: the model of the demo,
the end-to-end tests and the benchmarks (not part of the library's API)."""

from __future__ import annotations


import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import nn

import doc_packed as dp


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, window: tuple[int, int] = (-1, -1)):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.window = window
        self.cp_group: dist.ProcessGroup | str | None = None  # a group: run on sequence shards
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        q = self.wq(x).view(B, S, self.n_heads, self.head_dim)
        k = self.wk(x).view(B, S, self.n_kv, self.head_dim)
        v = self.wv(x).view(B, S, self.n_kv, self.head_dim)
        o = dp.doc_packed_attn(q, k, v, cu_seqlens, window_size=self.window, cp_group=self.cp_group, causal=True)
        assert isinstance(o, torch.Tensor)  # return_lse=False
        return self.wo(o.reshape(B, S, -1))


class Block(nn.Module):
    """Attention and an MLP: ``silu(w1 x)`` of width ``4 * dim``, or with ``hidden`` Llama's
    SwiGLU ``w2(silu(w1 x) * w3 x)`` of that width."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, window=(-1, -1), hidden: int | None = None):
        super().__init__()
        self.attn = Attention(dim, n_heads, n_kv_heads, window)
        self.w1 = nn.Linear(dim, hidden or 4 * dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False) if hidden else None
        self.w2 = nn.Linear(hidden or 4 * dim, dim, bias=False)
        self.n1 = nn.RMSNorm(dim)
        self.n2 = nn.RMSNorm(dim)

    def forward(self, x, cu_seqlens):
        x = x + self.attn(self.n1(x), cu_seqlens)
        h = self.n2(x)
        gate = torch.nn.functional.silu(self.w1(h))
        return x + self.w2(gate if self.w3 is None else gate * self.w3(h))


# Llama-3-8B's shape (no RoPE): Transformer(**LLAMA_8B, n_layers=...)
LLAMA_8B = dict(vocab=128256, dim=4096, n_heads=32, n_kv_heads=8, hidden=14336)


class Transformer(nn.Module):
    """``checkpoint=True``: activation checkpointing, each block recomputed in the backward
    (``torch.utils.checkpoint``, non-reentrant: AutoParallel and ``torch.compile`` trace it)."""

    def __init__(
        self, vocab=256, dim=64, n_heads=4, n_kv_heads=2, n_layers=2, window=(-1, -1), hidden=None, checkpoint=False
    ):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([Block(dim, n_heads, n_kv_heads, window, hidden) for _ in range(n_layers)])
        self.norm = nn.RMSNorm(dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        self.checkpoint = checkpoint

    def forward(self, tokens: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for layer in self.layers:
            if self.checkpoint:
                x = torch.utils.checkpoint.checkpoint(layer, x, cu_seqlens, use_reentrant=False)
            else:
                x = layer(x, cu_seqlens)
        return self.out(self.norm(x))


def training_flops(model: nn.Module, cu_seqlens: torch.Tensor, seq_len: int) -> float:
    """Model FLOPs of one training step (forward + backward) of ``model`` on rows laid out by
    ``cu_seqlens``: ``6 * tokens * (weights of every Linear)`` plus, per attention layer, 3.5x
    the forward's ``4 * pairs * H_q * D`` (the flash convention used in docs/benchmarks.md), with
    ``pairs`` the exact (query, key) pairs of the layout. The MFU numerator of the benchmarks."""
    from doc_packed.flops import total_pairs

    tokens = cu_seqlens.shape[0] * seq_len
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    flops = 6.0 * tokens * linear
    for m in model.modules():
        if isinstance(m, Attention):
            left, right = m.window
            pairs = total_pairs(cu_seqlens.cpu(), seq_len, True, left, 0)
            flops += 3.5 * 4 * pairs * m.n_heads * m.head_dim
    return flops


def random_attention_problem(
    lengths: list[int], seq_len: int, heads: tuple[int, int], head_dim: int, dtype: torch.dtype, device, seed: int
) -> tuple[torch.Tensor, ...]:
    """``(q, k, v, dout, cu_seqlens)`` for one packed row of ``lengths``: the benchmarks' input
    (standard normal, ``heads = (H_q, H_kv)``, MAX_DOCS = len(lengths) + 8)."""
    g = torch.Generator(device=device).manual_seed(seed)
    Hq, Hkv = heads
    q = torch.randn(1, seq_len, Hq, head_dim, device=device, dtype=dtype, generator=g)
    k = torch.randn(1, seq_len, Hkv, head_dim, device=device, dtype=dtype, generator=g)
    v = torch.randn(1, seq_len, Hkv, head_dim, device=device, dtype=dtype, generator=g)
    dout = torch.randn(q.shape, device=device, dtype=dtype, generator=g)
    cu = dp.cu_seqlens_from_lengths([lengths], seq_len, max_docs=len(lengths) + 8).to(device)
    return q, k, v, dout, cu
