"""doc-packed: document-packed (cu_seqlens) attention for automatic parallelism.

This package holds the op, its kernels, context parallelism and data preparation; it never
imports :mod:`shardings`. DTensor and AutoParallel need the sharding rules: ``import shardings``
once. The names here are what a training script calls most; the rest of data preparation
(``pack_order``, ``pack_stream``, ``lognormal_lengths``, ...) is in :mod:`doc_packed.data`.
"""

__version__ = "0.1.0"  # the package's version (pyproject reads it from here)

from . import ops  # noqa: F401  (registers torch.ops.doc_packed.*)
from .api import doc_packed_attn, planning
from .cp import ContextParallelPlan, plan_context_parallel
from .data import cu_seqlens_from_document_ids, cu_seqlens_from_eos, cu_seqlens_from_lengths, pack_documents, positions
from .varlen import doc_packed_attn_varlen

__all__ = [
    "doc_packed_attn",
    "doc_packed_attn_varlen",
    "planning",
    "plan_context_parallel",
    "ContextParallelPlan",
    "pack_documents",
    "cu_seqlens_from_lengths",
    "cu_seqlens_from_document_ids",
    "cu_seqlens_from_eos",
    "positions",
]
