"""Search axes (partitioner.place.search.axes): a toy registered here reaches the space, the price and the plan.

The toy, "turbo", is a made-up kernel set: "fused" runs every node in half the time. It is defined and
registered in this file only; nothing in the package names it. Both searches (the cluster's and the
device list's) try it, keep it where it prices lower, and hand its value to its `apply`, which halves
the plan's compute times.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator

import pytest
import torch

from cost_model.analytic import AnalyticCostModel
from cost_model.cluster_shape import Cluster
from cost_model.precision import MIXED
from examples.models import make_gpt
from partitioner import plan
from partitioner.arguments import cluster_devices
from partitioner.capture.graph import build_graph, compute_nodes
from partitioner.capture.shardable import find_shardable
from partitioner.capture.trace import trace
from partitioner.place.cluster.plan import plan_on_cluster
from partitioner.place.devices.plan import plan_devices
from partitioner.place.search.axes import AxisSpec, NodeFacts, axis_names, each_choice, register, unregister
from partitioner.place.search.problem import SearchProblem
from partitioner.place.search.space import SearchSpace
from runtime.plan import Plan

APPLIED: list[tuple[Plan, Any, list[float]]] = []  # (plan, value, its stages' compute ms before)


def _fused(problem: SearchProblem, value: Any, nodes: NodeFacts) -> SearchProblem:
    if value != "fused":
        return problem
    times = {k: v / 2 for k, v in problem.size_times.items()} if problem.size_times else None
    return dataclasses.replace(problem, fixed_times=problem.fixed_times / 2, batch_times=problem.batch_times / 2,
                               size_times=times)


def _apply(made: Plan, value: Any) -> None:
    APPLIED.append((made, value, [s.compute_ms for s in made.stages]))
    if value == "fused":
        for stage in made.stages:
            stage.forward_ms, stage.backward_ms = stage.forward_ms / 2, stage.backward_ms / 2
            stage.compute_ms = stage.forward_ms + stage.backward_ms


KERNELS = AxisSpec("turbo", lambda space: ("eager", "fused"), _fused, _apply, doc="fused: every node twice as fast")


@pytest.fixture
def kernels() -> Iterator[AxisSpec]:
    """The toy registered for one test (other tests plan with the built-in axes alone)."""
    APPLIED.clear()
    register(KERNELS)
    try:
        yield KERNELS
    finally:
        unregister(KERNELS.name)


@pytest.fixture(scope="module")
def gpt() -> tuple[Any, list[str], Any, torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model, (x,) = make_gpt(batch=16)
    gm = trace(model, (x,), {}).graph_module
    graph = build_graph(gm, [x])
    return graph, [n.name for n in compute_nodes(gm)], find_shardable(gm, graph), model, x


def test_recomputation_gradients_and_kernels_are_the_built_in_axes() -> None:
    assert axis_names() == ("kernels", "recompute", "gradients")  # the kernel set first: recomputation keeps its count
    eager = {"kernels": "eager"}
    assert each_choice(SearchSpace(recompute="auto")) == [{"recompute": "none", "gradients": "last", **eager},
                                                          {"recompute": "full", "gradients": "last", **eager}]
    assert each_choice(SearchSpace(precision=MIXED, sharding=("zero3",), kernels="fused")) == [
        {"recompute": "none", "gradients": "every", "kernels": "fused"}]
    assert each_choice(SearchSpace(precision=MIXED, sharding=("zero3",), gradient_sync=("last", "every"))) == [
        {"recompute": "none", "gradients": "last", **eager}, {"recompute": "none", "gradients": "every", **eager}]
    zero1 = SearchSpace(precision=MIXED, sharding=("zero1",))
    assert each_choice(zero1) == [{"recompute": "none", "gradients": "last", **eager}]
    with pytest.raises(ValueError, match="'recompute' is registered already"):
        register(AxisSpec("recompute", lambda space: ("none",), lambda problem, value, nodes: problem))


def test_a_toy_axis_reaches_the_space(kernels: AxisSpec) -> None:
    assert axis_names() == ("kernels", "recompute", "gradients", "turbo")
    last = {"gradients": "last", "kernels": "eager"}
    assert each_choice(SearchSpace(recompute="auto")) == [
        {"recompute": "none", **last, "turbo": "eager"}, {"recompute": "none", **last, "turbo": "fused"},
        {"recompute": "full", **last, "turbo": "eager"}, {"recompute": "full", **last, "turbo": "fused"}]


def test_a_toy_axis_is_priced_by_the_cluster_search(gpt: Any, kernels: AxisSpec) -> None:
    graph, order, shardable, _, _ = gpt
    cluster = Cluster.parse("1x4xH100")
    cost = AnalyticCostModel(cluster_devices(cluster)[2])
    space = SearchSpace(micro_batches=8)
    made, found = plan_on_cluster(graph, order, cluster, cost, space=space, shardable=shardable)
    assert found.choice == {"recompute": "none", "gradients": "last", "kernels": "eager", "turbo": "fused"}
    unregister(KERNELS.name)
    try:
        _, eager = plan_on_cluster(graph, order, cluster, cost, space=space, shardable=shardable)
    finally:
        register(KERNELS)
    assert eager.choice == {"recompute": "none", "gradients": "last", "kernels": "eager"}
    assert found.step_s < eager.step_s
    assert [(p, v) for p, v, _ in APPLIED] == [(made, "fused")]  # the plan the search returned


def test_a_toy_axis_is_priced_by_the_device_list_search(gpt: Any, kernels: AxisSpec) -> None:
    graph, order, shardable, _, _ = gpt
    cost = AnalyticCostModel(cluster_devices(Cluster.parse("1x4xH100"))[2])
    made = plan_devices(graph, order, ["cuda:0", "cuda:1", "cuda:2", "cuda:3"], cost,
                        space=SearchSpace(micro_batches=8), shardable=shardable)
    assert [(p, v) for p, v, _ in APPLIED] == [(made, "fused")]


def test_a_toy_axis_reaches_the_plan(gpt: Any, kernels: AxisSpec) -> None:
    _, _, _, model, x = gpt
    made = plan(model, example_inputs=(x,), cluster="1x4xH100", micro_batches=8, replicas="auto")
    assert {v for _, v, _ in APPLIED} == {"fused"}  # both searches kept the toy's cheaper value
    kept = [before for p, _, before in APPLIED  # the search's plan the front door returns (drawable, finished)
            if [(s.nodes, s.ranks) for s in p.stages] == [(s.nodes, s.ranks) for s in made.stages]]
    assert kept and [s.compute_ms for s in made.stages] == pytest.approx([c / 2 for c in kept[-1]])
