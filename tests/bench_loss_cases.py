"""Rank functions for test_bench_loss.py (spawned ranks import them by name)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from bench.bench_e2e import vocab_parallel_token_loss


def vocab_parallel_case(rank: int, world: int, vocab: int) -> tuple[float, float]:
    """Each rank holds its Shard(2) chunk of the same logits; returns (max loss error, max
    gradient error) against float64 cross entropy of the full logits."""
    g = torch.Generator().manual_seed(0)
    full = (3 * torch.randn(2, 5, vocab, generator=g, dtype=torch.float64)).float()
    targets = torch.randint(0, vocab, (2, 5), generator=g)
    weights = torch.rand(2, 5, generator=g, dtype=torch.float64)
    ref_in = full.double().requires_grad_()
    ref = torch.nn.functional.cross_entropy(ref_in.flatten(0, 1), targets.flatten(), reduction="none")
    (ref * weights.flatten()).sum().backward()
    chunk = -(-vocab // world)
    local = full[..., rank * chunk : (rank + 1) * chunk].clone().requires_grad_()
    got = vocab_parallel_token_loss(local, targets, rank * chunk, dist.group.WORLD)
    (got * weights).sum().backward()
    loss_err = (got.double() - ref.view(2, 5)).abs().max().item()
    grad_err = (local.grad.double() - ref_in.grad[..., rank * chunk : (rank + 1) * chunk]).abs().max().item()
    return loss_err, grad_err
