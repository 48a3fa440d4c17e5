"""doc-packed: document-packed (cu_seqlens) attention for automatic parallelism."""

from . import ops  # noqa: F401  (registers torch.ops.doc_packed.*)
from ._flops import set_planning_doc_len
from .api import doc_packed_attn
from .layout import cu_seqlens_from_lengths, document_ids, pack_documents, positions

__all__ = [
    "doc_packed_attn",
    "cu_seqlens_from_lengths",
    "document_ids",
    "positions",
    "pack_documents",
    "set_planning_doc_len",
]
