"""Independent float64 reference: dense masked attention, one row at a time.

Written from the definition in the README, sharing no code with the package: the mask is
built token by token from the document boundaries.
"""

from __future__ import annotations

import torch


def dense_mask(bounds: list[int], seq_len: int, causal: bool, window: tuple[int, int]) -> torch.Tensor:
    """[S, S] bool: mask[p, p2] is True when query p may see key p2."""
    doc = torch.empty(seq_len, dtype=torch.long)
    pos = torch.empty(seq_len, dtype=torch.long)
    for d in range(len(bounds) - 1):
        a, e = bounds[d], bounds[d + 1]
        doc[a:e] = d
        pos[a:e] = torch.arange(e - a)
    i, j = pos[:, None], pos[None, :]
    m = doc[:, None] == doc[None, :]
    left, right = window
    if left >= 0:
        m &= j >= i - left
    if causal:
        m &= j <= i
    elif right >= 0:
        m &= j <= i + right
    return m


def reference(q, k, v, cu_seqlens, causal=True, window=(-1, -1), scale=None):
    """(out [B, S, Hq, D] float64, lse [B, Hq, S] float64), differentiable in q, k, v."""
    B, S, Hq, D = q.shape
    G = Hq // k.shape[2]
    scale = D ** -0.5 if scale is None else scale
    q, k, v = q.double(), k.double(), v.double()
    outs, lses = [], []
    for b in range(B):
        mask = dense_mask([int(x) for x in cu_seqlens[b].tolist()], S, causal, window)
        kb = k[b].repeat_interleave(G, dim=1)  # [S, Hq, D]
        vb = v[b].repeat_interleave(G, dim=1)
        s = torch.einsum("qhd,khd->hqk", q[b], kb) * scale
        s = s.masked_fill(~mask, float("-inf"))
        lse = torch.logsumexp(s, dim=-1)  # [Hq, S]
        p = torch.exp(s - lse[..., None])
        outs.append(torch.einsum("hqk,khd->qhd", p, vb))
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)
