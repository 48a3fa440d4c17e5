"""Sharding rules for ``doc_packed`` attention: DTensor strategies, eager CP lowering, costs,
and the AutoParallel glue (:mod:`shardings.autoparallel`, optional).

``import shardings`` registers everything with DTensor (it calls :func:`register`), once per
process; DTensor inputs to :func:`doc_packed.doc_packed_attn` and AutoParallel need it.
This package imports :mod:`doc_packed`; :mod:`doc_packed` never imports it.
"""

from . import costs, dtensor, strategies

__all__ = ["costs", "dtensor", "register", "strategies"]


def register() -> None:
    """Register the strategies, the eager DTensor handler and the planning costs (idempotent:
    a second call re-installs the same entries)."""
    strategies.register()
    dtensor.register()
    costs.register()


register()
