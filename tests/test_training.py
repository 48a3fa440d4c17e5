"""Training settings in one process (fast): activation checkpointing changes no gradient and
saves less for the backward, in doc_packed's example model, a Hugging Face Llama and
torchtitan's Llama3 (each checkpointed its library's way); the mixed-precision reference of the
AutoParallel tests really computes in bf16; and bench/e2e_models.py's pieces that bench_e2e.py
reports from: the loss per document, the step's FLOPs, models built with parameters on meta and
real buffers. Placed runs (AutoParallel + AdamW + mixed precision + checkpointing on gloo ranks):
tests/test_ap_models.py::test_training_settings."""

from __future__ import annotations

import pytest
import torch

import doc_packed as dp
from ap_model_cases import Training, batches, build, plain_name, reference, to_dtype
from bench import e2e_models

MODELS = ["example", "hf", "torchtitan"]


def _needs(which):
    if which == "hf":
        pytest.importorskip("transformers")
    if which == "torchtitan":
        pytest.importorskip("torchtitan")


def _grads_and_saved(which: str, checkpoint: bool) -> tuple[dict[str, torch.Tensor], int]:
    """First step's gradients (float64) and the bytes autograd kept for the backward outside
    checkpointed regions."""
    torch.manual_seed(0)
    model, vocab = build(which, checkpoint=checkpoint)
    model = to_dtype(model, torch.float64)
    inputs, targets = batches(which, "rows", vocab, 1)[0]
    saved = 0

    def pack(t):
        nonlocal saved
        saved += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(*inputs)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    return {plain_name(k): p.grad for k, p in model.named_parameters()}, saved


@pytest.mark.parametrize("which", MODELS)
def test_activation_checkpointing_same_gradients(which):
    _needs(which)
    plain, saved_plain = _grads_and_saved(which, False)
    ckpt, saved_ckpt = _grads_and_saved(which, True)
    assert plain.keys() == ckpt.keys()
    for k in plain:
        assert torch.equal(plain[k], ckpt[k]), (k, (plain[k] - ckpt[k]).abs().max().item())
    assert saved_ckpt < 0.6 * saved_plain, (saved_ckpt, saved_plain)  # it recomputes instead of keeping


def test_mixed_precision_reference_computes_in_bf16():
    """The AutoParallel tests' one-process mixed-precision run (parameters cast to bf16 for the
    forward) differs from float32 by bf16 rounding, not more; its gradients are float32."""
    data = batches("example", "rows", 64, 2)
    f32 = reference("example", data, Training(optim="adamw", lr=1e-2, dtype=torch.float32))
    mp = reference("example", data, Training(optim="adamw", lr=1e-2, dtype=torch.float32, mixed_precision=True))
    diffs = [abs(a - b) / b for a, b in zip(f32[2], mp[2])]
    assert 1e-5 < max(diffs) < 2e-2, diffs
    assert {g.dtype for g in mp[3].values()} == {torch.float32}


def test_document_losses_match_each_document_alone():
    """The loss per document from per-token losses equals each document's own mean."""
    S, B = 16, 2
    cu = dp.cu_seqlens_from_lengths([[5, 3, 8], [16]], S, max_docs=4)
    tok = torch.rand(B, S)
    ids = e2e_models.global_doc_ids(cu, S)
    per_doc = e2e_models.document_losses(tok, ids, B * 4)
    want = [tok[0, :5].mean(), tok[0, 5:8].mean(), tok[0, 8:].mean(), tok[1].mean()]
    got = per_doc[~torch.isnan(per_doc)]
    torch.testing.assert_close(got, torch.stack(want).double())
    assert got.numel() == 4  # the empty slots are NaN, not 0


def test_step_flops_match_training_flops():
    """bench's FLOP count is the example model's training_flops, and SwiGLU adds its third matrix."""
    from doc_packed_examples.model import Transformer, training_flops

    cu = dp.cu_seqlens_from_lengths([[5, 20, 7], [32]], 32, max_docs=8)
    spec = e2e_models.spec_for("example", layers=2, dim=64, checkpoint=False, tiny=True)
    with torch.device("meta"):
        model = e2e_models.build(spec)
        ref = Transformer(vocab=256, dim=64, n_heads=4, n_kv_heads=2, n_layers=2)
    assert e2e_models.step_flops(spec, model, cu, 32) == training_flops(ref, cu, 32)
    spec8 = e2e_models.spec_for("llama8b", layers=3, dim=0, checkpoint=False, tiny=False)
    assert spec8.cfg == dict(vocab=128256, dim=4096, n_heads=32, n_kv_heads=8, hidden=14336, n_layers=3)
    with torch.device("meta"):
        big = e2e_models.build(spec8)
    per_layer = 4096 * 4096 * 2 + 4096 * 1024 * 2 + 3 * 4096 * 14336
    assert sum(p.numel() for p in big.parameters() if p.dim() == 2) == 3 * per_layer + 2 * 128256 * 4096


@pytest.mark.parametrize("name", ["hf-llama", "titan-llama"])
def test_parameters_on_meta_keeps_real_buffers(name):
    """Models bench_e2e places: parameters on meta (nothing allocated), buffers (RoPE tables)
    equal to a normal build's."""
    pytest.importorskip("transformers" if name == "hf-llama" else "torchtitan")
    spec = e2e_models.spec_for(name, layers=2, dim=0, checkpoint=False, tiny=True)
    with e2e_models.parameters_on_meta():
        meta = e2e_models.build(spec)
    real = e2e_models.build(spec)
    assert all(p.is_meta for p in meta.parameters())
    assert not any(p.is_meta for p in real.parameters())
    bufs = dict(meta.named_buffers())
    assert bufs and bufs.keys() == dict(real.named_buffers()).keys()
    for k, b in real.named_buffers():
        assert not bufs[k].is_meta and torch.equal(bufs[k], b), k
