"""The ``math`` backend: exact attention in plain torch, tiled so memory stays bounded (the CPU path).

Queries are processed in blocks of ``BLOCK_Q`` packed rows; each block visits only the key
range its rows can see, in tiles of at most ``BLOCK_K`` keys, with an online softmax (the
flash-attention recurrence) accumulated in float32 (float64 for float64 inputs). No ``[S, S]``
matrix is ever formed: the largest temporary is ``[H_q, BLOCK_Q, BLOCK_K]``. Tiles that every
row of the block sees in full skip the mask. The block plan is computed on the host once per
:class:`VarlenSpec` and reused by every layer; it runs on any device, and on CUDA it serves
dtypes and head sizes the flash kernel does not take.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .spec import VarlenSpec, lse_dtype

BLOCK_Q = 128
BLOCK_K = 512


class _Block:
    __slots__ = ("t0", "t1", "tiles")

    def __init__(self, t0: int, t1: int, tiles: list[tuple[int, int, bool]]):
        self.t0, self.t1, self.tiles = t0, t1, tiles


def _plan_blocks(spec: VarlenSpec) -> list[_Block]:
    lo, hi = spec.key_bounds()
    blocks = []
    for t0 in range(0, spec.total_q, BLOCK_Q):
        t1 = min(t0 + BLOCK_Q, spec.total_q)
        blo, bhi = lo[t0:t1], hi[t0:t1]
        live = bhi >= blo
        if not bool(live.any()):
            blocks.append(_Block(t0, t1, []))
            continue
        klo = int(blo[live].min())
        khi = int(bhi[live].max()) + 1
        # a tile needs no mask when every row of the block sees all of it
        all_live = bool(live.all())
        max_lo, min_hi = int(blo.max()), int(bhi.min())
        tiles = []
        for k0 in range(klo, khi, BLOCK_K):
            k1 = min(k0 + BLOCK_K, khi)
            tiles.append((k0, k1, not (all_live and max_lo <= k0 and min_hi >= k1 - 1)))
        blocks.append(_Block(t0, t1, tiles))
    return blocks


def _heads_first(x: Tensor, hkv: int, dtype: torch.dtype) -> Tensor:
    """``[n, Hq, D]`` -> ``[Hkv, G * n, D]`` so one bmm serves a whole GQA group."""
    n, hq, d = x.shape
    return x.to(dtype).view(n, hkv, hq // hkv, d).permute(1, 2, 0, 3).reshape(hkv, -1, d)


def _heads_last(x: Tensor, n: int) -> Tensor:
    """Inverse of :func:`_heads_first`: ``[Hkv, G * n, D]`` -> ``[n, Hq, D]``."""
    hkv, gn, d = x.shape
    return x.view(hkv, gn // n, n, d).permute(2, 0, 1, 3).reshape(n, -1, d)


def _row_stats(x: Tensor, hkv: int) -> Tensor:
    """``[Hq, n]`` -> ``[Hkv, G * n]`` (head-major, same order as :func:`_heads_first`)."""
    return x.reshape(hkv, -1)


def _masked_scores(qb, kb, scale, bounds, tile, n):
    k0, k1, needs_mask = tile
    s = torch.bmm(qb, kb.transpose(1, 2)).mul_(scale)
    if needs_mask:
        lo, hi = bounds
        kidx = torch.arange(k0, k1, device=qb.device)
        hidden = (kidx < lo[:, None]) | (kidx > hi[:, None])  # [n, k1 - k0]
        hkv, gn, bk = s.shape
        s = s.view(hkv, gn // n, n, bk).masked_fill_(hidden, -math.inf).view(hkv, gn, bk)
    return s


def _device_bounds(spec: VarlenSpec, device: torch.device):
    return spec.cached(("bounds", device), lambda: tuple(t.to(device) for t in spec.key_bounds()))


def _query_blocks(spec: VarlenSpec, q: Tensor, hkv: int, acc: torch.dtype):
    """Each query block that sees any key: ``(block, t0, t1, its queries heads-first, its key bounds)``."""
    lo, hi = _device_bounds(spec, q.device)
    for blk in spec.cached("blocks", lambda: _plan_blocks(spec)):
        if blk.tiles:
            yield (
                blk,
                blk.t0,
                blk.t1,
                _heads_first(q[blk.t0 : blk.t1], hkv, acc),
                (lo[blk.t0 : blk.t1], hi[blk.t0 : blk.t1]),
            )


def _key_tiles(blk: _Block, qb: Tensor, k: Tensor, v: Tensor, acc: torch.dtype, scale: float, bounds):
    """Each key tile of ``blk``: ``(k0, k1, keys, values, masked scaled scores)``, keys/values heads-first."""
    for tile in blk.tiles:
        k0, k1, _ = tile
        kb = k[k0:k1].to(acc).transpose(0, 1)
        vb = v[k0:k1].to(acc).transpose(0, 1)
        yield k0, k1, kb, vb, _masked_scores(qb, kb, scale, bounds, tile, blk.t1 - blk.t0)


def forward(spec: VarlenSpec, q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """``(out [T_q, H_q, D], lse [H_q, T_q])``; lse is float32 (float64 for float64 inputs)."""
    hkv = k.shape[1]
    acc = lse_dtype(q.dtype)
    out = torch.zeros_like(q, memory_format=torch.contiguous_format)
    lse = torch.full((q.shape[1], q.shape[0]), -math.inf, dtype=acc, device=q.device)
    for blk, t0, t1, qb, bounds in _query_blocks(spec, q, hkv, acc):
        n = t1 - t0
        m = torch.full(qb.shape[:2], -math.inf, dtype=acc, device=q.device)
        l = torch.zeros_like(m)
        o = torch.zeros_like(qb)
        for _, _, _, vb, s in _key_tiles(blk, qb, k, v, acc, scale, bounds):
            m_new = torch.maximum(m, s.amax(-1))
            m_safe = m_new.masked_fill(m_new == -math.inf, 0.0)
            p = torch.exp(s - m_safe[..., None])
            corr = torch.exp(m - m_safe)
            l = l * corr + p.sum(-1)
            o = o * corr[..., None] + torch.bmm(p, vb)
            m = m_new
        empty = l == 0
        o = o / l.masked_fill(empty, 1.0)[..., None]
        out[t0:t1] = _heads_last(o, n).to(q.dtype)
        lse_b = (m + torch.log(l)).masked_fill(empty, -math.inf)
        lse[:, t0:t1] = lse_b.view(q.shape[1], n)
    return out, (lse if acc == torch.float64 else lse.float())


def backward(
    spec: VarlenSpec, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` from the saved ``out`` and ``lse`` (no forward recompute)."""
    hkv = k.shape[1]
    acc = lse_dtype(q.dtype)
    dq = torch.zeros_like(q, memory_format=torch.contiguous_format)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    for blk, t0, t1, qb, bounds in _query_blocks(spec, q, hkv, acc):
        n = t1 - t0
        dob = _heads_first(dout[t0:t1], hkv, acc)
        delta = (dout[t0:t1].to(acc) * out[t0:t1].to(acc)).sum(-1)  # [n, Hq]
        delta = _row_stats(delta.t(), hkv)
        lse_b = _row_stats(lse[:, t0:t1].to(acc), hkv)
        lse_b = lse_b.masked_fill(lse_b == -math.inf, math.inf)  # rows that see nothing
        dqb = torch.zeros_like(qb)
        for k0, k1, kb, vb, s in _key_tiles(blk, qb, k, v, acc, scale, bounds):
            p = torch.exp(s - lse_b[..., None])
            dv[k0:k1] += torch.bmm(p.transpose(1, 2), dob).transpose(0, 1)
            ds = p * (torch.bmm(dob, vb.transpose(1, 2)) - delta[..., None])
            dqb += torch.bmm(ds, kb)
            dk[k0:k1] += torch.bmm(ds.transpose(1, 2), qb).transpose(0, 1)
        dq[t0:t1] = _heads_last(dqb.mul_(scale), n).to(q.dtype)
    return dq, dk.mul_(scale).to(k.dtype), dv.to(v.dtype)
