"""Benchmarks: scripts that print tables with a same-run anchor, run from the repository's root
as ``python -m bench.<script> [--help]`` (docs/benchmarks.md says which figure each one makes).

Every script has ``main(argv=None)`` and parses its command line only there, and ``--dry-run``:
a tiny size on CPU that checks the script runs (``tests/test_bench.py`` runs each one that way;
the figures of a dry run mean nothing). Shared pieces: :mod:`bench._harness` (the timer, rank
spawning, the dry-run flag), :mod:`doc_packed_testing` (the oracle and the AutoParallel shims
the tests use too). Importing a script runs nothing.
"""
