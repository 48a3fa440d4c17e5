"""Rank bodies for AutoParallel runs of other libraries' models (module level so spawn can import
them): a Hugging Face Llama through ``doc_packed.integrations.hf.PackedCausalLM`` and torchtitan's
Llama3 with ``DocPackedAttention``, rows (``[B, L]`` + ``cu_seqlens [B, MAX_DOCS + 1]``) or flat
(``[1, T]`` + 1-D ``cu_seqlens`` over ``T``) layout."""

from __future__ import annotations

import torch
import torch.distributed as dist

import doc_packed as dp

MAX_DOCS = 8


def build(which: str) -> tuple[torch.nn.Module, int]:
    """(model in float64 on the current default device, vocab size)."""
    if which == "hf":
        import transformers

        import doc_packed.integrations.hf as dp_hf

        dp_hf.register()
        cfg = transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, initializer_range=0.2,
        )
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="doc_packed")
        return dp_hf.PackedCausalLM(model).double(), 64
    from torchtitan.models.llama3 import llama3_configs

    from doc_packed.integrations.torchtitan import use_doc_packed

    cfg = use_doc_packed(llama3_configs["debugmodel"](attn_backend="varlen"))
    cfg.layers = cfg.layers[:1]
    model = cfg.build()
    if not any(p.is_meta for p in model.parameters()):
        model.init_states()
    return model.double(), 2048


def batches(which: str, layout: str, vocab: int, steps: int) -> list[tuple[torch.Tensor, ...]]:
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
        inputs = (tokens, cu) if which == "hf" else (tokens, _positions(cu, tokens.shape[1]), cu)
        out.append((inputs, targets))
    return out


def _positions(cu: torch.Tensor, length: int) -> torch.Tensor:
    return dp.positions(cu if cu.dim() == 2 else cu[None], length)


def _loss(logits, targets, numel):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum") / numel


def reference(which, data, lr):
    torch.manual_seed(0)
    model, _ = build(which)
    state = {k: v.detach().clone() for k, v in model.named_parameters()}  # not state_dict: hooks rename
    buffers = {k: v.detach().clone() for k, v in model.named_buffers()}
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for inputs, targets in data:
        loss = _loss(model(*inputs), targets, targets.numel())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return state, buffers, losses


def ap_train(rank, world, *args, **kwargs):
    from ap_compat import torch_patched_for_autoparallel

    with torch_patched_for_autoparallel():
        return _ap_train(rank, world, *args, **kwargs)


def _ap_train(rank, world, which, layout, mesh_shape, names, force, steps, lr, compile_backend):
    from autoparallel.api import AutoParallel
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from ap_compat import device_name_for_cost_model
    from shardings.autoparallel import cost_model_for, describe_attention, force_attention_layout, lower_context_parallel
    from shardings.compile import compile_placed
    from shardings.costs import pricing

    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    _, vocab = build(which)
    data = batches(which, layout, vocab, steps)
    init_state, init_buffers, ref_losses = reference(which, data, lr)
    # tokens / positions / targets: batch on "dp", tokens on "cp"; cu_seqlens rows follow the batch
    tok_pl = tuple(Shard(0) if n == "dp" else Shard(1) for n in names)
    cu_pl = tuple(Shard(0) if n == "dp" and layout == "rows" else Replicate() for n in names)
    in_pl = [tok_pl, cu_pl] if which == "hf" else [tok_pl, tok_pl, cu_pl]

    def input_fn():
        return tuple(torch.zeros(t.shape, dtype=t.dtype) for t in data[0][0])

    with torch.device("meta"):
        model, _ = build(which)
    with device_name_for_cost_model(), dp.planning(doc_len=16), pricing(mesh, gpus_per_host=mesh.size()):
        with AutoParallel(model, input_fn, mesh, cost_model=cost_model_for(mesh, mesh.size())) as autop:
            autop.add_input_constraints(in_pl)
            autop.add_output_constraints([tok_pl])
            force_attention_layout(autop, force)
            placement = autop.optimize_placement()
            placement = lower_context_parallel(autop, placement)
            choices = describe_attention(autop, placement, print_report=False)
            parallel = autop.apply_placement(placement)
    parallel.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in parallel.named_parameters():
            p.to_local().copy_(distribute_tensor(init_state[name], mesh, p.placements).to_local())
        for name, b in parallel.named_buffers():
            local = b.to_local() if hasattr(b, "to_local") else b
            full = init_buffers[name]
            local.copy_(distribute_tensor(full, mesh, b.placements).to_local() if hasattr(b, "placements") else full)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    run, choice = compile_placed(parallel, compile_backend)
    opt = torch.optim.SGD(parallel.parameters(), lr=lr)
    losses = []
    for inputs, targets in data:
        local = [distribute_tensor(t, mesh, pl).to_local() for t, pl in zip(inputs, in_pl)]
        logits = run(*local)
        local_t = distribute_tensor(targets, mesh, tok_pl).to_local()
        loss = _loss(logits, local_t, targets.numel())
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item())
    return dict(
        losses=losses, ref_losses=ref_losses, layout=[(c.role, c.layout) for c in choices],
        compiled_with=choice.backend, graphs=torch._dynamo.utils.counters["stats"]["unique_graphs"],
    )
