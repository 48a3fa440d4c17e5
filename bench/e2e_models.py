"""The models bench_e2e.py trains, each as ``forward(tokens [B, S], cu_seqlens [B, MAX_DOCS + 1])
-> logits [B, S, V]``, the form AutoParallel traces:

- ``example``: doc_packed's example model (``doc_packed_examples.model.Transformer``, its 4x MLP);
- ``llama8b``: the same model in Llama-3-8B's shape (``examples.LLAMA_8B``: dim 4096, 32 / 8 heads,
  SwiGLU hidden 14336, vocab 128256; no RoPE), ``--layers`` of them;
- ``hf-llama``: transformers' ``LlamaForCausalLM`` in that shape (RoPE), through
  ``doc_packed.integrations.hf.PackedCausalLM``;
- ``titan-llama``: torchtitan's Llama3 ``8B`` config (``--layers`` of its layers) with
  ``use_doc_packed``, positions per document computed in the graph.

Each also runs, for the one-device anchor, with its library's own attention on the same packed
batch (:func:`anchor_call`): transformers' ``attn_implementation`` (``sdpa``, ``flex_attention``,
``flash_attention_2``, ...: boundaries from ``position_ids`` that restart per document) or
torchtitan's inner attention (``varlen``: torch's varlen op, FA3/FA4 where torchtitan activates
them; ``flex``: a document BlockMask), its masks made outside the compiled model each step, as
torchtitan's trainer makes them.

Activation checkpointing is each library's own: ``Transformer(checkpoint=True)``,
``activation_checkpointing_enable`` (transformers; ``gradient_checkpointing_enable`` before 5.24), ``FullAC``
(torchtitan): every block recomputed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

import doc_packed as dp
from doc_packed_examples.model import LLAMA_8B, Transformer

MODELS = ("example", "llama8b", "hf-llama", "titan-llama")
# each model's attentions for the anchor: doc_packed first, then the library's own
ATTENTIONS = {
    "example": ("doc_packed",),
    "llama8b": ("doc_packed",),
    "hf-llama": ("doc_packed", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3"),
    "titan-llama": ("doc_packed", "varlen", "flex"),
}
DEFAULT_ANCHOR = {"example": "doc_packed", "llama8b": "doc_packed", "hf-llama": "doc_packed,sdpa,flex_attention",
                  "titan-llama": "doc_packed,varlen,flex"}  # fmt: skip
# on CPU (--dry-run): flex_attention has no CPU backward, torch's varlen op no CPU kernel
DEFAULT_ANCHOR_CPU = {**DEFAULT_ANCHOR, "hf-llama": "doc_packed,sdpa", "titan-llama": "doc_packed"}
# the tiny shape of --dry-run (every model): 2 layers
TINY = dict(vocab=256, dim=64, n_heads=4, n_kv_heads=2, hidden=128, n_layers=2)


@dataclass
class ModelSpec:
    """Which model, its shape, and how it runs. ``cfg`` keys: vocab, dim, n_heads, n_kv_heads,
    n_layers, hidden (None: the example model's 4x MLP)."""

    name: str
    cfg: dict
    checkpoint: bool = False  # activation checkpointing
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.name not in MODELS:
            raise ValueError(f"model must be one of {MODELS}, got {self.name!r}")


def spec_for(name: str, *, layers: int, dim: int, checkpoint: bool, tiny: bool) -> ModelSpec:
    """The bench's shapes: ``example`` keeps bench_e2e's historical one (vocab 8192, ``dim``, head
    dim 128, ``dim // 512`` K/V heads, 4x MLP); the others are Llama-3-8B-shaped. ``tiny``: the
    CPU dry run's shape for every model."""
    if tiny:
        cfg = dict(TINY)
        if name == "example":
            cfg["hidden"] = None
        elif name == "titan-llama":  # torchtitan's debug model (dim 256, 16 heads, vocab 2048)
            cfg.update(vocab=2048, dim=256, n_heads=16, n_kv_heads=16, hidden=768)
    elif name == "example":
        cfg = dict(vocab=8192, dim=dim, n_heads=dim // 128, n_kv_heads=max(1, dim // 512), hidden=None)
    else:
        cfg = dict(LLAMA_8B)
    cfg["n_layers"] = TINY["n_layers"] if tiny else layers
    return ModelSpec(name, cfg, checkpoint)


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Build a model with its parameters on the meta device and its buffers real (on the default
    device): RoPE tables computed as the library computes them, no weights allocated or
    initialised. (Parameters are moved to meta as each module registers them.)"""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def _hf_config(cfg: dict):
    import transformers

    return transformers.LlamaConfig(
        vocab_size=cfg["vocab"], hidden_size=cfg["dim"], intermediate_size=cfg["hidden"],
        num_hidden_layers=cfg["n_layers"], num_attention_heads=cfg["n_heads"], num_key_value_heads=cfg["n_kv_heads"],
        max_position_embeddings=131072, tie_word_embeddings=False,
    )  # fmt: skip


def _titan_config(cfg: dict, attn: str):
    from torchtitan.models.llama3 import llama3_configs

    from doc_packed.integrations.torchtitan import use_doc_packed

    flavor = "8B" if cfg["dim"] == LLAMA_8B["dim"] else "debugmodel"
    base = llama3_configs[flavor](attn_backend="varlen" if attn == "doc_packed" else attn)
    if base.dim != cfg["dim"] or base.vocab_size != cfg["vocab"]:
        raise ValueError(f"titan-llama runs torchtitan's 8B or debugmodel shapes, got {cfg}")
    base.layers = base.layers[: cfg["n_layers"]]
    return use_doc_packed(base) if attn == "doc_packed" else base


class _TitanPacked(nn.Module):
    """torchtitan's decoder as ``forward(tokens, cu_seqlens)``: positions per document in the graph
    (RoPE restarts per document), ``cu_seqlens`` as its attention masks (rows layout)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens, dp.positions(cu_seqlens, tokens.shape[1]), cu_seqlens)


class _HFPositions(nn.Module):
    """A transformers causal LM as ``forward(tokens, positions) -> logits``: its own attention finds
    the documents from ``position_ids`` that restart at 0 (as ``DataCollatorWithFlattening`` packs)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=tokens, position_ids=positions, use_cache=False).logits


def hf_checkpointing(model) -> None:
    """transformers' activation checkpointing, non-reentrant, every layer: 5.24 renamed
    ``gradient_checkpointing_enable`` (the old name warns) to ``activation_checkpointing_enable``."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def build(spec: ModelSpec, attn: str = "doc_packed") -> nn.Module:
    """The model on the default device (under ``torch.device("meta")`` or :func:`parameters_on_meta`
    for AutoParallel), in float32, training mode. ``attn="doc_packed"``: ``forward(tokens,
    cu_seqlens)``; another attention (anchor only): see :func:`anchor_call`."""
    if attn not in ATTENTIONS[spec.name]:
        raise ValueError(f"{spec.name} runs attention {ATTENTIONS[spec.name]}, got {attn!r}")
    cfg = spec.cfg
    if spec.name in ("example", "llama8b"):
        keys = ("vocab", "dim", "n_heads", "n_kv_heads", "n_layers", "hidden")
        return Transformer(**{k: cfg[k] for k in keys}, checkpoint=spec.checkpoint)
    if spec.name == "hf-llama":
        import transformers

        import doc_packed.integrations.hf as dp_hf

        dp_hf.register()
        model = transformers.AutoModelForCausalLM.from_config(_hf_config(cfg), attn_implementation=attn)
        if spec.checkpoint:
            hf_checkpointing(model)
        model.train()
        return dp_hf.PackedCausalLM(model) if attn == "doc_packed" else _HFPositions(model)
    tcfg = _titan_config(cfg, attn)
    model = tcfg.build()
    if not any(p.is_meta for p in model.parameters()):
        model.init_states()
    if spec.checkpoint:
        from torchtitan.distributed.activation_checkpoint import FullAC

        FullAC(FullAC.Config()).apply(model)
    return _TitanPacked(model) if attn == "doc_packed" else model


def anchor_call(spec: ModelSpec, attn: str, model: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], tuple]:
    """``inputs(tokens, cu_seqlens) -> args`` of ``model(*args)`` (``model`` from :func:`build` with
    ``attn``), made outside the compiled model: for another library's attention, the positions and
    masks it makes from the packed batch (host reads included, as its trainer pays them)."""
    if attn == "doc_packed":
        return lambda tokens, cu: (tokens, cu)
    if spec.name == "hf-llama":
        return lambda tokens, cu: (tokens, dp.positions(cu, tokens.shape[1]))

    def titan(tokens, cu):
        positions = dp.positions(cu, tokens.shape[1])
        return tokens, positions, model.get_attention_masks(positions)

    return titan


def step_flops(spec: ModelSpec, model: nn.Module, cu_seqlens: torch.Tensor, seq_len: int) -> float:
    """Model FLOPs of one training step on rows laid out by ``cu_seqlens``, as
    :func:`doc_packed_examples.model.training_flops` counts them: ``6 * tokens * (weights of every
    Linear)`` plus, per layer, 3.5 x the forward's ``4 * pairs * H_q * D`` with the layout's exact
    causal pairs (activation checkpointing's recompute is not model work: not counted)."""
    from doc_packed.flops import total_pairs

    cfg = spec.cfg
    tokens = cu_seqlens.shape[0] * seq_len
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    pairs = total_pairs(cu_seqlens.cpu(), seq_len, True, -1, 0)
    head_dim = cfg["dim"] // cfg["n_heads"]
    return 6.0 * tokens * linear + cfg["n_layers"] * 3.5 * 4 * pairs * cfg["n_heads"] * head_dim


def init_weights(model: nn.Module, std: float = 0.02) -> None:
    """Normal(0, std) matrices and embeddings, ones for norm weights (vectors): local shards of
    DTensor parameters alike."""
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            if p.dim() == 1:
                local.fill_(1.0)
            else:
                local.normal_(0, std)


def document_losses(token_loss: torch.Tensor, doc_ids: torch.Tensor, num_docs: int, group=None) -> torch.Tensor:
    """Per-document mean loss ``[num_docs]`` (NaN for a document with no tokens) from per-token
    losses and each token's global document index (``row * MAX_DOCS + doc``), summed over
    ``group``'s ranks when given: each rank holds its tokens' part (replicas scale both sums alike)."""
    sums = torch.zeros(num_docs, dtype=torch.float64, device=token_loss.device)
    counts = torch.zeros(num_docs, dtype=torch.float64, device=token_loss.device)
    ids = doc_ids.reshape(-1).to(token_loss.device)
    sums.index_add_(0, ids, token_loss.detach().reshape(-1).double())
    counts.index_add_(0, ids, torch.ones(ids.numel(), dtype=torch.float64, device=ids.device))
    if group is not None:
        import torch.distributed as dist

        both = torch.stack([sums, counts])
        dist.all_reduce(both, group=group)
        sums, counts = both[0], both[1]
    return sums / counts


def global_doc_ids(cu_seqlens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """``[B, S]``: each token's document as ``row * MAX_DOCS + doc`` (unique over the batch)."""
    ids = dp.data.document_ids(cu_seqlens, seq_len)
    max_docs = cu_seqlens.shape[1] - 1
    return ids + max_docs * torch.arange(cu_seqlens.shape[0], device=ids.device)[:, None]
