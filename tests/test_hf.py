"""Hugging Face transformers models with ``attn_implementation="doc_packed"``.

No downloads: configs are built in code, weights are random, sizes tiny. References: the same
model with transformers' eager attention given a per-document mask built token by token by
doc_packed_testing/oracle.py (one per layer type: full, sliding window), and each document run alone through
eager attention. Not transformers' own packed-sequence detection: GPT-OSS (5.23) builds its masks
without ``position_ids``, so its eager and SDPA paths attend across packed documents.
Tolerance (float32 on CPU): logits and gradients within 2e-5 absolute of eager (measured: logits <= 2.8e-6
with values up to ~5, gradients <= 2.7e-7; the two sum the softmax in different orders).
"""

from __future__ import annotations

import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers not installed: pip install 'doc-packed[hf]'")

import doc_packed as dp  # noqa: E402
import doc_packed.integrations.hf as dp_hf  # noqa: E402
from doc_packed_testing.oracle import dense_mask  # noqa: E402

# the KV cache's keyword: transformers 5.24 renamed past_key_values to cache (the old name warns)
_CACHE_KWARG = "cache" if "cache" in inspect.signature(transformers.LlamaForCausalLM.forward).parameters else "past_key_values"

ATOL = 2e-5
VOCAB = 97


@pytest.fixture(scope="module", autouse=True)
def registered():
    assert dp_hf.register() == "doc_packed"


def _config(kind: str):
    common = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, attention_dropout=0.0, initializer_range=0.2,
    )
    if kind == "llama":
        return transformers.LlamaConfig(**common)
    if kind == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=8)
    if kind == "gemma2":  # softcapping everywhere, a 4-token sliding window on layer 0
        return transformers.Gemma2Config(
            **common, head_dim=8, sliding_window=4, attn_logit_softcapping=3.0, query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "full_attention"],
        )
    if kind == "gpt_oss":  # learnable sinks, a 3-token sliding window on layer 0, tiny MoE
        cfg = transformers.GptOssConfig(
            **common, head_dim=8, sliding_window=3, num_local_experts=4, num_experts_per_tok=2,
            layer_types=["sliding_attention", "full_attention"],
        )
        return cfg
    raise ValueError(kind)


MODELS = ["llama", "qwen3", "gemma2", "gpt_oss"]


def _pair(kind: str):
    """(doc_packed model, eager model) with the same random weights, float32, train mode."""
    torch.manual_seed(0)
    # one config object each: from_config records the implementation on the config it is given
    ours = transformers.AutoModelForCausalLM.from_config(_config(kind), attn_implementation="doc_packed")
    ref = transformers.AutoModelForCausalLM.from_config(_config(kind), attn_implementation="eager")
    assert ours.config._attn_implementation == "doc_packed" and ref.config._attn_implementation == "eager"
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if "sinks" in name:  # zero-initialised: make them matter
                p.copy_(torch.randn_like(p))
    ref.load_state_dict(ours.state_dict())
    return ours.float().train(), ref.float().train()


def _packed(lengths: list[list[int]], seed: int = 0):
    """input_ids [B, S] and position_ids restarting at 0 per document (every row the same S)."""
    g = torch.Generator().manual_seed(seed)
    S = sum(lengths[0])
    ids = torch.randint(0, VOCAB, (len(lengths), S), generator=g)
    pos = torch.cat([torch.cat([torch.arange(n) for n in row])[None] for row in lengths])
    return ids, pos


def _document_masks(model, lengths: list[list[int]]):
    """The eager model's ``attention_mask``: additive ``[B, 1, S, S]`` per-document causal masks,
    as a dict by layer type where the model has several (a sliding window of ``W`` sees ``W - 1``
    keys back)."""
    cfg = model.config
    S = sum(lengths[0])

    def additive(window):
        rows = []
        for row in lengths:
            bounds = [0]
            for n in row:
                bounds.append(bounds[-1] + n)
            rows.append(dense_mask(bounds, S, True, window))
        m = torch.stack(rows)[:, None]
        return torch.zeros(m.shape).masked_fill(~m, torch.finfo(torch.float32).min)

    full = additive((-1, 0))
    if "sliding_attention" not in (getattr(cfg, "layer_types", None) or ()):
        return full
    return {"full_attention": full, "sliding_attention": additive((cfg.sliding_window - 1, 0))}


LAYOUTS = [[[5, 1, 9, 3]], [[7, 6, 5], [18]]]  # one packed row; two rows, one unpacked


@pytest.mark.parametrize("kind", MODELS)
@pytest.mark.parametrize("lengths", LAYOUTS, ids=["1row", "2rows"])
def test_logits_and_grads_match_eager_per_document(kind, lengths):
    ours, ref = _pair(kind)
    ids, pos = _packed(lengths)
    outs = []
    for model, mask in ((ours, None), (ref, _document_masks(ref, lengths))):
        logits = model(ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
        logits.square().mean().backward()
        outs.append((logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (lo, go), (lr, gr) = outs
    # the packing matters: a plain causal mask over the row gives other logits
    plain = ref(ids, use_cache=False).logits.detach()
    assert (plain - lr).abs().max() > 100 * ATOL
    torch.testing.assert_close(lo, lr, atol=ATOL, rtol=0)
    assert go.keys() == gr.keys() and len(go) > 5
    for name in go:
        torch.testing.assert_close(go[name], gr[name], atol=ATOL, rtol=0, msg=name)
    if kind == "gpt_oss":
        assert any("sinks" in n and go[n].abs().max() > 0 for n in go)


@pytest.mark.parametrize("kind", MODELS)
def test_each_document_as_if_alone(kind):
    """Independent of transformers' packed mask: each document's logits equal the document run
    alone (one row, positions 0..n-1) through the eager model."""
    ours, ref = _pair(kind)
    lengths = [5, 1, 9, 3]
    ids, pos = _packed([lengths])
    with torch.no_grad():
        packed = ours(ids, position_ids=pos, use_cache=False).logits
        start = 0
        for n in lengths:
            alone = ref(ids[:, start : start + n], use_cache=False).logits
            torch.testing.assert_close(packed[:, start : start + n], alone, atol=ATOL, rtol=0)
            start += n


def test_flattening_collator_same_per_document_loss_as_one_by_one():
    """A DataCollatorWithFlattening batch (position_ids, and with return_flash_attn_kwargs its
    cu_seq_lens_q/k and max_length_q/k) gives each document the loss it has alone."""
    from transformers import DataCollatorWithFlattening

    ours, _ = _pair("llama")
    g = torch.Generator().manual_seed(3)
    docs = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (6, 2, 11, 4)]
    features = [{"input_ids": d} for d in docs]

    def per_doc_loss(logits, labels):
        # next-token loss per document, from the collator's labels (-100 at each document's start)
        lp = torch.nn.functional.cross_entropy(logits[0, :-1], labels[0, 1:], reduction="none", ignore_index=-100)
        out, start = [], 0
        for d in docs:
            out.append(lp[start : start + len(d) - 1].sum() / (len(d) - 1))
            start += len(d)
        return torch.stack(out)

    with torch.no_grad():
        alone = []
        for d in docs:
            t = torch.tensor([d])
            logits = ours(t, use_cache=False).logits
            alone.append(torch.nn.functional.cross_entropy(logits[0, :-1], t[0, 1:]))
        alone = torch.stack(alone)
        for flash_kwargs in (False, True):
            batch = DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs, return_tensors="pt")(features)
            assert ("cu_seq_lens_q" in batch) == flash_kwargs
            labels = batch.pop("labels")
            logits = ours(**batch, use_cache=False).logits
            torch.testing.assert_close(per_doc_loss(logits, labels), alone, atol=ATOL, rtol=0)


def test_flash_kwargs_over_several_rows():
    """cu_seq_lens_q over the flattened B * S tokens (transformers' padding-free form) equals the
    position_ids form."""
    ours, _ = _pair("qwen3")
    lengths = [[7, 6, 5], [4, 14]]
    ids, pos = _packed(lengths)
    flat = [0]
    for row in lengths:
        for n in row:
            flat.append(flat[-1] + n)
    cu = torch.tensor(flat, dtype=torch.int32)
    with torch.no_grad():
        a = ours(ids, position_ids=pos, use_cache=False).logits
        b = ours(ids, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=14, max_length_k=14,
                 use_cache=False).logits
    torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_doc_packed_cu_seqlens_keyword_and_packed_wrapper():
    ours, ref = _pair("gemma2")
    lengths = [[7, 6, 5], [4, 14]]
    ids, pos = _packed(lengths)
    cu = dp.cu_seqlens_from_lengths(lengths, 18, max_docs=4)
    with torch.no_grad():
        expected = ref(ids, attention_mask=_document_masks(ref, lengths), position_ids=pos, use_cache=False).logits
        a = ours(ids, position_ids=pos, doc_packed_cu_seqlens=cu, use_cache=False).logits
        b = dp_hf.PackedCausalLM(ours)(ids, cu)
    torch.testing.assert_close(a, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(b, expected, atol=ATOL, rtol=0)


def test_autocast_runs_attention_in_the_autocast_dtype():
    """Under torch.autocast(bf16) RoPE leaves q and k in float32 next to a bf16 v: attention runs
    in bf16 (as sdpa does under autocast). Its logits and gradients stay as close to sdpa's under
    autocast as twice what bf16 itself moves sdpa (autocast against float32): measured 3.3e-2
    against 2.9e-2 (largest gap over the largest value, logits and every gradient)."""
    torch.manual_seed(0)
    ours = transformers.AutoModelForCausalLM.from_config(_config("llama"), attn_implementation="doc_packed")
    ref = transformers.AutoModelForCausalLM.from_config(_config("llama"), attn_implementation="sdpa")
    ref.load_state_dict(ours.state_dict())
    ids, pos = _packed([[5, 1, 9, 3]])

    def run(model, autocast):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(ids, position_ids=pos, use_cache=False).logits
        assert logits.dtype == (torch.bfloat16 if autocast else torch.float32)
        logits.float().square().mean().backward()
        return [logits.float()] + [p.grad.clone() for p in model.parameters()]

    def gap(xs, ys):
        return max(((x - y).abs().max() / y.abs().max()).item() for x, y in zip(xs, ys))

    ours_bf16, ref_bf16, ref_f32 = run(ours, True), run(ref, True), run(ref, False)
    bf16_alone = gap(ref_bf16, ref_f32)
    assert 1e-4 < bf16_alone < 0.1, bf16_alone
    assert gap(ours_bf16, ref_bf16) <= 2 * bf16_alone, (gap(ours_bf16, ref_bf16), bf16_alone)


def test_padding_mask_right_and_left():
    """A 2-D padding mask: real tokens match eager with that mask, padding outputs are 0 (as in
    transformers' flash path), and padding never leaks into real tokens."""
    ours, ref = _pair("llama")
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[0, 7:] = 0  # right padding
    mask[1, :3] = 0  # left padding
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        a = ours(ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
        e = ref(ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
        real = mask.bool()
        torch.testing.assert_close(a[real], e[real], atol=ATOL, rtol=0)
        other = ids.clone()
        other[~real] = (other[~real] + 1) % VOCAB  # other padding tokens: same real outputs
        b = ours(other, attention_mask=mask, position_ids=pos, use_cache=False).logits
        torch.testing.assert_close(a[real], b[real], atol=0, rtol=0)


def test_boundaries_are_built_once_per_forward(monkeypatch):
    ours, _ = _pair("llama")
    ids, pos = _packed([[5, 1, 9, 3]])
    built = []
    real = dp_hf.document_boundaries
    monkeypatch.setattr(dp_hf, "document_boundaries", lambda *a: built.append(1) or real(*a))
    with torch.no_grad():
        ours(ids, position_ids=pos, use_cache=False)
    assert len(built) == 1  # two layers, one host read
    pos2 = pos.clone()
    pos2[0, 6] = 0  # another layout in another tensor: rebuilt
    with torch.no_grad():
        ours(ids, position_ids=pos2, use_cache=False)
    assert len(built) == 2


def test_document_boundaries():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0], [3, 4, 5, 6, 7, 8]])
    assert dp_hf.document_boundaries(pos, None, 2, 6).tolist() == [[0, 3, 5, 6], [0, 6, 6, 6]]
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    assert dp_hf.document_boundaries(pos, mask, 2, 6).tolist() == [[0, 3, 5, 6], [0, 4, 6, 6]]
    # the traceable form: S slots, the same documents
    assert dp_hf._cu_on_device(torch.tensor([[True, False, True, False]])).tolist() == [[0, 2, 4, 4, 4]]
    with pytest.raises(ValueError, match=r"position_ids must be \[B, S\] with S = 5"):
        dp_hf.document_boundaries(pos, None, 2, 5)


def test_unsupported_calls_raise_clearly():
    ours, _ = _pair("llama")
    ids, pos = _packed([[5, 1, 9, 3]])
    ours.config.attention_dropout = 0.1
    for layer in ours.model.layers:
        layer.self_attn.attention_dropout = 0.1
    with pytest.raises(ValueError, match="no attention dropout, got dropout=0.1"):
        ours(ids, position_ids=pos, use_cache=False)
    ours.eval()  # dropout is off outside training
    with torch.no_grad():
        out = ours(ids[:, :5], use_cache=True)
        with pytest.raises(ValueError, match="queries and keys of one length.*1 queries and 6 keys"):
            ours(ids[:, 5:6], use_cache=True, **{_CACHE_KWARG: out.past_key_values})
    with pytest.raises(TypeError, match="name must be a non-empty str"):
        dp_hf.register("")


def test_import_doc_packed_does_not_import_integrations():
    import subprocess
    import sys

    code = "import sys, doc_packed; print(any(m.startswith(('doc_packed.integrations', 'transformers')) for m in sys.modules))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "False"
