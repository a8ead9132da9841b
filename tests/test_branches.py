"""Branch placement: optimal assignment of branches, a valid DAG of stages covering every node."""

from __future__ import annotations

import itertools

import networkx as nx
import numpy as np
import pytest
import torch

from cost_model.analytic import AnalyticCostModel
from cost_model.devices import DeviceSpec
from partitioner.capture.graph import build_graph, compute_nodes
from partitioner.capture.trace import trace
from partitioner.place.branches import assign_branches, plan_branches
from partitioner.predict.counting import stage_edges
from partitioner.predict.simulator import simulate
from runtime.plan import Plan
from tests import zoo

FIXED = DeviceSpec(name="test", flops_per_s=1e9, bytes_per_s=1e10, op_overhead_s=1e-6, memory_bytes=1 << 30)


@pytest.mark.parametrize("seed", range(20))
def test_assignment_equals_brute_force(seed: int) -> None:
    rng = np.random.default_rng(seed)
    k, d = int(rng.integers(2, 6)), int(rng.integers(2, 4))
    bt = [[(float(f), float(w)) for f, w in row] for row in rng.uniform(1, 10, size=(k, d, 2))]
    ct = rng.uniform(0, 3, size=(k, d))
    ct[:, 0] = 0
    choice, span = assign_branches(bt, ct.tolist(), home=0)

    def makespan(c: tuple[int, ...]) -> float:  # forward and backward phases each wait for the slowest
        fwd, bwd = [0.0] * d, [0.0] * d
        for b, dev in enumerate(c):
            fwd[dev] += bt[b][dev][0] + ct[b][dev] / 2
            bwd[dev] += bt[b][dev][1] + ct[b][dev] / 2
        return max(fwd) + max(bwd)

    assert span == pytest.approx(min(makespan(c) for c in itertools.product(range(d), repeat=k)))
    assert makespan(tuple(choice)) == pytest.approx(span)


def test_greedy_beyond_exhaustive_limit_stays_balanced() -> None:
    bt = [[(1.0, 2.0)] * 4 for _ in range(12)]  # 4**12 assignments: too many, longest-first instead
    choice, span = assign_branches(bt, [[0.0] * 4 for _ in range(12)], home=0)
    assert span == 9.0 and sorted(np.bincount(choice).tolist()) == [3, 3, 3, 3]


def inception_plan(devices: int) -> tuple[Plan, nx.DiGraph, list[str]]:
    model, args, _ = zoo.inception()
    traced = trace(model, args, {})
    graph = build_graph(traced.graph_module, traced.flatten_inputs(args, {}))
    order = [n.name for n in compute_nodes(traced.graph_module)]
    cost = AnalyticCostModel(measure=lambda d: FIXED)
    return plan_branches(graph, order, [torch.device("cpu")] * devices, cost, 2, min_gain=0.0), graph, order


@pytest.mark.parametrize("devices", [2, 4])
def test_inception_branches_spread_over_devices(devices: int) -> None:
    plan, graph, order = inception_plan(devices)
    assert sorted(n for s in plan.stages for n in s.nodes) == sorted(order)
    slots = {s.ranks[0] for s in plan.stages}
    assert len(slots) >= 2  # more devices than pay for their transfers stay idle
    producers = [s.reads_from for s in plan.stages]
    edges = stage_edges(graph, [s.nodes for s in plan.stages])
    assert producers == [sorted(a for a, b in edges if b == s) for s in range(len(plan.stages))]
    assert plan.placement == "branches"
    assert all(p < s for s, ps in enumerate(producers) for p in ps)  # numbered in topological order
    assert [p.rank for p in plan.programs] == list(range(devices))  # one program per device slot
    for program in plan.programs:  # a slot no stage uses does nothing but end the step
        assert (program.rank in slots) or [str(op) for op in program.ops] == ["STEP"]
    assert plan.predicted_step_ms == simulate(plan).makespan_ms
    stage_of = plan.stage_of()
    for stage in plan.stages:  # every node reads only earlier nodes of its stage or earlier stages
        seen: set[str] = set()
        for n in stage.nodes:
            for u in graph.predecessors(n):
                if u in stage_of:
                    assert stage_of[u] < stage.index or u in seen, (n, u)
            seen.add(n)
    branch_stages = [s for s, ps in enumerate(producers) if not ps]
    assert len(branch_stages) >= 2  # side by side: several stages read only the model input
    assert producers[-1] == branch_stages  # the join reads every branch stage


def test_chain_without_branches_stays_on_one_device() -> None:
    model, args, _ = zoo.mlp()
    traced = trace(model, args, {})
    graph = build_graph(traced.graph_module, traced.flatten_inputs(args, {}))
    order = [n.name for n in compute_nodes(traced.graph_module)]
    plan = plan_branches(graph, order, [torch.device("cpu")] * 2, AnalyticCostModel(measure=lambda d: FIXED), 2)
    assert len(plan.stages) == 1 and plan.stages[0].nodes == order
