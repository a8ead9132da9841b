"""The hybrid planner's per-micro-batch costs equal the cost model on the graph traced at that batch."""

from __future__ import annotations

import math
from pathlib import Path

import networkx as nx
import numpy as np
import pytest
import torch
from torch import nn

from cost_model.analytic import AnalyticCostModel
from cost_model.cluster import DeviceSet
from cost_model.processes import BetweenProcesses
from partitioner.capture.graph import build_graph, compute_nodes
from partitioner.capture.shardable import find_shardable
from partitioner.capture.shardable_groups import Shardable
from partitioner.capture.trace import trace
from partitioner.errors import PartitionError
from partitioner.place.devices.problem import device_problem
from partitioner.place.devices.search import evaluate, solve_devices
from partitioner.place.replicated import plan_hybrid
from partitioner.place.search.counts import micro_batch_counts
from partitioner.place.search.graph_costs import at_batch, per_micro_batch
from partitioner.place.search.problem import SearchProblem
from partitioner.place.search.space import SearchSpace
from tests.hybrid_worker import SmallCnn, cost as fixed_speed, planned
from tests.test_distributed import results, torchrun

pytestmark = pytest.mark.timeout(300)

BATCH, DEVICES = 32, 8
WORKER = str(Path(__file__).resolve().parent / "hybrid_worker.py")


def vgg_like() -> nn.Module:
    """VGG's pattern: 3x3 convolutions and pools, then wide linear layers."""
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
        nn.Linear(64 * 4 * 4, 256), nn.ReLU(), nn.Linear(256, 10),
    )


class Block(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels)
        self.conv2, self.bn2 = nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))


def resnet_like() -> nn.Module:
    """ResNet's pattern: a stem, residual blocks with batch norm, global pooling and a classifier."""
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), Block(32), Block(32),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
    )


def traced_at(model: nn.Module, batch: int) -> tuple[torch.fx.GraphModule, object, list[str]]:
    x = torch.randn(batch, 3, 16, 16)
    traced = trace(model, (x,), {})
    graph = build_graph(traced.graph_module, traced.flatten_inputs((x,), {}))
    return traced.graph_module, graph, [n.name for n in compute_nodes(traced.graph_module)]


def h100s(count: int) -> AnalyticCostModel:
    return AnalyticCostModel(DeviceSet.from_dict({"devices": {f"cuda:{i}": {"gpu_type": "H100-SXM"}
                                                              for i in range(count)}}))


@pytest.mark.parametrize("build", [vgg_like, resnet_like])
@pytest.mark.parametrize("m", [2, 4, 8, 16])
def test_micro_batch_compute_equals_the_graph_traced_at_that_batch(build, m: int) -> None:
    """The planner's compute of one micro-batch (whole model, per device kind) is the cost model's on the model
    traced at batch / m samples, within 5%; so is the per-micro-batch graph the Plan's numbers come from."""
    torch.manual_seed(0)
    model = build().eval()
    module, graph, order = traced_at(model, BATCH)
    cost = h100s(DEVICES)
    cost.prepare(module)
    problem = device_problem(graph, order, [f"cuda:{i}" for i in range(DEVICES)], cost)
    small_module, small, small_order = traced_at(model, BATCH // m)
    reference = h100s(1)
    reference.prepare(small_module)
    dev = torch.device("cuda:0")
    expected = sum(reference.node_time(small.nodes[x], dev) for x in small_order)
    assert problem.micro_batch_times(m)[0].sum() == pytest.approx(expected, rel=0.05)
    assembled = per_micro_batch(graph, m)
    assert sum(cost.node_time(assembled.nodes[x], dev) for x in order) == pytest.approx(expected, rel=0.05)


def test_uneven_micro_batches_are_the_mean_of_tensor_split_sizes() -> None:
    """32 samples in 5 micro-batches are 7, 7, 6, 6, 6: one micro-batch costs their mean."""
    torch.manual_seed(0)
    model = vgg_like().eval()
    module, graph, order = traced_at(model, BATCH)
    cost = h100s(DEVICES)
    cost.prepare(module)
    problem = device_problem(graph, order, [f"cuda:{i}" for i in range(DEVICES)], cost, micro_batches=[5])
    dev = torch.device("cuda:0")
    totals = {}
    for size in (6, 7):
        small_module, small, small_order = traced_at(model, size)
        reference = h100s(1)
        reference.prepare(small_module)
        totals[size] = sum(reference.node_time(small.nodes[x], dev) for x in small_order)
    assert problem.micro_batch_times(5)[0].sum() == pytest.approx((2 * totals[7] + 3 * totals[6]) / 5, rel=0.05)


def test_at_batch_cuts_batch_dimensions_only() -> None:
    attrs = {"op": "call_module", "shapes": [(32, 64, 8, 8), (64,)], "flops": 1000.0, "out_bytes": 400}
    small = at_batch(attrs, batch=32, size=8)
    assert small["shapes"] == [(8, 64, 8, 8), (64,)] and small["flops"] == 250.0 and small["out_bytes"] == 100
    assert attrs["shapes"] == [(32, 64, 8, 8), (64,)]  # the graph's own attributes are not written


def two_node_problem(devices: int = 16) -> SearchProblem:
    """Node 0: 15 s of batch work, no weights; node 1: 1 s of batch work and weights too costly to all-reduce;
    every micro-batch costs 1 ms of overhead on each node. The best layout is 15 replicas of node 0 + 1 of node 1."""
    D = devices
    return SearchProblem(
        fixed_times=np.array([[1e-3, 1e-3]]),
        batch_times=np.array([[15.0, 1.0]]),
        device_kind=np.zeros(D, dtype=np.int64),
        producers=np.array([-1, 0, 1]),
        consumers=[np.array([0]), np.array([1]), np.array([2])],
        value_bytes=np.array([0.0, 0.0, 0.0]),
        param_bytes=np.array([0.0, 1e9]),
        saved_bytes=np.zeros(2),
        link=np.zeros((D, D, 2)),
        allreduce=np.tile(np.array([0.0, 1e-6]), (D, D + 1, 1)),
        capacity=np.full(D, np.inf),
        batch=240,
    )


def test_fifteen_replicas_take_one_micro_batch_each_of_fifteen() -> None:
    """15 + 1 replicas with m = 15: the 15-replica stage runs ceil(15 / 15) = 1 micro-batch per replica."""
    problem = two_node_problem()
    step, work, _ = evaluate(problem, [0, 1, 2], [15, 1], 15, "1f1b")
    assert work[0] == pytest.approx(1 * (1e-3 + 15.0 / 15))
    assert work[1] == pytest.approx(15 * (1e-3 + 1.0 / 15))
    assert step == pytest.approx(16 / 15 * max(work))
    assert evaluate(problem, [0, 1, 2], [15, 1], 30, "1f1b")[1][0] == pytest.approx(2 * (1e-3 + 15.0 / 30))


def test_default_counts_find_fifteen_plus_one() -> None:
    """Powers of two price 15 + 1 as if the 15 were 16 (ceil(16 / 15) = 2); the default counts include 15's
    multiples, and the planner picks 15 + 1 on them, faster than anything on powers of two."""
    problem = two_node_problem()
    counts = micro_batch_counts(16, 240)
    assert {15, 30, 45, 60} <= set(counts) and {1, 2, 4, 8, 16, 32, 64} <= set(counts)
    assert all(240 % c == 0 or any(c % r == 0 and c // r <= 4 for r in range(1, 17)) for c in counts)
    sol = solve_devices(problem)
    assert sol.replicas == [15, 1] and sol.micro_batches % 15 == 0
    m = sol.micro_batches
    expected = (m + 1) / m * max(math.ceil(m / 15) * (1e-3 + 15.0 / m), m * (1e-3 + 1.0 / m))
    assert sol.step_s == pytest.approx(expected)
    powers = solve_devices(problem, [1, 2, 4, 8, 16, 32, 64])
    assert sol.step_s < powers.step_s


# Split layers (hybrid_split.py): replicas="auto" on a device list may give a stage a tensor degree.


def small_cnn_graph(hidden: int) -> tuple[nx.DiGraph, list[str], Shardable]:
    torch.manual_seed(0)
    x = torch.randn(8, 3, 8, 8)
    traced = trace(SmallCnn(hidden), (x,), {})
    graph = build_graph(traced.graph_module, traced.flatten_inputs((x,), {}))
    return graph, [n.name for n in compute_nodes(traced.graph_module)], find_shardable(traced.graph_module, graph)


def test_a_plan_that_splits_nothing_is_the_plan_made_without_split_groups() -> None:
    graph, order, found = small_cnn_graph(64)
    cost = BetweenProcesses(fixed_speed(10**9))
    made = [plan_hybrid(graph, order, ["cpu"] * 4, cost, space=SearchSpace(micro_batches=4), shardable=s)
            for s in (found, None)]
    assert all(s.tensor == 1 for s in made[0].stages)
    assert made[0].to_json() == made[1].to_json()


@pytest.mark.parametrize("memory_bytes, tensors, groups", [
    (1_000_000, [2], {"classifier", "classifier.4"}),  # 10 classes split 2 ways, not 4
    (700_000, [4], {"classifier"}),
])
def test_layers_that_fit_only_split_are_split_by_the_plan(memory_bytes: int, tensors: list[int],
                                                          groups: set[str]) -> None:
    torch.manual_seed(0)
    made = planned(SmallCnn(), torch.randn(8, 3, 8, 8), "1f1b", memory_bytes)
    assert [s.tensor for s in made.stages] == tensors and made.programs == []
    assert {g.name for s in made.stages for g in s.tensor_groups} == groups
    assert all(s.memory_bytes <= (s.capacity_bytes or 0) for s in made.stages)
    # every rank is some replica's tensor rank (stage ranks: each replica's first)
    assert sorted(r + i for s in made.stages for r in s.ranks for i in range(s.tensor)) == [0, 1, 2, 3]
    made.check()
    # Too little memory even split: the error names the degrees that came closest
    with pytest.raises(PartitionError, match=r"tensor \[4\]"):
        planned(SmallCnn(), torch.randn(8, 3, 8, 8), "1f1b", 400_000)


@pytest.mark.timeout(600)
def test_a_plan_the_search_split_runs_under_torchrun_equal_to_the_plain_model() -> None:
    # 2 replicas x 2 tensor ranks (1F1B) and 1 replica x 4 (GPipe), as the search chose them (tests/hybrid_worker.py)
    cases = ["1f1b:1000000", "gpipe:700000"]
    proc = torchrun(4, "equivalence", *cases, worker=WORKER, timeout=540)
    lines = results(proc.stdout)
    assert proc.returncode == 0 and len(lines) == 4 * len(cases), proc.stdout[-4000:]
    assert all("ok=True" in line for line in lines), "\n".join(lines)
    assert sum("tensor=[2]" in line for line in lines) == 4 and sum("tensor=[4]" in line for line in lines) == 4
