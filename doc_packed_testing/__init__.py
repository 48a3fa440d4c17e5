"""What the tests and the benchmarks share: the float64 oracle and the random layouts it is
checked on (``oracle``), the CUDA parity grid (``gpu_parity``), and the test/bench-only shims
that let AutoParallel's head run here (``ap_compat``).

Above both libraries, like ``doc_packed_examples``: it may import ``doc_packed``, and nothing
in ``doc_packed``, ``shardings`` or ``doc_packed_examples`` imports it. Importing this package
imports nothing.
"""
