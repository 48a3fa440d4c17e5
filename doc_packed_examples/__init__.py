"""doc-packed in use: the example model and the end-to-end demo.

- :mod:`.model`: a small Llama-like transformer that calls :func:`doc_packed.doc_packed_attn`
  (the model of the demo, the end-to-end tests and the benchmarks), ``training_flops`` and
  ``random_attention_problem``.
- :mod:`.demo`: ``python -m doc_packed_examples.demo``, the end-to-end program (context-parallel
  training on gloo ranks, placed by AutoParallel where it imports).

This package sits above both libraries: it may import :mod:`doc_packed` and :mod:`shardings`,
and neither imports it.
"""
