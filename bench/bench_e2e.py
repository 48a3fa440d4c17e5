"""AutoParallel end to end on N GPUs: training tokens/s of the layout it chose vs pure DP / CP.

For each mode, every rank traces the same Llama-like model (calling doc_packed_attn) with
AutoParallel, solves, lowers sequence-sharded attention to context parallelism, applies the
placement, and trains a few SGD steps on packed documents:
- ``auto``: no constraints; the solver picks input, activation and attention placements;
- ``dp``: inputs and outputs Shard(0), attention forced to "batch";
- ``cp``: inputs and outputs Shard(1), attention forced to "sequence".
The placed module is compiled with :func:`shardings.compile.compile_placed` (``--compile``:
``auto`` by default, ``eager`` for AutoParallel's uncompiled runner). Rank 0 also trains the
plain model (no AutoParallel) on one GPU, one row of ``S`` tokens, eager and compiled: the
anchor. Each mode reports tokens/s, tokens/s per GPU over the anchor's tokens/s, and MFU =
model FLOPs (:func:`doc_packed_examples.model.training_flops`, attention pairs of the real layouts)
/ (step time x GPUs x ``--peak-tflops``), next to the step-time model's prediction for the
solved placement (:func:`shardings.step_model.price_placement` on the first batch's layout,
rates from ``--rates``; ops other than matmuls, attention and collectives priced fused when the
module runs compiled, one kernel each when it runs eager) and the MFU it implies.
The solver is told the real topology (``shardings.autoparallel.cost_model_for``: hosts of
``--gpus-per-host`` GPUs; AutoParallel's own detection falls back to an 87.7 GB/s link model
on meshes that are not a multiple of 8 GPUs) and prices attention from the measured rates
(``shardings.costs.pricing`` with the first batch's real cu_seqlens).
Training pays for a new document layout every step, as here: each step's batch has its own
``cu_seqlens``, kept on the host by the data side, and the next step's is handed to
``doc_packed.cp.prepare`` while the current step's work is queued (plan and schedule made off the
critical path, the device copy registered: no read back). ``--no-prepare`` moves each step's
``cu_seqlens`` to the device in the step instead (the runtime plans in the first attention call).
Each mode is timed twice on the same placed module, with the intra-op thread pool the launcher
left (``torch.multiprocessing.spawn``: as wide as the host; ``torchrun``: 1 unless
OMP_NUM_THREADS says otherwise) and with one thread (``--threads``), printing every step's time,
the slowest over the median, and what the steps cost the host (schedules built, device reads).
Launch with ``--gpus N`` (spawn) or under ``torchrun --nproc-per-node N bench/bench_e2e.py``.
Needs AutoParallel (git) and pulp. On torch 2.11 the shims of ``doc_packed_testing.ap_compat`` are applied.

Models (``--model``, bench/e2e_models.py): ``example`` (the default: the historical runs, SGD and
bf16 parameters), and in Llama-3-8B's shape (``--layers`` of them) ``llama8b`` (the example model
with SwiGLU), ``hf-llama`` (transformers' Llama, ``attn_implementation="doc_packed"``) and
``titan-llama`` (torchtitan's Llama3 8B config, ``use_doc_packed``). Training settings: ``--optim``
(``adamw``, torchtitan's defaults, unless the model is ``example``), ``--mp bf16`` (the default
unless ``example``: float32 parameters, bf16 compute, float32 gradient reduction through
AutoParallel's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=float32)`` as torchtitan's
AutoParallel flow sets it; the one-device anchor runs under ``torch.autocast(bf16)``, torchtitan's
single-device mixed precision), ``--ac`` (activation checkpointing: every block recomputed, each
library's own way). The anchor also runs the library's own attentions on the same packed batch
(``--attn``, default doc_packed and theirs: transformers ``sdpa,flex_attention``, torchtitan
``varlen,flex``). Every run reports the loss per document (mean over the batch's documents of each
document's mean token loss) next to the token-mean loss.
Usage: ``python -m bench.bench_e2e [--gpus 2] [--seq 32768] [--batch 2] [--compile auto] [--dry-run]
[--model hf-llama --layers 4 --ac]``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import resource
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

import doc_packed as dp
from doc_packed import _doc_layout
from bench import e2e_models as models
from bench._harness import add_dry_run, spawn_ranks, wrapped_cp_passes
from doc_packed.data import lognormal_lengths
from doc_packed.kernels import fa4_launch
from doc_packed_testing.ap_compat import device_name_for_cost_model, patch_autoparallel_for_torch


def _solved(placement, nodes):
    """The solver's placements of ``nodes`` (descriptor -> (node, its grad or tangent)), in order."""
    return [tuple(placement[nodes[d][0]].output_specs.placements) for d in sorted(nodes, key=lambda d: d.idx)]


def solved_input_placements(autop, placement):
    from torch._functorch._aot_autograd.fx_utils import get_plain_input_and_grad_nodes

    return _solved(placement, get_plain_input_and_grad_nodes(autop.gm.graph))


def solved_output_placements(autop, placement):
    """The solver's placements of the placed module's outputs (the logits first)."""
    from torch._functorch._aot_autograd.fx_utils import get_plain_output_and_tangent_nodes

    return _solved(placement, get_plain_output_and_tangent_nodes(autop.gm.graph))


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) whose backward is the identity: every rank of the group computes the
    same loss from the sum, so each rank's part gets the sum's gradient as it is."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def vocab_parallel_token_loss(logits, targets, vocab_start, group) -> torch.Tensor:
    """Per-token cross entropy of logits whose vocabulary is split over ``group`` (this rank holds
    columns ``vocab_start`` onwards), as the full logits would give it; float32."""
    x = logits.float()
    top = x.detach().amax(-1)
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    z = x - top.unsqueeze(-1)
    total = _SumOverGroup.apply(z.exp().sum(-1), group)
    t = targets - vocab_start
    mine = (t >= 0) & (t < x.shape[-1])
    picked = z.gather(-1, t.clamp(0, x.shape[-1] - 1).unsqueeze(-1)).squeeze(-1) * mine
    return total.log() - _SumOverGroup.apply(picked, group)


# mode -> (mesh dim names -> (token placement letters or None for free, forced attention))
MODES = {
    "auto": lambda names: (None, None),
    "dp": lambda names: ("B" * len(names), {n: "batch" for n in names}),
    "cp": lambda names: ("S" * len(names) if len(names) == 1 else None, {names[0]: "sequence"}),
    # 2-D meshes named (dp, cp) / (cp, tp): inputs constrained, attention free or forced
    "dp_cp_auto": lambda names: ("BS", None),
    "dp_cp": lambda names: ("BS", {"dp": "batch", "cp": "sequence"}),
    "cp_tp_auto": lambda names: ("SR", None),
    "cp_tp": lambda names: ("SR", {"cp": "sequence", "tp": "heads"}),
}


@dataclass(frozen=True)
class Settings:
    """How a run trains: ``optim`` "sgd" / "adamw"; ``mp`` "off" (parameters in the run's dtype) /
    "bf16" (float32 parameters, bf16 compute, float32 gradient reduction); ``lr`` (None: the
    optimizer's default here)."""

    optim: str = "sgd"
    mp: str = "off"
    lr: float | None = None

    def param_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.float32 if self.mp == "bf16" else dtype

    def optimizer(self, params) -> torch.optim.Optimizer:
        if self.optim == "sgd":
            return torch.optim.SGD(params, lr=self.lr or 1e-3)
        # torchtitan's AdamW defaults (its OptimizersContainer config)
        return torch.optim.AdamW(params, lr=self.lr or 8e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)

    def mp_policy(self):
        """AutoParallel's policy, as torchtitan's AutoParallel flow sets it (None: off)."""
        if self.mp == "off":
            return None
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)

    def autocast(self, device: torch.device):
        """The one-device anchor's mixed precision: torch.autocast(bf16), as torchtitan's trainer
        runs a model it does not shard (``maybe_enable_amp``)."""
        return torch.autocast(device.type, dtype=torch.bfloat16) if self.mp == "bf16" else contextlib.nullcontext()

    def __str__(self) -> str:
        mp = {"off": "parameters in the run dtype", "bf16": "bf16 compute, float32 parameters and gradient reduction"}
        return f"{self.optim}, {mp[self.mp]}"


def make_batches(n, spec, B, S, mean_doc, device, seed=0):
    """``n`` steps of (tokens, targets, cu_seqlens on the host): lognormal documents, a new layout
    per step (the data side has the layout on the host before the step)."""
    batches = []
    for step in range(seed, seed + n):
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, spec.cfg["vocab"], (B, S), generator=g)
        targets = torch.randint(0, spec.cfg["vocab"], (B, S), generator=g)
        cu = dp.cu_seqlens_from_lengths(
            [lognormal_lengths(S, mean_doc, 1000 * step + b) for b in range(B)], S, max_docs=S // 8
        )
        batches.append((tokens.to(device), targets.to(device), cu))
    return batches


def step_flops(spec, batches, S) -> float:
    """Mean model FLOPs per step over ``batches``."""
    with torch.device("meta"):
        model = models.build(spec)
    return sum(models.step_flops(spec, model, cu, S) for _, _, cu in batches) / len(batches)


def doc_loss_stats(per_doc: torch.Tensor) -> dict:
    """The loss per document: mean, min and max over the documents that have tokens."""
    v = per_doc[~torch.isnan(per_doc)]
    return dict(docs=int(v.numel()), mean=float(v.mean()), min=float(v.min()), max=float(v.max()))


def plain_anchor(spec, attns, S, mean_doc, device, dtype, settings, steps, warmup) -> dict:
    """The plain model on this one device, one row of S tokens, with each attention of ``attns``
    (doc_packed, or the library's own on the same packed batch): seconds per step, eager and
    compiled. The first attention's figures are also the top-level keys (the per-GPU columns)."""
    batches = make_batches(warmup + steps, spec, 1, S, mean_doc, device)
    out: dict = dict(flops=step_flops(spec, batches[warmup:], S), attentions={})
    for attn in attns:
        try:
            out["attentions"][attn] = _anchor_one(spec, attn, batches, S, device, dtype, settings, steps, warmup)
        except Exception as e:  # report and go on with the next attention
            out["attentions"][attn] = dict(error=f"{type(e).__name__}: {e}"[:600])
        if device.type == "cuda":
            torch.cuda.empty_cache()
    out.update(out["attentions"][attns[0]])
    return out


def _anchor_one(spec, attn, batches, S, device, dtype, settings, steps, warmup) -> dict:
    torch._dynamo.reset()  # each attention compiles its own model (no recompile limit, nothing kept)
    torch.manual_seed(0)
    with torch.device(device):
        model = models.build(spec, attn)
    models.init_weights(model)
    for p in model.parameters():
        p.data = p.data.to(settings.param_dtype(dtype))
    opt = settings.optimizer(model.parameters())
    call = models.anchor_call(spec, attn, model)
    out: dict = {}
    # doc_packed compiles whole (no graph breaks); another attention as its library compiles it
    for kind, m in (("eager", model), ("compiled", torch.compile(model, fullgraph=attn == "doc_packed"))):

        def step(i):
            tokens, targets, cu = batches[i]
            # doc_packed: validated, on the device, registered; theirs: the library's masks
            cu = dp.cp.prepare(cu, None, device=device) if attn == "doc_packed" else cu.to(device)
            with settings.autocast(device):
                logits = m(*call(tokens, cu))
            tok_loss = torch.nn.functional.cross_entropy(
                logits.flatten(0, 1).float(), targets.flatten(), reduction="none"
            )
            tok_loss.mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return tok_loss

        for i in range(warmup):
            step(i)
        _startup_gc()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(warmup, warmup + steps):
            tok_loss = step(i)
        if device.type == "cuda":
            torch.cuda.synchronize()
        out[f"{kind}_step_s"] = (time.perf_counter() - t0) / steps
        out[f"{kind}_tokens_per_s"] = S / out[f"{kind}_step_s"]
        cu = batches[warmup + steps - 1][2]
        per_doc = models.document_losses(tok_loss, models.global_doc_ids(cu, S), cu.numel() - cu.shape[0])
        out[f"{kind}_doc_loss"] = doc_loss_stats(per_doc.cpu())
    return out


def _meta_model(spec, dtype):
    """The model AutoParallel traces (on meta, parameters in ``dtype``) and its buffers' values
    (RoPE tables: computed on the host as the library computes them, by a second build whose
    parameters alone are on meta; copied in after placement)."""
    with torch.device("meta"):
        model = models.build(spec)
    for p in model.parameters():
        p.data = p.data.to(dtype)  # parameters only (torchtitan's RoPE table is complex)
    buffers = {}
    if any(True for _ in model.buffers()):
        with models.parameters_on_meta():
            buffers = {name: b.detach().clone() for name, b in models.build(spec).named_buffers()}
    return model, buffers


def run_mode(
    mode,
    mesh,
    spec,
    B,
    S,
    mean_doc,
    device,
    dtype,
    steps,
    warmup,
    compile_backend,
    gpus_per_host,
    rates_path,
    thread_settings,
    use_prepare,
    settings,
    profile_dir=None,
    stall_dump=0.0,
    trace_steps=(),
    call_stats=False,
    overlap_scheduling=None,
    cuda_graphs=False,
):
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from shardings.flow import place
    from shardings.step_model import Layout, Rates, Topology, price_placement

    torch._dynamo.reset()  # each mode compiles its own placed module
    # every mode trains on the same layouts (the seeds below), and each must pay for them as new:
    # forget the layouts, plans and schedules an earlier mode of this process made for them
    _doc_layout.clear_cache()
    rank = dist.get_rank()
    max_docs = S // 8
    batches = make_batches(warmup + steps, spec, B, S, mean_doc, device)

    def input_fn():
        return (
            torch.randint(0, spec.cfg["vocab"], (B, S), device=device),
            torch.zeros(B, max_docs + 1, dtype=torch.int32, device=device),
        )

    cu_host = batches[0][2].cpu()  # real tensors must be read before AutoParallel's fake mode
    model, buffers = _meta_model(spec, settings.param_dtype(dtype))
    t0 = time.perf_counter()
    names = mesh.mesh_dim_names
    tok_words, force = MODES[mode](names)
    pl = {"R": Replicate(), "B": Shard(0), "S": Shard(1)}
    rates = Rates.load(rates_path)
    layout = Layout.from_cu_seqlens(cu_host)  # real values: read before AutoParallel's fake mode
    io = {}
    if tok_words is not None:
        tok_pl = tuple(pl[w] for w in tok_words)
        cu_pl = tuple(Shard(0) if p == Shard(0) else Replicate() for p in tok_pl)
        io = dict(inputs=[tok_pl, cu_pl], outputs=[tok_pl])
    with device_name_for_cost_model():
        placed = place(
            model, input_fn, mesh, **io, attention=force, doc_len=mean_doc, gpus_per_host=gpus_per_host, rates=rates,
            cu_seqlens=cu_host, mp_policy=settings.mp_policy(), print_report=rank == 0, compile_backend=compile_backend,
            overlap_scheduling=overlap_scheduling, cuda_graphs=cuda_graphs,
        )  # fmt: skip
    autop, placement, choices = placed.autop, placed.placement, placed.attention
    in_pl = solved_input_placements(autop, placement)
    # the step model, per op (an eager module) and fused (a compiled one): which one applies
    # is known once compile_placed has chosen
    predicted_by = {
        fused: price_placement(
            autop.gm.graph.nodes, placement, rates=rates, topology=Topology(gpus_per_host), layout=layout, fused=fused,
        )
        for fused in (False, True)
    }  # fmt: skip
    parallel = placed.parallel
    plan_s = time.perf_counter() - t0
    parallel.to_empty(device=device)
    torch.manual_seed(0)
    models.init_weights(parallel)
    with torch.no_grad():  # the buffers' real values (RoPE tables), in each one's placement
        for name, b in parallel.named_buffers():
            full = buffers[name].to(device)
            if isinstance(b, DTensor):
                b.to_local().copy_(distribute_tensor(full, b.device_mesh, b.placements).to_local())
            else:
                b.copy_(full)
    model, choice = placed.module, placed.compiled_with
    predicted = predicted_by[choice.backend != "eager"]
    opt = settings.optimizer(parallel.parameters())
    tok_pl, cu_pl = in_pl[-2], in_pl[-1]
    # the logits as the solver placed them: rows / tokens split like the targets, and, left free,
    # perhaps the vocabulary split too (the loss is then computed vocabulary-parallel)
    out_pl = tok_pl if tok_words is not None else solved_output_placements(autop, placement)[0]
    if any(p.is_partial() for p in out_pl):
        raise NotImplementedError(f"logits placed {out_pl}: partial sums are not reduced by this benchmark")
    vocab_dims = [d for d, p in enumerate(out_pl) if p == Shard(2)]
    if len(vocab_dims) > 1:
        raise NotImplementedError(f"logits placed {out_pl}: vocabulary split over more than one mesh dim")
    tgt_pl = tuple(Replicate() if p == Shard(2) else p for p in out_pl)

    cp_calls = _cp_calls(autop.gm, spec.cfg)
    ready: dict[int, torch.Tensor] = {}

    def local_cu(i):
        """Batch ``i``'s cu_seqlens as this rank's model takes it, on the device: prepared (the
        plan and schedule of each context-parallel call made now), or just moved there."""
        cu = batches[i][2]
        for d, p in enumerate(cu_pl):  # rows sharded where the tokens are batch-sharded
            if p == Shard(0):
                cu = cu.chunk(mesh.size(d), 0)[mesh.get_local_rank(d)]
        if not use_prepare:
            return cu.to(device)
        out = dp.cp.prepare(cu, None, device=device)
        for group, heads, causal, window in cp_calls:
            out = dp.cp.prepare(
                out if device.type != "cpu" else cu,
                group,
                num_heads=heads,
                causal=causal,
                window_size=window,
                device=device,
            )
        return out

    def like_logits(full):
        """``full`` ([B, S]) as this rank's logits hold its rows and tokens."""
        return distribute_tensor(full, mesh, tgt_pl).to_local()

    def token_loss(logits, targets):
        if not vocab_dims:
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none")
        d = vocab_dims[0]
        vocab_start = -(-spec.cfg["vocab"] // mesh.size(d)) * mesh.get_local_rank(d)  # Shard's chunks
        return vocab_parallel_token_loss(logits, targets, vocab_start, mesh.get_group(d)).flatten()

    last: dict = {}

    phases: list[tuple[float, ...]] = []  # host seconds of each step's parts, and its agreement wait

    def step(i, n):
        clock = time.perf_counter
        t0, a0 = clock(), dp.cp.runtime_counts()["agreement_us"]
        tokens, targets, _ = batches[i]
        lc = ready.pop(i) if i in ready else local_cu(i)
        lt = distribute_tensor(tokens, mesh, tok_pl).to_local()
        logits = model(lt, lc)
        t1 = clock()
        if i + 1 < n:  # the next batch's host work while this step's is queued
            ready[i + 1] = local_cu(i + 1)
        t2 = clock()
        tok_loss = token_loss(logits, like_logits(targets))
        loss = tok_loss.mean()
        loss.backward()
        t3 = clock()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t4 = clock()
        waited = (dp.cp.runtime_counts()["agreement_us"] - a0) * 1e-6
        phases.append((t1 - t0, t2 - t1, t3 - t2, t4 - t3, waited))
        last.update(tok_loss=tok_loss.detach(), step=i)  # per document, after timing
        return loss

    timed: dict[str, dict] = {}
    first_s = 0.0
    for j, (threads, gc_mode) in enumerate(thread_settings):
        torch.set_num_threads(threads)
        if j:  # each setting gets layouts of its own (new ones every step: nothing planned before)
            batches[:] = make_batches(warmup + steps, spec, B, S, mean_doc, device, seed=1000 * j)
        ready.clear()
        t0 = time.perf_counter()
        for i in range(warmup):
            step(i, warmup)
        first_s = first_s or time.perf_counter() - t0
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        # per-step times from events between steps (no extra sync): a step that compiles a kernel
        # or plans on the critical path shows up as an outlier
        before, fa4_before = dp.cp.runtime_counts(), fa4_launch.counts()
        marks: list = []
        host: list[float] = []  # host seconds each step took to queue
        pauses: list[tuple[float, int]] = []
        compiled: list[int] = []  # FA4 kernels compiled during each step (0 after the warm-up)
        stalls: list[dict] = []  # allocator calls, page faults, context switches during each step
        _startup_gc()
        if gc_mode == "freeze":  # what a trainer can do once the model is placed: long-lived objects out of gc's walk
            gc.freeze()
        phases.clear()
        t0 = time.perf_counter()
        with _GcPauses() as seen, _CallStats(device, call_stats) as per_call:
            for i in range(warmup, warmup + steps):
                marks.append(_mark(device))
                h0, k0, m0 = time.perf_counter(), dp.cp.runtime_counts()["kernels_compiled"], _stall_counts(device)
                with (
                    _stall_dumps(stall_dump, profile_dir, mode, f"{threads} threads, timed step {i - warmup}"),
                    _traced(i - warmup in trace_steps, profile_dir, f"{mode}_{threads}threads_step{i - warmup}"),
                ):
                    loss = step(i, warmup + steps)
                host.append(time.perf_counter() - h0)
                compiled.append(dp.cp.runtime_counts()["kernels_compiled"] - k0)
                stalls.append({key: n - m0[key] for key, n in _stall_counts(device).items()})
                pauses.append(seen.take())
            marks.append(_mark(device))
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        after = dp.cp.runtime_counts()
        dt = (time.perf_counter() - t0) / steps
        per_step = [_elapsed_s(a, b) for a, b in zip(marks[:-1], marks[1:])]
        expected = _expected_steps(predicted, [batches[i][2] for i in range(warmup, warmup + steps)], S)
        every: list = [None] * dist.get_world_size()  # each rank's host and gc per step (a stall anywhere shows)
        counts = {k: after[k] - before[k] for k in after}
        fa4_after = fa4_launch.counts()
        fa4_calls = {k: n - fa4_before.get(k, 0) for k, n in fa4_after.items() if n > fa4_before.get(k, 0)}
        dist.all_gather_object(every, (host, pauses, compiled, list(phases), counts, stalls, fa4_calls, per_call.summary()))
        host_max = [max(r[0][k] for r in every) for k in range(steps)]
        gc_max = [max(r[1][k][0] for r in every) for k in range(steps)]
        gc_gen = [max(r[1][k][1] for r in every) for k in range(steps)]
        compiled_max = [max(r[2][k] for r in every) for k in range(steps)]
        if gc_mode == "freeze":
            gc.unfreeze()
        tok_loss = last["tok_loss"]
        doc_ids = like_logits(models.global_doc_ids(batches[last["step"]][2], S).to(device))
        per_doc = models.document_losses(tok_loss, doc_ids, B * max_docs, group=dist.group.WORLD)
        timed[f"{threads}" + (", gc frozen" if gc_mode == "freeze" else "")] = dict(
            step_s=dt,
            tokens_per_s=B * S / dt,
            step_times_s=per_step,
            # each step against its own layout's predicted time, over the median of that ratio: the
            # slowest step's stall, with the layouts' differing attention work taken out
            slowest_vs_layout=_slowest_vs_expected(per_step, expected),
            host_s_max=host_max,
            gc_s_max=gc_max,
            gc_generation=gc_gen,
            kernels_compiled_max=compiled_max,
            # per step, per rank: host seconds of forward, next batch's prepare, loss + backward,
            # optimizer, and of the agreements' waits inside them
            host_phases=[[r[3][k] for r in every] for k in range(steps)],
            # per step, per rank: the allocators' calls, page faults, context switches (_stall_counts)
            stall_counts=[[r[5][k] for r in every] for k in range(steps)],
            loss=float(loss.detach()),
            doc_loss=doc_loss_stats(per_doc.cpu()),
            host=counts,
            # per rank: mean host ms of a CP forward/backward call, the first of its pass on a
            # layout and the later layers' (issue item 2: the first should cost what the others do),
            # then both without the agreement's share (a rank ahead of its peers waits there), then
            # the exchanges' and the kernel calls' shares (first / later each)
            call_host_ms=[_call_ms(r[4]) for r in every],
            # per rank: what its FA4 calls in the timed steps did (replayed, recorded, not
            # replayable and why: kernels.fa4_launch.counts)
            fa4_calls=[r[6] for r in every],
            # per rank (--call-stats): each pass's first and later calls, medians (_CallStats)
            call_stats=[r[7] for r in every] if call_stats else None,
        )
    if profile_dir and not stall_dump:  # after the timed steps: their figures stay unprofiled
        torch.set_num_threads(thread_settings[0][0])
        n0 = len(batches)
        batches.extend(make_batches(4, spec, B, S, mean_doc, device, seed=4242))
        _profile_steps(lambda i: step(n0 + i, n0 + 4), device, profile_dir, mode)
    mem = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    layout = {c.role: c.layout for c in choices}
    head = next(iter(timed.values()))
    res = dict(
        mode=mode,
        compile=str(choice),
        step_s=head["step_s"],
        tokens_per_s=head["tokens_per_s"],
        plan_s=plan_s,
        warmup_s=first_s,
        flops=step_flops(spec, batches[warmup:], S),
        loss=head["loss"],
        doc_loss=head["doc_loss"],
        attention=layout,
        inputs=[str(p) for p in in_pl[-2:]],
        max_mem_GiB=mem,
        cp=[c.cp for c in choices if c.cp][:1],
        predicted_step_s=predicted.total_us * 1e-6,
        predicted=str(predicted),
        step_times_s=head["step_times_s"],
        threads=timed,
        prepare=use_prepare,
    )
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return res


def _expected_steps(predicted, cus: list, S: int) -> list[float]:
    """Each step's predicted seconds with its own layout: the step model's attention share scaled
    by the layout's causal pairs against the steps' mean (a row with one long document does
    several times the attention work of a row of short ones; the rest of the step does not move)."""
    from doc_packed.flops import total_pairs

    pairs = [total_pairs(cu, S, True, -1, 0) for cu in cus]
    mean = sum(pairs) / len(pairs)
    return [(predicted.total_us + predicted.attention_us * (p / mean - 1)) * 1e-6 for p in pairs]


def _slowest_vs_expected(times: list[float], expected: list[float]) -> float:
    """The largest step / expected ratio over the median ratio (1.0: no step slower than its
    layout's work says)."""
    ratios = sorted(t / e for t, e in zip(times, expected))
    return ratios[-1] / ratios[len(ratios) // 2]


def _call_ms(counts: dict) -> tuple[float | None, ...]:
    """Mean host ms of a context-parallel call, the first of its pass on a layout and the others,
    then the same without the agreement's share (the wait for late peers), then the exchanges'
    and the kernel calls' shares of each, from a ``runtime_counts()`` difference (None where
    there was no such call)."""

    def mean(which: str, us: int) -> float | None:
        n = counts.get(f"{which}_calls", 0)
        return us / n / 1e3 if n else None

    def part(which: str, name: str) -> float | None:
        return mean(which, counts.get(f"{which}_call_{name}_us", 0))

    whole = {w: counts[f"{w}_call_us"] for w in ("first", "other")}
    work = {w: whole[w] - counts[f"{w}_call_agreement_us"] for w in ("first", "other")}
    return (
        mean("first", whole["first"]),
        mean("other", whole["other"]),
        mean("first", work["first"]),
        mean("other", work["other"]),
        part("first", "exchange"),
        part("other", "exchange"),
        part("first", "kernel"),
        part("other", "kernel"),
    )


@contextlib.contextmanager
def _stall_dumps(after_s: float, out_dir, mode: str, label: str):
    """Where this rank's host is when a step has run ``after_s`` seconds (faulthandler: every
    thread's Python stack, taken without the GIL), appended to ``out_dir/stalls_<mode>_rank<r>.txt``;
    nothing when ``after_s`` is 0. Once per step: reading running threads' frames unlocked can
    crash the process, and repeated dumps (every ``after_s``) preceded two silent rank deaths on
    4 x H200 (docs/end_to_end.md); a diagnostic, not for measured runs."""
    if not after_s or not out_dir:
        yield
        return
    import faulthandler

    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"stalls_{mode}_rank{dist.get_rank()}.txt"), "a") as f:
        f.write(f"=== {label}\n")
        f.flush()
        faulthandler.dump_traceback_later(after_s, repeat=False, file=f)
        try:
            yield
        finally:
            faulthandler.cancel_dump_traceback_later()


@contextlib.contextmanager
def _traced(on: bool, out_dir, label: str):
    """torch.profiler (CPU and CUDA) around one timed step on this rank when ``on``: a Chrome
    trace ``out_dir/trace_<label>_rank<r>.json`` and a table of its ops by self CPU time (a stall
    shows as a long launch or runtime call under the op that made it); the step is slower for it."""
    if not on or not out_dir:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    os.makedirs(out_dir, exist_ok=True)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        yield
    base = os.path.join(out_dir, f"trace_{label}_rank{dist.get_rank()}")
    prof.export_chrome_trace(base + ".json")
    with open(base + ".txt", "w") as f:
        f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


def _profile_steps(step, device, out_dir, mode) -> None:
    """Where a step's host time goes, on every rank, written by rank 0 for itself and the rank
    slowest to queue: step 0 (a new layout) unprofiled, step 1 under cProfile (Python calls), step 2
    under torch.profiler (operators, host and device). Each step has a layout of its own."""
    import cProfile
    import io
    import pstats

    def settle():
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()

    step(0)
    settle()
    py = cProfile.Profile()
    h0 = time.perf_counter()
    py.enable()
    step(1)
    py.disable()
    host_py = time.perf_counter() - h0
    settle()
    acts = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else []
    )
    with torch.profiler.profile(activities=acts) as prof:
        h0 = time.perf_counter()
        step(2)
        host_op = time.perf_counter() - h0
        settle()
    text = io.StringIO()
    for key, n in (("tottime", 45), ("cumulative", 45)):
        pstats.Stats(py, stream=text).sort_stats(key).print_stats(n)
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    ops = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
    ops_dev = prof.key_averages().table(sort_by=sort, row_limit=25) if device.type == "cuda" else ""
    # each attention call of the step in order, host ms: the first of a step (a new layout) against the others
    calls = [
        (e.name.split("::")[-1], e.cpu_time_total / 1e3)
        for e in sorted(prof.events(), key=lambda e: e.time_range.start)
        if e.name in ("doc_packed::attn_fwd", "doc_packed::attn_bwd")
    ]
    ops += "\nattention calls in order, host ms each: " + ", ".join(f"{n} {ms:.2f}" for n, ms in calls) + "\n"
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, (host_py, host_op, text.getvalue(), ops, ops_dev))
    if dist.get_rank() == 0:
        os.makedirs(out_dir, exist_ok=True)
        slow = max(range(len(every)), key=lambda r: every[r][1])
        with open(os.path.join(out_dir, f"profile_{mode}.txt"), "w") as f:
            f.write("host ms to queue (cProfiled step, torch.profiler step) per rank: "
                    + ", ".join(f"{r}: {1e3 * e[0]:.1f}, {1e3 * e[1]:.1f}" for r, e in enumerate(every)) + "\n")  # fmt: skip
            for r in dict.fromkeys((0, slow)):
                f.write(f"\n===== rank {r}: torch.profiler, by self CPU time =====\n{every[r][3]}\n")
                if every[r][4]:
                    f.write(f"\n===== rank {r}: torch.profiler, by self device time =====\n{every[r][4]}\n")
                f.write(f"\n===== rank {r}: cProfile =====\n{every[r][2]}\n")


def _cp_calls(gm, cfg) -> list[tuple[str, tuple[int, int], bool, tuple[int, int]]]:
    """The distinct context-parallel calls of a placed graph: (group name, (H_q, H_kv), causal,
    window) of each attention node that lowering gave a cp_group (what prepare() needs)."""
    from doc_packed.ops import arg_index

    out = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or getattr(node.target, "namespace", None) != "doc_packed":
            continue
        try:
            arg_index(node.target, "cp_group")
        except (KeyError, ValueError):  # a doc_packed op without one
            continue

        def arg(name):
            i = arg_index(node.target, name)
            return node.args[i] if len(node.args) > i else node.kwargs.get(name)

        group = arg("cp_group")
        if group is None:
            continue
        call = (
            group,
            (cfg["n_heads"], cfg["n_kv_heads"]),
            bool(arg("causal")),
            (int(arg("window_left")), int(arg("window_right"))),
        )
        if call not in out:
            out.append(call)
    return out


def _startup_gc() -> None:
    """One full garbage collection before the timed steps of every mode (and of the anchor), as a
    trainer's start-up does once (torchtitan: its initial collection). Python (3.12) runs a full
    collection when the objects that survived into its oldest generation since the last one exceed
    a quarter of those it kept then; placing and compiling leave that count near the bound, so
    without this one early timed step pays a full walk of AutoParallel's, Inductor's and FA4's
    objects (672 ms on a 2 x H200 rank, session 25), once: a cost a long run spreads over thousands
    of steps. A full collection inside the timed steps still shows in the printed pauses."""
    gc.collect()


class _CallStats:
    """Each context-parallel forward and backward call of the timed steps timed on its own
    (``--call-stats``): the pass, whether it was the pass's first call on its layout (the
    runtime's own split, :func:`doc_packed.cp.runtime_counts`), host wall and thread CPU
    microseconds, the agreement's wait, voluntary context switches (the thread blocked: a full
    launch queue, a wait in a collective) and cudaMalloc calls inside it. Medians show whether a
    first call is slower as a rule or through a few calls that waited or allocated."""

    def __init__(self, device, on: bool):
        self.device, self.on, self.rows = device, on, []

    def __enter__(self):
        self._wrapped = wrapped_cp_passes(self._timed) if self.on else contextlib.nullcontext()
        self._wrapped.__enter__()
        return self

    def __exit__(self, *exc):
        self._wrapped.__exit__(*exc)

    def _mallocs(self) -> int:
        if self.device.type != "cuda":
            return 0
        return int(torch.cuda.memory_stats(self.device).get("num_device_alloc", 0))

    def _timed(self, name, fn):
        from doc_packed.cp import attention, comm

        def call(*args):
            m0, firsts = self._mallocs(), attention.call_host_times()["first"][0]
            sw0, a0 = resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw, comm.agreement_ns()
            c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
            result = fn(*args)
            wall, cpu = time.perf_counter_ns() - t0, time.thread_time_ns() - c0
            waited = comm.agreement_ns() - a0
            switches = resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw - sw0
            first = attention.call_host_times()["first"][0] > firsts
            self.rows.append((name, first, wall / 1e3, (wall - waited) / 1e3, cpu / 1e3, switches, self._mallocs() - m0))
            return result

        return call

    def summary(self) -> dict:
        """``{"<pass> first|later": (calls, median wall us, median wall without the agreement,
        median thread CPU us, share of calls that blocked, share that called cudaMalloc)}``."""
        import statistics

        out = {}
        for name in ("forward", "backward"):
            for first in (True, False):
                rows = [r for r in self.rows if r[0] == name and r[1] == first]
                if rows:
                    med = [statistics.median(r[k] for r in rows) for k in (2, 3, 4)]
                    share = [sum(1 for r in rows if r[k] > 0) / len(rows) for k in (5, 6)]
                    out[f"{name} {'first' if first else 'later'}"] = (len(rows), *med, *share)
        return out


class _GcPauses:
    """Python's cyclic garbage collections seen by this process: (generation, seconds) of each,
    gathered per timed step (a collection over AutoParallel's long-lived graphs stalls a rank,
    and a stalled rank stalls every collective of the step)."""

    def __init__(self):
        self.log: list[tuple[int, float]] = []
        self._t0 = 0.0

    def __call__(self, phase, info):
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.log.append((info["generation"], time.perf_counter() - self._t0))

    def __enter__(self):
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self)

    def take(self) -> tuple[float, int]:
        """Seconds spent collecting since the last take, and the oldest generation collected (-1: none)."""
        out = (sum(s for _, s in self.log), max((g for g, _ in self.log), default=-1))
        self.log.clear()
        return out


_ALLOC_KEYS = {  # torch.cuda.memory_stats / host_memory_stats keys: calls that can stall the host
    "num_device_alloc": "cudaMalloc",
    "num_device_free": "cudaFree (syncs the device)",
    "num_alloc_retries": "alloc retries (free cache + sync)",
    "num_sync_all_streams": "sync all streams",
}
_HOST_ALLOC_KEYS = {"num_host_alloc": "cudaHostAlloc", "num_host_free": "cudaFreeHost"}


def _stall_counts(device) -> dict[str, int]:
    """What can stall a host, counted so far: the CUDA caching allocator's and the pinned host
    allocator's calls (cudaFree and an allocation retry wait for the whole device) and the
    process's page faults and context switches (a blocking wait is a voluntary switch)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    counts = {
        "page faults": usage.ru_minflt + usage.ru_majflt,
        "waits (voluntary switches)": usage.ru_nvcsw,
        "preempted (involuntary switches)": usage.ru_nivcsw,
    }
    if device.type == "cuda":
        dev = torch.cuda.memory_stats(device)
        counts.update({name: int(dev.get(key, 0)) for key, name in _ALLOC_KEYS.items()})
        host_stats = getattr(torch.cuda, "host_memory_stats", None)  # torch 2.6+
        if host_stats is not None:
            pinned = host_stats()
            counts.update({name: int(pinned.get(key, 0)) for key, name in _HOST_ALLOC_KEYS.items()})
    return counts


def _mark(device):
    """A point on the step timeline: a recorded CUDA event, or the host clock on CPU."""
    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def _elapsed_s(a, b) -> float:
    return a.elapsed_time(b) / 1e3 if isinstance(a, torch.cuda.Event) else b - a


def worker(rank, world, port, args):
    launched_threads = torch.get_num_threads()  # what the launcher left: spawn = the host's width
    settings = {"both": (launched_threads, 1), "launched": (launched_threads,), "1": (1,)}[args.threads]
    settings = tuple(dict.fromkeys(settings))  # one entry when the launcher already gave one thread
    gc_modes = {"default": ("default",), "freeze": ("freeze",), "both": ("default", "freeze")}[args.gc]
    settings = tuple((t, g) for g in gc_modes for t in settings)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    patch_autoparallel_for_torch()
    from torch.distributed.device_mesh import init_device_mesh

    if args.dry_run:
        device, dtype, backend = torch.device("cpu"), torch.float32, "gloo"
    else:
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        device, dtype, backend = torch.device("cuda", local), torch.bfloat16, "nccl"
    spec = models.spec_for(args.model, layers=args.layers, dim=args.dim, checkpoint=args.ac, tiny=args.dry_run)
    real = args.model != "example"  # the real-settings runs: AdamW, bf16 mixed precision
    train = Settings(
        optim=args.optim or ("adamw" if real else "sgd"), mp=args.mp or ("bf16" if real else "off"), lr=args.lr
    )
    defaults = models.DEFAULT_ANCHOR_CPU if args.dry_run else models.DEFAULT_ANCHOR
    attns = args.attn.split(",") if args.attn else defaults[args.model].split(",")
    init = "env://" if port is None else f"tcp://127.0.0.1:{port}"  # torchrun: its rendezvous
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
    shape = tuple(int(x) for x in args.mesh.split(",")) if args.mesh else (world,)
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=tuple(args.names.split(",")))
    anchor = None
    if rank == 0 and not args.no_anchor:
        anchor = plain_anchor(spec, attns, args.seq, args.mean_doc, device, dtype, train, args.steps, args.warmup)
        print(json.dumps(dict(anchor=anchor)), flush=True)
    dist.barrier()
    # a side group for agreeing after a failed mode: the default one may be the failed mode's NCCL
    side = dist.new_group(backend="gloo")
    rows = []
    for mode in args.modes.split(","):
        try:
            r = run_mode(
                mode,
                mesh,
                spec,
                args.batch,
                args.seq,
                args.mean_doc,
                device,
                dtype,
                args.steps,
                args.warmup,
                args.compile,
                args.gpus_per_host or world,
                args.rates,
                settings,
                not args.no_prepare,
                train,
                profile_dir=args.profile,
                stall_dump=args.stall_dump,
                trace_steps=args.trace_steps,
                call_stats=args.call_stats,
                overlap_scheduling=True if args.overlap else None,
                cuda_graphs=args.cuda_graphs,
            )
        except Exception as e:  # report on every rank; go on with the next mode if every rank failed
            import traceback

            r = dict(mode=mode, error=f"{type(e).__name__}: {e}"[:2000], tb=traceback.format_exc()[-3000:])
            print(f"[rank {rank}] mode {mode} failed: {r['error']}\n{r['tb']}", file=sys.stderr, flush=True)
            try:  # a rank still inside the mode (waiting in a collective for this one) never comes
                dist.monitored_barrier(group=side, timeout=timedelta(seconds=120))
            except RuntimeError:
                raise e from None  # the run ends here (the launcher kills the rank that waits)
        if rank == 0:
            print(json.dumps(r), flush=True)
        rows.append(r)
    if rank == 0:
        peak = args.peak_tflops * 1e12
        print(
            f"\ndevice: {world} x {torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}  torch {torch.__version__}"
        )
        print(
            f"model: {args.model} {spec.cfg}  B={args.batch} S={args.seq} lognormal docs mean {args.mean_doc}  {dtype}"
        )
        print(f"training: {train}; activation checkpointing {'on' if args.ac else 'off'}")
        print(f"mesh: {tuple(mesh.shape)} {mesh.mesh_dim_names}; MFU peak {args.peak_tflops:g} TFLOP/s per GPU")
        if anchor:
            for attn, a in anchor["attentions"].items():
                if "error" in a:
                    print(f"one GPU, plain model, attention {attn}: error: {a['error'][:300]}")
                    continue
                for kind in ("eager", "compiled"):
                    d = a[kind + "_doc_loss"]
                    print(
                        f"one GPU, plain model {kind}, attention {attn}: [1, {args.seq}] {a[kind + '_step_s']:.3f} "
                        f"s/step, {a[kind + '_tokens_per_s']:.0f} tokens/s, MFU "
                        f"{anchor['flops'] / a[kind + '_step_s'] / peak:.2f}, loss per document {d['mean']:.4f} "
                        f"(min {d['min']:.4f}, max {d['max']:.4f}, {d['docs']} documents)"
                    )
            if "eager_step_s" not in anchor:
                anchor = None  # doc_packed's own anchor failed: no per-GPU columns
        launcher = "torchrun" if port is None else "torch.multiprocessing.spawn"
        print(
            f"launcher: {launcher}; intra-op threads as launched: {launched_threads}; "
            f"cu_seqlens {'prepared a step ahead' if not args.no_prepare else 'moved in the step'}"
        )
        print(
            "| mode | threads | attention layout (fwd) | inputs (tokens, cu) | step ms | slowest / median | per GPU vs "
            "plain eager | vs plain compiled | MFU | predicted ms | measured / predicted | schedules built in "
            "calls, device reads per step | vs launched threads |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            if "error" in r:
                print(f"| {r['mode']} | error: {r['error'][:80]} | | | | | | | | | | | |")
                continue
            first = None
            for threads, t in r["threads"].items():
                times = sorted(t["step_times_s"])
                median = times[len(times) // 2]
                per_gpu = t["tokens_per_s"] / world
                vs = [f"{per_gpu / anchor[k + '_tokens_per_s']:.2f}" if anchor else "-" for k in ("eager", "compiled")]
                mfu = r["flops"] / t["step_s"] / (world * peak)
                host = ", ".join(f"{t['host'][k] / args.steps:.1f}" for k in ("schedules_in_calls", "device_reads"))
                first = first or t["step_s"]
                print(
                    f"| {r['mode']} | {threads} | {r['attention'].get('forward')} | {', '.join(r['inputs'])} "
                    f"| {1e3 * t['step_s']:.1f} | {times[-1] / median:.2f} | {vs[0]} | {vs[1]} | {mfu:.2f} "
                    f"| {1e3 * r['predicted_step_s']:.1f} | {t['step_s'] / r['predicted_step_s']:.2f} | {host} "
                    f"| {t['step_s'] / first:.2f} |"
                )
        for r in rows:
            for threads, t in r.get("threads", {}).items():
                print(
                    f"{r['mode']} ({threads} threads): step times ms "
                    + " ".join(f"{1e3 * x:.1f}" for x in t["step_times_s"])
                )
                if "slowest_vs_layout" in t:
                    print(
                        "    slowest / median step against each step's own layout (its attention work priced): "
                        f"{t['slowest_vs_layout']:.2f}"
                    )
                print(
                    "    host ms to queue the step (slowest rank) "
                    + " ".join(f"{1e3 * x:.1f}" for x in t["host_s_max"])
                )
                print("    FA4 kernels compiled (most on a rank) " + " ".join(map(str, t["kernels_compiled_max"])))
                if any(t.get("fa4_calls", [])):
                    print(
                        "    FA4 calls in the timed steps, per rank: "
                        + "; ".join(
                            f"r{r} " + ", ".join(f"{what} {n}" for what, n in sorted(c.items()))
                            for r, c in enumerate(t["fa4_calls"])
                        )
                    )
                if any(ms[0] is not None for ms in t.get("call_host_ms", [])):
                    print(
                        "    host ms per attention call, first of its pass on a layout / later layers, per rank"
                        " (in brackets: without the agreement's wait for late peers): "
                        + "; ".join(
                            f"r{r} {first:.2f} / {other:.2f} ({first_work:.2f} / {other_work:.2f})"
                            for r, (first, other, first_work, other_work, *_) in enumerate(t["call_host_ms"])
                            if first is not None and other is not None
                        )
                    )
                    print(
                        "      of which exchanges / kernel calls, first / later: "
                        + "; ".join(
                            f"r{r} {ms[4]:.2f} / {ms[5]:.2f}, {ms[6]:.2f} / {ms[7]:.2f}"
                            for r, ms in enumerate(t["call_host_ms"])
                            if None not in ms
                        )
                    )
                for rank_, stats in enumerate(t.get("call_stats") or []):
                    print(
                        f"    r{rank_} per call (median us: wall / without the agreement / thread CPU; share blocked, share "
                        "with cudaMalloc): "
                        + "; ".join(
                            f"{what} x{n} {wall:.0f} / {work:.0f} / {cpu:.0f}, {blocked:.2f}, {malloc:.2f}"
                            for what, (n, wall, work, cpu, blocked, malloc) in stats.items()
                        )
                    )
                slowest = sorted(range(len(t["step_times_s"])), key=lambda k: -t["step_times_s"][k])[:3]
                for k in sorted(slowest):
                    parts = "; ".join(
                        f"r{r} " + "/".join(f"{1e3 * x:.1f}" for x in ph) for r, ph in enumerate(t["host_phases"][k])
                    )
                    print(f"    step {k} host ms forward/prepare/backward/optimizer/agreement wait: {parts}")
                    calls = t.get("stall_counts", [[]] * (k + 1))[k]
                    if any(calls):
                        print(f"    step {k} allocators, faults, switches: " + "; ".join(
                            f"r{r} " + ", ".join(f"{key} {n}" for key, n in c.items() if n) for r, c in enumerate(calls)
                        ))  # fmt: skip
                print(
                    "    gc pause ms (slowest rank; oldest generation) "
                    + " ".join(
                        f"{1e3 * x:.1f}({g})" if g >= 0 else "-" for x, g in zip(t["gc_s_max"], t["gc_generation"])
                    )
                )
        if anchor and len(anchor["attentions"]) > 1:  # the placed step against each library attention's
            for r in rows:
                for threads, t in r.get("threads", {}).items():
                    vs = [f"{attn} {t['tokens_per_s'] / world / a['compiled_tokens_per_s']:.3f}"
                          for attn, a in anchor["attentions"].items() if "error" not in a]  # fmt: skip
                    print(f"{r['mode']} ({threads} threads) per GPU / plain compiled, by the anchor's attention: "
                          + ", ".join(vs))  # fmt: skip
        for r in rows:
            for threads, t in r.get("threads", {}).items():
                d = t["doc_loss"]
                print(
                    f"{r['mode']} ({threads} threads): last step's loss {t['loss']:.4f} (token mean), per document "
                    f"{d['mean']:.4f} (min {d['min']:.4f}, max {d['max']:.4f}, {d['docs']} documents)"
                )
        for r in rows:
            if "predicted" in r:
                print(f"{r['mode']}: step model {r['predicted']}")
        rows.insert(
            0,
            dict(
                anchor=anchor,
                world=world,
                batch=args.batch,
                seq=args.seq,
                mesh=[[n, int(k)] for n, k in zip(mesh.mesh_dim_names, mesh.shape)],
                launcher=launcher,
                launched_threads=launched_threads,
                peak_tflops=args.peak_tflops,
                model=args.model,
                cfg=spec.cfg,
                training=str(train),
                ac=args.ac,
            ),
        )
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--dim", type=int, default=2048, help="--model example's width")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--mean-doc", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--modes", default="auto,dp,cp", help=f"any of {sorted(MODES)}")
    ap.add_argument("--mesh", default=None, help="mesh shape, e.g. 2,2 (default: 1-D of all GPUs)")
    ap.add_argument("--names", default="x", help="mesh dim names, e.g. dp,cp")
    ap.add_argument("--compile", default="auto", help="compile_placed backend: auto, autoparallel, inductor, eager")
    ap.add_argument(
        "--overlap",
        action="store_true",
        help="compile_placed(overlap_scheduling=True): the Inductor fallback also runs torch's "
        "communication/compute overlap pass (AutoParallel's backend runs it on GPUs anyway)",
    )
    ap.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="compile_placed(cuda_graphs=True): the placed module's graphs recorded as CUDA graphs between "
        "doc_packed's calls (Inductor path; the anchor stays a default compile)",
    )
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="per-GPU dense bf16 peak for MFU (H100/H200: 989)")
    ap.add_argument("--no-anchor", action="store_true", help="skip the one-GPU plain model run")
    ap.add_argument("--gpus-per-host", type=int, default=None, help="GPUs per host for the cost model (default: all)")
    ap.add_argument("--rates", default=None, help="rates file of the step model (default shardings/h200_rates.json)")
    ap.add_argument(
        "--threads",
        default="both",
        choices=["both", "launched", "1"],
        help="time each mode with the launcher's intra-op threads and/or one thread",
    )
    ap.add_argument(
        "--gc",
        default="default",
        choices=["default", "freeze", "both"],
        help="Python's garbage collector in the timed steps: as the process has it, and/or frozen "
        "(gc.freeze() once the model is placed: long-lived objects no longer walked)",
    )
    ap.add_argument(
        "--call-stats",
        action="store_true",
        help="time every context-parallel call of the timed steps on its own: medians of each pass's "
        "first call on a layout and of its later ones, wall and thread CPU time, and the share of "
        "calls that waited (voluntary switches) or called cudaMalloc (a diagnostic: it adds host work)",
    )
    ap.add_argument("--no-prepare", action="store_true", help="move each step's cu_seqlens in the step (no prepare)")
    ap.add_argument(
        "--model",
        default="example",
        choices=models.MODELS,
        help="example (dim from --dim), or Llama-3-8B-shaped: llama8b, hf-llama, titan-llama (--layers)",
    )
    ap.add_argument(
        "--attn",
        default=None,
        help="the anchor's attentions, comma-separated (default: doc_packed, and for hf-llama "
        "sdpa,flex_attention, for titan-llama varlen,flex); any of "
        + "; ".join(f"{m}: {','.join(a)}" for m, a in models.ATTENTIONS.items() if len(a) > 1),
    )
    ap.add_argument("--optim", default=None, choices=["sgd", "adamw"], help="default: adamw, sgd for --model example")
    ap.add_argument(
        "--mp",
        default=None,
        choices=["off", "bf16"],
        help="bf16: float32 parameters, bf16 compute, float32 gradient reduction (AutoParallel's "
        "MixedPrecisionPolicy); off: parameters in bf16 (GPU) / float32 (CPU). "
        "Default: bf16, off for --model example",
    )
    ap.add_argument("--lr", type=float, default=None, help="default: 1e-3 (SGD), 8e-4 (AdamW)")
    ap.add_argument("--ac", action="store_true", help="activation checkpointing: every block recomputed")
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="after each mode's timed steps, profile two more (cProfile, torch.profiler) on every rank: "
        "DIR/profile_<mode>.txt holds rank 0's and the slowest rank's",
    )
    ap.add_argument(
        "--trace-steps",
        type=lambda v: {int(x) for x in v.split(",") if x},
        default=set(),
        metavar="K[,K...]",
        help="with --profile: run these timed steps (counting from 0) under torch.profiler on every "
        "rank (DIR/trace_<mode>_<threads>threads_step<K>_rank<r>.json and .txt); a diagnostic of a "
        "step that stalls at a given layout: it slows the step it traces",
    )
    ap.add_argument(
        "--stall-dump",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="with --profile: each timed step still queuing after SECONDS writes every thread's "
        "Python stack to DIR/stalls_<mode>_rank<r>.txt (a diagnostic: the unlocked stack walk can "
        "crash a rank)",
    )
    add_dry_run(ap, "gloo ranks on CPU, float32, the models' tiny shape (pass small sizes too: --seq 256 ...)")
    args = ap.parse_args(argv)
    if args.trace_steps and not args.profile:
        ap.error("--trace-steps writes its traces under --profile DIR: pass --profile too")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun: this process is one rank
        worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), None, args)
        return
    spawn_ranks(worker, args.gpus, args)


if __name__ == "__main__":
    main()
