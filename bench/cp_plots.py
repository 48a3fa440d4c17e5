"""Plots of bench/simulate_cp.py: the grid's traffic, imbalance and planner time, and the
validation's measured-vs-predicted speedups (matplotlib, Agg backend; the CLI imports this
module only when ``--out`` asks for plots)."""

from __future__ import annotations

import os

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from bench.cp_model import BF16, DISTS, HEAD_DIM, HKV, HQ, TOLERANCE, Model, token_label  # noqa: E402


def grid_plots(res: list[dict], out_dir: str, plot_tokens: int) -> list[str]:
    """(a) traffic and (b) imbalance vs CP size, (c) planner time vs tokens; the paths written."""
    paths = []
    sel = [r for r in res if r["T"] == plot_tokens]
    if not sel:
        plot_tokens = max(r["T"] for r in res)
        sel = [r for r in res if r["T"] == plot_tokens]
    dists = [d for d in DISTS if any(r["dist"] == d for r in sel)]

    # (a) bytes per rank vs cp
    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5), sharex=True, sharey=True)
    for ax, dist in zip(axes.flat, dists):
        rs = sorted((r for r in sel if r["dist"] == dist), key=lambda r: r["c"])
        cs = [r["c"] for r in rs]
        ax.plot(cs, [r["ag_bytes"] / 1e6 for r in rs], "k-o", ms=4, label="all-gather / ring")
        ax.plot(cs, [r["uly_bytes"] / 1e6 for r in rs], "-s", color="tab:purple", ms=4,
                label="Ulysses (c <= Hq)")
        ax.plot(cs, [r["heap_bytes"] / 1e6 for r in rs], "-^", color="tab:orange", ms=4,
                label="min-heap (K/V + queries)")
        ax.plot(cs, [r["ours_bytes"] / 1e6 for r in rs], "-o", color="tab:blue", ms=4,
                label="ours (K/V + queries)")
        ax.plot(cs, [r["ours_kv_bytes"] / 1e6 for r in rs], "--", color="tab:blue",
                label="ours (K/V only)")
        ax.plot(cs, [r["kv_lb"] * HKV * HEAD_DIM * 2 * BF16 / 1e6 for r in rs], ":",
                color="gray", label="K/V lower bound, any plan")
    paths.append(_finish_cp_grid(
        fig, axes, dists, "MB per rank per layer (fwd, max)",
        f"(a) per-rank traffic, T = {token_label(plot_tokens)} tokens per CP group "
        f"(Hq={HQ}, Hkv={HKV}, D={HEAD_DIM}, bf16) - simulation with our real planner",
        0.05, out_dir, "sim_traffic.png",
    ))

    # (b) imbalance vs cp, every T; plotted as max/mean - 1 so that 1.001 and 1.6 both read
    excess = lambda x: max(x - 1, 1e-5)  # noqa: E731
    fig, axes = plt.subplots(2, 3, figsize=(15, 8), sharex=True, sharey=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    all_T = sorted({r["T"] for r in res})
    for ax, dist in zip(axes.flat, dists):
        for col, T in zip(colors, all_T):
            rs = sorted((r for r in res if r["dist"] == dist and r["T"] == T), key=lambda r: r["c"])
            cs = [r["c"] for r in rs]
            ax.plot(cs, [excess(r["imb"]) for r in rs], "-o", color=col, ms=4,
                    label=f"ours T={token_label(T)}")
            ax.plot(cs, [excess(r["heap_imb"]) for r in rs], "--^", color=col, ms=4, alpha=0.6,
                    label=f"min-heap T={token_label(T)}")
        ax.axhline(0.05, color="red", lw=0.8, ls=":", label="goal 1.05")
        ax.axhline(TOLERANCE, color="gray", lw=0.8, ls=":", label="planner tolerance 1.01")
    paths.append(_finish_cp_grid(
        fig, axes, dists, "max/mean work - 1 (log; floor 1e-5)",
        "(b) work imbalance (solid: ours, dashed: locality-blind min-heap)",
        0.08, out_dir, "sim_imbalance.png",
    ))

    # (c) planner time vs tokens
    pdists = [d for d in ("lognormal-512", "powerlaw", "one-doc")
              if any(r["dist"] == d for r in res)]
    fig, axes = plt.subplots(1, len(pdists), figsize=(5 * len(pdists), 4.5), sharey=True,
                             squeeze=False)
    for ax, dist in zip(axes[0], pdists):
        rs = [r for r in res if r["dist"] == dist]
        for c in sorted({r["c"] for r in rs}):
            pts = sorted((r["T"], r["plan_s"] * 1e3) for r in rs if r["c"] == c)
            if len(pts) >= 2:
                ax.plot(*zip(*pts), "-o", ms=4, label=f"cp {c}")
        ref = sorted((r["T"], r["plan_s"] * 1e3) for r in rs if r["c"] == min(r["c"] for r in rs))
        if ref:
            t0, y0 = ref[0]
            ts = sorted({r["T"] for r in rs})
            ax.plot(ts, [y0 * t / t0 for t in ts], "k--", lw=0.8, alpha=0.5, label="linear")
        ax.axhline(10, color="red", lw=0.8, ls=":", label="10 ms")
        ax.set_xscale("log", base=2)
        ticks = sorted({r["T"] for r in rs})
        ax.set_xticks(ticks, [token_label(t) for t in ticks])
        ax.set_yscale("log")
        ax.set_xlabel("tokens per CP group")
        ax.set_title(dist)
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("build_plan CPU ms (median, 1 thread)")
    axes[0][0].legend(fontsize=7)
    fig.suptitle("(c) planner CPU time vs tokens")
    fig.tight_layout()
    paths.append(_save(fig, out_dir, "sim_planner_time.png"))
    return paths



def validation_plot(res: list[dict], m: Model, out_dir: str) -> str:
    """Speedup over one GPU, measured vs predicted, per validated layout; the path written."""
    layouts = list(dict.fromkeys(r["layout"] for r in res))
    fig, axes = plt.subplots(1, len(layouts), figsize=(6 * len(layouts), 4.5), squeeze=False)
    for ax, name in zip(axes[0], layouts):
        rs = [r for r in res if r["layout"] == name]
        x = np.arange(len(rs))
        w = 0.2
        one = np.array([r["one_gpu_ms"] for r in rs])
        bars = [
            ("ours measured", [r["ours_ms"] for r in rs], "tab:blue", None),
            ("ours predicted", [r["ours_pred_ms"] for r in rs], "tab:blue", "//"),
            ("all-gather measured", [r["ag_ms"] for r in rs], "tab:gray", None),
            ("all-gather predicted", [r["ag_pred_ms"] for r in rs], "tab:gray", "//"),
        ]
        for i, (label, ys, col, hatch) in enumerate(bars):
            ax.bar(x + (i - 1.5) * w, one / np.array(ys), w, color=col, hatch=hatch,
                   alpha=0.55 if hatch else 0.9, edgecolor="black", lw=0.5, label=label)
        c = max(r["c"] for r in rs)
        ax.axhline(c, color="red", lw=0.8, ls=":", label=f"ideal {c}x")
        ax.set_xticks(x, [token_label(r["S"]) for r in rs])
        ax.set_xlabel("S (one packed row)")
        ax.set_ylabel("speedup over one GPU (fwd+bwd)")
        ax.set_title(name)
        ax.set_ylim(0, 1.1 * c)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=8, loc="lower right")
    fixed = (f", fixed {m.a2a_fixed_ms:g} / {m.ag_fixed_ms:g} ms"
             if m.a2a_fixed_ms or m.ag_fixed_ms else ", no fixed cost")
    cps = "/".join(str(c) for c in dict.fromkeys(r["c"] for r in res))
    fig.suptitle(f"CP={cps}: measured vs step-time model (compute rate from the measured "
                 f"one-GPU run; all-to-all {m.a2a_gbps:g} GB/s, all-gather {m.ag_gbps:g} GB/s"
                 f"{fixed})", fontsize=10)
    fig.tight_layout()
    return _save(fig, out_dir, "sim_validation.png")


def _finish_cp_grid(fig, axes, dists, ylabel, title, bottom, out_dir, name) -> str:
    """Log-log axes per distribution, CP-size x labels, one shared legend; saves the figure."""
    for ax, dist in zip(axes.flat, dists):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(dist)
        ax.grid(True, which="both", alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("CP size")
    for ax in axes[:, 0]:
        ax.set_ylabel(ylabel)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=6, fontsize=9)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, bottom, 1, 1))
    return _save(fig, out_dir, name)


def _save(fig, out_dir: str, name: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
