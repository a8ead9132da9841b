"""The analytic model against hand-computed rooflines, and swapping cost models under the planner."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from cost_model.analytic import AnalyticCostModel
from cost_model.cluster import DeviceSet
from cost_model.devices import DeviceError, DeviceSpec
from cost_model.float8_casts import cast_seconds
from cost_model.ops import classify, gemm_dims, gemm_efficiency
from cost_model.profiler import ProfiledCostModel

CPU = torch.device("cpu")
# 100 GFLOP/s, 10 GB/s, 1 us per op: round numbers to compute by hand.
SPEC = DeviceSpec("test-cpu", flops_per_s=1e11, bytes_per_s=1e10, op_overhead_s=1e-6, memory_bytes=1 << 30, kind="cpu")


def never(device: torch.device) -> DeviceSpec:
    raise AssertionError(f"the model measured {device} although a spec was given")


def model() -> AnalyticCostModel:
    return AnalyticCostModel({CPU: SPEC}, measure=never)


LINEAR = {"name": "fc", "op": "call_module", "target": "fc", "kind": "Linear", "flops": 2 * 512**3,
          "shapes": [(512, 512)], "dtypes": ["float32"], "out_bytes": 512 * 512 * 4, "param_bytes": 513 * 512 * 4}


def test_linear_roofline_hand_computed() -> None:
    # M = N = K = 512: efficiency (1 / (1 + 3 * 16/512)) / (1 / (1 + 3 * 16/1024)) = 1.046875 / 1.09375
    efficiency = 1.046875 / 1.09375
    compute = 2 * 512**3 / (1e11 * efficiency)  # 2.8045 ms, well above the 0.31 ms of memory traffic
    forward = 8 * 1e-6 + compute
    backward = 8 * 1e-6 + 2 * compute
    cost = model()
    assert cost.forward_time(LINEAR, CPU) == pytest.approx(forward)
    assert cost.backward_time(LINEAR, CPU) == pytest.approx(backward)
    assert cost.node_time(LINEAR, CPU) == pytest.approx(forward + backward)
    assert cost.node_time(LINEAR, CPU) == pytest.approx(8.4296e-3, rel=1e-4)


def test_memory_bound_matmul_uses_bytes() -> None:
    # 1 x 4096 by 4096 x 4096: 33.5 MFLOP but 64 MiB of weights to read at 10 GB/s.
    node = {**LINEAR, "flops": 2 * 4096 * 4096, "shapes": [(1, 4096)], "out_bytes": 4096 * 4,
            "param_bytes": 4096 * 4096 * 4}
    moved = (2 * 4096 * 4 + 4096 * 4096 * 4) / 1e10
    assert model().forward_time(node, CPU) == pytest.approx(8e-6 + moved)


def test_elementwise_views_and_sizes_hand_computed() -> None:
    cost = model()
    relu = {"name": "relu", "op": "call_function", "target": "relu", "shapes": [(1000, 1000)], "out_bytes": 4_000_000}
    # activation class: forward 5 overheads + 3 x bytes / bandwidth; backward 5 + 3 x bytes / bandwidth
    assert cost.forward_time(relu, CPU) == pytest.approx(5e-6 + 3 * 4e6 / 1e10)
    assert cost.node_time(relu, CPU) == pytest.approx(2 * (5e-6 + 1.2e-3))
    view = {"name": "view", "op": "call_method", "target": "view", "shapes": [(10,)], "out_bytes": 40}
    assert cost.node_time(view, CPU) == pytest.approx(2e-6 + 1e-6)
    size = {"name": "floordiv", "op": "call_function", "target": "floordiv", "shapes": [], "out_bytes": 0}
    assert cost.node_time(size, CPU) == pytest.approx(0.5e-6)
    assert cost.node_time({"name": "x", "op": "placeholder"}, CPU) == 0.0


def test_classes_and_gemm_shapes() -> None:
    tensor = {"shapes": [(2, 3)], "out_bytes": 24}
    assert classify({"flops": 1, "shapes": [(8, 16, 4, 4)]}, "Conv2d") == "conv"
    assert classify({"flops": 1, "shapes": [(8, 16)]}, "Linear") == "gemm"
    assert classify(tensor, "MaxPool2d") == "maxpool"
    assert classify(tensor, "BatchNorm2d") == "batchnorm"
    assert classify({**tensor, "op": "call_function", "target": "gelu.default"}) == "transcendental"
    assert classify(tensor, "transpose") == "view"
    assert classify(tensor, "mul") == "mul" and classify(tensor, "where") == "elementwise"
    assert gemm_dims((8, 16, 4, 4), 2 * 128 * 16 * 27, "Conv2d") == (1.0, 128.0, 16.0, 27.0)
    assert gemm_dims((4, 10, 32), 2 * 40 * 32 * 64, "linear") == (1.0, 40.0, 32.0, 64.0)
    assert gemm_dims((4, 10, 32), 2 * 4 * 10 * 32 * 8, "matmul") == (4.0, 10.0, 32.0, 8.0)
    assert gemm_efficiency(1024, 1024, 1024, "cpu", 1024) == pytest.approx(1.0)
    assert gemm_efficiency(64, 64, 64, "cuda", 4096) < gemm_efficiency(4096, 4096, 4096, "cuda", 4096)


def test_deterministic_given_a_spec() -> None:
    assert model().node_time(LINEAR, CPU) == model().node_time(LINEAR, CPU)


def test_transfers_default_and_described() -> None:
    g0, g1 = torch.device("cuda", 0), torch.device("cuda", 1)
    assert model().transfer_time(1e6, CPU, CPU) == 0.0
    assert model().transfer_time(1e6, g0, g1) == pytest.approx(10e-6 + 1e6 / 20e9)
    cluster = DeviceSet.from_dict({
        "devices": {"cuda:0": {"speed": 1e13, "bandwidth": 1e12}, "cuda:1": {"speed": 1e13, "bandwidth": 1e12}},
        "links": [{"between": ["cuda:0", "cuda:1"], "kind": "nvlink", "latency_s": 5e-6, "bandwidth": 100e9}],
    })
    described = AnalyticCostModel(cluster, measure=never)
    assert described.transfer_time(1e6, g0, g1) == pytest.approx(5e-6 + 1e6 / 100e9)
    assert described.allreduce_time(1e6, [g0, g1]) == pytest.approx(2 * 5e-6 + 1e6 / 100e9)
    # Absent GPUs are planned from their description, never measured.
    assert described.node_time(LINEAR, torch.device("cuda", 1)) > 0


def test_absent_device_without_description_says_how_to_describe_it() -> None:
    with pytest.raises(DeviceError, match="flops_per_s"):
        model().node_time(
            LINEAR, torch.device("cuda", 7) if not torch.cuda.is_available() else torch.device("cuda", 99)
        )


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(8 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(torch.relu(self.conv(x))), 1))


def test_prepare_learns_module_classes() -> None:
    gm = torch.fx.symbolic_trace(Net())
    cost = model()
    node = {"name": "pool", "op": "call_module", "target": "pool", "shapes": [(2, 8, 4, 4)], "out_bytes": 1024}
    without = cost.forward_time(node, CPU)  # 'pool' alone says nothing: elementwise
    cost.prepare(gm, [])
    assert cost.forward_time(node, CPU) == pytest.approx(8e-6 + 210 * 1024 / 1e10)
    assert cost.forward_time(node, CPU) > without


def test_swapping_cost_models_needs_no_planner_change(tmp_path: Any) -> None:
    from partitioner import partition

    torch.manual_seed(0)
    x = torch.randn(4, 3, 8, 8)
    profiled = ProfiledCostModel(fallback=model(), warmup=0, repeats=1, cache_dir=str(tmp_path), progress=False)
    profiled.prepare(torch.fx.symbolic_trace(Net()), [x[:2]])
    described = AnalyticCostModel(DeviceSet.from_dict({"devices": {"cpu": {"speed": 1e11, "bandwidth": 1e10}}}),
                                  measure=never)
    for cost in (model(), described, profiled):
        net = Net()
        pipe = partition(net, ["cpu", "cpu"], example_inputs=(x,), micro_batches=2, cost_model=cost)
        assert len(pipe.plan.stages) == 2
        assert all(s.predicted_ms > 0 for s in pipe.plan.stages)
        torch.testing.assert_close(pipe(x), net(x))


# --- GPUs of the table (cost_model/gpus.json): see [Note: GPU rates from the table] ---------------------------

ABSENT = torch.device("cuda", 0) if not torch.cuda.is_available() else torch.device("cuda", 99)
H100 = DeviceSet.from_dict({"devices": {str(ABSENT): {"gpu_type": "H100-SXM"}}})
N = 8192  # large enough that the product is compute-bound at every precision


def big_linear(dtype: str = "float32", **extra: Any) -> dict[str, Any]:
    size = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    return {"name": "fc", "op": "call_function", "target": "linear", "flops": 2 * N**3, "shapes": [(N, N)],
            "dtypes": [dtype], "out_bytes": N * N * size, "param_bytes": N * N * size, **extra}


def compute_s(cost: AnalyticCostModel, node: dict[str, Any], device: torch.device = ABSENT) -> float:
    """Forward seconds less the 4 launch overheads a GPU matrix product pays."""
    return cost.forward_time(node, device) - 4 * cost.spec(device).op_overhead_s


def test_absent_h100_rates_follow_the_table_per_precision() -> None:
    from cost_model.analytic import DEFAULT_GPU_EFFICIENCY
    from cost_model.gpu_table import gpu_type

    h100 = gpu_type("H100-SXM")
    fp32 = AnalyticCostModel(H100, measure=never, tf32=False)
    tf32 = AnalyticCostModel(H100, measure=never, tf32=True)
    spec = fp32.spec(ABSENT)  # filled from the table: planned without the GPU
    assert (spec.memory_bytes, spec.gpu_type, spec.kind) == (80 << 30, "H100-SXM", "cuda")
    assert spec.flops_per_s == pytest.approx(DEFAULT_GPU_EFFICIENCY * 66.9e12)
    # fp32 and TF32 have no measured GEMM fraction in the table: the stated default. bf16 has one: 792.1 of
    # 989.4 TFLOP/s at the best shape of stas00's "Maximum Achievable Matmul FLOPS" table (0.801), taken as
    # the large-product limit and brought to the 4096 cube by the accelerator shape rule of ops.py:
    # 1 / (1 + 128/4096 + 128/4096 + 64/4096) = 4096 / 4416.
    bf16_e = 0.801 * 4096 / 4416
    bandwidth = 0.9 * 3.35e12  # gpus.json: FlashMLA's measured 3000 of the H800/H100 SXM's 3350 GB/s
    assert fp32.gpu_rates(ABSENT, "fp32") == (h100, DEFAULT_GPU_EFFICIENCY, bandwidth)
    assert fp32.gpu_rates(ABSENT, "tf32") == (h100, DEFAULT_GPU_EFFICIENCY, bandwidth)
    assert fp32.gpu_rates(ABSENT, "bf16") == (h100, pytest.approx(bf16_e), bandwidth)
    shape = gemm_efficiency(N, N, N, "cuda", 4096)
    expected = 2 * N**3 / (66.9e12 * DEFAULT_GPU_EFFICIENCY * shape)
    assert compute_s(fp32, big_linear()) == pytest.approx(expected)
    # the ratios: fp32 : tf32 = 1 / 66.9 : 1 / 494.7 (one efficiency); bf16 also by its own efficiency
    assert compute_s(fp32, big_linear()) / compute_s(tf32, big_linear()) == pytest.approx(494.7 / 66.9)
    assert compute_s(fp32, big_linear()) / compute_s(fp32, big_linear("bfloat16")) == pytest.approx(
        989.4 * bf16_e / (66.9 * DEFAULT_GPU_EFFICIENCY))
    assert compute_s(tf32, big_linear("float16")) == pytest.approx(compute_s(fp32, big_linear("bfloat16")))
    # backward is twice the forward's compute, at the same rate
    node = big_linear("bfloat16")
    assert fp32.backward_time(node, ABSENT) - 4 * spec.op_overhead_s == pytest.approx(2 * compute_s(fp32, node))


def test_tf32_follows_torch_switches_when_not_given(monkeypatch: pytest.MonkeyPatch) -> None:
    import cost_model.analytic as analytic

    cost = AnalyticCostModel(H100, measure=never)
    monkeypatch.setattr(analytic, "tf32_enabled", lambda family="matmul": False)
    slow = compute_s(cost, big_linear())
    monkeypatch.setattr(analytic, "tf32_enabled", lambda family="matmul": True)
    assert slow / compute_s(cost, big_linear()) == pytest.approx(494.7 / 66.9)


def test_gpu_found_by_name_and_memory_bound_ops_use_table_bandwidth() -> None:
    a100 = torch.device("cuda", 1) if not torch.cuda.is_available() else torch.device("cuda", 98)
    cluster = DeviceSet.from_dict({"devices": {str(a100): {"name": "NVIDIA A100-SXM4-80GB"}}})
    cost = AnalyticCostModel(cluster, measure=never, tf32=False)
    assert cost.spec(a100).gpu_type == "A100-SXM4-80GB"
    relu = {"name": "relu", "op": "call_function", "target": "relu", "shapes": [(1 << 28,)], "out_bytes": 1 << 30}
    bandwidth = 0.87 * 2039e9  # gpus.json: a measured memcopy, 1355 of an A100's 1555 GB/s
    # accelerator 'activation' class: 2 overheads + 2 x bytes / bandwidth forward
    assert cost.forward_time(relu, a100) == pytest.approx(2 * 5e-6 + 2 * (1 << 30) / bandwidth)


def test_memory_bound_kernels_run_at_the_tables_measured_bandwidth_else_the_default() -> None:
    from cost_model.analytic import DEFAULT_BANDWIDTH_EFFICIENCY, bandwidth_efficiency
    from cost_model.gpu_table import GpuTable, GpuTableError, gpu_type

    assert bandwidth_efficiency(gpu_type("H100-SXM")) == 0.9  # FlashMLA: 3000 of 3350 GB/s on H800 SXM5
    assert bandwidth_efficiency(gpu_type("A100-SXM4-80GB")) == 0.87  # a memcopy: 1355 of 1555 GB/s
    assert "FlashMLA" in gpu_type("H100-SXM").memory_source
    assert bandwidth_efficiency(gpu_type("V100-SXM2-16GB")) == DEFAULT_BANDWIDTH_EFFICIENCY  # nothing measured
    v100 = DeviceSet.from_dict({"devices": {str(ABSENT): {"gpu_type": "V100-SXM2-16GB"}}})
    assert AnalyticCostModel(v100, measure=never).spec(ABSENT).bytes_per_s == pytest.approx(0.8 * 900e9)
    entry = {"name": "X1", "tflops": {"fp32": 10}, "memory_gib": 8, "memory_gb_per_s": 100, "memory_efficiency": 0.7}
    with pytest.raises(GpuTableError, match="memory_source"):
        GpuTable.load(extra=[entry])
    with pytest.raises(GpuTableError, match="memory_efficiency=1.5"):
        GpuTable.load(extra=[{**entry, "memory_efficiency": 1.5, "memory_source": "x"}])


def test_measured_efficiency_scales_every_precision(monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    import logging

    import cost_model.analytic as analytic

    # A present H100 whose 4096-cube fp32 matmul ran at 50 TFLOP/s (TF32 off): efficiency 50 / 66.9.
    measured = DeviceSpec("NVIDIA H100 80GB HBM3", flops_per_s=50e12, bytes_per_s=2.8e12, op_overhead_s=6e-6,
                          memory_bytes=85_000_000_000, kind="cuda", matmul_precision="fp32")
    monkeypatch.setattr(analytic, "device_present", lambda device: True)
    cost = AnalyticCostModel(measure=lambda device: measured, tf32=False)
    with caplog.at_level(logging.DEBUG, logger="cost_model.analytic"):
        gpu, efficiency, bandwidth = cost.gpu_rates("cuda:0", "fp32") or (None, 0.0, 0.0)
    assert gpu is not None and gpu.name == "H100-SXM"
    assert (efficiency, bandwidth) == (pytest.approx(50 / 66.9), 2.8e12)
    assert "0.75 of the 66.9 peak" in caplog.text and "H100-SXM" in caplog.text
    # bf16 keeps the table's ratio to fp32: the table's bf16 fraction at the 4096 cube (0.801 x 4096 / 4416,
    # see the test above) over fp32's (the default 0.7, nothing measured), times the fraction measured here
    bf16_e = 50 / 66.9 * (0.801 * 4096 / 4416) / 0.7
    assert cost.gpu_rates("cuda:0", "bf16")[1] == pytest.approx(bf16_e)  # type: ignore[index]
    shape = gemm_efficiency(N, N, N, "cuda", 4096)
    bf16 = compute_s(cost, big_linear("bfloat16"), torch.device("cuda", 0))
    assert bf16 == pytest.approx(2 * N**3 / (989.4e12 * bf16_e * shape))


@pytest.mark.parametrize(
    "flops, precision, expected",
    [
        (400e12, "tf32", 400 / 494.7),  # measured with TF32 on: compared with the TF32 peak
        (400e12, "", 400 / 494.7),  # not recorded, above the fp32 peak: it was TF32
        (60e12, "", 60 / 66.9),
        (10e12, "fp32", 0.3),  # clipped: a disturbed measurement
        (900e12, "tf32", 1.0),
    ],
)
def test_efficiency_from_described_rates(flops: float, precision: str, expected: float) -> None:
    cluster = DeviceSet.from_dict({"devices": {str(ABSENT): {
        "gpu_type": "H100-SXM", "flops_per_s": flops, "bytes_per_s": 1e15, "matmul_precision": precision}}})
    reference = precision or ("tf32" if flops > 66.9e12 * 1.05 else "fp32")
    rates = AnalyticCostModel(cluster, measure=never).gpu_rates(ABSENT, reference)
    assert rates is not None and rates[1] == pytest.approx(expected)
    assert rates[2] == 3.35e12  # bandwidth capped at the table's peak
    # bf16 in the table's ratio to the measured precision (default 0.7 for fp32 and TF32, 0.801 x 4096 / 4416
    # for bf16: see test_absent_h100_rates_follow_the_table_per_precision), never above the peak
    bf16 = AnalyticCostModel(cluster, measure=never).gpu_rates(ABSENT, "bf16")
    assert bf16 is not None and bf16[1] == pytest.approx(min(1.0, expected / 0.7 * 0.801 * 4096 / 4416))


def test_autocast_region_prices_products_at_its_dtype() -> None:
    cost = AnalyticCostModel(H100, measure=never, tf32=False)
    fp32, bf16 = compute_s(cost, big_linear()), compute_s(cost, big_linear("bfloat16"))
    # a node dict may carry the region itself ...
    inside = big_linear(autocast=(("cuda", torch.bfloat16),))
    assert compute_s(cost, inside) == pytest.approx(bf16)
    assert compute_s(cost, big_linear(autocast=(("cpu", torch.bfloat16),))) == pytest.approx(fp32)  # not this device
    # ... or prepare() reads it from the traced graph, where partitioner/trace writes it: node.meta["autocast"]
    gm = torch.fx.symbolic_trace(Net())
    node = next(n for n in gm.graph.nodes if n.name == "fc")
    node.meta["autocast"] = (("cuda", torch.bfloat16),)
    cost.prepare(gm, [])
    assert compute_s(cost, {**big_linear(), "name": "fc", "op": "call_module"}) == pytest.approx(bf16)
    assert compute_s(cost, {**big_linear(), "name": "conv", "op": "call_module", "flops": 2 * N**3}) > bf16


def test_trace_records_autocast_regions_as_prepare_reads_them() -> None:
    from partitioner.capture.trace import trace

    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                x = self.a(x)
            return self.b(x.float())

    gm = trace(Mixed(), (torch.randn(2, 8),)).graph_module
    regions = {n.name: n.meta.get("autocast") for n in gm.graph.nodes}
    assert regions["a"] == (("cpu", torch.bfloat16),) and regions["b"] is None  # what prepare() reads


def test_unknown_gpu_type_in_a_description_names_close_matches() -> None:
    from cost_model.gpu_table import UnknownGpuError

    cluster = DeviceSet.from_dict({"devices": {str(ABSENT): {"gpu_type": "H1000"}}})
    with pytest.raises(UnknownGpuError, match="H100-SXM"):
        AnalyticCostModel(cluster, measure=never).node_time(LINEAR, ABSENT)


def test_cuda_devices_not_in_the_table_keep_the_measured_rate() -> None:
    spec = DeviceSpec("some-gpu", flops_per_s=1e13, bytes_per_s=1e12, op_overhead_s=5e-6, memory_bytes=1 << 34,
                      kind="cuda")
    cost = AnalyticCostModel({ABSENT: spec}, measure=never)
    assert cost.gpu_rates(ABSENT) is None
    shape = gemm_efficiency(N, N, N, "cuda", 4096)
    assert compute_s(cost, big_linear()) == pytest.approx(2 * N**3 / (1e13 * shape))
    assert compute_s(cost, big_linear("bfloat16")) == pytest.approx(2 * N**3 / (8e13 * shape))
    assert compute_s(cost, big_linear(autocast=(("cuda", torch.float16),))) == pytest.approx(
        2 * N**3 / (8e13 * shape))


def test_fp8_products_run_at_the_fp8_peak_and_attention_keeps_its_dtype() -> None:
    # matmul="float8_e4m3fn" (Precision.matmul: FP8 training): a bf16 product runs at the H100's dense FP8 peak
    # (1979 TFLOP/s) x its FP8 efficiency (0.783, DeepGEMM) where it ran at 989.4 x 0.801, forward and backward;
    # fused attention is not a product of the recipe's FP8 set and keeps the bf16 rate.
    bf16, fp8 = AnalyticCostModel(H100, measure=never), AnalyticCostModel(H100, measure=never, matmul="float8_e4m3fn")
    node = big_linear("bfloat16")
    ratio = 1979 * 0.783 / (989.4 * 0.801)
    assert compute_s(bf16, node) / compute_s(fp8, node) == pytest.approx(ratio)
    overhead = 4 * bf16.spec(ABSENT).op_overhead_s
    assert (bf16.backward_time(node, ABSENT) - overhead) / (fp8.backward_time(node, ABSENT) - overhead) == \
        pytest.approx(ratio)
    flops = 4.0 * 8 * 128 * 8192**2 * 128
    attend = {"name": "sdpa", "op": "call_function", "target": "scaled_dot_product_attention", "flops": flops,
              "shapes": [(8, 128, 8192, 128)], "dtypes": ["bfloat16"], "out_bytes": 8 * 128 * 8192 * 128 * 2}
    assert fp8.forward_time(attend, ABSENT) == bf16.forward_time(attend, ABSENT)


def test_a_float8_linear_pays_its_casts_as_torchaos_roofline_counts_them() -> None:
    # float8="tensorwise" (torchao's Float8Linear): an M x K input, K x N weight. By hand, bytes per element:
    # forward: input amax 2 + cast to both layouts 2 + 2, weight amax 2 + cast 2 + 1; backward: weight cast to the
    # other layout 2 + 1, output gradient amax 2 + cast 2 + 2; each kernel at least a launch (the second amax
    # stage reads nothing: a launch). Rowwise casts each tensor again along its other dimension.
    m, k, n, bw, launch = 8192.0, 4096.0, 2048.0, 2e12, 5e-6
    fwd, bwd = cast_seconds(m, k, n, "tensorwise", bw, launch)
    assert fwd == pytest.approx(((2 + 4) * m * k + (2 + 3) * k * n) / bw + 2 * launch)
    assert bwd == pytest.approx((3 * k * n + (2 + 4) * m * n) / bw + launch)
    fwd, bwd = cast_seconds(m, k, n, "rowwise", bw, launch)
    assert fwd == pytest.approx((5 * m * k + 3 * k * n) / bw)
    assert bwd == pytest.approx((3 * m * k + 7 * k * n + 8 * m * n) / bw)
    tiny = cast_seconds(16, 16, 16, "tensorwise", bw, launch)
    assert tiny == pytest.approx((6 * launch, 4 * launch))  # every kernel a launch at least
    with pytest.raises(ValueError, match="'blockwise'"):
        cast_seconds(m, k, n, "blockwise", bw, launch)
    # in the cost model: an FP8 linear's time is the plain FP8 product's plus its casts at the GPU's bandwidth
    plain = AnalyticCostModel(H100, measure=never, matmul="float8_e4m3fn")
    cast = AnalyticCostModel(H100, measure=never, matmul="float8_e4m3fn", float8="tensorwise")
    node = big_linear("bfloat16")
    bandwidth = cast.gpu_rates(ABSENT, "bf16")[2]
    extra = cast_seconds(N, N, N, "tensorwise", bandwidth, cast.spec(ABSENT).op_overhead_s)
    assert cast.forward_time(node, ABSENT) - plain.forward_time(node, ABSENT) == pytest.approx(extra[0])
    assert cast.backward_time(node, ABSENT) - plain.backward_time(node, ABSENT) == pytest.approx(extra[1])
    exported = {**node, "param_bytes": 0, "target": "linear.default"}  # torch.export lifts the weight out
    assert cast.forward_time(exported, ABSENT) - plain.forward_time(exported, ABSENT) == pytest.approx(extra[0])
    bmm = {**node, "param_bytes": 0, "target": "bmm"}  # two activations: no Float8Linear, no casts
    assert cast.forward_time(bmm, ABSENT) == plain.forward_time(bmm, ABSENT)
    with pytest.raises(ValueError, match="matmul='float8_e4m3fn'"):
        AnalyticCostModel(H100, measure=never, float8="tensorwise")  # a recipe without FP8 products
    # a module left out (torchtitan's filter_fqns: the output layer) keeps the node's dtype and pays no casts
    kept = AnalyticCostModel(H100, measure=never, matmul="float8_e4m3fn", float8="tensorwise", keep=("head",))
    bf16 = AnalyticCostModel(H100, measure=never)
    head = {**node, "module": "head"}
    assert kept.forward_time(head, ABSENT) == bf16.forward_time(head, ABSENT)
    assert kept.backward_time(head, ABSENT) == bf16.backward_time(head, ABSENT)
    assert kept.forward_time({**node, "module": "layers.0.mlp.w1"}, ABSENT) == cast.forward_time(node, ABSENT)


def test_fused_attention_runs_at_the_tables_attention_efficiency_and_skips_masked_blocks() -> None:
    # H100's fused attention at 0.35 of the bf16 peak forward and backward (gpus.json: FlashAttention-3's
    # paper, about 35% for FlashAttention-2); causal: half the counted FLOPs; backward 2.5 x the forward's
    # FLOPs (five products to two). Compute-bound here, so the differences leave the launch overheads out.
    class Attend(nn.Module):
        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    gm = torch.fx.symbolic_trace(Attend())
    name = next(n.name for n in gm.graph.nodes if n.op == "call_function")
    flops = 4.0 * 8 * 128 * 8192**2 * 128  # 4 b h s^2 d: batch 8, 128 heads of 128, sequence 8192
    node = {"name": name, "op": "call_function", "target": "scaled_dot_product_attention", "flops": flops,
            "shapes": [(8, 128, 8192, 128)], "dtypes": ["bfloat16"], "out_bytes": 8 * 128 * 8192 * 128 * 2}
    plain, causal = AnalyticCostModel(H100, measure=never), AnalyticCostModel(H100, measure=never)
    causal.prepare(gm)
    rate = 989.4e12 * 0.35
    assert plain.forward_time(node, ABSENT) - causal.forward_time(node, ABSENT) == pytest.approx(flops / 2 / rate)
    assert plain.backward_time(node, ABSENT) - causal.backward_time(node, ABSENT) == pytest.approx(
        2.5 * flops / 2 / rate)
