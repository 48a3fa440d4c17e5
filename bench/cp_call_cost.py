"""A context-parallel rank's kernel time from what its calls touch, fitted to the emulation.

``bench/bench_cp_emulate.py`` times each rank's whole per-layer work on one GPU. This module
explains those times by the rank's schedule (``doc_packed.cp.schedule.build_schedule``: the
stage A and stage B kernel calls the runtime makes) and the one-GPU op by its single call:

    ms = (tile_us * padded tiles + q_row_us * query rows + k_row_us * key rows
          + merge_us * merged rows) / 1000

- padded tiles: the 128 x 128 (query, key) tiles with a visible pair, per segment of every
  call (what a tiled kernel computes, causal masks included);
- query / key rows: the rows each call spans (FA4 streams every query row through its pre- and
  post-processing and launches one backward program per 128 keys and query head);
- merged rows: rows a stage B call folds into earlier output by log-sum-exp.

A per-call term does not improve the fit (it comes out negative, trading against the rows).

:func:`fit` solves the rates by least squares from emulation JSONs (every rank and the one-GPU
anchor of every cell). :data:`H200_FA4` holds the fit to ``docs/results/cp_reduce_s12_after2.json``
(one H200, bf16, Hq 32 / Hkv 8 / D 128, FA4 4.0.0b36, the runtime of session 12): 2.7% mean
and 9.3% worst error over its 96 ranks and 16 anchors. ``bench/simulate_cp.py --call-cost`` prices the staged design with these
rates instead of one flat TFLOP/s; the rates hold for that shape and kernel only.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import astuple, dataclass

import numpy as np
import torch

from doc_packed._doc_layout import DocLayout
from doc_packed.cp.plan import ROW_COST, TOLERANCE
from doc_packed.cp.plan import ContextParallelPlan, RowCost, build_plan
from doc_packed.cp.schedule import Call, build_schedule

from bench.emulated_layouts import emulated_lengths

TILE = 128
HQ, HKV = 32, 8  # the shape the rates were fitted at, bench.cp_model's too (it imports them from here)
QUERY_COST = HQ / HKV  # the runtime's (doc_packed/cp/attention.py) for the fitted shape


@dataclass(frozen=True)
class Features:
    """What a set of kernel calls touches (see the module docstring)."""

    tiles: int = 0
    q_rows: int = 0
    k_rows: int = 0
    merged: int = 0

    def __add__(self, o: Features) -> Features:
        return Features(*(a + b for a, b in zip(astuple(self), astuple(o))))


@dataclass(frozen=True)
class CallCost:
    """Rates in microseconds per unit of each :class:`Features` field."""

    tile_us: float
    q_row_us: float
    k_row_us: float
    merge_us: float

    def ms(self, f: Features) -> float:
        return float(np.dot(astuple(self), astuple(f))) / 1e3


# fit() on docs/results/cp_reduce_s12_after2.json (112 points: 96 ranks, 16 one-GPU anchors)
H200_FA4 = CallCost(tile_us=1.47861, q_row_us=0.01464, k_row_us=0.02640, merge_us=0.02152)


def segment_tiles(nq: int, nk: int, causal: bool) -> int:
    """Tiles with a visible pair in one segment (causal: bottom-right aligned, as the kernels)."""
    if nq <= 0 or nk <= 0:
        return 0
    if not causal:
        return math.ceil(nq / TILE) * math.ceil(nk / TILE)
    tiles = 0
    for t in range(math.ceil(nq / TILE)):
        last = min(nk - 1, min(nq, (t + 1) * TILE) - 1 + nk - nq)  # the tile's last query's last key
        if last >= 0:
            tiles += math.ceil((last + 1) / TILE)
    return tiles


def call_features(call: Call) -> Features:
    spec = call.spec
    tiles = sum(
        segment_tiles(spec.cu_q[i + 1] - spec.cu_q[i], spec.cu_k[i + 1] - spec.cu_k[i], spec.causal)
        for i in range(len(spec.cu_q) - 1)
    )
    return Features(tiles, call.q1 - call.q0, call.k1 - call.k0, call.n_rows if call.merge else 0)


def rank_stages(plan: ContextParallelPlan, rank: int) -> tuple[Features, Features]:
    """(stage A, stage B) features of one rank's schedule under ``plan``."""
    sch = build_schedule(plan, rank, torch.device("cpu"))
    a = sum((call_features(c) for c in sch.stage_a), Features())
    b = sum((call_features(c) for c in sch.stage_b), Features())
    return a, b


def one_gpu_features(rows: Sequence[Sequence[tuple[int, int]]], seq_len: int) -> Features:
    """The one-GPU op: one causal call over every row's documents."""
    tiles = sum(segment_tiles(e - s, e - s, True) for row in rows for s, e in row)
    n = len(rows) * seq_len
    return Features(tiles, n, n, 0)


def _layout(lengths: list[int], S: int) -> DocLayout:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return DocLayout([cu], S)


def plan_for(lengths: list[int], S: int, c: int, row_cost: RowCost | None = ROW_COST) -> ContextParallelPlan:
    """The runtime's plan (``row_cost=None``: the pairs-only planner before session 13)."""
    return build_plan(
        _layout(lengths, S), c, True, -1, 0, query_cost=QUERY_COST, tolerance=TOLERANCE, row_cost=row_cost
    )


def emulation_points(path: str) -> list[tuple[Features, float, str]]:
    """(features, measured ms, label) of every rank and one-GPU anchor in an emulation JSON (each
    row re-planned as its run planned it: with its recorded ``row_cost``, none if absent)."""
    with open(path) as f:
        rows = json.load(f)["rows"]
    out = []
    for row in rows:
        S, c = row["S"], row["cp"]
        lengths = emulated_lengths(row["layout"], S, c, row["packing"])
        rc = row.get("row_cost")
        plan = plan_for(lengths, S, c, None if rc is None else RowCost(*rc))
        tag = f"{S // 1024}k {row['layout']} {row['packing']} cp={c}"
        for r in row["ranks"]:
            a, b = rank_stages(plan, r["rank"])
            out.append((a + b, r["ms"], f"{tag} rank {r['rank']}"))
        out.append((one_gpu_features(_layout(lengths, S).rows, S), row["one_gpu_ms"], f"{tag} one GPU"))
    return out


def fit(paths: Sequence[str]) -> tuple[CallCost, float, float]:
    """Least-squares rates from emulation JSONs: (rates, mean and worst relative error)."""
    pts = [p for path in paths for p in emulation_points(path)]
    X = np.array([astuple(f) for f, _, _ in pts], dtype=float)
    y = np.array([ms for _, ms, _ in pts]) * 1e3
    rates, *_ = np.linalg.lstsq(X, y, rcond=None)
    cost = CallCost(*(float(x) for x in rates))
    err = np.abs(X @ rates - y) / y
    return cost, float(err.mean()), float(err.max())
