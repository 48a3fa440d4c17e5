"""NaN/Inf containment on every CUDA backend, forward and backward (docs/contract.md, section 4).

A NaN or Inf in one document's ``q``, ``k``, ``v`` or output gradient. A backend that isolates
(``flash``, ``fa4``, ``math``) leaves every other document's ``out``, ``lse``, ``dq``, ``dk``,
``dv`` finite and equal (within the dtype's tolerance) to those of the clean inputs. ``flex``
does not isolate inside a row (its 128 x 128 blocks straddle document boundaries: a masked
probability 0 times a NaN value is NaN), documented in contract.md; its test asserts that
documented behaviour: other rows stay clean, and at least one other document of the poisoned row
is hit. ``auto``'s documented choice (FA4 where it runs, else flex for local calls) is asserted
with the behaviour it implies. Skipped without a GPU.
"""

from __future__ import annotations

import math

import pytest
import torch

import doc_packed as dp
from doc_packed import kernels
from doc_packed._doc_layout import get_layout
from doc_packed.ops import local_spec
from doc_packed_testing.gpu_parity import rel

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

S = 512  # flex needs rows divisible by 128
# row 0: the poisoned document [0, 200), neighbours sharing 128-blocks with it, then more; row 1 clean
LENGTHS = [[200, 57, 130, 125], [96, 300, 116]]
POISON = (0, 150)  # row, token inside document 0 of row 0 (in the block it shares with [200, 257))
ISOLATING = {"flash", "fa4", "math"}


def _fa4_why_not() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA device"
    from doc_packed.kernels import fa4

    return fa4.unsupported_reason(torch.empty(0, 8, 64, device="cuda", dtype=torch.bfloat16), 2)


FA4_WHY_NOT = _fa4_why_not()
FA4 = pytest.param("fa4", marks=pytest.mark.skipif(FA4_WHY_NOT is not None, reason=f"FA4 {FA4_WHY_NOT}"))


def _docs() -> list[tuple[int, int, int]]:
    out = []
    for b, row in enumerate(LENGTHS):
        s = 0
        for n in row:
            out.append((b, s, s + n))
            s += n
    return out


def _run(backend: str, target: str, bad: float, dtype=torch.bfloat16):
    """(out, lse, dq, dk, dv) of a poisoned call and of the clean one, on CUDA."""
    cu = dp.cu_seqlens_from_lengths(LENGTHS, S).cuda()
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, S, 8, 64, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(2, S, 2, 64, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(2, S, 2, 64, device="cuda", dtype=dtype, generator=g)
    dout = torch.randn(2, S, 8, 64, device="cuda", dtype=dtype, generator=g)
    results = []
    for poisoned in (True, False):
        tensors = {"q": q.clone(), "k": k.clone(), "v": v.clone(), "dout": dout.clone()}
        if poisoned:
            tensors[target][POISON[0], POISON[1]] = bad
        leaves = [tensors[n].requires_grad_() for n in ("q", "k", "v")]
        out, lse = dp.doc_packed_attn(*leaves, cu, return_lse=True, backend=backend, causal=True)
        grads = torch.autograd.grad(out, leaves, tensors["dout"])
        results.append((out.detach(), lse.detach().transpose(1, 2), *grads))  # lse as [B, S, H]
    return results


def _hit_documents(poisoned, clean, dtype) -> set[tuple[int, int, int]]:
    """Documents (other than the poisoned one) whose results are non-finite or differ from the
    clean run beyond the dtype's tolerance."""
    tol = 2e-2 if dtype == torch.bfloat16 else 8e-3
    hit = set()
    for doc in _docs():
        b, s, e = doc
        if (b, s) == (POISON[0], 0):
            continue
        for got, want in zip(poisoned, clean):
            part, ref = got[b, s:e].float(), want[b, s:e].float()
            if not torch.isfinite(part).all() or (ref.norm() > 0 and rel(part, ref) > tol):
                hit.add(doc)
    return hit


@pytest.mark.parametrize("target", ["q", "k", "v", "dout"])
@pytest.mark.parametrize("bad", [math.nan, math.inf])
@pytest.mark.parametrize("backend", ["flash", FA4, "math", "auto-isolated"])
def test_isolating_backends_keep_a_bad_value_in_its_document(backend, target, bad):
    poisoned, clean = _run(backend, target, bad)
    assert _hit_documents(poisoned, clean, torch.bfloat16) == set()


@pytest.mark.parametrize("target", ["k", "v"])
def test_flex_leaks_inside_the_row_only(target):
    """Documented (contract.md, section 4): flex's blocks straddle documents, so a NaN in one
    document's keys/values reaches neighbours in the same row; other rows stay clean."""
    poisoned, clean = _run("flex", target, math.nan)
    hit = _hit_documents(poisoned, clean, torch.bfloat16)
    assert all(b == POISON[0] for b, _, _ in hit), hit  # never another row
    assert hit, "flex isolated the NaN: update docs/contract.md (section 4) and this test"


def test_auto_choice_and_its_containment():
    """``auto`` runs FA4 where it can, else flex (local calls): isolation follows the choice."""
    cu = dp.cu_seqlens_from_lengths(LENGTHS, S).cuda()
    q = torch.zeros(2 * S, 8, 64, device="cuda", dtype=torch.bfloat16)
    chosen = kernels.choose("auto", local_spec(get_layout(cu, S), True, -1, 0), q, 2)
    assert chosen == ("flex" if FA4_WHY_NOT else "fa4")
    poisoned, clean = _run("auto", "v", math.nan)
    hit = _hit_documents(poisoned, clean, torch.bfloat16)
    if chosen in ISOLATING:
        assert hit == set()
    else:
        assert hit and all(b == POISON[0] for b, _, _ in hit)
