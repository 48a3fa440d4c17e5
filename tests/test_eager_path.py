"""The eager path (doc_packed._eager): plain eager calls skip the custom op's dispatcher and give
the op's results bit for bit; wherever torch must see the op (compile, modes, subclasses,
functorch, the profiler's names) the op still runs."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import doc_packed as dp
from doc_packed import _eager
from doc_packed_testing.oracle import reference

CASES = [
    dict(lengths=[[5, 0, 11], [16]], heads=(4, 2), causal=True, window=(-1, -1)),
    dict(lengths=[[7, 9], [3, 13]], heads=(2, 2), causal=False, window=(3, 2)),
    dict(lengths=[[16]], heads=(4, 1), causal=True, window=(4, 0)),
]


def _problem(case, dtype=torch.float64):
    B, S, D = len(case["lengths"]), 16, 8
    Hq, Hkv = case["heads"]
    q = torch.randn(B, S, Hq, D, dtype=dtype, requires_grad=True)
    k = torch.randn(B, S, Hkv, D, dtype=dtype, requires_grad=True)
    v = torch.randn(B, S, Hkv, D, dtype=dtype, requires_grad=True)
    cu = dp.cu_seqlens_from_lengths(case["lengths"], S, max_docs=4)
    return q, k, v, cu


def _op_args(case, S=16, D=8):
    left, right = case["window"]
    right = 0 if case["causal"] else right
    return (S, case["causal"], left, right, D**-0.5, "math", None, 0, None)


def _grads(out, lse, q, k, v, with_lse):
    loss = out.square().sum() + (lse.exp().sum() if with_lse else 0)
    return torch.autograd.grad(loss, (q, k, v), retain_graph=True)


@pytest.mark.parametrize("with_lse", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_eager_path_matches_the_custom_op_bitwise(case, with_lse):
    q, k, v, cu = _problem(case)
    out, lse = dp.doc_packed_attn(q, k, v, cu, causal=case["causal"], window_size=case["window"],
                                  backend="math", return_lse=True)
    assert type(out.grad_fn).__name__ == "_AttentionBackward"  # the eager path ran
    op_out, op_lse = torch.ops.doc_packed.attn_fwd(q, k, v, cu, *_op_args(case))
    assert type(op_out.grad_fn).__name__ != "_AttentionBackward"
    assert torch.equal(out, op_out) and torch.equal(lse, op_lse)
    for a, b in zip(_grads(out, lse, q, k, v, with_lse), _grads(op_out, op_lse, q, k, v, with_lse)):
        assert torch.equal(a, b)
    # and both are right: the float64 oracle
    ref_out, ref_lse = reference(q, k, v, cu, case["causal"], case["window"])
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-10)
    for a, b in zip(_grads(out, lse, q, k, v, with_lse), _grads(ref_out, ref_lse, q, k, v, with_lse)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_without_grad_no_autograd_node_and_same_values():
    case = CASES[0]
    q, k, v, cu = _problem(case)
    with torch.no_grad():
        out = dp.doc_packed_attn(q, k, v, cu, backend="math", causal=True)
    assert out.grad_fn is None
    assert torch.equal(out, dp.doc_packed_attn(q, k, v, cu, backend="math", causal=True))


def test_flop_counter_sees_the_op():
    q, k, v, cu = _problem(CASES[2])
    with FlopCounterMode(display=False) as counter:
        dp.doc_packed_attn(q, k, v, cu, window_size=(4, 0), backend="math", causal=True).sum().backward()
    counts = counter.get_flop_counts()["Global"]
    fwd, bwd = torch.ops.doc_packed.attn_fwd, torch.ops.doc_packed.attn_bwd
    # one 16-token document, window (4, 0), Hq 4, D 8: pairs = 1 + 2 + 3 + 4 + 12 * 5 = 70
    assert counts[fwd] == 4 * 70 * 4 * 8 and counts[bwd] == 2.5 * counts[fwd]


def test_modes_subclasses_and_transforms_take_the_op():
    q, k, v, cu = _problem(CASES[0])
    assert _eager.takes_eager_path(q, k, v, cu)
    with FlopCounterMode(display=False):
        assert not _eager.takes_eager_path(q, k, v, cu)
    with torch.device("cpu"):  # a torch function mode
        assert not _eager.takes_eager_path(q, k, v, cu)
    assert not _eager.takes_eager_path(q.detach().to("meta"), k, v, cu)

    class Sub(torch.Tensor):
        pass

    assert not _eager.takes_eager_path(q.detach().as_subclass(Sub), k, v, cu)
    seen = []

    def f(qq):
        seen.append(_eager.takes_eager_path(qq, k, v, cu))
        return qq.sum()

    torch.func.grad(f)(q.detach())  # (the custom op itself has no functorch rule: no call here)
    assert seen == [False]


def test_compiled_call_keeps_the_op_in_the_graph():
    q, k, v, cu = _problem(CASES[0])
    ops_seen = []

    def backend(gm, example_inputs):
        ops_seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    f = torch.compile(lambda q, k, v, cu: dp.doc_packed_attn(q, k, v, cu, backend="math", causal=True), backend=backend,
                      fullgraph=True)
    out = f(q, k, v, cu)
    assert any("doc_packed.attn_fwd" in s for s in ops_seen), ops_seen
    torch.testing.assert_close(out, dp.doc_packed_attn(q, k, v, cu, backend="math", causal=True), rtol=0, atol=0)


def test_profiler_names_the_calls():
    q, k, v, cu = _problem(CASES[0])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        dp.doc_packed_attn(q, k, v, cu, backend="math", causal=True).sum().backward()
    names = {e.name for e in prof.events()}
    assert "doc_packed::attn_fwd" in names and "doc_packed::attn_bwd" in names


def test_double_backward_is_refused_clearly():
    q, k, v, cu = _problem(CASES[0])
    out = dp.doc_packed_attn(q, k, v, cu, backend="math", causal=True)
    (gq,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|double backward|does not require grad"):
        gq.sum().backward()
