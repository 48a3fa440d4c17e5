"""shardings.overlap: the time Inductor's overlap pass is given for doc_packed's calls.

The pass times a compute node by running it on random inputs unless its hook answers; for a
context-parallel call that would run the exchange inside the compile. These check, on fake
graphs (CPU), that the hook answers for both of our ops from the step model, leaves the nodes
the pass times itself to it, and that the pass's own timing function takes the answer without
running the op.
"""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import doc_packed.ops
from shardings import compile as sc
from shardings import overlap, step_model

S, HQ, HKV, D = 4096, 8, 2, 64  # a CP 2 shard of an 8192-token row


def _graph(seq_len: int = 2 * S, doc_len: int = 512, cp_group: str | None = "g0"):
    def step(q, k, v, cu, dout):
        args = (cu, seq_len, True, -1, -1, D**-0.5, "auto", cp_group, doc_len)
        out, lse = torch.ops.doc_packed.attn_fwd(q, k, v, *args)
        dq, dk, _ = torch.ops.doc_packed.attn_bwd(dout, q, k, v, out, lse, *args)
        return torch.mm(dq.flatten(0, 2)[:64], dk.flatten(0, 2)[:64].T) + 1

    local = seq_len if cp_group is None else S
    q = torch.randn(1, local, HQ, D, dtype=torch.bfloat16)
    k = torch.randn(1, local, HKV, D, dtype=torch.bfloat16)
    cu = torch.tensor([[0, seq_len] + [seq_len] * 7], dtype=torch.int32)
    gm = make_fx(step, tracing_mode="fake")(q, k, k.clone(), cu, q.clone())
    return {str(n.target): n for n in gm.graph.nodes if n.op == "call_function"}


def test_our_calls_are_priced_by_the_step_model():
    nodes = _graph()
    fwd = overlap.runtime_estimate_ms(nodes["doc_packed.attn_fwd.default"])
    bwd = overlap.runtime_estimate_ms(nodes["doc_packed.attn_bwd.default"])

    def model(local_len, backward=False):
        return step_model.attention_us(
            step_model.Rates.load(),
            rows=1,
            seq_len=2 * S,
            local_len=local_len,
            q_heads=HQ,
            kv_heads=HKV,
            head_dim=D,
            layout=step_model.Layout(512),
            backward=backward,
        )

    assert fwd == pytest.approx(model(S).total / 1e3) and model(S).exchange > 0  # the exchange is in
    assert bwd == pytest.approx(model(S, backward=True).total / 1e3) and bwd > fwd
    # the same row unsharded: the whole row's work, no exchange
    whole = overlap.runtime_estimate_ms(_graph(cp_group=None)["doc_packed.attn_fwd.default"])
    assert whole == pytest.approx(model(2 * S).total / 1e3) and model(2 * S).exchange == 0
    assert model(2 * S).compute > model(S).compute
    # longer documents: more pairs, more time
    assert overlap.runtime_estimate_ms(_graph(doc_len=4096)["doc_packed.attn_fwd.default"]) > fwd


def test_a_call_without_shapes_is_never_left_to_the_pass():
    """Without its inputs' fake values the hook still answers for our call (0 ms), so the pass
    never falls back to running it."""
    graph = torch.fx.Graph()
    q, k, v, cu = (graph.placeholder(n) for n in ("q", "k", "v", "cu"))
    args = (q, k, v, cu, 2 * S, True, -1, -1, D**-0.5, "auto", "g0", 512)
    node = graph.call_function(torch.ops.doc_packed.attn_fwd.default, args)
    assert overlap.runtime_estimate_ms(node) == 0.0


def test_other_nodes_keep_the_pass_own_estimates(monkeypatch):
    nodes = _graph()
    assert overlap.runtime_estimate_ms(nodes["aten.mm.default"]) is None  # a compute node: the pass times it
    import torch._inductor.fx_passes.overlap_scheduling as passes

    name = (
        "estimate_roofline_runtime_ms"
        if hasattr(passes, "estimate_roofline_runtime_ms")
        else "estimate_mem_bound_runtime_ms"
    )
    monkeypatch.setattr(passes, name, lambda node: 0.125 if node.target is torch.ops.aten.add.Tensor else 0.0)
    assert overlap.runtime_estimate_ms(nodes["aten.add.Tensor"]) == 0.125

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    coll = graph.call_function(torch.ops._c10d_functional.all_reduce.default, (x, "sum", "g0"))
    assert overlap.runtime_estimate_ms(coll) is None  # a collective: the pass's own model


def test_the_pass_takes_the_estimate_without_running_the_op(monkeypatch):
    """torch's own timing function for a compute node consults the hook before it would run the
    node on random inputs; with it, the call's implementation never runs."""
    import torch._inductor.fx_passes.overlap_scheduling as passes

    ran = []
    real = doc_packed.ops.forward_impl
    monkeypatch.setattr(doc_packed.ops, "forward_impl", lambda *a: ran.append(1) or real(*a))
    monkeypatch.setattr(passes, "get_cached_node_time", lambda key: None)
    monkeypatch.setattr(passes, "set_cached_node_time", lambda key, value: None)
    node = _graph()["doc_packed.attn_fwd.default"]
    took, _ = passes.benchmark_node_with_cache_key(node, overlap.runtime_estimate_ms)
    assert took == overlap.runtime_estimate_ms(node) and not ran


def test_the_inductor_overlap_settings_carry_the_hook():
    assert (
        sc.INDUCTOR_OVERLAP["aten_distributed_optimizations.custom_runtime_estimation"] is overlap.runtime_estimate_ms
    )
    assert set(sc.INDUCTOR_OVERLAP) <= sc._compat.inductor_settings()  # every name exists on this torch
