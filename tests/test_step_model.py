"""The step-time model (shardings/step_model.py) and the solver's pricing hook (shardings/costs.py),
without AutoParallel: rates lookup, collectives, one attention call, the representative layout's
pairs against the dense oracle mask, and the hook's conversion of a priced call's time."""

import json
import math
from types import SimpleNamespace

import pytest
import torch

import doc_packed as dp
from doc_packed import flops
from doc_packed_testing.oracle import dense_mask
from shardings import costs
from shardings.step_model import (
    DEFAULT_RATES,
    Layout,
    Rates,
    Topology,
    attention_us,
    collective_us,
    exchange_bytes,
    plan_for,
)

RATES = Rates.load()


def _rates(tmp_path, **changes) -> Rates:
    data = json.loads(DEFAULT_RATES.read_text())
    data.update(changes)
    path = tmp_path / "rates.json"
    path.write_text(json.dumps(data))
    return Rates.load(path)


def test_rates_file_names_its_device_and_torch():
    data = json.loads(DEFAULT_RATES.read_text())
    assert "H200" in data["device"] and data["torch"] and data["date"]
    assert RATES.default_backend() == "fa4"


def test_attention_rate_is_exact_at_a_measured_point_and_bounded_between():
    # the measured lognormal point of longest mean documents at 64k (its mean as measured)
    p = max((p for p in RATES.data["attention"]["fa4"] if p["seq_len"] == 65536 and p["doc_len"] < 65536),
            key=lambda p: p["doc_len"])
    n = p["doc_len"]
    assert RATES.attention_tflops("fa4", False, n, 65536) == p["fwd"]
    # backward alone from fwd and fwd+bwd: 3.5 F / r_fb = F / r_f + 2.5 F / r_b
    r_b = RATES.attention_tflops("fa4", True, n, 65536)
    assert 3.5 / p["fwd_bwd"] == pytest.approx(1 / p["fwd"] + 2.5 / r_b)
    one_doc = RATES.attention_tflops("fa4", False, 65536, 65536)
    mid = RATES.attention_tflops("fa4", False, 4 * n, 65536)
    assert p["fwd"] < mid < one_doc
    # a document longer than the row is one document
    assert RATES.attention_tflops("fa4", False, 10**9, 65536) == one_doc
    with pytest.raises(ValueError, match="backend 'nope' has no attention rates"):
        RATES.attention_tflops("nope", False, 2048, 65536)


def test_rates_file_is_checked(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"device": "x"}))
    with pytest.raises(ValueError, match="lacks 'attention'"):
        Rates.load(path)


def test_collectives_by_hand():
    ag, a2a, lat = RATES.coll("all_gather_gbps"), RATES.coll("all_to_all_gbps"), RATES.coll("latency_us")
    nbytes = 256 * 2**20
    # all-gather of a 256 MiB tensor over 4 ranks: each rank receives 3/4 of it
    assert collective_us(RATES, "all_gather", nbytes, 4) == pytest.approx(lat + 0.75 * nbytes / (ag * 1e3))
    # all-reduce = reduce-scatter + all-gather
    assert collective_us(RATES, "all_reduce", nbytes, 2) == pytest.approx(2 * lat + nbytes / (ag * 1e3))
    assert collective_us(RATES, "all_to_all", nbytes, 2) == pytest.approx(lat + 0.5 * nbytes / (a2a * 1e3))
    inter = collective_us(RATES, "all_gather", nbytes, 4, inter_host=True)
    assert inter == pytest.approx(lat + 0.75 * nbytes / (RATES.coll("inter_host_gbps") * 1e3))
    assert collective_us(RATES, "all_gather", nbytes, 1) == 0.0
    with pytest.raises(ValueError, match="kind must be"):
        collective_us(RATES, "broadcast", nbytes, 2)


def test_topology_hosts():
    t = Topology(gpus_per_host=4)
    assert not t.crosses_hosts((2, 2), 0) and not t.crosses_hosts((2, 2), 1)
    assert t.crosses_hosts((2, 4), 0) and not t.crosses_hosts((2, 4), 1)


@pytest.mark.parametrize("seq_len,doc_len", [(512, 64), (700, 100), (512, 0)])
def test_representative_pairs_match_the_dense_mask(seq_len, doc_len):
    bounds = list(flops.representative_bounds(seq_len, doc_len))
    assert bounds[0] == 0 and bounds[-1] == seq_len
    dense = int(dense_mask(bounds, seq_len, True, (-1, 0)).sum())
    assert flops.assumed_row_pairs(seq_len, True, -1, 0, doc_len) == dense
    windowed = int(dense_mask(bounds, seq_len, True, (32, 0)).sum())
    assert flops.assumed_row_pairs(seq_len, True, 32, 0, doc_len) == windowed


def test_lognormal_rows_have_more_pairs_than_equal_documents():
    """The planning count's old assumption (equal documents) undercounted a lognormal row."""
    S, L = 65536, 2048
    equal = (S // L) * L * (L + 1) // 2
    assert flops.assumed_row_pairs(S, True, -1, 0, L) / equal > 1.5


def test_real_layout_counts_its_own_pairs():
    lengths = [[100, 300, 112], [512]]
    cu = dp.cu_seqlens_from_lengths(lengths, 512, max_docs=8)
    layout = Layout.from_cu_seqlens(cu)
    assert layout.rows == ((0, 100, 400, 512), (0, 512))
    dense = sum(int(dense_mask(list(r), 512, True, (-1, 0)).sum()) for r in layout.rows)
    cost = attention_us(RATES, rows=2, seq_len=512, local_len=512, q_heads=4, kv_heads=2, head_dim=16, layout=layout)
    rate = RATES.attention_tflops(None, False, layout.mean_doc_len(512), 512)
    call = RATES.data["attention_call_us"]["forward"]
    assert cost.compute == pytest.approx(4 * dense * 4 * 16 / (rate * 1e6) + call)
    assert layout.mean_doc_len(512) == pytest.approx(1024 / 4)


def test_attention_call_one_gpu_heads_and_sequence():
    kw = dict(rows=1, seq_len=65536, q_heads=16, kv_heads=4, head_dim=128, layout=Layout(2048))
    whole = attention_us(RATES, local_len=65536, **kw)
    heads = attention_us(RATES, local_len=65536, **dict(kw, q_heads=8, kv_heads=2))
    call = RATES.data["attention_call_us"]["forward"]
    assert whole.exchange == 0 and heads.exchange == 0
    assert heads.compute - call == pytest.approx((whole.compute - call) / 2)
    seq = attention_us(RATES, local_len=32768, **kw)
    plan, planned = plan_for(Layout(2048), 65536, 2, True, -1, 0, 4.0)
    assert seq.imbalance == plan.imbalance
    assert seq.compute - call == pytest.approx((whole.compute - call) / 2 * plan.imbalance)
    nbytes = exchange_bytes(plan, 1 / planned, 16, 4, 128, 2, False)
    expected = RATES.cp_fixed_us(2, False) + sum(nbytes) / (RATES.coll("all_to_all_gbps") * 1e3)
    assert seq.exchange == pytest.approx(expected + len(nbytes) * RATES.coll("latency_us"))
    # across hosts the exchange runs at the network's bandwidth
    inter = attention_us(RATES, local_len=32768, inter_host=True, **kw)
    assert inter.exchange > seq.exchange and inter.compute == seq.compute
    # backward: 2.5x the forward's FLOPs at the backward's rate
    bwd = attention_us(RATES, local_len=65536, backward=True, **kw)
    f = 4 * flops.assumed_row_pairs(65536, True, -1, 0, 2048) * 16 * 128
    r_b = RATES.attention_tflops(None, True, Layout(2048).mean_doc_len(65536), 65536)
    assert bwd.compute == pytest.approx(2.5 * f / (r_b * 1e6) + RATES.data["attention_call_us"]["backward"])


def test_cp_fixed_cost_by_cp_size(tmp_path):
    r = _rates(tmp_path, cp_exchange_fixed_us={"by_cp": {"2": 900, "8": 3000}, "forward_share": 1 / 3})
    assert r.cp_fixed_us(2, False) == pytest.approx(300)
    assert r.cp_fixed_us(4, True) == pytest.approx(600)  # nearest CP size at or below 4: 2
    assert r.cp_fixed_us(16, False) == pytest.approx(1000)


def _fake_call(shape, seq_len, cp_dim=None):
    q = torch.empty(shape, dtype=torch.bfloat16, device="meta")
    cu = torch.empty(shape[0], 9, dtype=torch.int32, device="meta")
    return flops.attention_flops(q, 4, cu, seq_len, True, -1, 0, None, False, 2048, cp_dim)


def test_pricing_turns_a_planned_call_into_its_time(monkeypatch):
    """Under pricing(), a call on fake cu_seqlens counts time x the solver's FLOPs per us; outside,
    or with real cu_seqlens, it counts its FLOPs."""
    monkeypatch.setattr(costs, "solver_flops_per_us", lambda dtype: 1000.0)
    monkeypatch.setattr(costs, "current_mesh", lambda: None)
    mesh = SimpleNamespace(shape=(2, 4), mesh_dim_names=("dp", "cp"))
    plain = _fake_call((1, 65536, 16, 128), 65536)
    assert plain == 4 * flops.assumed_row_pairs(65536, True, -1, 0, 2048) * 16 * 128
    with costs.pricing(mesh, gpus_per_host=8) as p:
        for shape, cp_dim in [((1, 65536, 16, 128), None), ((1, 16384, 16, 128), "cp"), ((1, 65536, 4, 128), None)]:
            us = costs.call_us(p, shape, 4, 65536, True, -1, 0, torch.bfloat16, False, 2048, cp_dim).total
            assert _fake_call(shape, 65536, cp_dim) == int(us * 1000.0)
        # the sequence shard's exchange: the 4-rank dim fits in a host of 8
        seq = costs.call_us(p, (1, 16384, 16, 128), 4, 65536, True, -1, 0, torch.bfloat16, False, 2048, "cp")
        assert seq.exchange > 0
    assert _fake_call((1, 65536, 16, 128), 65536) == plain
    with costs.pricing(mesh, gpus_per_host=2) as p:  # (2, 4) over hosts of 2: the cp dim crosses hosts
        far = costs.call_us(p, (1, 16384, 16, 128), 4, 65536, True, -1, 0, torch.bfloat16, False, 2048, "cp")
        assert far.exchange > seq.exchange
    with pytest.raises(ValueError, match="gpus_per_host must be >= 1"):
        with costs.pricing(mesh, gpus_per_host=0):
            pass


def test_pricing_with_a_real_layout(monkeypatch):
    monkeypatch.setattr(costs, "solver_flops_per_us", lambda dtype: 1.0)
    mesh = SimpleNamespace(shape=(2,), mesh_dim_names=("cp",))
    cu = dp.cu_seqlens_from_lengths([[5000, 3192], [8192]], 8192, max_docs=4)
    with costs.pricing(mesh, cu_seqlens=cu) as p:
        got = costs.call_us(p, (2, 8192, 4, 64), 1, 8192, True, -1, 0, torch.bfloat16, False)
    pairs = sum(n * (n + 1) // 2 for n in (5000, 3192, 8192))
    rate = RATES.attention_tflops(None, False, 8192 * 2 / 3, 8192)
    assert got.compute == pytest.approx(4 * pairs * 4 * 64 / (rate * 1e6) + RATES.data["attention_call_us"]["forward"])
    assert math.isfinite(got.total)


def _priced_graph():
    """A traced chain: three pointwise ops, a matmul, two more pointwise ops, as a one-device
    placement (node -> strategy-like specs, every tensor replicated)."""
    from torch.distributed.tensor import Replicate
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, w):
        c = ((x * 2) + 1).relu()
        return (c @ w).sin().sum()

    gm = make_fx(f)(torch.randn(256, 512), torch.randn(512, 512))
    mesh = SimpleNamespace(shape=(1,), size=lambda: 1)

    def spec(node):
        val = node.meta["val"]
        return SimpleNamespace(placements=(Replicate(),), mesh=mesh, tensor_meta=SimpleNamespace(shape=val.shape, dtype=val.dtype))

    placement = {}
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "call_function"):
            ins = [spec(x) for x in n.all_input_nodes]
            placement[n] = SimpleNamespace(input_specs=ins, output_specs=spec(n))
    return gm, placement


def test_fused_pricing_reads_what_enters_a_region_and_writes_what_leaves():
    """Compiled, the pointwise chain before the matmul is one kernel (reads x, writes relu's
    output), and sin + sum after it another (reads the product, writes a scalar); per op, every
    op reads and writes its own tensors."""
    from shardings.step_model import price_placement

    gm, placement = _priced_graph()
    bw, floor = RATES.data["hbm_gbps"] * 1e3, RATES.data["op_floor_us"]
    x = 256 * 512 * 4  # bytes of x and of every pointwise result before the matmul
    y = 256 * 512 * 4  # the product
    per_op = price_placement(gm.graph.nodes, placement, rates=RATES)
    fused = price_placement(gm.graph.nodes, placement, rates=RATES, fused=True)
    t = lambda n: max(n / bw, floor)  # noqa: E731
    assert per_op.other_us == pytest.approx(3 * t(2 * x) + t(2 * y) + t(y + 4))
    assert fused.other_us == pytest.approx(t(2 * x) + t(y + 4))
    assert fused.matmul_us == per_op.matmul_us > 0
