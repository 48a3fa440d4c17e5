"""Other libraries' models through AutoParallel: a Hugging Face Llama (``PackedCausalLM``) and
torchtitan's Llama3 (``DocPackedAttention``, rows and flat layouts) traced, solved with the
attention layout forced, placed, compiled with ``compile_placed`` and trained 3 steps on real
gloo ranks: the losses equal the one-process float64 run's (to 1e-10; the Hugging Face model to
1e-6: its rotary embedding computes cos/sin in float32 whatever the model's dtype, and compiled
code rounds that float32 arithmetic differently: measured 2e-8).

Every case traces and solves on each rank (and compiles where asked): minutes on 2 CPU cores, so
all are ``slow``. Skipped without AutoParallel, transformers or torchtitan (the skip says which).
"""

import pytest

from ap_compat import autoparallel_available

if not autoparallel_available():
    from doc_packed.env import autoparallel_status

    pytest.skip(autoparallel_status()[1], allow_module_level=True)

from ap_model_cases import ap_train  # noqa: E402

pytestmark = [pytest.mark.autoparallel, pytest.mark.slow]

CASES = [
    # (model, layout, mesh, names, forced attention layout, compile backend)
    ("hf", "rows", (2,), ("dp",), {"dp": "batch"}, "auto"),
    ("hf", "rows", (2, 2), ("dp", "cp"), {"dp": "batch", "cp": "sequence"}, "auto"),
    ("torchtitan", "rows", (2,), ("cp",), {"cp": "sequence"}, "auto"),
    ("torchtitan", "rows", (2, 2), ("dp", "cp"), {"dp": "batch", "cp": "sequence"}, "auto"),
    ("torchtitan", "flat", (2,), ("cp",), {"cp": "sequence"}, "auto"),
    ("torchtitan", "flat", (2,), ("cp",), {"cp": "heads"}, "eager"),
]


def _ids():
    return [f"{m}-{lay}-{'x'.join(names)}-{'-'.join(f.values())}-{b}" for m, lay, _, names, f, b in CASES]


@pytest.mark.parametrize("which,layout,mesh,names,force,backend", CASES, ids=_ids())
def test_placed_model_trains_like_one_process(run_ranks, which, layout, mesh, names, force, backend):
    pytest.importorskip("transformers" if which == "hf" else "torchtitan")
    world = 1
    for n in mesh:
        world *= n
    results = run_ranks(ap_train, world, which, layout, mesh, names, force, 3, 0.5, backend, timeout=1200)
    tol = 1e-6 if which == "hf" else 1e-10
    for r in results:
        assert max(abs(a - b) for a, b in zip(r["losses"], r["ref_losses"])) < tol, (r["losses"], r["ref_losses"])
        assert r["losses"][-1] != r["losses"][0]  # it trained
        for role, lay in r["layout"]:
            assert lay == force, (role, lay)
        if backend != "eager":
            assert r["compiled_with"] in ("autoparallel", "inductor")
            assert r["graphs"] == 1, r["graphs"]  # fullgraph, no recompile over the layouts
