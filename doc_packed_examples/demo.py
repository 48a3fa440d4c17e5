"""End-to-end demo: context-parallel training of a small transformer on packed documents.

    python -m doc_packed_examples.demo [--ranks 4] [--seq 2048] [--batch 2] [--steps 3] [--free] [--out DIR]

Spawns CPU processes with a gloo group, packs random documents of arbitrary lengths into rows,
and trains a small transformer whose attention runs context parallel (each rank holds a
``torch.chunk`` of every row). With AutoParallel installed, AutoParallel places the model and
chooses the attention layout; otherwise the demo shards the sequence itself. A one-process run
of the same model on the same data is the reference. The placed model is compiled (for
AutoParallel's module: :func:`shardings.compile.compile_placed`, which says which compiler it
used and why; ``--eager`` skips compilation). The report gives the layout, the compiler, loss
and parameter parity and time; when attention is sequence-sharded, the plan's per-rank attention
work (query-key pairs) and K/V traffic against all-gather; with ``--free``, when AutoParallel
chooses another layout, its estimate for each layout it considered and the row length from which
the sequence placement would win by our cost formulas. Without AutoParallel the report gives
the step model's estimate of each layout instead (no solver: no redistribution). ``--out DIR``
writes the figures as PNGs (needs matplotlib): the chosen layout's estimate (kernel, exchange,
redistribution) against the alternatives, and the context-parallel plan's work and traffic.

The report is a list of sections (:data:`SECTIONS`), each a function of the run's
:class:`Result` returning its lines: a new figure is one more function.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import random
import socket
import sys
import time
from typing import Any
from unittest.mock import patch

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import doc_packed as dp
from doc_packed.data import lognormal_lengths
from doc_packed_examples.model import Attention, Transformer

MODEL = dict(vocab=256, dim=64, n_heads=4, n_kv_heads=2, n_layers=2)


def _runtime_plan(cu_seqlens: torch.Tensor, world: int) -> dp.ContextParallelPlan:
    """The plan the context-parallel runtime makes for the model's attention over ``world`` ranks
    (plan_context_parallel's defaults are the runtime's; the heads set its query cost)."""
    return dp.plan_context_parallel(cu_seqlens, world, num_heads=(MODEL["n_heads"], MODEL["n_kv_heads"]))


def log(msg: str) -> None:
    print(msg, flush=True)


@contextlib.contextmanager
def progress(say, what: str):
    """A line before a step that can take a while, and its time after it."""
    say(f"      {what}...")
    t0 = time.perf_counter()
    yield
    say(f"      {what}: {time.perf_counter() - t0:.1f} s")


def make_batches(args, cp_size: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Random documents of lognormal lengths (some longer than a shard, some 1 token), packed
    for ``cp_size`` ranks (docs/packing.md; None: first-fit)."""
    rng = random.Random(args.seed)
    g = torch.Generator().manual_seed(args.seed)
    batches = []
    for _ in range(args.steps):
        lengths = lognormal_lengths(args.batch * args.seq, args.mean_doc, rng)
        docs = [torch.randint(0, MODEL["vocab"], (n + 1,), generator=g) for n in lengths]
        # the same lengths give the same order: targets line up with inputs
        rows, cu = dp.pack_documents([d[:-1] for d in docs], args.seq, cp_size=cp_size, max_docs=args.seq // 4)
        targets, _ = dp.pack_documents([d[1:] for d in docs], args.seq, cp_size=cp_size, max_docs=args.seq // 4)
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


@dataclasses.dataclass
class Placed:
    """What placing the model gave: the module to train and how it was placed."""

    model: Any  # a module, or torch.compile of one
    layout: str  # the attention layout in words, and who chose it
    compiled_with: str
    sequence_sharded: bool  # attention runs context parallel
    considered: list[str] = dataclasses.field(default_factory=list)  # --free: AutoParallel's estimates
    break_even: str = ""  # --free, not sequence-sharded: where the sequence placement would win
    strategies: list[str] = dataclasses.field(default_factory=list)  # describe_attention's report lines
    skipped: str = ""  # without AutoParallel: why, and what the run left out
    # per role ("forward", "backward"), one layer's attention: each layout's estimate (the chosen
    # one first) as shardings.autoparallel.Alternative, and where the estimates come from
    breakdown: dict[str, list] = dataclasses.field(default_factory=dict)
    breakdown_from: str = ""


def _autoparallel_model(args, mesh, batches, init, say) -> Placed:
    """AutoParallel places the model (attention pinned to the sequence unless ``--free``)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from shardings.autoparallel import attention_report_lines
    from shardings.costs import pricing
    from shardings.flow import place

    B, S = args.batch, args.seq
    cu_host = batches[0][2]

    def input_fn():
        return torch.randint(0, MODEL["vocab"], (B, S)), torch.zeros(tuple(cu_host.shape), dtype=torch.int32)

    with torch.device("meta"):
        model = Transformer(**MODEL).double()
    # AutoParallel's cost model looks up the device's peak FLOP/s by name; CPUs have none, so it
    # prices this CPU run as H100s would run it. Its topology detection needs a CUDA device and a
    # multiple of 8 GPUs: tell it the ranks share one host; attention is priced from the measured
    # rates of the step model (shardings/h200_rates.json) on the first batch's layout.
    # Attention: at demo sizes it costs about its per-call host time whatever the layout and the
    # exchange only adds, so the free choice is replicate; unless --free, pin it to context
    # parallel and let AutoParallel place the rest.
    stages = {"trace": "tracing the model", "solve": "solving the placement (pulp)", "apply": "applying the placement"}
    with patch("torch.cpu.get_device_name", lambda *a, **k: "H100", create=True):
        by_ap = place(
            model, input_fn, mesh, inputs=[(Shard(1),), (Replicate(),)], outputs=[(Shard(1),)],
            attention=None if args.free else {"cp": "sequence"}, doc_len=args.mean_doc,
            gpus_per_host=mesh.size(), cu_seqlens=cu_host, compile_backend="eager" if args.eager else "auto",
            progress=lambda stage: progress(say, stages[stage]),
        )  # fmt: skip
        choices = list(by_ap.attention)
        sequence = any("sequence" in c.layout.values() for c in choices)
        considered, break_even = [], ""
        if args.free:
            considered = _considered(choices)
            if not sequence:  # priced as the solver was
                with pricing(mesh, gpus_per_host=mesh.size(), cu_seqlens=cu_host):
                    break_even = _break_even(args, mesh, S, sorted({c.layout["cp"] for c in choices}))
    assert by_ap.parallel is not None and by_ap.module is not None and by_ap.compiled_with is not None  # applied
    parallel: Any = by_ap.parallel  # its parameters are DTensors
    compiled, choice = by_ap.module, by_ap.compiled_with
    parallel.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in parallel.named_parameters():
            p.to_local().copy_(distribute_tensor(init[name], mesh, p.placements).to_local())
    words = " | ".join(sorted({", ".join(f"{k}: {v}" for k, v in c.layout.items()) for c in choices}))
    how = "chosen by AutoParallel" if args.free else "pinned; the rest placed by AutoParallel"
    strategies = attention_report_lines(choices)[1:-1]  # the nodes' lines (the header is the section's)
    breakdown: dict[str, list] = {}
    for c in choices:  # the first node of each role: one layer
        breakdown.setdefault(c.role, c.alternatives)
    placed = Placed(compiled, f"{words} ({how})", str(choice), sequence, considered, break_even, strategies)
    placed.breakdown, placed.breakdown_from = breakdown, "AutoParallel's estimates (the step model's H200 rates)"
    return placed


def _considered(choices) -> list[str]:
    """Per attention role, AutoParallel's estimate of each layout it considered (one layer)."""
    lines = []
    for role in ("forward", "backward"):
        c = next(c for c in choices if c.role == role)
        for alt in c.alternatives:
            where = ", ".join(f"{k}: {v}" for k, v in alt.layout.items())
            lines.append(
                f"{role:<8} {where:<14} {alt.compute_ms:.3f} ms compute + {alt.comm_ms:.3f} ms communication"
                f" = {alt.total_ms:.3f} ms{'  <- chosen' if alt.chosen else ''}"
            )
    return lines


def _break_even(args, mesh, S: int, chosen: list[str]) -> str:
    """Where sequence-sharded attention would cost less than the chosen layout, by our formulas."""
    from shardings.autoparallel import sequence_break_even

    other = chosen[0]
    heads = MODEL["n_heads"]
    be = sequence_break_even(
        mesh, 0, other, start=S, rows=args.batch, q_heads=heads, kv_heads=MODEL["n_kv_heads"],
        head_dim=MODEL["dim"] // heads, dtype=torch.float64, doc_len=args.mean_doc,
    )  # fmt: skip
    if be.seq_len is None:
        return f"sequence does not beat {other} below {be.limit:,} tokens per row"
    return (
        f"from about {be.seq_len:,} tokens per row: {be.sequence_ms:.3f} ms vs {be.other_ms:.3f} ms ({other}) "
        f"per layer, forward + backward\n({args.batch} rows, ~{args.mean_doc}-token documents, {mesh.size(0)} "
        "ranks; the step model's measured H200 rates, shardings/h200_rates.json)"
    )


def _manual_cp_model(args, init, why_not: str | None = None) -> Placed:
    """Without AutoParallel: replicated weights, sequence-sharded activations, CP attention.
    ``why_not``: AutoParallel's import error, when that is the reason (the report says what
    the run left out)."""
    model = Transformer(**MODEL).double()
    model.load_state_dict(init)
    for m in model.modules():
        if isinstance(m, Attention):
            m.cp_group = dist.group.WORLD
    layout = "cp: sequence (manual placement)"
    skipped = ""
    if why_not is not None:
        skipped = (
            "AutoParallel's placement, its per-node strategy report (describe_attention)"
            + (" and --free's estimates and break-even" if args.free else "")
            + f": {why_not}"
        )
    if args.eager:
        return Placed(model, layout, "eager: asked for", True, skipped=skipped)
    return Placed(torch.compile(model, fullgraph=True), layout, "inductor: torch.compile", True, skipped=skipped)


def _step_model_breakdown(args, mesh, cu_seqlens: torch.Tensor) -> dict[str, list]:
    """Without a solver: the step model's estimate of one layer's attention call in each layout
    the mesh dim offers, the manual placement's (sequence) first (redistribution not priced)."""
    from shardings.autoparallel import layout_alternatives
    from shardings.costs import pricing

    heads = MODEL["n_heads"]
    shape = dict(
        rows=args.batch, seq_len=args.seq, q_heads=heads, kv_heads=MODEL["n_kv_heads"],
        head_dim=MODEL["dim"] // heads, dtype=torch.float64, doc_len=args.mean_doc,
    )  # fmt: skip
    with pricing(mesh, gpus_per_host=mesh.size(), cu_seqlens=cu_seqlens):
        return {
            role: layout_alternatives(mesh, 0, "sequence", backward=role == "backward", **shape)
            for role in ("forward", "backward")
        }


def rank_main(rank: int, world: int, port: int, args):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    say = log if rank == 0 else (lambda *_: None)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        batches = make_batches(args, cp_size=world)
        t0 = time.perf_counter()
        say(f"[1/4] single-process reference ({args.steps} steps)...")
        init, ref_losses, ref_final = reference(batches, args.lr)
        t_ref = time.perf_counter() - t0
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
        why_not = _autoparallel_missing()
        use_ap = why_not is None and not args.no_autoparallel
        if use_ap:
            say("[2/4] AutoParallel places the model" + (" (attention too: --free)" if args.free else ""))
        elif why_not is None:
            say("[2/4] --no-autoparallel: sharding the sequence manually")
        else:
            skipped = " (--free needs AutoParallel: ignored)" if args.free else ""
            say(f"[2/4] {why_not}; sharding the sequence manually{skipped}")
        t1 = time.perf_counter()
        placed = (
            _autoparallel_model(args, mesh, batches, init, say) if use_ap else _manual_cp_model(args, init, why_not)
        )
        if not use_ap:
            placed.breakdown = _step_model_breakdown(args, mesh, batches[0][2])
            placed.breakdown_from = "the step model alone (H200 rates; no solver, so no redistribution)"
        t_plan = time.perf_counter() - t1
        model = placed.model
        opt = torch.optim.SGD(model.parameters(), lr=args.lr)
        losses, t2 = [], time.perf_counter()
        if not args.eager:
            say("[3/4] training; the first step compiles the model (a minute or more on CPU)...")
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
            result = Result(
                args=args,
                world=world,
                placed=placed,
                batches=batches,
                plans=[_runtime_plan(cu, world) for _, _, cu in batches],
                losses=losses,
                ref_losses=ref_losses,
                param_err=param_err,
                times={"reference": t_ref, "placement": t_plan, "training": t_train},
            )
            log("\n".join(report(result)))
            if args.out:
                log(write_plots(result, args.out))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _autoparallel_missing() -> str | None:
    """None when AutoParallel imports, else why not (the import's own error)."""
    from doc_packed.env import autoparallel_status

    ok, line = autoparallel_status()
    return None if ok else line


@dataclasses.dataclass
class Result:
    """Everything the report and the plots read from one run."""

    args: argparse.Namespace
    world: int
    placed: Placed
    batches: list
    plans: list  # per step, our plan for its cu_seqlens over the ranks
    losses: list[float]
    ref_losses: list[float]
    param_err: float
    times: dict[str, float]  # seconds

    @property
    def loss_err(self) -> float:
        return max(abs(a - b) for a, b in zip(self.losses, self.ref_losses))

    @property
    def ok(self) -> bool:
        return self.loss_err < 1e-9 and self.param_err < 1e-9


def _row(name: str, text: str) -> str:
    return f"  {name:<21}{text}"


def _setup(r: Result) -> list[str]:
    n_docs = int((r.batches[0][2].diff(dim=1) > 0).sum())
    a = r.args
    return [
        _row("ranks", f"{r.world} gloo processes (CPU), one mesh dim 'cp' of {r.world}"),
        _row("data", f"{a.batch} rows x {a.seq} tokens per step, {n_docs} documents in the first step"),
        _row("attention layout", r.placed.layout),
        _row("compiled with", r.placed.compiled_with),
    ]


def _strategies(r: Result) -> list[str]:
    """AutoParallel's choice per attention node (describe_attention), or what was skipped and
    the step model's estimates instead."""
    lines = [_row("skipped", r.placed.skipped)] if r.placed.skipped else []
    if r.placed.strategies:
        return [_row("strategies", "per attention node: chosen layout, best alternatives (ms per call), why"), *(
            _row("", line) for line in r.placed.strategies)]  # fmt: skip
    if r.placed.breakdown:
        lines.append(_row("step model", f"one layer's attention per call, by {r.placed.breakdown_from}:"))
        for role, alts in r.placed.breakdown.items():
            for a in alts:
                where = ", ".join(f"{k}: {v}" for k, v in a.layout.items())
                mark = "  <- this run" if a.chosen else ""
                cost = f"kernel {a.kernel_ms:.3f} + exchange {a.exchange_ms:.3f} = {a.total_ms:.3f} ms"
                lines.append(_row("", f"{role:<8} {where:<14} {cost}{mark}"))
    return lines


def _free_choice(r: Result) -> list[str]:
    """--free: AutoParallel's estimates, and where the sequence placement would win."""
    lines = []
    if r.placed.considered:
        lines.append(
            _row("considered", "AutoParallel's estimates per attention call (one layer, measured H200 rates):")
        )
        lines += [_row("", c) for c in r.placed.considered]
    if r.placed.break_even:
        first, *rest = r.placed.break_even.splitlines()
        lines += [_row("sequence would win", first), *(_row("", line) for line in rest)]
    return lines


def _context_parallel(r: Result) -> list[str]:
    """The plan's balance and traffic: only when attention runs sequence-sharded."""
    if not r.placed.sequence_sharded:
        return [_row("context parallel", "not used (attention is not sequence-sharded): no plan figures")]
    p = r.plans[0]
    all_gather = p.batch * (p.seq_len - p.seq_len // r.world)
    return [
        _row("attention work", f"{list(p.work)} query-key pairs per rank and head (first step; "
             f"max/mean {p.imbalance:.3f})"),
        _row("K/V received", f"{list(p.kv_recv_tokens)} tokens per rank (all-gather: {all_gather} each)"),
        _row("queries moved", f"{list(p.q_moved_tokens)} tokens per rank (computed for another rank)"),
        *_greedy_packing(r),
    ]  # fmt: skip


def _greedy_packing(r: Result) -> list[str]:
    """The first step's documents packed first-fit instead of CP-aware: what the plan would move."""
    a = r.args
    pieces = []  # the first step's input documents (n tokens each), split as pack_documents splits
    for n in lognormal_lengths(a.batch * a.seq, a.mean_doc, random.Random(a.seed)):
        pieces += [a.seq] * (n // a.seq) + ([n % a.seq] if n % a.seq else [])
    cu = dp.cu_seqlens_from_lengths(dp.data.pack_order(pieces, a.seq).lengths[: a.batch], a.seq)
    if cu.shape == r.batches[0][2].shape and torch.equal(cu, r.batches[0][2]):
        return [_row("packing", "first-fit (greedy)")]
    g = _runtime_plan(cu, r.world)
    return [
        _row("packing", f"CP-aware (pack_documents(..., cp_size={r.world})); the figures above are for it"),
        _row("  if greedy instead", f"queries moved {list(g.q_moved_tokens)}, K/V received "
             f"{list(g.kv_recv_tokens)} tokens per rank (same documents packed first-fit; max/mean {g.imbalance:.3f})"),
    ]  # fmt: skip


def _parity(r: Result) -> list[str]:
    what = "context-parallel" if r.placed.sequence_sharded else "placed"
    n = len(r.losses)
    return [
        _row("loss parity", f"max |placed - one process| = {r.loss_err:.2e} over {n} steps "
             f"(final loss {r.losses[-1]:.6f}, nats per token)"),
        _row("parameter parity", f"max |placed - one process| = {r.param_err:.2e} after {n} SGD steps (float64)"),
        _row("time", ", ".join(f"{k} {v:.1f} s" for k, v in r.times.items())
             + ("" if r.args.eager else " (training's first step compiles)")),
        _row("result", f"OK: {what} training matches one process" if r.ok else "MISMATCH"),
    ]  # fmt: skip


# the report, top to bottom: a section is a function of the Result returning its lines
SECTIONS = [_setup, _strategies, _free_choice, _context_parallel, _parity]


def report(r: Result) -> list[str]:
    lines = ["", "[4/4] report"]
    for section in SECTIONS:
        lines += section(r)
    return lines


_PARTS = (("kernel", "tab:blue"), ("exchange", "tab:orange"), ("redistribution", "tab:gray"))


def strategy_figure(breakdown: dict[str, list], source: str):
    """One layer's attention per role: for each layout considered (the chosen one first), its
    estimate in ms as stacked bars of kernel, context-parallel exchange and redistribution
    (:meth:`shardings.autoparallel.Alternative.parts`). Returns the matplotlib figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    roles = list(breakdown)
    fig, axes = plt.subplots(1, len(roles), figsize=(4.2 * len(roles), 3.6), squeeze=False)
    for ax, role in zip(axes[0], roles):
        alts = breakdown[role]
        xs = list(range(len(alts)))
        bottom = [0.0] * len(alts)
        for part, color in _PARTS:
            heights = [a.parts()[part] for a in alts]
            ax.bar(xs, heights, 0.6, bottom=bottom, label=part, color=color)
            bottom = [b + h for b, h in zip(bottom, heights)]
        ax.set_xticks(xs)
        labels = [", ".join(f"{k}: {v}" for k, v in a.layout.items()) for a in alts]
        ax.set_xticklabels([f"{w}\n(chosen)" if a.chosen else w for w, a in zip(labels, alts)])
        ax.set(ylabel="ms per call", title=f"{role}, one layer")
        ax.set_ylim(top=1.3 * max(bottom, default=0.0) or 1.0)
        ax.legend(loc="upper right", fontsize="small")
    fig.suptitle(f"attention layouts: {source}", fontsize="medium")
    fig.tight_layout()
    return fig


def write_plots(r: Result, out: str) -> str:
    """The figures of this run as PNGs under ``out``: the strategy breakdown
    (:func:`strategy_figure`, ``strategies.png``), and when attention is sequence-sharded the
    plan's per-rank attention work and K/V traffic (planned vs all-gather). Returns a line
    saying what was written, or why nothing was."""
    if not r.placed.sequence_sharded and not r.placed.breakdown:
        return f"plots: none written to {out} (attention is not sequence-sharded and no layouts were priced)"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plots: matplotlib is not installed (pip install matplotlib); text report only"
    os.makedirs(out, exist_ok=True)
    written = []
    if r.placed.breakdown:
        fig = strategy_figure(r.placed.breakdown, r.placed.breakdown_from)
        written.append(os.path.join(out, "strategies.png"))
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    if not r.placed.sequence_sharded:
        return "plots: " + ", ".join(written) + " (no context-parallel figures: attention is not sequence-sharded)"
    p, ranks = r.plans[0], list(range(r.world))
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.bar(ranks, p.work, color="tab:blue")
    ax.axhline(sum(p.work) / r.world, color="black", linestyle="--", label="mean")
    ax.set(
        xlabel="rank",
        ylabel="query-key pairs (per head)",
        title=f"attention work, first step (max/mean {p.imbalance:.3f})",
    )
    ax.set_ylim(top=1.25 * max(p.work))
    ax.set_xticks(ranks)
    ax.legend(loc="upper center")
    written.append(os.path.join(out, "cp_work.png"))
    fig.tight_layout()
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(5, 3.2))
    width = 0.4
    all_gather = p.batch * (p.seq_len - p.seq_len // r.world)
    ax.bar([x - width / 2 for x in ranks], p.kv_recv_tokens, width, label="planned (AllToAll-V)")
    ax.bar([x + width / 2 for x in ranks], [all_gather] * r.world, width, label="all-gather", color="tab:gray")
    ax.set(xlabel="rank", ylabel="K/V tokens received", title="K/V traffic per rank (forward, first step)")
    ax.set_ylim(top=1.35 * max(all_gather, *p.kv_recv_tokens))
    ax.set_xticks(ranks)
    ax.legend(loc="upper center", ncol=2)
    written.append(os.path.join(out, "cp_kv_traffic.png"))
    fig.tight_layout()
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)
    return "plots: " + ", ".join(written)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description="doc-packed demo: train a small transformer on packed documents over gloo ranks (CPU), "
        "placed by AutoParallel when it imports (else the sequence is sharded by hand), against a "
        "one-process reference",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--ranks", type=int, default=4, help="gloo processes (one mesh dim)")
    ap.add_argument("--seq", type=int, default=2048, help="tokens per packed row")
    ap.add_argument("--batch", type=int, default=2, help="rows per step")
    ap.add_argument("--steps", type=int, default=3, help="SGD steps")
    ap.add_argument("--mean-doc", type=int, default=300, help="mean document length in tokens (lognormal)")
    ap.add_argument("--lr", type=float, default=0.5, help="SGD learning rate")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random documents")
    ap.add_argument("--no-autoparallel", action="store_true", help="shard manually even if installed")
    ap.add_argument(
        "--free",
        action="store_true",
        help="let AutoParallel choose the attention layout too; the report gives its estimate for each "
        "layout it considered and, if it does not shard the sequence, where that would start to pay",
    )
    ap.add_argument("--eager", action="store_true", help="run the placed model uncompiled (debugging)")
    ap.add_argument(
        "--out",
        metavar="DIR",
        help="write the figures as PNGs here (needs matplotlib): each attention layout's estimate, kernel + "
        "exchange + redistribution, against the chosen one; and the context-parallel plan's work and traffic",
    )
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
