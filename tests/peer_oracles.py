"""The peers' attention semantics as float64 oracles, written from their sources (flash-attention
2's csrc/flash_attn/flash_api.cpp and interface; torch 2.13's torch/nn/attention/varlen.py;
flash-attn-4 4.0.0b36's flash_attn/cute/interface.py, mask.py and softmax.py). Each says which
keys a query sees by its own rules; the attention over each segment is one loop
(:func:`_segments`). Used by tests/test_compat.py and tests/test_coming_from.py."""

import torch


def _segments(q, k, v, cu_q, cu_k, sees, *, scale, softcap=0.0, sink=None):
    """Float64 attention per segment of ``cu_q`` queries and ``cu_k`` keys: query ``i`` (its
    position plus ``Lk - Lq``: aligned bottom-right) sees key ``j`` where ``sees(i, j)``;
    ``softcap`` (0 or None: off) maps each scaled logit s to softcap * tanh(s / softcap); ``sink [H]`` is one
    more logit per head in the softmax, with no value, included in the lse. A row that sees
    nothing: out 0, lse = sink (-inf without one). Returns out [T, H, Dv] and lse [H, T]."""
    T, H, D = q.shape
    G = H // k.shape[1]
    scale = D**-0.5 if scale is None else scale
    out = torch.zeros(T, H, v.shape[-1], dtype=torch.float64)
    lse = torch.full((H, T), float("-inf"), dtype=torch.float64)
    bq, bk = cu_q.tolist(), cu_k.tolist()
    for qa, qe, ka, ke in zip(bq[:-1], bq[1:], bk[:-1], bk[1:]):
        lq, lk = qe - qa, ke - ka
        if lq == 0:
            continue
        m = sees(torch.arange(lq)[:, None] + (lk - lq), torch.arange(lk)[None, :])
        qs = q[qa:qe].double().transpose(0, 1)
        ks = k[ka:ke].double().repeat_interleave(G, 1).transpose(0, 1)
        vs = v[ka:ke].double().repeat_interleave(G, 1).transpose(0, 1)
        s = qs @ ks.transpose(1, 2) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        s = s.masked_fill(~m, float("-inf"))
        if sink is not None:
            s = torch.cat([s, sink.double()[:, None, None].expand(H, lq, 1)], -1)
        row_lse = torch.logsumexp(s, -1)
        p = torch.exp(s - row_lse[..., None]).nan_to_num(0.0)  # a row that sees nothing: 0
        if sink is not None:
            p = p[..., :-1]
        lse[:, qa:qe] = row_lse
        out[qa:qe] = (p @ vs).transpose(0, 1)
    return out, lse


def _window(left, right):
    """``sees(i, j)``: ``i - left <= j <= i + right``, a side None unbounded."""

    def sees(i, j):
        m = torch.ones(i.shape[0], j.shape[1], dtype=torch.bool)
        if left is not None:
            m &= j >= i - left
        if right is not None:
            m &= j <= i + right
        return m

    return sees


def flash_oracle(q, k, v, cu_q, cu_k, *, causal=False, window=(-1, -1), scale=None, softcap=0.0):
    """flash-attention 2's varlen forward in float64, as its kernel applies the arguments:
    ``causal`` forces the right window to 0; a negative side is unbounded; the mask is aligned
    bottom-right (query i of a segment of Lq queries and Lk keys sees key j when
    i + Lk - Lq - left <= j <= i + Lk - Lq + right); softcap > 0 maps each scaled logit s to
    softcap * tanh(s / softcap), anything else is off. Returns out [T, H, D] and lse [H, T]."""
    left, right = window
    if causal:
        right = 0
    sees = _window(left if left >= 0 else None, right if right >= 0 else None)
    return _segments(q, k, v, cu_q, cu_k, sees, scale=scale, softcap=softcap if softcap > 0 else 0.0)


def torch_varlen_oracle(query, key, value, cu_q, cu_k, *, window=(-1, -1), scale=None):
    """torch 2.13's varlen_attn: ``is_causal = window_size == (-1, 0)``, then flash's kernel with
    that flag and the window as given."""
    return flash_oracle(query, key, value, cu_q, cu_k, causal=tuple(window) == (-1, 0), window=window, scale=scale)


def fa4_oracle(q, k, v, cu, *, causal=False, window=(None, None), scale=None, softcap=0.0, sink=None):
    """FA4's flash_attn_varlen_func (flash-attn-4 4.0.0b36) in float64, self-attention, as its
    ``_resolve_causal_local_window`` and mask apply the arguments: both window sides negative is
    no window; then ``causal`` sets the right side to 0; None is unbounded and any other side is
    taken literally (query i sees key j when i - left <= j <= i + right, so a negative side
    excludes the query); softcap 0 or None is off, else s -> softcap * tanh(s / softcap) on the
    scaled logit; ``sink [H]`` is one more logit per head in the softmax, with no value, included
    in the lse (a row that sees nothing: out 0, lse = sink, or -inf without a sink). Returns out
    [T, H, Dv] and lse [H, T]."""
    left, right = window
    if left is not None and right is not None and left < 0 and right < 0:
        left = right = None
    if causal:
        right = 0
    return _segments(q, k, v, cu, cu, _window(left, right), scale=scale, softcap=softcap, sink=sink)
