"""torchtitan: document-packed attention as the inner attention of its models (Llama3, Qwen3, ...).

One line switches a model config (this module imports torchtitan; ``import doc_packed`` does not)::

    from torchtitan.models.llama3 import llama3_configs
    from doc_packed.integrations.torchtitan import use_doc_packed

    config = use_doc_packed(llama3_configs["8B"](attn_backend="varlen"))
    model = config.build()

Every layer's ``inner_attention`` becomes :class:`DocPackedAttention` (a ``VarlenAttention``
config underneath, so torchtitan's own ``Decoder.get_attention_masks(positions)`` builds the
metadata, and its window carries over). ``attention_masks`` may be, per call:

- torchtitan's ``VarlenMetadata`` (flat layout: q/k/v folded to ``[T, H, D]``, ``T = B * L``,
  ``cu_seq_q`` over ``T``): :func:`doc_packed.doc_packed_attn_varlen`;
- a 1-D ``cu_seqlens [N + 1]`` tensor over ``T``: the same, as a plain tensor (the traceable form);
- a 2-D ``cu_seqlens [B, MAX_DOCS + 1]`` tensor (rows layout, ``[B, L, H, D]`` as they come):
  :func:`doc_packed.doc_packed_attn` (:func:`row_masks` builds it from ``positions``).

A traced model (AutoParallel, ``torch.compile``) takes the tensor forms as its third input:
``model(tokens, positions, cu_seqlens)``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.models.common.attention import VarlenAttention, VarlenMetadata
from torchtitan.protocols.module import Module

import doc_packed as dp

__all__ = ["DocPackedAttention", "TESTED", "flat_masks", "row_masks", "use_doc_packed"]

TESTED = ("0.3.0",)  # torchtitan releases this module was checked on


class DocPackedAttention(Module):
    """torchtitan inner attention running :func:`doc_packed.doc_packed_attn` (rows) or
    :func:`doc_packed.doc_packed_attn_varlen` (flat), chosen by the ``attention_masks`` it gets."""

    @dataclass(kw_only=True, slots=True)
    class Config(VarlenAttention.Config):
        """``window_size=(left, right)`` as torchtitan's ``VarlenAttention``: ``(-1, 0)`` causal,
        ``(W, 0)`` causal with ``W`` keys back, ``(-1, -1)`` bidirectional."""

        backend: str = "auto"  # doc_packed's kernel choice (doc_packed.doc_packed_attn's backend=)

    def __init__(self, config: Config) -> None:
        super().__init__()
        left, right = config.window_size
        self.causal = right == 0
        self.window = (left, 0) if self.causal else (left, right)
        self.backend = config.backend

    def forward(
        self,
        q_BLNH: torch.Tensor,
        k_BLNH: torch.Tensor,
        v_BLNH: torch.Tensor,
        *,
        attention_masks: VarlenMetadata | torch.Tensor,
        scale: float | None = None,
        out_transform: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        want_lse = out_transform is not None
        common = dict(causal=self.causal, window_size=self.window, scale=scale, backend=self.backend)
        B, L = q_BLNH.shape[:2]
        if isinstance(attention_masks, torch.Tensor) and attention_masks.dim() == 2:
            result = dp.doc_packed_attn(q_BLNH, k_BLNH, v_BLNH, attention_masks, return_lse=want_lse, **common)
            if out_transform is None:
                assert isinstance(result, torch.Tensor)
                return result
            out_BLNH, lse_BNL = result
            return out_transform(out_BLNH, lse_BNL.transpose(1, 2))
        if isinstance(attention_masks, VarlenMetadata):
            if attention_masks.cu_seq_k is not attention_masks.cu_seq_q and not torch.equal(
                attention_masks.cu_seq_k, attention_masks.cu_seq_q
            ):
                raise ValueError("DocPackedAttention is self-attention: VarlenMetadata.cu_seq_k must equal cu_seq_q")
            cu, max_seqlen = attention_masks.cu_seq_q, attention_masks.max_q
        elif isinstance(attention_masks, torch.Tensor) and attention_masks.dim() == 1:
            cu, max_seqlen = attention_masks, None
        else:
            what = (
                f"a {attention_masks.dim()}-D tensor"
                if isinstance(attention_masks, torch.Tensor)
                else type(attention_masks).__name__
            )
            raise TypeError(
                "DocPackedAttention needs attention_masks: torchtitan's VarlenMetadata, a 1-D cu_seqlens over "
                f"the B * L tokens, or a [B, MAX_DOCS + 1] cu_seqlens; got {what}"
            )
        T = B * L
        q_TNH, k_TNH, v_TNH = (t.reshape(T, *t.shape[2:]) for t in (q_BLNH, k_BLNH, v_BLNH))
        result = dp.doc_packed_attn_varlen(q_TNH, k_TNH, v_TNH, cu, max_seqlen, return_lse=want_lse, **common)
        if out_transform is None:
            assert isinstance(result, torch.Tensor)
            return result.view(B, L, *result.shape[1:])
        out_TNH, lse_NT = result
        return out_transform(out_TNH.view(B, L, *out_TNH.shape[1:]), lse_NT.transpose(0, 1).reshape(B, L, -1))


def use_doc_packed(config: Any, *, backend: str = "auto") -> Any:
    """``config`` (a torchtitan model config, e.g. ``llama3_configs["8B"](attn_backend="varlen")``)
    with every layer's ``inner_attention`` replaced by :class:`DocPackedAttention`, in place; returns
    it. A ``VarlenAttention`` window carries over; any other backend becomes causal."""
    layers = getattr(config, "layers", None)
    if not isinstance(layers, list):
        raise TypeError(f"config must be a torchtitan decoder config with a `layers` list, got {type(config).__name__}")
    replaced = 0
    for layer in layers:
        attention = getattr(layer, "attention", None)
        if attention is None or not hasattr(attention, "inner_attention"):
            continue  # linear-attention layers of hybrid models
        old = attention.inner_attention
        window = old.window_size if isinstance(old, VarlenAttention.Config) else (-1, 0)
        attention.inner_attention = DocPackedAttention.Config(window_size=tuple(window), backend=backend)
        replaced += 1
    if not replaced:
        raise ValueError("config has no attention layer with an inner_attention to replace")
    return config


def row_masks(positions: torch.Tensor, *, max_docs: int | None = None) -> torch.Tensor:
    """``cu_seqlens [B, MAX_DOCS + 1]`` (rows layout) from torchtitan's ``positions [B, L]``,
    which restart at 0 per document (one host read)."""
    if not isinstance(positions, torch.Tensor) or positions.dim() != 2:
        raise ValueError(f"positions must be [B, L], got {getattr(positions, 'shape', type(positions).__name__)}")
    starts = positions == 0
    starts[:, 0] = True
    return dp.cu_seqlens_from_document_ids(starts.to(torch.int32).cumsum(1), max_docs=max_docs)


def flat_masks(positions: torch.Tensor) -> VarlenMetadata:
    """torchtitan's ``VarlenMetadata`` (flat layout) for ``positions [B, L]``: what its
    ``Decoder.get_attention_masks`` returns for a :class:`DocPackedAttention` model."""
    from torchtitan.models.common.attention import create_varlen_metadata_for_document

    return create_varlen_metadata_for_document(positions)
