"""doc-packed: document-packed (cu_seqlens) attention for automatic parallelism."""

from . import ops  # noqa: F401  (registers torch.ops.doc_packed.*)
from ._flops import set_planning_doc_len
from .api import doc_packed_attn
from .cp import ContextParallelPlan, plan_context_parallel
from .layout import cu_seqlens_from_lengths, document_ids, pack_documents, positions

import shardings as _shardings  # noqa: E402,F401  (registers the DTensor sharding rules)

__all__ = [
    "doc_packed_attn",
    "cu_seqlens_from_lengths",
    "document_ids",
    "positions",
    "pack_documents",
    "set_planning_doc_len",
    "plan_context_parallel",
    "ContextParallelPlan",
]
