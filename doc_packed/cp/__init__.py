"""Context parallelism for document-packed attention (MagiAttention-style, zero redundancy).

- :mod:`.plan`: the load-balanced, locality-aware plan (host, once per layout).
- :mod:`.prepared`: plans and schedules made ahead (the next batch's, while this step computes).
- :mod:`.warmup`: every kernel a schedule can ask for, built at the first call (no compile later).
- :mod:`.schedule`: one rank's exchange runs and kernel calls for a plan (built once, cached on device).
- :mod:`.lse_merge`: folding two partial results of the same query rows by log-sum-exp.
- :mod:`.partials`: adding the partial dK/dV that peers send home to the owner's gradients.
- :mod:`.comm`: the exchange: several fields sent as runs of rows in one AllToAll-V.
- :mod:`.attention`: forward and backward over a process group.
- :mod:`.max_logits`: the largest visible logit of a context-parallel call (diagnostic).
"""

from .plan import ROW_COST, TOLERANCE, ContextParallelPlan, RowCost, plan_context_parallel
from .prepared import prepare, runtime_counts

__all__ = [
    "ROW_COST",
    "TOLERANCE",
    "ContextParallelPlan",
    "RowCost",
    "plan_context_parallel",
    "prepare",
    "runtime_counts",
]
