"""Rank bodies for AutoParallel runs of other libraries' models and of the example model in
training settings (module level so spawn can import them): a Hugging Face Llama through
``doc_packed.integrations.hf.PackedCausalLM``, torchtitan's Llama3 with ``DocPackedAttention``,
rows (``[B, L]`` + ``cu_seqlens [B, MAX_DOCS + 1]``) or flat (``[1, T]`` + 1-D ``cu_seqlens``
over ``T``) layout, and ``example``: doc_packed's example model with SwiGLU.

``Training`` says how a run trains: SGD or AdamW, the parameters' dtype, AutoParallel's
mixed-precision policy (bf16 compute, float32 gradient reduction), activation checkpointing.
The one-process reference trains the same model with the same optimizer and precision (mixed
precision: float32 parameters cast to bf16 for the forward, as AutoParallel's policy casts them)
and never checkpoints activations: a run with checkpointing is compared with one without.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

import doc_packed as dp
from bench.e2e_models import hf_checkpointing  # one copy: bench_e2e's models

MAX_DOCS = 8


@dataclass(frozen=True)
class Training:
    optim: str = "sgd"  # "sgd" / "adamw"
    lr: float = 0.5
    dtype: torch.dtype = torch.float64  # the parameters' (mixed precision: their master copy's)
    mixed_precision: bool = False  # AutoParallel's MixedPrecisionPolicy(bf16, reduce float32)
    checkpoint: bool = False  # activation checkpointing in the placed model (never in the reference)
    solve_once: bool = False  # rank 0 solves the ILP, the others load its placements

    def optimizer(self, params):
        if self.optim == "sgd":
            return torch.optim.SGD(params, lr=self.lr)
        return torch.optim.AdamW(params, lr=self.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)

    def mp_policy(self):
        if not self.mixed_precision:
            return None
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)


def build(which: str, checkpoint: bool = False, layers: int | None = None) -> tuple[torch.nn.Module, int]:
    """(model in float32 on the current default device, vocab size). ``checkpoint``: activation
    checkpointing, each library's own way. ``layers``: 2 by default, torchtitan's (wider) 1."""
    if layers is None:
        layers = 1 if which == "torchtitan" else 2
    if which == "example":
        from doc_packed_examples.model import Transformer

        model = Transformer(vocab=64, dim=32, n_heads=4, n_kv_heads=2, n_layers=layers, hidden=64, checkpoint=checkpoint)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() > 1:
                    p.normal_(0, 0.2)
        return model, 64
    if which == "hf":
        import transformers

        import doc_packed.integrations.hf as dp_hf

        dp_hf.register()
        cfg = transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
            num_key_value_heads=2, initializer_range=0.2,
        )  # fmt: skip
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="doc_packed")
        if checkpoint:
            hf_checkpointing(model)
        model.train()
        return dp_hf.PackedCausalLM(model), 64
    from torchtitan.models.llama3 import llama3_configs

    from doc_packed.integrations.torchtitan import use_doc_packed

    cfg = use_doc_packed(llama3_configs["debugmodel"](attn_backend="varlen"))
    cfg.layers = cfg.layers[:layers]
    model = cfg.build()
    if not any(p.is_meta for p in model.parameters()):
        model.init_states()
    if checkpoint:
        from torchtitan.distributed.activation_checkpoint import FullAC

        FullAC(FullAC.Config()).apply(model)
    return model, 2048


def plain_name(name: str) -> str:
    """A parameter's name without the wrappers activation checkpointing inserts."""
    return name.replace("_checkpoint_wrapped_module.", "")


def batches(which: str, layout: str, vocab: int, steps: int) -> list[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
    """Per step: the model's inputs and the targets. Rows: B = 4 rows of 32 tokens; flat: the same
    documents folded into one stream of T = 128 tokens with a 1-D cu_seqlens."""
    layouts = [[[5, 20, 7], [32], [1, 30, 1], [16, 16]], [[2, 2, 28], [9, 23], [32], [3, 3, 3, 23]]]
    out = []
    for s in range(steps):
        lengths = layouts[s % len(layouts)]
        g = torch.Generator().manual_seed(100 + s)
        tokens = torch.randint(0, vocab, (4, 32), generator=g)
        targets = torch.randint(0, vocab, (4, 32), generator=g)
        cu = dp.cu_seqlens_from_lengths(lengths, 32, max_docs=MAX_DOCS)
        if layout == "flat":
            flat = [0]
            for row in lengths:
                for n in row:
                    flat.append(flat[-1] + n)
            flat += [128] * (4 * MAX_DOCS + 1 - len(flat))  # a fixed shape across steps
            tokens, targets, cu = tokens.reshape(1, 128), targets.reshape(1, 128), torch.tensor(flat, dtype=torch.int32)
        inputs = (tokens, _positions(cu, tokens.shape[1]), cu) if which == "torchtitan" else (tokens, cu)
        out.append((inputs, targets))
    return out


def _positions(cu: torch.Tensor, length: int) -> torch.Tensor:
    return dp.positions(cu if cu.dim() == 2 else cu[None], length)


def to_dtype(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Floating-point parameters and buffers in ``dtype``; complex ones (torchtitan's RoPE table)
    as they are (``Module.to(dtype)`` would drop their imaginary part)."""
    return model._apply(lambda t: t.to(dtype) if t.is_floating_point() else t)


def _loss(logits, targets, numel):
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 logits: the loss in float32
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum") / numel


def reference(which, data, training: Training, layers: int | None = None):
    """One process: the initial parameters and buffers, each step's loss, the first step's
    gradients (placed runs report their largest gap relative to each gradient's largest value). Mixed precision as AutoParallel's policy does it: the float32 parameters cast to
    bf16 for the forward (``functional_call``), gradients back through the cast in float32."""
    torch.manual_seed(0)
    model, _ = build(which, layers=layers)
    model = to_dtype(model, training.dtype)
    state = {k: v.detach().clone() for k, v in model.named_parameters()}  # not state_dict: hooks rename
    buffers = {k: v.detach().clone() for k, v in model.named_buffers()}
    opt = training.optimizer(model.parameters())
    losses, grads = [], {}
    for step, (inputs, targets) in enumerate(data):
        if training.mixed_precision:
            params = {k: p.to(torch.bfloat16) for k, p in model.named_parameters()}
            logits = torch.func.functional_call(model, params, inputs)
        else:
            logits = model(*inputs)
        loss = _loss(logits, targets, targets.numel())
        loss.backward()
        if step == 0:
            grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return state, buffers, losses, grads


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest gap over ``want``'s largest magnitude."""
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def ap_train(rank, world, *args, **kwargs):
    from doc_packed_testing.ap_compat import torch_patched_for_autoparallel

    with torch_patched_for_autoparallel():
        return _ap_train(rank, world, *args, **kwargs)


def _solve(autop, training: Training):
    """``autop.optimize_placement()`` on every rank, or (``solve_once``) on rank 0 only: its
    placements (AutoParallel's ``save_placements`` JSON) broadcast, the others load them: every
    rank builds the same ILP, so one solve is enough (CBC's time, once instead of per rank)."""
    if not training.solve_once:
        return autop.optimize_placement()
    from torch._subclasses.fake_tensor import unset_fake_temporarily  # the broadcast runs on real tensors

    opt = autop.sharding_optimizer
    text = [None]
    with tempfile.TemporaryDirectory() as tmp, unset_fake_temporarily():
        path = os.path.join(tmp, "placements.json")
        if dist.get_rank() == 0:
            placement = autop.optimize_placement()
            opt.save_placements(path)
            with open(path) as f:
                text[0] = f.read()
        dist.broadcast_object_list(text, src=0)
        if dist.get_rank() != 0:
            with open(path, "w") as f:
                f.write(text[0])
            placement = opt.load_placements(path)
    return placement


def _ap_train(rank, world, which, layout, mesh_shape, names, force, steps, compile_backend, training=Training(),
              layers=None):  # fmt: skip
    from autoparallel.api import AutoParallel
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from doc_packed_testing.ap_compat import device_name_for_cost_model
    from shardings.autoparallel import cost_model_for, describe_attention, force_attention_layout, lower_context_parallel
    from shardings.compile import compile_placed
    from shardings.costs import pricing

    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    _, vocab = build(which, layers=layers)
    data = batches(which, layout, vocab, steps)
    init_state, init_buffers, ref_losses, ref_grads = reference(which, data, training, layers)
    bf16_noise = {}
    if training.mixed_precision:  # how far bf16 compute alone moves the one-process run
        _, _, f32_losses, f32_grads = reference(which, data, replace(training, mixed_precision=False), layers)
        bf16_noise = dict(
            loss=max(abs(a - b) / abs(b) for a, b in zip(ref_losses, f32_losses)),
            grad=max(_rel_err(ref_grads[k], f32_grads[k]) for k in f32_grads),
        )
    # tokens / positions / targets: batch on "dp", tokens on "cp"; cu_seqlens rows follow the batch
    tok_pl = tuple(Shard(0) if n == "dp" else Shard(1) for n in names)
    cu_pl = tuple(Shard(0) if n == "dp" and layout == "rows" else Replicate() for n in names)
    in_pl = [tok_pl, tok_pl, cu_pl] if which == "torchtitan" else [tok_pl, cu_pl]

    def input_fn():
        return tuple(torch.zeros(t.shape, dtype=t.dtype) for t in data[0][0])

    with torch.device("meta"):
        model, _ = build(which, checkpoint=training.checkpoint, layers=layers)
        model = to_dtype(model, training.dtype)
    with device_name_for_cost_model(), dp.planning(doc_len=16), pricing(mesh, gpus_per_host=mesh.size()):
        with AutoParallel(
            model, input_fn, mesh, mp_policy=training.mp_policy(), cost_model=cost_model_for(mesh, mesh.size())
        ) as autop:
            autop.add_input_constraints(in_pl)
            autop.add_output_constraints([tok_pl])
            force_attention_layout(autop, force)
            placement = _solve(autop, training)
            placement = lower_context_parallel(autop, placement)
            choices = None
            if rank == 0 or not training.solve_once:  # the others hold no solved ILP to describe
                choices = [(c.role, c.layout) for c in describe_attention(autop, placement, print_report=False)]
            parallel = autop.apply_placement(placement)
    graph = _graph_facts(autop)
    parallel.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in parallel.named_parameters():
            p.to_local().copy_(distribute_tensor(init_state[plain_name(name)], mesh, p.placements).to_local())
        for name, b in parallel.named_buffers():
            full = init_buffers[plain_name(name)]
            if isinstance(b, DTensor):
                b.to_local().copy_(distribute_tensor(full, mesh, b.placements).to_local())
            else:
                b.copy_(full)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    run, choice = compile_placed(parallel, compile_backend)
    opt = training.optimizer(parallel.parameters())
    losses, grad_err, grad_dtypes = [], 0.0, []
    for step, (inputs, targets) in enumerate(data):
        local = [distribute_tensor(t, mesh, pl).to_local() for t, pl in zip(inputs, in_pl)]
        logits = run(*local)
        local_t = distribute_tensor(targets, mesh, tok_pl).to_local()
        loss = _loss(logits, local_t, targets.numel())
        loss.backward()
        if step == 0:  # every parameter's whole gradient against the reference's
            grad_dtypes = sorted({str(p.grad.dtype) for p in parallel.parameters()})
            for name, p in parallel.named_parameters():
                g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                grad_err = max(grad_err, _rel_err(g, ref_grads[plain_name(name)]))
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item())
    if training.solve_once:
        held = [choices if rank == 0 else None]
        dist.broadcast_object_list(held, src=0)
        choices = held[0]
    return dict(
        losses=losses, ref_losses=ref_losses, grad_err=grad_err, bf16_noise=bf16_noise, layout=choices, graph=graph,
        grad_dtypes=grad_dtypes,
        param_dtypes=sorted({str(p.dtype) for p in parallel.parameters()}),
        compiled_with=choice.backend, graphs=torch._dynamo.utils.counters["stats"]["unique_graphs"],
    )  # fmt: skip


def _graph_facts(autop) -> dict:
    """What the traced and placed graphs say about the training settings: the dtypes matrix
    products run in (the joint graph's einsums: AutoParallel writes linear layers as einsum),
    how many nodes activation checkpointing tagged for recompute, and the dtypes the placed graph
    reduces parameter gradients in: each reduction found up the single-input chain (waits,
    casts, views) from a gradient the graph returns."""
    from torch.utils._pytree import tree_leaves

    mm = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.einsum.default}
    mm_dtypes = sorted(
        {str(n.meta["val"].dtype) for n in autop.gm.graph.nodes if n.op == "call_function" and n.target in mm}
    )
    recompute = sum(1 for n in autop.gm.graph.nodes if n.meta.get("recompute") is not None)
    out = next(n for n in autop.parallel_gm.graph.nodes if n.op == "output")
    fw_and_grads = out.args[0]  # (forward outputs, parameter gradients)
    reductions = set()
    for node in tree_leaves(fw_and_grads[1]):
        for _ in range(16):
            if not isinstance(node, torch.fx.Node) or node.op != "call_function":
                break
            target = str(node.target)
            if "all_reduce" in target or "reduce_scatter" in target:
                reductions.add(str(node.args[0].meta["val"].dtype))
                break
            inputs = node.all_input_nodes
            node = inputs[0] if len(inputs) == 1 else None
    return dict(mm_dtypes=mm_dtypes, recompute_nodes=recompute, grad_reduction_dtypes=sorted(reductions))
