"""Rank bodies for the AutoParallel end-to-end tests (module level so spawn can import them)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import doc_packed as dp
from doc_packed_examples.model import Transformer


def _batch(seed, B, S, vocab, lengths):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (B, S), generator=g)
    targets = torch.randint(0, vocab, (B, S), generator=g)
    cu = dp.cu_seqlens_from_lengths(lengths, S, max_docs=32)
    return tokens, targets, cu


def _shard(t, mesh, placements):
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(t, mesh, placements).to_local()


def reference_training(cfg, batches, lr, steps):
    torch.manual_seed(0)
    model = Transformer(**cfg).double()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        tokens, targets, cu = batches[step]
        logits = model(tokens, cu)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum") / targets.numel()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return state, losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def ap_train(rank, world, *args, **kwargs):
    """:func:`_ap_train` with torch patched for AutoParallel's head (ap_compat)."""
    from doc_packed_testing.ap_compat import torch_patched_for_autoparallel

    with torch_patched_for_autoparallel():
        return _ap_train(rank, world, *args, **kwargs)


def _ap_train(rank, world, mesh_shape, names, in_pl, out_pl, cfg, batch_cfg, steps, lr, doc_len_hint, force=None,
              compile_backend="eager"):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from doc_packed_testing.ap_compat import device_name_for_cost_model
    from shardings.flow import place

    pl = {"R": Replicate(), "B": Shard(0), "S": Shard(1)}
    tok_pl = tuple(pl[c] for c in in_pl)
    cu_pl = tuple(Shard(0) if p == Shard(0) else Replicate() for p in tok_pl)
    o_pl = tuple(pl[c] for c in out_pl)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    B, S, lengths = batch_cfg["B"], batch_cfg["S"], batch_cfg["lengths"]
    batches = [_batch(100 + s, B, S, cfg["vocab"], lengths[s % len(lengths)]) for s in range(steps)]
    init_state, ref_losses, ref_final = reference_training(cfg, batches, lr, steps)

    def input_fn():
        return (torch.randint(0, cfg["vocab"], (B, S)), torch.zeros(B, 33, dtype=torch.int32))

    with torch.device("meta"):
        model = Transformer(**cfg).double()
    # one host: AutoParallel is told the topology (its detection needs CUDA and 8 GPUs)
    with device_name_for_cost_model():
        placed = place(
            model, input_fn, mesh, inputs=[tok_pl, cu_pl], outputs=[o_pl], attention=force or None,
            doc_len=doc_len_hint, gpus_per_host=mesh.size(), cu_seqlens=batches[0][2], compile_backend=compile_backend,
        )  # fmt: skip
    parallel, model, choice, choices = placed.parallel, placed.module, placed.compiled_with, placed.attention
    parallel.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in parallel.named_parameters():
            p.to_local().copy_(distribute_tensor(init_state[name], mesh, p.placements).to_local())
    torch._dynamo.reset()  # after the trace, before the first call compiles (compilation is lazy)
    torch._dynamo.utils.counters.clear()
    opt = torch.optim.SGD(parallel.parameters(), lr=lr)
    replicas = 1
    for d, p in enumerate(o_pl):
        if not p.is_shard():
            replicas *= mesh.size(d)
    losses = []
    for step in range(steps):
        tokens, targets, cu = batches[step]
        logits = model(_shard(tokens, mesh, tok_pl), _shard(cu, mesh, cu_pl))
        local_t = _shard(targets, mesh, tuple(Shard(p.dim) if p.is_shard() else Replicate() for p in o_pl))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), local_t.flatten(), reduction="sum") / targets.numel()
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / replicas)
    final = {name: p.full_tensor() for name, p in parallel.named_parameters()}
    param_err = max((final[k] - ref_final[k]).abs().max().item() for k in final)
    loss_err = max(abs(a - b) for a, b in zip(losses, ref_losses))
    return dict(
        losses=losses, ref_losses=ref_losses, param_err=param_err, loss_err=loss_err,
        layout=[(c.role, c.layout) for c in choices], choices=[str(c) for c in choices],
        compiled_with=choice.backend, graphs=torch._dynamo.utils.counters["stats"]["unique_graphs"],
    )
