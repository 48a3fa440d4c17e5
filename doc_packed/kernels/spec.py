"""One packed variable-length attention problem, described once and shared by every layer.

Queries ``[T_q, H_q, D]`` and keys ``[T_k, H_kv, D]`` are split into segments by ``cu_q`` and
``cu_k``; query ``i`` of a segment with ``L_q`` queries and ``L_k`` keys sees key ``j`` when::

    i + (L_k - L_q) - left <= j <= i + (L_k - L_q) + right     (right = 0 when causal)

with -1 meaning unbounded: flash-attention's bottom-right-aligned convention, so a query chunk
given the key prefix of its document stays exactly causal. With ``prefix`` (one length ``P`` per
segment, causal only), a query whose diagonal ``i + (L_k - L_q)`` is below ``P`` also sees every
key below ``P`` (a bidirectional prefix): its interval becomes ``[0, max(hi, P - 1)]``, still one
interval per query with both ends non-decreasing, which is all the kernels rely on. The same spec drives every backend;
device tensors are made once per device and cached on the spec.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from .._host import queue_to

# int32 elements (16 bytes) each device offsets tensor starts on: FA4's backward copies offsets
# that start elsewhere (flash_attn.cute's maybe_contiguous), a copy per call that also keeps the
# call from being replayed (kernels.fa4_launch)
OFFSETS_ALIGN = 4


class Variant(NamedTuple):
    """What a call asks of a kernel beyond its :class:`VarlenSpec` (the mask, prefixes included):
    ``softcap`` (0.0: none) and the value head dim (``None``: q's)."""

    softcap: float = 0.0
    v_dim: int | None = None

    @staticmethod
    def of(q: torch.Tensor, v: torch.Tensor, softcap: float = 0.0) -> Variant:
        return Variant(softcap, None if v.shape[-1] == q.shape[-1] else v.shape[-1])


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """dtype of the log-sum-exp and of every softmax accumulation: float64 for float64 inputs,
    else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class VarlenSpec:
    """Segment offsets (host ints) plus the mask of a packed varlen attention call."""

    __slots__ = (
        "_cache",
        "causal",
        "cu_k",
        "cu_q",
        "left",
        "max_k",
        "max_q",
        "prefix",
        "right",
        "row_len",
        "total_k",
        "total_q",
    )

    def __init__(
        self,
        cu_q: Sequence[int],
        cu_k: Sequence[int],
        causal: bool,
        left: int,
        right: int,
        row_len: int | None = None,
        prefix: Sequence[int] | None = None,
        bounds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ):
        if len(cu_q) != len(cu_k) or len(cu_q) < 1:
            raise ValueError("cu_q and cu_k must have the same, non-zero length")
        if prefix is not None and (len(prefix) != len(cu_q) - 1 or not causal):
            raise ValueError("prefix needs causal=True and one length per segment")
        # per segment, the length of its bidirectional prefix in key positions (None: no prefixes)
        self.prefix = None if prefix is None or not any(prefix) else tuple(int(x) for x in prefix)
        self.cu_q = tuple(map(int, cu_q))
        self.cu_k = tuple(map(int, cu_k))
        self.causal = causal
        self.left = left
        self.right = 0 if causal else right
        self.total_q = self.cu_q[-1]
        self.total_k = self.cu_k[-1]
        self.max_q = max(map(operator.sub, self.cu_q[1:], self.cu_q[:-1]), default=0)
        self.max_k = max(map(operator.sub, self.cu_k[1:], self.cu_k[:-1]), default=0)
        # queries and keys form independent rows of ``row_len`` tokens (no segment crosses a
        # row boundary); lets a kernel batch by row (flex). None: one packed problem.
        self.row_len = row_len
        self._cache: dict = {}
        if bounds is not None:
            # explicit per-query key intervals (host int64, packed key indices) for queries that
            # are not bottom-right aligned with their keys; only the math kernel reads a spec's
            # bounds alone (fa4/flash take the offsets), so such a spec is for the math kernel
            self._cache["key_bounds"] = bounds

    def cached(self, key, factory):
        try:
            return self._cache[key]
        except KeyError:
            value = self._cache[key] = factory()
            return value

    def cu_tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cu_q, cu_k)`` as int32 tensors on ``device``: one copy of both, queued from pinned
        memory on CUDA (a plain copy would wait for the device's queue: a sync per new layout),
        each starting on a 16-byte boundary (:data:`OFFSETS_ALIGN`)."""

        def build() -> tuple[torch.Tensor, torch.Tensor]:
            gap = -len(self.cu_q) % OFFSETS_ALIGN
            both = queue_to(np.asarray([*self.cu_q, *[0] * gap, *self.cu_k], dtype=np.int32), device)
            return both[: len(self.cu_q)], both[len(self.cu_q) + gap :]

        return self.cached(("cu", device), build)

    def key_bounds(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per query, the inclusive packed-key interval ``[lo, hi]`` it sees (host int64).

        An empty interval (``hi < lo``) means the query sees nothing.
        """

        def build():
            cu_q = torch.tensor(self.cu_q, dtype=torch.int64)
            cu_k = torch.tensor(self.cu_k, dtype=torch.int64)
            lq, lk = cu_q.diff(), cu_k.diff()
            seg = torch.repeat_interleave(torch.arange(lq.numel()), lq, output_size=self.total_q)
            i = torch.arange(self.total_q, dtype=torch.int64) - cu_q[seg]
            diag = i + (lk - lq)[seg]
            lo = torch.zeros_like(i) if self.left < 0 else (diag - self.left).clamp_min(0)
            if self.right < 0:
                hi = lk[seg] - 1
            else:
                hi = torch.minimum(diag + self.right, lk[seg] - 1)
            if self.prefix is not None:
                plen = torch.minimum(torch.tensor(self.prefix, dtype=torch.int64)[seg], lk[seg])
                inside = diag < plen
                lo = lo.masked_fill(inside, 0)
                hi = torch.where(inside, torch.maximum(hi, plen - 1), hi)
            return lo + cu_k[seg], hi + cu_k[seg]

        return self.cached("key_bounds", build)
