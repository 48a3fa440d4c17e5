"""``cu_seqlens`` in and out: boundaries from what data loaders hold, and per-token metadata
from boundaries.

``cu_seqlens`` is ``[B, MAX_DOCS + 1]`` int32: row ``b``'s document boundaries, starting at 0,
non-decreasing, ending at ``S``; unused trailing slots repeat ``S`` (zero-length documents), so
every row and every rank sees the same shape. One packed sequence ``[S]`` has ``[N + 1]``
boundaries (:func:`doc_packed.doc_packed_attn_varlen`'s form).

- :func:`cu_seqlens_from_lengths`: from document lengths per row (host lists).
- :func:`cu_seqlens_from_document_ids`, :func:`cu_seqlens_from_eos`: from a document id per
  token, or EOS tokens, on the input's device. Both take ``[S]`` or ``[B, S]`` and return
  ``[N + 1]`` for ``[S]``, ``[B, MAX_DOCS + 1]`` for ``[B, S]``.
- :func:`document_ids`, :func:`positions`: each token's document and its position in it (for
  RoPE), on the device of ``cu_seqlens``, without a host sync.

``max_docs`` fixes the number of slots so shapes stay the same across steps and ranks (the
context-parallel plan and compiled graphs key on shapes). Without it, it is the largest count of
any row. The device builders read one scalar on the host (the largest count, to size the result
or to check that it fits ``max_docs``); on CUDA that is one sync per call (once per batch, not
per layer). Everything else stays on the device.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch

from .._checks import INT32_MAX, describe

__all__ = [
    "cu_seqlens_from_document_ids",
    "cu_seqlens_from_eos",
    "cu_seqlens_from_lengths",
    "document_ids",
    "positions",
]

_INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def cu_seqlens_from_lengths(
    lengths: Sequence[Sequence[int]],
    seq_len: int,
    *,
    max_docs: int | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """``cu_seqlens`` ``[B, max_docs + 1]`` from per-row document lengths.

    A row whose lengths sum to less than ``seq_len`` gets one more document holding the rest
    (padding tokens then attend only to each other). ``max_docs`` defaults to the largest
    document count of any row; shorter rows are padded with zero-length documents.
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, int):
        raise TypeError(f"seq_len must be an int, got {type(seq_len).__name__}")
    rows = []
    for b, given in enumerate(lengths):
        try:  # ints, or integer scalars (numpy, 0-d tensors): never truncate 5.5 to 5
            row = [operator.index(n) for n in given]
        except TypeError:
            raise TypeError(f"lengths[{b}] must hold ints (token counts), got {list(given)!r}") from None
        if any(isinstance(n, bool) for n in given):
            raise TypeError(f"lengths[{b}] must hold ints (token counts), not bools")
        if any(n < 0 for n in row):
            raise ValueError(f"lengths[{b}] has a negative document length: {row}")
        total = sum(row)
        if total > seq_len:
            raise ValueError(f"lengths[{b}] sums to {total}, more than seq_len={seq_len}")
        if total < seq_len:
            row.append(seq_len - total)
        rows.append([n for n in row if n > 0] or [seq_len])
    if not rows:
        raise ValueError("lengths must hold at least one row")
    need = max(len(r) for r in rows)
    max_docs = need if max_docs is None else max_docs
    if max_docs < need:
        raise ValueError(f"max_docs={max_docs} is smaller than the {need} documents of some row")
    out = torch.full((len(rows), max_docs + 1), seq_len, dtype=torch.int32)
    for b, row in enumerate(rows):
        out[b, 0] = 0
        out[b, 1 : len(row) + 1] = torch.tensor(row, dtype=torch.int64).cumsum(0).to(torch.int32)
    return out.to(device) if device is not None else out


def cu_seqlens_from_document_ids(doc_ids: torch.Tensor, *, max_docs: int | None = None) -> torch.Tensor:
    """Boundaries of the runs of equal ids: a document starts at position 0 and wherever the
    id differs from the previous token's.

    Ids need not be sorted or distinct across documents: ``[7, 7, 3, 7]`` is three documents
    (``[0, 2, 3, 4]``); an id that comes back after another is a new document. Padding with
    its own id is a document of its own (its tokens attend to each other only).
    """
    ids, batched = _rows("doc_ids", doc_ids)
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    return _from_starts(starts, batched, max_docs)


def cu_seqlens_from_eos(
    tokens_or_mask: torch.Tensor, eos_id: int | None = None, *, max_docs: int | None = None
) -> torch.Tensor:
    """Boundaries from end-of-sequence tokens: each EOS is the *last* token of its document.

    ``tokens_or_mask`` is token ids with ``eos_id`` given, or a bool mask (True at EOS) without.
    A new document starts after each EOS; a row ending with EOS gets no empty document after it;
    the tokens after a row's last EOS (or a whole row without EOS) form one more document; two
    EOS in a row make a 1-token document of the second. This is torchtitan's convention (its
    document mask puts the EOS in the document it closes). For a start-of-document marker
    (BOS), use ``cu_seqlens_from_document_ids(bos_mask.cumsum(-1))``.
    """
    if eos_id is None:
        if not isinstance(tokens_or_mask, torch.Tensor) or tokens_or_mask.dtype != torch.bool:
            raise TypeError(
                "cu_seqlens_from_eos needs eos_id=... for token ids, or a bool mask (True at EOS) "
                f"without it; got {_what(tokens_or_mask)}"
            )
        eos = tokens_or_mask
    else:
        if isinstance(eos_id, bool) or not isinstance(eos_id, int):
            raise TypeError(f"eos_id must be an int or None, got {describe(eos_id)}")
        _rows("tokens_or_mask", tokens_or_mask)
        eos = tokens_or_mask == eos_id
    eos, batched = _rows("tokens_or_mask", eos)
    starts = torch.ones_like(eos)
    starts[:, 1:] = eos[:, :-1]
    return _from_starts(starts, batched, max_docs)


def document_ids(cu_seqlens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """``[B, S]`` int64: index of the document each token belongs to (no host sync)."""
    ends = cu_seqlens[:, 1:].contiguous()
    t = torch.arange(seq_len, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return torch.searchsorted(ends, t.expand(ends.shape[0], seq_len).contiguous(), right=True)


def positions(cu_seqlens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """``[B, S]`` int64: each token's position inside its document (for RoPE; no host sync)."""
    ids = document_ids(cu_seqlens, seq_len)
    starts = torch.gather(cu_seqlens.long(), 1, ids)
    return torch.arange(seq_len, device=cu_seqlens.device) - starts


def _what(x: object) -> str:
    return f"a {x.dtype} tensor" if isinstance(x, torch.Tensor) else describe(x)


def _rows(name: str, x: object) -> tuple[torch.Tensor, bool]:
    """``x`` as ``[B, S]`` (a 1-D input as one row) and whether it was batched."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _INT_DTYPES and x.dtype != torch.bool:
        raise TypeError(f"{name} must hold integers or bools, got {x.dtype}")
    if x.dim() not in (1, 2) or x.shape[-1] == 0 or (x.dim() == 2 and x.shape[0] == 0):
        raise ValueError(f"{name} must be [S] or [B, S] with B, S >= 1, got shape {tuple(x.shape)}")
    if x.shape[-1] > INT32_MAX:
        raise ValueError(f"{name} has {x.shape[-1]} tokens per row, past 2**31 - 1 (kernels take 32-bit offsets)")
    return (x if x.dim() == 2 else x.unsqueeze(0)), x.dim() == 2


def _from_starts(starts: torch.Tensor, batched: bool, max_docs: object) -> torch.Tensor:
    """``[B, max_docs + 1]`` (or ``[N + 1]``) int32 boundaries from a ``[B, S]`` document-start
    mask whose first column is True."""
    B, S = starts.shape
    doc = starts.to(torch.int32).cumsum(1, dtype=torch.int32) - 1  # document index of each token
    most = int(doc[:, -1].max()) + 1  # the one host read
    if max_docs is None:
        max_docs = most
    elif isinstance(max_docs, bool) or not isinstance(max_docs, int):
        raise TypeError(f"max_docs must be an int or None, got {describe(max_docs)}")
    elif max_docs < 1:
        raise ValueError(f"max_docs must be >= 1, got {max_docs}")
    elif most > max_docs:
        raise ValueError(f"a row holds {most} documents, more than max_docs={max_docs}")
    # each document's start goes to its slot; every other token to a spare column, dropped
    pos = torch.arange(S, dtype=torch.int32, device=starts.device).expand(B, S)
    slot = torch.where(starts, doc, max_docs + 1).to(torch.int64)
    cu = torch.full((B, max_docs + 2), S, dtype=torch.int32, device=starts.device)
    cu.scatter_(1, slot, pos)
    cu = cu[:, : max_docs + 1].contiguous()
    return cu if batched else cu[0]
