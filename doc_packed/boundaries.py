"""``cu_seqlens`` from what data loaders hold: a document id per token, or EOS tokens.

Both take one packed sequence ``[S]`` or rows ``[B, S]`` and return int32 boundaries on the
input's device: ``[N + 1]`` for ``[S]`` (:func:`doc_packed.doc_packed_attn_varlen`'s form),
``[B, MAX_DOCS + 1]`` for ``[B, S]`` (:func:`doc_packed.doc_packed_attn`'s form), each row
starting at 0 and ending at ``S``, unused slots repeating ``S``.

``max_docs`` fixes the number of slots so shapes stay the same across steps and ranks (the
context-parallel plan and compiled graphs key on shapes). Without it, it is the largest count of
any row. Host reads: one scalar (the largest count, to size the result or to check that it fits
``max_docs``); on CUDA that is one sync per call (once per batch, not per layer). Everything
else stays on the device.
"""

from __future__ import annotations

import torch

from ._checks import INT32_MAX, describe

__all__ = ["cu_seqlens_from_document_ids", "cu_seqlens_from_eos"]

_INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


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
