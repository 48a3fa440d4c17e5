"""Sharding rules for ``doc_packed`` attention: DTensor strategies, eager CP lowering, costs,
and the AutoParallel glue (:mod:`shardings.autoparallel`, optional).

Importing :mod:`doc_packed` imports this package, which registers everything once.
"""

from . import costs, dtensor, strategies

strategies.register()
dtensor.register()
costs.register()

__all__ = ["strategies", "dtensor", "costs"]
