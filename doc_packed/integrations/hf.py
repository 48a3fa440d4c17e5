"""Hugging Face transformers: document-packed attention as an ``attn_implementation``.

One line switches a model (after :func:`register`, which ``import`` of this module does not do)::

    import doc_packed.integrations.hf as dp_hf

    dp_hf.register()  # "doc_packed" in transformers' AttentionInterface and AttentionMaskInterface
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="doc_packed")

Document boundaries come from the call, first that applies:

1. ``doc_packed_cu_seqlens=`` ``[B, MAX_DOCS + 1]`` (:func:`doc_packed.doc_packed_attn`'s rows
   form), passed to the model's forward like any attention keyword;
2. ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (+ ``max_length_q/k``), the flattened-tokens keywords of
   transformers' flash-attention path (``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``);
3. ``position_ids``: a document starts at each row start and wherever a position does not continue
   the previous one (``pos[t] != pos[t - 1] + 1``: ``DataCollatorWithFlattening`` restarts them at 0),
   transformers' own rule (``masking_utils.find_packed_sequence_indices``);
4. a 2-D padding ``attention_mask`` further splits each row where it turns on or off; padding
   tokens get output 0 (as the flash path's unpadding gives).

Under ``torch.autocast`` q, k and v run in the autocast dtype (as autocast runs sdpa, and as
transformers' flash path casts them). Per layer it takes what the model passes: GQA (no K/V repeat), ``scaling``, ``sliding_window``
(transformers' window counts the query itself: a window ``W`` sees ``W - 1`` keys back),
``softcap`` (Gemma 2) and ``s_aux`` sinks (GPT-OSS). Not supported (ValueError): attention dropout
> 0, a KV cache past the prompt (queries shorter than keys: generation), ``output_attentions``
weights (None is returned, as flash-attention does).

Boundaries from ``position_ids`` or a mask cost one host read per forward (cached on the tensor,
so every layer shares it). Under ``torch.compile`` and AutoParallel there is no host read: pass
``doc_packed_cu_seqlens`` (what :class:`PackedCausalLM` does); without it the boundaries are built
on the device with ``S`` document slots per row.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

import doc_packed as dp

from .. import _compat

__all__ = ["NAME", "TESTED", "PackedCausalLM", "attention_forward", "document_boundaries", "register"]

NAME = "doc_packed"  # the attn_implementation :func:`register` installs by default
TESTED = ("5.17", "5.23")  # transformers versions this module was checked on (pyproject's extra: >=5.17,<6)
CU_SEQLENS_KWARG = "doc_packed_cu_seqlens"


def register(name: str = NAME) -> str:
    """Register :func:`attention_forward` in transformers' ``AttentionInterface`` and a mask
    function in its ``AttentionMaskInterface`` under ``name``; return ``name``. Idempotent.

    The mask function hands attention a 2-D padding mask as given (or None): no dense
    ``[B, 1, S, S]`` mask is ever built, whatever the packing."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    try:
        import transformers
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as err:
        raise ImportError(
            f"doc_packed.integrations.hf needs transformers 5.x: pip install 'doc-packed[hf]' ({err})"
        ) from err
    major = int(transformers.__version__.split(".")[0])
    if major < 5:
        raise ImportError(
            f"doc_packed.integrations.hf needs transformers >= 5 (its AttentionInterface keywords), "
            f"found {transformers.__version__}"
        )
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, _padding_mask_only)
    return name


def _padding_mask_only(
    batch_size: int,
    q_length: int,
    kv_length: int,
    *args: Any,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """transformers' mask hook: the 2-D padding mask (sliced to the keys, as its flash hook does)
    or None. Document structure reaches attention through ``position_ids`` and the cu_seqlens
    keywords, never through a dense mask."""
    if attention_mask is None:
        return None
    return attention_mask[:, -kv_length:]


# ----------------------------------------------------------------------------- boundaries


def _starts(position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None, B: int, S: int, device):
    """``[B, S]`` bool, True where a document starts; None when every row is one document."""
    starts = None
    if position_ids is not None:
        pos = position_ids.expand(B, S) if position_ids.shape[0] != B else position_ids
        starts = torch.ones(B, S, dtype=torch.bool, device=device)
        starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    if attention_mask is not None:
        m = attention_mask.bool()
        flips = torch.ones(B, S, dtype=torch.bool, device=device)
        flips[:, 1:] = m[:, 1:] != m[:, :-1]
        starts = flips if starts is None else starts | flips
    return starts


def _cu_on_device(starts: torch.Tensor) -> torch.Tensor:
    """``[B, S + 1]`` int32 boundaries from a start mask without a host read (S document slots;
    unused ones repeat S): the traceable form."""
    B, S = starts.shape
    doc = starts.to(torch.int32).cumsum(1, dtype=torch.int32) - 1
    pos = torch.arange(S, dtype=torch.int32, device=starts.device).expand(B, S)
    slot = torch.where(starts, doc, S + 1).to(torch.int64)
    cu = torch.full((B, S + 2), S, dtype=torch.int32, device=starts.device)
    cu.scatter_(1, slot, pos)
    return cu[:, : S + 1].contiguous()


def document_boundaries(
    position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None, batch: int, seq_len: int, device=None
) -> torch.Tensor:
    """``cu_seqlens [B, MAX_DOCS + 1]`` (int32) of a batch as transformers describes it: documents
    start at each row start, where ``position_ids`` does not continue (``pos[t] != pos[t-1] + 1``)
    and where the 2-D padding mask turns on or off. One host read in eager code (the number of
    slots); none under tracing (then ``S`` slots per row)."""
    for name, t in (("position_ids", position_ids), ("attention_mask", attention_mask)):
        if t is not None and (not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[-1] != seq_len):
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be [B, S] with S = {seq_len} (the query length), got {shape}")
    if device is None:
        source = position_ids if position_ids is not None else attention_mask
        if source is None:
            raise ValueError("document_boundaries needs position_ids, attention_mask or device=")
        device = source.device
    starts = _starts(position_ids, attention_mask, batch, seq_len, device)
    if starts is None:
        return torch.tensor([[0, seq_len]] * batch, dtype=torch.int32, device=device)
    if _tracing(starts):
        return _cu_on_device(starts)
    return dp.cu_seqlens_from_document_ids(starts.to(torch.int32).cumsum(1))


def _tracing(t: torch.Tensor) -> bool:
    return torch.compiler.is_compiling() or _compat.modes_active() or type(t) is not torch.Tensor


class _Memo:
    """The last boundaries built, keyed on the identity and version of the tensors they came
    from: every layer of one forward gets the same ``position_ids`` / mask objects."""

    def __init__(self) -> None:
        self.key: tuple = ()
        self.refs: tuple = ()
        self.value: torch.Tensor | None = None

    def get(self, tensors: tuple, build):
        if _tracing(next(t for t in tensors if t is not None)):
            return build()
        key = tuple(None if t is None else (id(t), _compat.tensor_version(t), t.shape) for t in tensors)
        alive = all((r is None and t is None) or (r is not None and r() is t) for r, t in zip(self.refs, tensors))
        if self.value is None or key != self.key or not alive or len(self.refs) != len(tensors):
            self.value = build()
            self.key = key
            self.refs = tuple(None if t is None else weakref.ref(t) for t in tensors)
        return self.value


_MEMO = _Memo()


# ----------------------------------------------------------------------------- attention


def _check_call(module, query, key, dropout, kwargs) -> None:
    if dropout:
        raise ValueError(
            f"doc_packed attention has no attention dropout, got dropout={dropout}: set the config's "
            "attention_dropout to 0.0 (or use attn_implementation='eager' / 'sdpa')"
        )
    if key.shape[2] != query.shape[2]:
        raise ValueError(
            f"doc_packed attention takes queries and keys of one length (training and prompt processing), got "
            f"{query.shape[2]} queries and {key.shape[2]} keys (a KV cache while generating): generate with "
            "attn_implementation='sdpa' (model.set_attn_implementation('sdpa'))"
        )


def attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    is_causal: bool | None = None,
    position_ids: torch.Tensor | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    max_length_q: int | None = None,
    max_length_k: int | None = None,
    doc_packed_cu_seqlens: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``query [B, H_q, S, D]``, ``key/value
    [B, H_kv, S, D]``; returns ``(out [B, S, H_q, D_v], None)``. See the module docstring for
    where document boundaries come from."""
    _check_call(module, query, key, dropout, kwargs)
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    window = (-1, -1)
    if sliding_window is not None:
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
        window = (sliding_window - 1, 0 if causal else sliding_window - 1)
    variants: dict[str, Any] = {}
    if softcap is not None and softcap != 0:
        variants["softcap"] = float(softcap)
    if s_aux is not None:
        variants["sinks"] = s_aux
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):
        # autocast runs sdpa in its dtype, and transformers' flash path casts to it: RoPE leaves
        # q and k in float32 (float32 cos / sin) next to a bf16 v
        dtype = torch.get_autocast_dtype(device_type)
        query, key, value = (t.to(dtype) for t in (query, key, value))
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # [B, S, H, D] views
    B, S = q.shape[:2]

    if doc_packed_cu_seqlens is None and cu_seq_lens_q is not None:
        return _flat(q, k, v, cu_seq_lens_q, cu_seq_lens_k, max_length_q, causal, window, scaling, variants), None

    pad = attention_mask if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2 else None
    if attention_mask is not None and pad is None:
        raise ValueError(
            "doc_packed attention takes a 2-D padding attention_mask [B, S] or none, got "
            f"{type(attention_mask).__name__} of shape {tuple(getattr(attention_mask, 'shape', ()))} "
            f"(was the model built with attn_implementation='{NAME}' after doc_packed.integrations.hf.register()?)"
        )
    cu = doc_packed_cu_seqlens
    if cu is None:
        if position_ids is None and pad is None:
            cu = torch.tensor([[0, S]] * B, dtype=torch.int32, device=q.device)
        else:
            cu = _MEMO.get((position_ids, pad), lambda: document_boundaries(position_ids, pad, B, S, q.device))
    out = dp.doc_packed_attn(q, k, v, cu, causal=causal, window_size=window, scale=scaling, **variants)
    assert isinstance(out, torch.Tensor)
    if pad is not None:
        out = out * pad.to(out.dtype)[:, :, None, None]
    return out, None


def _flat(q, k, v, cu_q, cu_k, max_q, causal, window, scaling, variants) -> torch.Tensor:
    """transformers' flattened form: ``cu_seq_lens_q`` over the ``B * S`` tokens."""
    if cu_k is not None and cu_k is not cu_q and (cu_k.shape != cu_q.shape or not torch.equal(cu_k, cu_q)):
        raise ValueError(
            "doc_packed attention is self-attention over packed documents: cu_seq_lens_k must equal cu_seq_lens_q"
        )
    B, S = q.shape[:2]
    q, k, v = (t.reshape(B * S, *t.shape[2:]) for t in (q, k, v))
    max_seqlen = max_q if isinstance(max_q, int) and not isinstance(max_q, bool) else None
    out = dp.doc_packed_attn_varlen(
        q, k, v, cu_q, max_seqlen, causal=causal, window_size=window, scale=scaling, **variants
    )
    assert isinstance(out, torch.Tensor)
    return out.view(B, S, *out.shape[1:])


# ----------------------------------------------------------------------------- tracing


class PackedCausalLM(nn.Module):
    """A transformers causal LM as ``forward(input_ids [B, S], cu_seqlens [B, MAX_DOCS + 1]) ->
    logits [B, S, V]``: positions per document (:func:`doc_packed.positions`) and the boundaries
    passed as ``doc_packed_cu_seqlens``, no cache, a plain tensor out. The form AutoParallel and
    ``torch.compile(fullgraph=True)`` trace: no host reads, no data-dependent branches."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        positions = dp.positions(cu_seqlens, input_ids.shape[1])
        out = self.model(input_ids=input_ids, position_ids=positions, use_cache=False, **{CU_SEQLENS_KWARG: cu_seqlens})
        return out.logits
