"""doc-packed: document-packed (cu_seqlens) attention for automatic parallelism.

This package holds the op, its kernels and context parallelism; it never imports
:mod:`shardings`. DTensor and AutoParallel need the sharding rules: ``import shardings`` once.
"""

__version__ = "0.1.0"  # the package's version (pyproject reads it from here)

from . import ops  # noqa: F401  (registers torch.ops.doc_packed.*)
from .api import doc_packed_attn, planning
from .boundaries import cu_seqlens_from_document_ids, cu_seqlens_from_eos
from .cp import ContextParallelPlan, plan_context_parallel
from .layout import cu_seqlens_from_lengths, document_ids, lognormal_lengths, positions
from .packing import PAD, Packed, PackOrder, pack_documents, pack_order, pack_stream
from .varlen import doc_packed_attn_varlen

__all__ = [
    "doc_packed_attn",
    "doc_packed_attn_varlen",
    "cu_seqlens_from_lengths",
    "cu_seqlens_from_document_ids",
    "cu_seqlens_from_eos",
    "document_ids",
    "lognormal_lengths",
    "positions",
    "pack_documents",
    "pack_order",
    "pack_stream",
    "Packed",
    "PackOrder",
    "PAD",
    "planning",
    "plan_context_parallel",
    "ContextParallelPlan",
]
