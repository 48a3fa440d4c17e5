"""Other libraries' models through AutoParallel: a Hugging Face Llama (``PackedCausalLM``) and
torchtitan's Llama3 (``DocPackedAttention``, rows and flat layouts) traced, solved with the
attention layout forced, placed, compiled with ``compile_placed`` and trained 3 steps on real
gloo ranks: the losses equal the one-process float64 run's (to 1e-10; the Hugging Face model to
1e-6: its rotary embedding computes cos/sin in float32 whatever the model's dtype, and compiled
code rounds that float32 arithmetic differently: measured 2e-8).

Training settings (``test_training_settings``): AdamW, AutoParallel's mixed-precision policy
(float32 parameters, bf16 compute, float32 gradient reduction, as torchtitan's AutoParallel flow
sets it) and activation checkpointing, against one process with the same optimizer and precision
and no checkpointing (tolerances there).

Every case traces and solves on each rank (and compiles where asked): minutes on 2 CPU cores, so
all are ``slow``. Skipped without AutoParallel, transformers or torchtitan (the skip says which).
"""

import pytest
import torch

from doc_packed_testing.ap_compat import autoparallel_available

if not autoparallel_available():
    from doc_packed.env import autoparallel_status

    pytest.skip(autoparallel_status()[1], allow_module_level=True)

from ap_model_cases import Training, ap_train  # noqa: E402

pytestmark = [pytest.mark.autoparallel, pytest.mark.slow]

SGD = Training(optim="sgd", lr=0.5)
# (dp, cp) meshes: rank 0 solves, the others load its placements (the same ILP on 4 ranks of a
# 2-core host otherwise runs CBC four times at once)
SGD_ONCE = Training(optim="sgd", lr=0.5, solve_once=True)

CASES = [
    # (model, layout, mesh, names, forced attention layout, compile backend, training)
    ("hf", "rows", (2,), ("dp",), {"dp": "batch"}, "auto", SGD),
    ("hf", "rows", (2, 2), ("dp", "cp"), {"dp": "batch", "cp": "sequence"}, "auto", SGD_ONCE),
    ("torchtitan", "rows", (2,), ("cp",), {"cp": "sequence"}, "auto", SGD),
    ("torchtitan", "rows", (2, 2), ("dp", "cp"), {"dp": "batch", "cp": "sequence"}, "auto", SGD_ONCE),
    ("torchtitan", "flat", (2,), ("cp",), {"cp": "sequence"}, "auto", SGD),
    ("torchtitan", "flat", (2,), ("cp",), {"cp": "heads"}, "eager", SGD),
]


def _ids(cases):
    return [f"{m}-{lay}-{'x'.join(names)}-{'-'.join(f.values())}-{b}" for m, lay, _, names, f, b, _ in cases]


def _world(mesh):
    world = 1
    for n in mesh:
        world *= n
    return world


@pytest.mark.parametrize("which,layout,mesh,names,force,backend,training", CASES, ids=_ids(CASES))
def test_placed_model_trains_like_one_process(run_ranks, which, layout, mesh, names, force, backend, training):
    pytest.importorskip("transformers" if which == "hf" else "torchtitan")
    results = run_ranks(ap_train, _world(mesh), which, layout, mesh, names, force, 3, backend, training, timeout=2400)
    tol = 1e-6 if which == "hf" else 1e-10
    for r in results:
        assert max(abs(a - b) for a, b in zip(r["losses"], r["ref_losses"])) < tol, (r["losses"], r["ref_losses"])
        assert r["losses"][-1] != r["losses"][0]  # it trained
        for role, lay in r["layout"]:
            assert lay == force, (role, lay)
        if backend != "eager":
            assert r["compiled_with"] in ("autoparallel", "inductor")
            assert r["graphs"] == 1, r["graphs"]  # fullgraph, no recompile over the layouts


# AdamW (torchtitan's betas and weight decay), 3 steps; activation checkpointing in the placed
# model only. float64: the losses and the first step's gradients equal the reference's to 1e-10
# (so checkpointing changes no gradient; measured: equal losses, gradients 2.5e-15 apart).
# Mixed precision: both sides compute in bf16, but the ranks' partial sums, the reduction order
# and the compiled kernels round differently from the one process. The yardstick is how far bf16
# compute alone moves the one-process run (the same run in float32): the placed run must stay
# within NOISE_FACTOR times that of the one-process bf16 run, in each step's loss (relative) and
# in the first step's gradients (largest gap over each parameter's largest gradient). Measured
# (torch 2.13 CPU): example model on cp 2, loss 1.9e-4 (bf16 alone: 4.4e-4), gradients 3.1e-2
# (2.7e-2); Hugging Face Llama on cp 2, loss 1.0e-3 (1.8e-3), gradients 3.8e-2 (4.0e-2).
ADAMW64_AC = Training(optim="adamw", lr=1e-2, dtype=torch.float64, checkpoint=True)
ADAMW_MP_AC = Training(optim="adamw", lr=1e-2, dtype=torch.float32, mixed_precision=True, checkpoint=True)
TRAINING = [
    # (model, layout, mesh, names, forced attention layout, compile backend, training)
    ("example", "rows", (2,), ("cp",), {"cp": "sequence"}, "auto", ADAMW64_AC),
    ("example", "rows", (2,), ("cp",), {"cp": "sequence"}, "auto", ADAMW_MP_AC),
    ("hf", "rows", (2,), ("cp",), {"cp": "sequence"}, "auto", ADAMW_MP_AC),
]
NOISE_FACTOR = 2.0


@pytest.mark.parametrize(
    "which,layout,mesh,names,force,backend,training", TRAINING,
    ids=[f"{i}-{'mp' if t.mixed_precision else 'f64'}" for i, t in zip(_ids(TRAINING), (t[-1] for t in TRAINING))],
)  # fmt: skip
def test_training_settings(run_ranks, which, layout, mesh, names, force, backend, training):
    """AdamW + mixed precision + activation checkpointing through AutoParallel, against one
    process with the same optimizer and precision, without checkpointing."""
    pytest.importorskip("transformers" if which == "hf" else "torch")
    results = run_ranks(ap_train, _world(mesh), which, layout, mesh, names, force, 3, backend, training, timeout=2400)
    print({k: results[0][k] for k in ("losses", "ref_losses", "grad_err", "bf16_noise", "graph")})  # gaps (-s)
    for r in results:
        losses, ref = r["losses"], r["ref_losses"]
        assert losses[-1] != losses[0]  # it trained
        assert r["graph"]["recompute_nodes"] > 0  # checkpointing reached the traced graph
        for role, lay in r["layout"]:
            assert lay == force, (role, lay)
        if training.mixed_precision:
            noise = r["bf16_noise"]
            assert noise["loss"] < 1e-2 and noise["grad"] < 0.1, noise  # the yardstick itself is small
            assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref)) <= NOISE_FACTOR * noise["loss"], (losses, ref)
            assert r["grad_err"] <= NOISE_FACTOR * noise["grad"], (r["grad_err"], noise)
            assert r["graph"]["mm_dtypes"] == ["torch.bfloat16"], r["graph"]  # bf16 compute
            assert r["graph"]["grad_reduction_dtypes"] == ["torch.float32"], r["graph"]  # float32 reduction
            assert r["param_dtypes"] == ["torch.float32"] and r["grad_dtypes"] == ["torch.float32"], r
        else:
            assert max(abs(a - b) for a, b in zip(losses, ref)) < 1e-10, (losses, ref)
            assert r["grad_err"] < 1e-10, r["grad_err"]
