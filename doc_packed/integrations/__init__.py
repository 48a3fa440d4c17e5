"""Opt-in integrations with other libraries' models; ``import doc_packed`` imports none of them.

- :mod:`doc_packed.integrations.hf`: Hugging Face transformers (``attn_implementation="doc_packed"``),
  extra ``doc-packed[hf]``.
- :mod:`doc_packed.integrations.torchtitan`: torchtitan's Llama3 / Qwen3 with doc-packed as the
  inner attention, extra ``doc-packed[torchtitan]``.

Each imports its library lazily (inside functions), so importing the module needs nothing extra.
"""
