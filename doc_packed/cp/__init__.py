"""Context parallelism for document-packed attention (MagiAttention-style, zero redundancy).

- :mod:`.plan`: the load-balanced, locality-aware plan (host, once per layout).
- :mod:`.exchange`: per-rank index maps and split sizes derived from a plan (cached on device).
- :mod:`.comm`: the AllToAll-V primitives (GroupCast / GroupReduce).
- :mod:`.attention`: forward and backward over a process group.
"""

from .plan import ContextParallelPlan, plan_context_parallel

__all__ = ["ContextParallelPlan", "plan_context_parallel"]
