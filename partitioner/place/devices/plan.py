"""The device-list search as a Plan: stages, replicas and tensor degrees on a list of devices (devices/search.py).

place/devices/problem.py asks the cost model for the search's numbers; devices/search.py searches them,
with a tensor degree per stage where devices/split.py finds layers to split; the chosen placement
(stages, ranks, micro-batches, schedule) goes to partitioner/predict/assemble.py, which counts the Plan's
numbers as for every planner: the search's objective ranks configurations, the simulator predicts the
chosen one. Which search plans a request (this one, the cluster's or both) is place/replicated.py's choice.
"""

from __future__ import annotations

from typing import Sequence

import networkx as nx
import torch

from cost_model.interface import CostModel
from partitioner.capture.shardable_groups import Shardable
from partitioner.errors import PartitionError
from partitioner.place.devices.problem import device_problem
from partitioner.place.devices.search import solve_devices
from partitioner.place.devices.solution import DeviceSolution
from partitioner.place.devices.split import place_solution, tensor_space
from partitioner.place.search.axes import Choice, NodeFacts, apply_choice, priced, search_choices
from partitioner.place.search.degrees import Degrees
from partitioner.place.search.problem import SearchProblem
from partitioner.place.search.space import ANY, SearchSpace
from runtime.plan import Plan

__all__ = ["plan_devices"]


def plan_devices(
    graph: nx.DiGraph,
    order: Sequence[str],
    devices: Sequence[torch.device | str],
    cost: CostModel,
    *,
    space: SearchSpace = ANY,
    stages: int | None = None,
    replicate: bool = True,
    memory_bytes: Sequence[float] | None = None,
    optimizer: str = "adam",
    headroom: float = 0.9,
    shardable: Shardable | None = None,
) -> Plan:
    """Plan `order` (compute nodes, topological) onto all of `devices` by the device-list search, once per choice of
    the registered search axes (search/axes.py), the best kept.

    `space`: its micro-batch counts, schedules and the axes' values (search/space.py; every state is counted at the
    model's dtype); `shardable`: the layer groups a stage may split over a tensor degree of its own (None: every
    layer whole); the other arguments are replicated.plan_hybrid's.

    Raises:
        InfeasibleError: no split fits; the message names the memory each device would need.
    """
    problem = device_problem(
        graph, order, devices, cost, memory_bytes, optimizer, headroom, micro_batches=space.micro_batches
    )
    split = shardable if replicate else None
    degrees, groups, rings = tensor_space(graph, order, devices, cost, problem, split)
    nodes = NodeFacts(graph, order, torch.device(devices[0]), cost)

    def run(choice: Choice, bound: float) -> tuple[tuple[DeviceSolution, Degrees | None], float]:
        redo = lambda x: priced(x, choice, nodes)  # noqa: E731 - the problem as the choice runs it
        chosen = degrees.priced(redo) if degrees is not None else None
        solution = _solve(redo(problem), space.micro_batches, space.schedules, stages, replicate, chosen)
        return (solution, chosen), solution.step_s

    (sol, chosen), choice = search_choices(space, run)
    names = problem.names or [str(d) for d in devices]
    plan = place_solution(graph, order, sol, names, cost, problem.capacity, optimizer, chosen, groups, rings)
    apply_choice(plan, choice, nodes)
    return plan


def _solve(
    problem: SearchProblem, micro_batches: int | Sequence[int] | None, schedules: Sequence[str], stages: int | None,
    replicate: bool, space: Degrees | None,
) -> DeviceSolution:
    """The device-list search's solution: with every stage whole, as it always was; where `space` lets stages split
    their layers, a search over tensor degrees too, kept where it splits one and is predicted faster (or where
    nothing fits whole). A plan that splits nothing is the one the search without tensor degrees makes."""
    try:
        whole = solve_devices(problem, micro_batches, schedules, stages, replicate)
    except PartitionError:
        if space is None:
            raise
        # what fits only split; if nothing does, the error names the least memory over tensor degrees too
        return solve_devices(problem, micro_batches, schedules, stages, replicate, tensor=space)
    if space is None:
        return whole
    try:
        split = solve_devices(problem, micro_batches, schedules, stages, replicate, tensor=space)
    except PartitionError:
        return whole
    return split if any(t > 1 for t in split.tensors) and split.step_s < whole.step_s else whole
