"""torchtitan's Llama3 and Qwen3 (from the ``torchtitan`` package) with doc-packed as the inner
attention, in both layouts: rows ``[B, L, H, D]`` with our ``cu_seqlens [B, MAX_DOCS + 1]``, and
torchtitan's flat ``[T, H, D]`` with ``VarlenMetadata`` (cu_seqlens over ``T = B * L``).

Reference: the same model, same weights, with a test inner attention that runs doc_packed_testing/oracle.py
(float64 dense attention under a per-document mask built token by token), and each document run
alone. Tolerance (float32 on CPU): 2e-5 absolute on logits and gradients (measured below 3e-6).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("torchtitan", reason="torchtitan not installed: pip install 'doc-packed[torchtitan]' (README)")

from torchtitan.models.common.attention import VarlenAttention  # noqa: E402
from torchtitan.protocols.module import Module  # noqa: E402

import doc_packed as dp  # noqa: E402
from doc_packed.integrations.torchtitan import DocPackedAttention, row_masks, use_doc_packed  # noqa: E402
from doc_packed_testing.oracle import reference  # noqa: E402

ATOL = 2e-5


class OracleAttention(Module):
    """Test-only inner attention: doc_packed_testing/oracle.py's float64 reference on rows ``cu_seqlens``."""

    @dataclass(kw_only=True, slots=True)
    class Config(VarlenAttention.Config):
        pass

    def __init__(self, config):
        super().__init__()
        left, right = config.window_size
        self.window = (left, 0)

    def forward(self, q, k, v, *, attention_masks, scale=None, **kwargs):
        out, _ = reference(q, k, v, attention_masks, True, self.window, scale)
        return out.to(q.dtype)


def _config(kind: str, window=(-1, 0)):
    if kind == "llama3":
        from torchtitan.models.llama3 import llama3_configs

        cfg = llama3_configs["debugmodel"](attn_backend="varlen")  # dim 256, 16 heads
    else:
        from torchtitan.models.qwen3 import qwen3_configs

        cfg = qwen3_configs["debugmodel"](attn_backend="varlen")  # GQA 16/8, head dim 128, qk-norm
    cfg.layers = cfg.layers[:2]
    for layer in cfg.layers:
        layer.attention.inner_attention = VarlenAttention.Config(window_size=window)
    return cfg


def _models(kind: str, window=(-1, 0)):
    ours_cfg = use_doc_packed(_config(kind, window))
    assert all(isinstance(layer.attention.inner_attention, DocPackedAttention.Config) for layer in ours_cfg.layers)
    ref_cfg = _config(kind, window)
    for layer in ref_cfg.layers:
        layer.attention.inner_attention = OracleAttention.Config(window_size=window)
    torch.manual_seed(0)
    ours = ours_cfg.build()
    ours.init_states()
    ref = ref_cfg.build()
    ref.load_state_dict(ours.state_dict())
    return ours, ref


def _batch(lengths, vocab=2048, seed=0):
    g = torch.Generator().manual_seed(seed)
    L = sum(lengths[0])
    tokens = torch.randint(0, vocab, (len(lengths), L), generator=g)
    positions = torch.cat([torch.cat([torch.arange(n) for n in row])[None] for row in lengths])
    return tokens, positions, dp.cu_seqlens_from_lengths(lengths, L, max_docs=4)


LENGTHS = [[10, 1, 13, 8], [32]]


def _step(model, tokens, positions, masks):
    logits = model(tokens, positions, masks)
    logits.square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return logits.detach(), grads


@pytest.mark.parametrize("kind", ["llama3", "qwen3"])
@pytest.mark.parametrize("layout", ["rows", "flat", "flat-tensor"])
def test_logits_and_grads_match_the_oracle(kind, layout):
    ours, ref = _models(kind)
    tokens, positions, cu = _batch(LENGTHS)
    masks = {"rows": cu, "flat": ours.get_attention_masks(positions)}.get(layout)
    if layout == "flat-tensor":
        masks = ours.get_attention_masks(positions).cu_seq_q  # the traceable 1-D form
    if layout == "flat":
        assert masks.cu_seq_q.tolist() == [0, 10, 11, 24, 32, 64]  # torchtitan's own, over T = B * L
    lo, go = _step(ours, tokens, positions, masks)
    lr, gr = _step(ref, tokens, positions, cu)
    # the packing matters: one document per row gives other logits
    whole = ref(tokens, torch.arange(32).expand(2, 32), dp.cu_seqlens_from_lengths([[32], [32]], 32)).detach()
    assert (whole - lr).abs().max() > 100 * ATOL
    torch.testing.assert_close(lo, lr, atol=ATOL, rtol=0)
    assert go.keys() == gr.keys() and len(go) > 10
    for name in go:
        torch.testing.assert_close(go[name], gr[name], atol=ATOL, rtol=0, msg=name)


def test_sliding_window_and_each_document_alone():
    """A torchtitan window (VarlenAttention's window_size=(W, 0)) carries over, and every document
    of a packed row gets the logits it has alone."""
    ours, ref = _models("llama3", window=(4, 0))
    assert ours.layers["0"].attention.inner_attention.window == (4, 0)
    tokens, positions, cu = _batch(LENGTHS)
    with torch.no_grad():
        packed = ours(tokens, positions, ours.get_attention_masks(positions))
        start = 0
        for n in LENGTHS[0]:
            one = tokens[:1, start : start + n]
            alone = ref(one, torch.arange(n)[None], dp.cu_seqlens_from_lengths([[n]], n))
            torch.testing.assert_close(packed[:1, start : start + n], alone, atol=ATOL, rtol=0)
            start += n


def test_out_transform_gets_the_lse_in_both_layouts():
    """torchtitan's ``out_transform(out_BLNH, lse_BLN)`` epilogue (gated attention variants)."""
    ours, _ = _models("qwen3")
    attn = ours.layers["0"].attention.inner_attention
    tokens, positions, cu = _batch(LENGTHS)
    q = torch.randn(2, 32, 16, 128)
    k = v = torch.randn(2, 32, 8, 128)
    seen = {}

    def keep(name):
        def transform(out, lse):
            seen[name] = (out, lse)
            return out

        return transform

    attn(q, k, v, attention_masks=cu, out_transform=keep("rows"))
    attn(q, k, v, attention_masks=ours.get_attention_masks(positions), out_transform=keep("flat"))
    _, lse_ref = reference(q, k, v, cu, True, (-1, 0))
    for name in ("rows", "flat"):
        out, lse = seen[name]
        assert lse.shape == (2, 32, 16)
        torch.testing.assert_close(lse.double(), lse_ref.transpose(1, 2), atol=1e-5, rtol=0)


def test_row_masks_from_positions():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]])
    assert row_masks(positions).tolist() == [[0, 3, 5, 6], [0, 6, 6, 6]]
    assert row_masks(positions, max_docs=4).shape == (2, 5)


def test_bad_attention_masks_and_configs_raise():
    ours, _ = _models("llama3")
    attn = ours.layers["0"].attention.inner_attention
    q = torch.randn(1, 8, 16, 16)
    with pytest.raises(TypeError, match="needs attention_masks: torchtitan's VarlenMetadata.*got NoneType"):
        attn(q, q, q, attention_masks=None)
    with pytest.raises(TypeError, match="got a 3-D tensor"):
        attn(q, q, q, attention_masks=torch.zeros(1, 1, 2, dtype=torch.int32))
    with pytest.raises(TypeError, match="torchtitan decoder config with a `layers` list"):
        use_doc_packed(object())
