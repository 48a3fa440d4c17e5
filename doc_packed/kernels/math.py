"""The ``math`` backend: exact attention in plain torch, tiled so memory stays bounded (the CPU path).

Queries are processed in blocks of at most ``BLOCK_Q`` rows of one segment (document): blocks
start at each segment's first query, so no block mixes documents. Each block visits only the key
range its rows can see, in tiles of at most ``BLOCK_K`` keys starting at the first key any of its
rows sees, with an online softmax (the flash-attention recurrence) accumulated in float32
(float64 for float64 inputs). No ``[S, S]`` matrix is ever formed: the largest temporary is
``[H_q, BLOCK_Q, BLOCK_K]``. Tiles that every row of the block sees in full skip the mask. The
block plan is computed on the host once per :class:`VarlenSpec` and reused by every layer; it
runs on any device, and on CUDA it serves dtypes and head sizes the flash kernel does not take.

**Batch invariance.** A block's shapes depend only on its document (its length, the mask and the
head counts), and every operand of its arithmetic is copied into a buffer of its own
(:func:`_fresh`), so a document's bits (out, lse, dq, dk, dv) do not depend on the other
documents, on its position in the row or on its batch row, and a NaN or Inf in one document
stays in that document.

**Backward.** Probabilities are recomputed from the saved lse (bit for bit the forward's: the
blocks are the same). The row term ``delta_i = sum_j P_ij dP_ij`` (``= dout_i . out_i``) has two
sources:

- whole rows (a local call, ``spec.row_len`` set): summed from the very fp32 (fp64) ``P`` and
  ``dP`` that ``dS = P * (dP - delta)`` then uses. It does not carry the rounding of ``out`` to
  fp16/bf16 (the saved ``out`` is not read), and a query that sees one key has ``P = 1``,
  ``delta = dP`` and ``dS = 0`` exactly, so dq = dk = 0 exactly. It needs ``delta`` before the
  first ``dS``: a first pass over the block's key tiles keeps their ``P``/``dP`` for the second,
  up to ``_BWD_KEEP_BYTES`` (recomputed past that).
- part of a row's keys (context parallelism: ``row_len`` None): ``dout . out`` from the row's
  final ``out`` passed in, accumulated in float32 (float64), so the result is this part's share
  of the gradient (``tests/test_kernel_contract.py``). A caller holding the accumulator's
  ``out`` may pass it in float32 to keep its precision.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .spec import VarlenSpec, lse_dtype

BLOCK_Q = 128
BLOCK_K = 512
# masks of tiles up to this many (query, key) pairs are kept per spec and device
_CACHED_MASK_ELEMENTS = 8192
# when the backward sums delta from P * dP (whole rows), a query block keeps its tiles' P, dP,
# keys and values between the two passes up to this many bytes (about 4 tiles of 512 keys at 32
# query heads); tiles past it are recomputed
_BWD_KEEP_BYTES = 64 << 20


class _Block:
    __slots__ = ("t0", "t1", "tiles")

    def __init__(self, t0: int, t1: int, tiles: list[tuple[int, int, bool]]):
        self.t0, self.t1, self.tiles = t0, t1, tiles


def _plan_blocks(spec: VarlenSpec) -> list[_Block]:
    """Query blocks that see any key, each inside one segment, with their key tiles."""
    lo_t, hi_t = spec.key_bounds()
    lo, hi = lo_t.tolist(), hi_t.tolist()
    blocks = []
    for q0, q1 in zip(spec.cu_q[:-1], spec.cu_q[1:]):
        for t0 in range(q0, q1, BLOCK_Q):  # aligned to the segment's start, not the batch's
            t1 = min(t0 + BLOCK_Q, q1)
            live = [i for i in range(t0, t1) if hi[i] >= lo[i]]
            if not live:
                continue
            klo = min(lo[i] for i in live)
            khi = max(hi[i] for i in live) + 1
            # a tile needs no mask when every row of the block sees all of it
            all_live = len(live) == t1 - t0
            max_lo, min_hi = max(lo[t0:t1]), min(hi[t0:t1])
            tiles = []
            for k0 in range(klo, khi, BLOCK_K):
                k1 = min(k0 + BLOCK_K, khi)
                tiles.append((k0, k1, not (all_live and max_lo <= k0 and min_hi >= k1 - 1)))
            blocks.append(_Block(t0, t1, tiles))
    return blocks


def _fresh(x: Tensor, dtype: torch.dtype) -> Tensor:
    """``x`` as ``dtype`` in a new contiguous buffer of its own. Every operand of a block's
    arithmetic is one, so its results depend on its shape and values only: a view into the
    packed batch would start at an address that depends on where the document sits, and BLAS
    kernels may pick another summation order for another alignment."""
    return torch.empty(x.shape, dtype=dtype, device=x.device).copy_(x)


def _heads_first(x: Tensor, hkv: int, dtype: torch.dtype) -> Tensor:
    """``[n, Hq, D]`` -> ``[Hkv, G * n, D]`` so one bmm serves a whole GQA group."""
    n, hq, d = x.shape
    return _fresh(x.view(n, hkv, hq // hkv, d).permute(1, 2, 0, 3), dtype).view(hkv, -1, d)


def _row_stats(x: Tensor, hkv: int) -> Tensor:
    """``[Hq, n]`` -> ``[Hkv, G * n]`` (head-major, same order as :func:`_heads_first`)."""
    return x.reshape(hkv, -1)


def _hidden(spec: VarlenSpec, bounds, tile, t0: int, device: torch.device) -> Tensor:
    """``[n, k1 - k0]`` bool: which keys of ``tile`` each query of the block starting at ``t0``
    does not see. Small ones (short documents, where per-op overhead dominates) are cached."""
    k0, k1, _ = tile
    lo, hi = bounds

    def build():
        kidx = torch.arange(k0, k1, device=device)
        return (kidx < lo[:, None]) | (kidx > hi[:, None])

    if lo.shape[0] * (k1 - k0) > _CACHED_MASK_ELEMENTS:
        return build()
    return spec.cached(("hidden", device, t0, k0), build)


def _masked_scores(spec, qb, kb, scale, bounds, tile, t0, n, softcap: float = 0.0, slope: bool = False):
    """Scaled (and softcapped) scores of one tile with hidden pairs at -inf; with ``slope`` also
    the softcap's derivative ``1 - tanh(s / softcap) ** 2`` (None without softcapping)."""
    s = torch.bmm(qb, kb.transpose(1, 2)).mul_(scale)
    d = None
    if softcap:
        t = s.div_(softcap).tanh_()
        if slope:
            d = 1 - t * t
        s = t.mul_(softcap)
    if tile[2]:
        hkv, gn, bk = s.shape
        s.view(hkv, gn // n, n, bk).masked_fill_(_hidden(spec, bounds, tile, t0, s.device), -math.inf)
    return s, d


def _device_bounds(spec: VarlenSpec, device: torch.device):
    return spec.cached(("bounds", device), lambda: tuple(t.to(device) for t in spec.key_bounds()))


def prepare(spec: VarlenSpec, device: torch.device) -> None:
    """Make what a call of ``spec`` on ``device`` reads first (its query blocks with their key
    tiles, its key bounds on the device) ahead of it: for a layout's calls before its step
    (``doc_packed.cp.prepare``), so its first call costs what a later one does."""
    if spec.total_q:
        spec.cached("blocks", lambda: _plan_blocks(spec))
        _device_bounds(spec, device)


def _query_blocks(spec: VarlenSpec, q: Tensor, hkv: int, acc: torch.dtype):
    """Each query block: ``(block, t0, t1, its queries heads-first, its key bounds)``."""
    lo, hi = _device_bounds(spec, q.device)
    for blk in spec.cached("blocks", lambda: _plan_blocks(spec)):
        yield (
            blk,
            blk.t0,
            blk.t1,
            _heads_first(q[blk.t0 : blk.t1], hkv, acc),
            (lo[blk.t0 : blk.t1], hi[blk.t0 : blk.t1]),
        )


def _key_tile(
    spec: VarlenSpec,
    blk: _Block,
    tile,
    qb: Tensor,
    k: Tensor,
    v: Tensor | None,
    acc,
    scale: float,
    bounds,
    softcap=0.0,
    slope=False,
):
    """One key tile of ``blk``: ``(keys, values, masked scaled scores, softcap slope or None)``,
    keys/values heads-first."""
    k0, k1, _ = tile
    kb = _fresh(k[k0:k1].transpose(0, 1), acc)
    vb = None if v is None else _fresh(v[k0:k1].transpose(0, 1), acc)
    return kb, vb, *_masked_scores(spec, qb, kb, scale, bounds, tile, blk.t0, blk.t1 - blk.t0, softcap, slope)


def forward(
    spec: VarlenSpec, q: Tensor, k: Tensor, v: Tensor, scale: float, softcap: float = 0.0
) -> tuple[Tensor, Tensor]:
    """``(out [T_q, H_q, D_v], lse [H_q, T_q])``; lse is float32 (float64 for float64 inputs).
    ``softcap > 0``: each scaled score ``s`` becomes ``softcap * tanh(s / softcap)``."""
    hkv = k.shape[1]
    acc = lse_dtype(q.dtype)
    out = torch.zeros((*q.shape[:2], v.shape[2]), dtype=q.dtype, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), -math.inf, dtype=acc, device=q.device)
    for blk, t0, t1, qb, bounds in _query_blocks(spec, q, hkv, acc):
        n = t1 - t0
        m = l = o = qb  # placeholders: set by the first tile (every block has one)
        for i, tile in enumerate(blk.tiles):
            _, vb, s, _ = _key_tile(spec, blk, tile, qb, k, v, acc, scale, bounds, softcap)
            m_new = s.amax(-1) if i == 0 else torch.maximum(m, s.amax(-1))
            m_safe = m_new.masked_fill(m_new == -math.inf, 0.0)
            p = s.sub_(m_safe[..., None]).exp_()
            if i == 0:  # nothing to rescale yet
                l, o = p.sum(-1), torch.bmm(p, vb)
            else:
                corr = torch.exp(m - m_safe)
                l = l.mul_(corr).add_(p.sum(-1))
                o = o.mul_(corr[..., None]).add_(torch.bmm(p, vb))
            m = m_new
        empty = l == 0
        o = o.div_(l.masked_fill(empty, 1.0)[..., None])
        g = q.shape[1] // hkv
        out[t0:t1].view(n, hkv, g, -1).copy_(o.view(hkv, g, n, -1).permute(2, 0, 1, 3))
        lse[:, t0:t1] = l.log_().add_(m).masked_fill_(empty, -math.inf).view(q.shape[1], n)
    return out, (lse if acc == torch.float64 else lse.float())


def _whole_rows(spec: VarlenSpec) -> bool:
    """Whether every key a query of ``spec`` sees is in ``spec`` (a local call: ``row_len`` set),
    so the backward can sum ``delta`` from ``P * dP`` rather than take it from ``out``."""
    return spec.row_len is not None


def backward(
    spec: VarlenSpec,
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    scale: float,
    softcap: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` from the saved ``out`` and ``lse`` (no forward recompute). With
    ``softcap``, ``dS`` is taken through the cap: ``dS_raw = dS * (1 - tanh(s / softcap) ** 2)``.
    ``lse`` may include sink terms (it then normalises ``P`` as the forward did; sinks have no
    value, so nothing else changes).

    ``out``/``lse`` are the rows' final values, possibly merged over more keys than ``spec``
    holds (context parallelism): the result is then this part's share (the module doc)."""
    hkv = k.shape[1]
    acc = lse_dtype(q.dtype)
    whole_rows = _whole_rows(spec)
    dq = torch.zeros_like(q, memory_format=torch.contiguous_format)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    for blk, t0, t1, qb, bounds in _query_blocks(spec, q, hkv, acc):
        n = t1 - t0
        dob = _heads_first(dout[t0:t1], hkv, acc)
        lse_b = _row_stats(lse[:, t0:t1].to(acc), hkv)
        lse_b = lse_b.masked_fill(lse_b == -math.inf, math.inf)  # rows that see nothing

        def probs(tile):
            kb, vb, s, slope = _key_tile(spec, blk, tile, qb, k, v, acc, scale, bounds, softcap, True)
            return kb, vb, s.sub_(lse_b[..., None]).exp_(), torch.bmm(dob, vb.transpose(1, 2)), slope

        kept: list = [None] * len(blk.tiles)
        if whole_rows:  # pass 1: delta = rowsum(P * dP), keeping tiles for pass 2 while they fit
            delta = torch.zeros(qb.shape[:2], dtype=acc, device=q.device)
            room = _BWD_KEEP_BYTES
            for i, tile in enumerate(blk.tiles):
                tensors = probs(tile)
                delta += (tensors[2] * tensors[3]).sum(-1)
                size = sum(t.numel() * t.element_size() for t in tensors if t is not None)
                if size <= room:
                    room -= size
                    kept[i] = tensors
        else:  # part of a row's keys: delta = rowsum(dout * out), accumulated in acc
            delta = _row_stats((dout[t0:t1].to(acc) * out[t0:t1].to(acc)).sum(-1).t(), hkv)
        dqb = torch.zeros_like(qb)
        for tile, tensors in zip(blk.tiles, kept):
            k0, k1, _ = tile
            kb, vb, p, dp, slope = probs(tile) if tensors is None else tensors
            dv[k0:k1] += torch.bmm(p.transpose(1, 2), dob).transpose(0, 1)
            ds = dp.sub_(delta[..., None]).mul_(p)
            if slope is not None:
                ds = ds.mul_(slope)
            dqb += torch.bmm(ds, kb)
            dk[k0:k1] += torch.bmm(ds.transpose(1, 2), qb).transpose(0, 1)
        g = q.shape[1] // hkv
        dq[t0:t1].view(n, hkv, g, -1).copy_(dqb.mul_(scale).view(hkv, g, n, -1).permute(2, 0, 1, 3))
    return dq, dk.mul_(scale).to(k.dtype), dv.to(v.dtype)


def max_logits(spec: VarlenSpec, q: Tensor, k: Tensor, scale: float, softcap: float = 0.0) -> Tensor:
    """``[H_q]``: per head, the largest visible scaled (post-softcap) logit over every query of
    ``spec`` (-inf for a head none of whose queries sees a key); float32 (float64 for float64).
    One pass of ``Q K^T`` over the same blocks as :func:`forward`, no softmax, no values."""
    hkv, hq = k.shape[1], q.shape[1]
    acc = lse_dtype(q.dtype)
    best = torch.full((hkv, hq // hkv), -math.inf, dtype=acc, device=q.device)
    for blk, t0, t1, qb, bounds in _query_blocks(spec, q, hkv, acc):
        n = t1 - t0
        for tile in blk.tiles:
            _, _, s, _ = _key_tile(spec, blk, tile, qb, k, None, acc, scale, bounds, softcap)
            best = torch.maximum(best, s.view(hkv, -1, n * s.shape[-1]).amax(-1))
    return best.reshape(hq)
