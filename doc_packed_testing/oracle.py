"""Independent float64 reference: dense masked attention, one row at a time.

Written from the definition in the README, sharing no code with the package: the mask is
built token by token from the document boundaries.

Variants (docs/contract.md, "Variants"), from their definitions:

- ``prefix_lens [B, N]``: query ``p`` also sees key ``p2`` of its document when both lie in the
  document's first ``prefix_lens[b, d]`` tokens (the mask is the causal/window mask OR that block).
- ``softcap``: every scaled logit ``s`` becomes ``softcap * tanh(s / softcap)`` before masking.
- ``sinks [Hq]``: one extra logit per head in each row's softmax denominator, with no value; the
  returned lse includes it (FA4's convention), a row that sees no key has ``lse = sink``, out 0.
- max logits ``[Hq]``: the largest visible (post-softcap) logit over every query of every row;
  sinks are not logits of a key and do not count; ``-inf`` for a head no query of which sees a key.
"""

from __future__ import annotations

import random

import torch


def dense_mask(
    bounds: list[int], seq_len: int, causal: bool, window: tuple[int, int], prefix: list[int] | None = None
) -> torch.Tensor:
    """[S, S] bool: mask[p, p2] is True when query p may see key p2."""
    doc = torch.empty(seq_len, dtype=torch.long)
    pos = torch.empty(seq_len, dtype=torch.long)
    plen = torch.zeros(seq_len, dtype=torch.long)
    for d in range(len(bounds) - 1):
        a, e = bounds[d], bounds[d + 1]
        doc[a:e] = d
        pos[a:e] = torch.arange(e - a)
        if prefix is not None:
            plen[a:e] = prefix[d]
    i, j = pos[:, None], pos[None, :]
    same = doc[:, None] == doc[None, :]
    m = same.clone()
    left, right = window
    if left >= 0:
        m &= j >= i - left
    if causal:
        m &= j <= i
    elif right >= 0:
        m &= j <= i + right
    if prefix is not None:
        m |= same & (i < plen[:, None]) & (j < plen[:, None])
    return m


def reference(
    q,
    k,
    v,
    cu_seqlens,
    causal=True,
    window=(-1, -1),
    scale=None,
    *,
    sinks=None,
    softcap=None,
    prefix_lens=None,
    max_logits=False,
):
    """(out [B, S, Hq, Dv] float64, lse [B, Hq, S] float64), differentiable in q, k, v and sinks;
    with ``max_logits=True`` also the ``[Hq]`` max logits (no gradient)."""
    B, S, Hq, D = q.shape
    G = Hq // k.shape[2]
    scale = D**-0.5 if scale is None else scale
    q, k, v = q.double(), k.double(), v.double()
    outs, lses, maxes = [], [], []
    for b in range(B):
        prefix = None if prefix_lens is None else [int(x) for x in prefix_lens[b].tolist()]
        mask = dense_mask([int(x) for x in cu_seqlens[b].tolist()], S, causal, window, prefix)
        kb = k[b].repeat_interleave(G, dim=1)  # [S, Hq, D]
        vb = v[b].repeat_interleave(G, dim=1)
        s = torch.einsum("qhd,khd->hqk", q[b], kb) * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        s = s.masked_fill(~mask, float("-inf"))
        maxes.append(s.detach().amax(dim=(1, 2)))
        if sinks is None:
            lse = torch.logsumexp(s, dim=-1)  # [Hq, S]
        else:
            sink = sinks.double()[:, None, None].expand(Hq, S, 1)
            lse = torch.logsumexp(torch.cat([s, sink], dim=-1), dim=-1)
        p = torch.exp(s - lse[..., None])
        outs.append(torch.einsum("hqk,khd->qhd", p, vb))
        lses.append(lse)
    result = (torch.stack(outs), torch.stack(lses))
    if max_logits:
        return (*result, torch.stack(maxes).amax(0))
    return result


def random_lengths(rng: random.Random, seq_len: int, *, zero_docs: bool = True) -> list[int]:
    """A random split of ``seq_len`` into documents, with zero-length and 1-token ones."""
    out, left = [], seq_len
    while left > 0:
        kind = rng.random()
        if kind < 0.15:
            n = 1
        elif kind < 0.3 and zero_docs:
            n = 0
        else:
            n = rng.randint(1, max(1, seq_len // 2))
        n = min(n, left)
        out.append(n)
        left -= n
    return out
