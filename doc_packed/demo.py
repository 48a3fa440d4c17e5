"""End-to-end demo: context-parallel training of a small transformer on packed documents.

    python -m doc_packed.demo [--ranks 4] [--seq 2048] [--batch 2] [--steps 3]

Spawns CPU processes with a gloo group, packs random documents of arbitrary lengths into rows,
and trains a small transformer whose attention runs context parallel (each rank holds a
``torch.chunk`` of every row). With AutoParallel installed, AutoParallel places the model and
chooses the attention layout; otherwise the demo shards the sequence itself. A one-process run
of the same model on the same data is the reference. The placed model is compiled (for
AutoParallel's module: :func:`shardings.compile.compile_placed`, which says which compiler it
used and why; ``--eager`` skips compilation). The report gives the layout, the compiler, the plan's
per-rank work balance and K/V traffic against all-gather, loss and parameter parity, and time.
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import sys
import time
from unittest.mock import patch

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import doc_packed as dp
from doc_packed.examples import Attention, Transformer
from doc_packed.layout import lognormal_lengths

MODEL = dict(vocab=256, dim=64, n_heads=4, n_kv_heads=2, n_layers=2)


def log(msg: str) -> None:
    print(msg, flush=True)


def make_batches(args) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Random documents of lognormal lengths (some longer than a shard, some 1 token)."""
    rng = random.Random(args.seed)
    g = torch.Generator().manual_seed(args.seed)
    batches = []
    for _ in range(args.steps):
        lengths = lognormal_lengths(args.batch * args.seq, args.mean_doc, rng)
        docs = [torch.randint(0, MODEL["vocab"], (n + 1,), generator=g) for n in lengths]
        rows, cu = dp.pack_documents([d[:-1] for d in docs], args.seq, max_docs=args.seq // 4)
        targets, _ = dp.pack_documents([d[1:] for d in docs], args.seq, max_docs=args.seq // 4)
        batches.append((rows[: args.batch], targets[: args.batch], cu[: args.batch].contiguous()))
    return batches


def loss_fn(logits: torch.Tensor, targets: torch.Tensor, total: int) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum") / total


def reference(batches, lr: float):
    torch.manual_seed(0)
    model = Transformer(**MODEL).double()
    init = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for tokens, targets, cu in batches:
        loss = loss_fn(model(tokens, cu), targets, targets.numel())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return init, losses, {k: v.detach() for k, v in model.state_dict().items()}


def _autoparallel_model(args, mesh, batches, init):
    """AutoParallel places the model; returns (module, layout words, input placements)."""
    from autoparallel.api import AutoParallel
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from shardings.autoparallel import describe_attention, force_attention_layout, lower_context_parallel

    B, S = args.batch, args.seq
    cu_host = batches[0][2]

    def input_fn():
        return torch.randint(0, MODEL["vocab"], (B, S)), torch.zeros(tuple(cu_host.shape), dtype=torch.int32)

    with torch.device("meta"):
        model = Transformer(**MODEL).double()
    # AutoParallel's cost model looks up the device's peak FLOP/s by name; CPUs have none
    with patch("torch.cpu.get_device_name", lambda *a, **k: "H100", create=True):
        with dp.planning(doc_len=args.mean_doc), AutoParallel(model, input_fn, mesh) as autop:
            autop.add_input_constraints([(Shard(1),), (Replicate(),)])
            autop.add_output_constraints([(Shard(1),)])
            if not args.free:
                # at demo sizes every op costs AutoParallel's 7 us floor, so its free choice says
                # little; pin attention to context parallel and let it place everything else
                force_attention_layout(autop, {"cp": "sequence"})
            placement = autop.optimize_placement()
            placement = lower_context_parallel(autop, placement)
            choices = describe_attention(autop, placement, cu_seqlens=cu_host, print_report=False)
            parallel = autop.apply_placement(placement)
    parallel.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in parallel.named_parameters():
            p.to_local().copy_(distribute_tensor(init[name], mesh, p.placements).to_local())
    words = " | ".join(sorted({", ".join(f"{k}: {v}" for k, v in c.layout.items()) for c in choices}))
    how = "chosen by AutoParallel" if args.free else "pinned; the rest placed by AutoParallel"
    from shardings.compile import compile_placed

    compiled, choice = compile_placed(parallel, "eager" if args.eager else "auto")
    return compiled, f"{words} ({how})", str(choice)


def _manual_cp_model(args, init):
    """Without AutoParallel: replicated weights, sequence-sharded activations, CP attention."""
    model = Transformer(**MODEL).double()
    model.load_state_dict(init)
    for m in model.modules():
        if isinstance(m, Attention):
            m.cp_group = dist.group.WORLD
    if args.eager:
        return model, "cp: sequence (manual placement)", "eager: asked for"
    return torch.compile(model, fullgraph=True), "cp: sequence (manual placement)", "inductor: torch.compile"


def rank_main(rank: int, world: int, port: int, args):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    say = log if rank == 0 else (lambda *_: None)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        batches = make_batches(args)
        t0 = time.perf_counter()
        say(f"[1/4] single-process reference ({args.steps} steps)...")
        init, ref_losses, ref_final = reference(batches, args.lr)
        t_ref = time.perf_counter() - t0
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
        installed = _has_autoparallel()
        use_ap = installed and not args.no_autoparallel
        if use_ap:
            say("[2/4] AutoParallel: tracing and solving placements...")
        elif installed:
            say("[2/4] --no-autoparallel: sharding the sequence manually")
        else:
            say(
                "[2/4] AutoParallel is not installed (it is not on PyPI: install it from "
                "github.com/meta-pytorch/autoparallel); sharding the sequence manually"
            )
        t1 = time.perf_counter()
        if use_ap:
            model, layout, compiled_with = _autoparallel_model(args, mesh, batches, init)
        else:
            model, layout, compiled_with = _manual_cp_model(args, init)
        t_plan = time.perf_counter() - t1
        opt = torch.optim.SGD(model.parameters(), lr=args.lr)
        losses, t2 = [], time.perf_counter()
        chunk = lambda t: t.chunk(world, dim=1)[rank].contiguous()  # noqa: E731
        for step, (tokens, targets, cu) in enumerate(batches):
            logits = model(chunk(tokens), cu)
            loss = loss_fn(logits, chunk(targets), targets.numel())
            loss.backward()
            if not use_ap:  # replicated weights: sum the per-shard gradients
                for p in model.parameters():
                    dist.all_reduce(p.grad)
            opt.step()
            opt.zero_grad()
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(total.item())
            say(f"[3/4] step {step + 1}/{args.steps}: loss {losses[-1]:.6f} (one process: {ref_losses[step]:.6f})")
        t_train = time.perf_counter() - t2
        module = getattr(model, "_orig_mod", model)  # torch.compile's wrapper prefixes the names
        params = {
            n: (p.full_tensor() if hasattr(p, "full_tensor") else p.detach()) for n, p in module.named_parameters()
        }
        param_err = max((params[n] - ref_final[n]).abs().max().item() for n in params)
        if rank == 0:
            plans = [dp.plan_context_parallel(cu, world) for _, _, cu in batches]
            n_docs = int((batches[0][2].diff(dim=1) > 0).sum())
            report(
                args, world, layout, compiled_with, plans, n_docs, losses, ref_losses, param_err, t_ref, t_plan, t_train
            )
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _has_autoparallel() -> bool:
    try:
        import autoparallel.api  # noqa: F401
        import pulp  # noqa: F401
    except ImportError:
        return False
    return True


def report(args, world, layout, compiled_with, plans, n_docs, losses, ref_losses, param_err, t_ref, t_plan, t_train):
    p = plans[0]
    all_gather = p.batch * (p.seq_len - p.seq_len // world)
    loss_err = max(abs(a - b) for a, b in zip(losses, ref_losses))
    ok = loss_err < 1e-9 and param_err < 1e-9
    lines = [
        "",
        "[4/4] report",
        f"  ranks                {world} gloo processes (CPU); {args.batch} rows x {args.seq} tokens, "
        f"{n_docs} documents in the first step",
        f"  attention layout     {layout}",
        f"  compiled with        {compiled_with}",
        f"  work per rank        {list(p.work)}  (max/mean {p.imbalance:.3f}; first step)",
        f"  K/V received / rank  {list(p.kv_recv_tokens)} tokens  (all-gather: {all_gather} each)",
        f"  queries moved / rank {list(p.q_moved_tokens)}",
        f"  loss parity          max |CP - one process| = {loss_err:.2e} over {len(losses)} steps "
        f"(final loss {losses[-1]:.6f})",
        f"  parameter parity     max |CP - one process| = {param_err:.2e} after {len(losses)} SGD steps (float64)",
        f"  time                 reference {t_ref:.1f}s, placement {t_plan:.1f}s, training {t_train:.1f}s"
        f"{'' if args.eager else ' (its first step compiles)'}",
        f"  result               {'OK: context-parallel training matches one process' if ok else 'MISMATCH'}",
    ]
    log("\n".join(line for line in lines if line.strip()))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="doc-packed context-parallel demo (CPU, gloo)")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048, help="tokens per packed row")
    ap.add_argument("--batch", type=int, default=2, help="rows per step")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--mean-doc", type=int, default=300, help="mean document length (lognormal)")
    ap.add_argument("--lr", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-autoparallel", action="store_true", help="shard manually even if installed")
    ap.add_argument("--free", action="store_true", help="let AutoParallel choose the attention layout too")
    ap.add_argument("--eager", action="store_true", help="run the placed model uncompiled (debugging)")
    args = ap.parse_args(argv)
    if args.seq % args.ranks:
        sys.exit(f"--seq {args.seq} must be divisible by --ranks {args.ranks}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log(f"doc-packed demo: {args.ranks} ranks, {args.batch} rows x {args.seq} tokens, {args.steps} steps")
    t0 = time.perf_counter()
    mp.spawn(rank_main, args=(args.ranks, port, args), nprocs=args.ranks)
    log(f"done in {time.perf_counter() - t0:.1f}s")


if __name__ == "__main__":
    main()
