"""The rows that bench/bench_cp_emulate.py times, rebuilt by name (also for bench/cp_call_cost.py)."""

from __future__ import annotations

import doc_packed as dp


def emulated_lengths(name: str, S: int, c: int = 1, packing: str = "greedy") -> list[int]:
    """The documents of layout ``name`` (``"one doc"``, ``"lognormal 2k"``, ``"lognormal 512"``)
    in one row of ``S``: as drawn, or with ``packing="cp"`` in CP-aware order for ``c`` ranks
    (``doc_packed.data.pack_order``; needs a doc_packed that has it)."""
    if name == "one doc":
        return [S]
    mean = int(name.split()[1].replace("k", "000").replace("2000", "2048"))
    drawn = dp.data.lognormal_lengths(S, mean, seed=S)
    if packing == "greedy":
        return drawn
    order = dp.data.pack_order(drawn, S, cp_size=c)
    assert len(order.lengths) == 1, "one row of documents packs into one row"
    return order.lengths[0]
