"""The contract every kernel backend keeps with context parallelism (docs/architecture.md).

A backward called on part of a query row's keys, with that row's *final* output and lse (merged
over all its keys), returns that part's share of dq, and the shares sum to the full gradient;
dk/dv of the part's keys are exact. Context parallelism splits a row's keys between local and
received buffers (stage A / stage B) and relies on this.
"""

import pytest
import torch

from doc_packed.cp.schedule import _kernel_mask, _Piece, _reach, _visible
from doc_packed.kernels import VarlenSpec, backward, forward


@pytest.mark.parametrize("causal,window", [(True, (-1, 0)), (True, (5, 0)), (False, (-1, -1)), (False, (4, 6))])
@pytest.mark.parametrize("cut", [1, 17, 32])
def test_backward_over_split_keys_sums_to_the_full_gradient(causal, window, cut):
    torch.manual_seed(0)
    S, Hq, Hkv, D, scale = 45, 4, 2, 8, 0.3
    q, do = torch.randn(S, Hq, D, dtype=torch.float64), torch.randn(S, Hq, D, dtype=torch.float64)
    k, v = torch.randn(S, Hkv, D, dtype=torch.float64), torch.randn(S, Hkv, D, dtype=torch.float64)
    left, right = window
    full = VarlenSpec([0, S], [0, S], causal, left, right)
    out, lse = forward(full, q, k, v, scale, "math")
    dq, dk, dv = backward(full, do, q, k, v, out, lse, scale, "math")
    # the last 13 queries (positions 32..44) against keys [0, cut) and [cut, 45) separately, each
    # part trimmed and masked the way the context-parallel schedule does it
    parts = []
    for k0, k1 in ((0, cut), (cut, S)):
        vis = _visible(32, 45, k0, k1, *_reach(causal, left, right))
        if vis is None:
            continue
        qa, qz, a, z = vis
        nq, nk = qz - qa, z - a
        piece = _Piece("local", qa, nq, qa, "local", a, nk, a)
        c, wl, wr = _kernel_mask(piece, causal, left, right)
        assert wl >= -1 and wr >= -1
        qs, ks = slice(piece.q0, piece.q0 + nq), slice(piece.k0, piece.k0 + nk)
        spec = VarlenSpec([0, nq], [0, nk], c, wl, wr)
        g = backward(spec, do[qs], q[qs], k[ks], v[ks], out[qs], lse[:, qs].contiguous(), scale, "math")
        parts.append((qs, ks, g))
    got_dq = torch.zeros_like(dq)
    for qs, ks, (a, _, _) in parts:
        got_dq[qs] += a
    torch.testing.assert_close(got_dq[32:], dq[32:], rtol=0, atol=1e-12)
