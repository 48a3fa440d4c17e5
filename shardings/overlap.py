"""What Inductor's communication/compute overlap pass is told a ``doc_packed`` call costs.

The pass (``torch._inductor.config.aten_distributed_optimizations``) needs a time for every
compute node. By default it makes one by running the node on random inputs of its shapes
(``compute_estimator="benchmark"``, the only way on torch 2.11 and the default on later ones):
for a context-parallel ``doc_packed`` call that runs the ranks' agreement and exchange inside the
compile, on random ``cu_seqlens``, which fails (measured on one H200, torch 2.11). The pass asks
a hook first (``custom_runtime_estimation``); :func:`runtime_estimate_ms` is that hook: the step
model's time for our calls (:func:`shardings.step_model.attention_us` at the node's local
shapes, on rows of lognormal documents of the call's ``planning_doc_len``: compute, the plan's
imbalance and the exchange), and for every other node what the pass would have used without a
hook.
"""

from __future__ import annotations

import torch

from doc_packed import flops
from doc_packed.ops import arg_index, node_arg

from . import _compat
from .step_model import Layout, Rates, attention_us

__all__ = ["runtime_estimate_ms"]


def _attention_ms(node: torch.fx.Node, backward: bool) -> float:
    """The step model's time of one call; 0 where the node's shapes are not known (never None:
    the pass would then time the call by running it)."""
    q = node.args[arg_index(node.target, "q")]
    k = node.args[arg_index(node.target, "k")]
    qv = q.meta.get("val") if isinstance(q, torch.fx.Node) else None
    kv = k.meta.get("val") if isinstance(k, torch.fx.Node) else None
    if not isinstance(qv, torch.Tensor) or not isinstance(kv, torch.Tensor):
        return 0.0
    try:
        rows, local_len, q_heads, head_dim = (int(x) for x in qv.shape)
        kv_heads, seq_len = int(kv.shape[2]), int(node_arg(node, "seq_len", local_len))
    except (TypeError, RuntimeError):  # sizes without a value (unbacked symbols)
        return 0.0
    if local_len == 0 or seq_len == 0:
        return 0.0
    cost = attention_us(
        Rates.load(),
        rows=rows,
        seq_len=seq_len,
        local_len=local_len,
        q_heads=q_heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        itemsize=qv.dtype.itemsize,
        causal=bool(node_arg(node, "causal", True)),
        window=(int(node_arg(node, "window_left", -1)), int(node_arg(node, "window_right", -1))),
        layout=Layout(flops.planned_doc_len(int(node_arg(node, "planning_doc_len", 0)), seq_len)),
        backward=backward,
    )
    return cost.total / 1e3


def runtime_estimate_ms(node: torch.fx.Node, override_size: int | None = None) -> float | None:
    """Milliseconds for ``node`` (the pass's ``custom_runtime_estimation(node, override_size)``):
    a ``doc_packed`` forward or backward call by the step model; None for the nodes the pass
    times itself (other compute nodes, collectives); torch's own estimate for the rest."""
    if node.target is torch.ops.doc_packed.attn_fwd.default:
        return _attention_ms(node, backward=False)
    if node.target is torch.ops.doc_packed.attn_bwd.default:
        return _attention_ms(node, backward=True)
    return _compat.overlap_default_ms(node)
