"""BetweenProcesses: transfers and all-reduces between ranks that share a device are not free."""

from __future__ import annotations

import pytest
import torch

from cost_model import AnalyticCostModel, BetweenProcesses
from cost_model.comm import Link
from cost_model.devices import DeviceSpec

SPEC = DeviceSpec(name="t", flops_per_s=1e9, bytes_per_s=1e9, op_overhead_s=1e-6, memory_bytes=1 << 30)
CPU = torch.device("cpu")


def test_same_device_transfer_goes_over_the_link() -> None:
    base = AnalyticCostModel(measure=lambda d: SPEC)
    cost = BetweenProcesses(base, Link("loop", 1e-4, 1e9))
    assert base.transfer_time(1e6, CPU, CPU) == 0.0  # one process: shared memory
    assert cost.transfer_time(1e6, CPU, CPU) == pytest.approx(1e-4 + 1e-3)
    assert cost.transfer_time(0, CPU, CPU) == 0.0


def test_ring_allreduce_over_ranks_of_one_device() -> None:
    cost = BetweenProcesses(AnalyticCostModel(measure=lambda d: SPEC), Link("loop", 1e-4, 1e9))
    # 4 ranks: 2 (n - 1) latencies + 2 (n - 1) / n of the bytes over the link
    assert cost.allreduce_time(4e6, [CPU] * 4) == pytest.approx(6 * 1e-4 + 1.5 * 4e6 / 1e9)
    assert cost.allreduce_time(4e6, [CPU]) == 0.0


def test_everything_else_is_the_wrapped_models() -> None:
    base = AnalyticCostModel(measure=lambda d: SPEC)
    cost = BetweenProcesses(base)
    node = {"op": "call_function", "flops": 2e6, "out_bytes": 4000, "param_bytes": 0, "target": "mm"}
    assert cost.node_time(node, CPU) == base.node_time(node, CPU)
    assert cost.spec(CPU) is base.spec(CPU)
