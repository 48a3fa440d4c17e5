"""Context parallelism for document-packed attention (MagiAttention-style, zero redundancy).

- :mod:`.plan`: the load-balanced, locality-aware plan (host, once per layout).
- :mod:`.schedule`: one rank's exchange runs and kernel calls for a plan (built once, cached on device).
- :mod:`.lse_merge`: folding two partial results of the same query rows by log-sum-exp.
- :mod:`.partials`: adding the partial dK/dV that peers send home to the owner's gradients.
- :mod:`.comm`: the exchange: several fields sent as runs of rows in one AllToAll-V.
- :mod:`.attention`: forward and backward over a process group.
- :mod:`.max_logits`: the largest visible logit of a context-parallel call (diagnostic).
"""

from .plan import ContextParallelPlan, RowCost, plan_context_parallel

__all__ = ["ContextParallelPlan", "RowCost", "plan_context_parallel"]
