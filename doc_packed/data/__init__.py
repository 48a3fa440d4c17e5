"""Data preparation: ``cu_seqlens`` from what loaders hold, and rows packed from documents.

- :mod:`.boundaries`: ``cu_seqlens`` from document lengths, document ids or EOS tokens, and
  per-token document ids and positions (for RoPE) from ``cu_seqlens``.
- :mod:`.packing`: documents into rows of ``seq_len`` (:func:`pack_documents`,
  :func:`pack_order`, :func:`pack_stream`), first-fit or ordered so that context-parallel
  shards carry equal work (docs/packing.md). Its private modules are the CP-aware order:
  ``_search`` (which passes run, which packing is kept), ``_packer`` (one pass), ``_trades``
  and ``_two_shards`` (remedies), ``_work`` (the work counted), ``_rows`` (rows, first-fit,
  padding).
- :mod:`.synthetic`: :func:`lognormal_lengths`, document lengths for tests and benchmarks.

Imports only downward: the argument checks, the mask's pair counts and the context-parallel
planner's shard ranges and tolerance (:mod:`doc_packed.cp.plan`); never the op.
"""

from .boundaries import (
    cu_seqlens_from_document_ids,
    cu_seqlens_from_eos,
    cu_seqlens_from_lengths,
    document_ids,
    positions,
)
from .packing import PAD, Packed, PackOrder, pack_documents, pack_order, pack_stream
from .synthetic import lognormal_lengths

__all__ = [
    "cu_seqlens_from_lengths",
    "cu_seqlens_from_document_ids",
    "cu_seqlens_from_eos",
    "document_ids",
    "positions",
    "pack_documents",
    "pack_order",
    "pack_stream",
    "Packed",
    "PackOrder",
    "PAD",
    "lognormal_lengths",
]
