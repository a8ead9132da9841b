"""The analytic model against hand-computed rooflines, and swapping cost models under the planner."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.fx
from torch import nn

from cost_model.analytic import AnalyticCostModel
from cost_model.cluster import DeviceSet
from cost_model.devices import DeviceError, DeviceSpec
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
    assert classify(tensor, "mul") == "elementwise"
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
