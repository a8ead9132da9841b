"""Tensor degrees of a device-list search from the model's split groups, and its chosen stages counted as they run.

`tensor_space` gives the device-list search (devices/search.py) each degree t > 1 that some split group takes
(partitioner.capture.shardable; a group whose span holds another group, a tied embedding and LM head,
stays whole), with the model as each of t ranks runs it (search.tensor_split.split_problem) priced on the ring of
the t devices a replica spans, and each stage's data-parallel ring over its replicas' ranks of one
tensor index (devices/tensor.py). Devices of one kind only: a split problem is priced on one device.

`place_solution` turns a solution into a Plan as devices/plan.py always did (`assemble` on the stages'
nodes, ranks and devices), on the graph as each stage's ranks run it (each split stage's groups
split t ways: search.tensor_split.split_graph), then adds each split group's collectives to its stage's
forward and backward and simulates again. A plan that splits a layer keeps `programs` empty (lowered
where it runs, runtime.program.plan_programs); its stages' `ranks` are each replica's first rank.
"""

from __future__ import annotations

from typing import Sequence

import networkx as nx
import numpy as np
import torch

from cost_model.collectives import Ring
from cost_model.interface import CostModel
from partitioner.capture.shardable_groups import Shardable, ShardGroup
from partitioner.place.devices.solution import DeviceSolution
from partitioner.place.search.degrees import Degrees, TensorDegree, split_groups
from partitioner.place.search.graph_costs import affine, batch_size, per_micro_batch
from partitioner.place.search.problem import LinkCost, SearchProblem
from partitioner.place.search.tensor_split import collective_seconds, split_graph, split_problem
from partitioner.predict.assemble import assemble, finish
from runtime.plan import Plan

__all__ = ["SplitGroups", "configuration", "place_solution", "tensor_space"]

SplitGroups = dict[int, list[ShardGroup]]  # by tensor degree: the groups it splits


def _ring(cost: CostModel, devices: Sequence[torch.device]) -> Ring:
    """An all-reduce over `devices`: the cost model's, else a ring over its slowest hop (as graph_costs prices one)."""
    n = len(devices)
    if n <= 1:
        return 0.0, 0.0
    reduce = getattr(cost, "allreduce_time", None)
    if callable(reduce):
        return affine(reduce, list(devices))
    hops = [affine(cost.transfer_time, devices[x], devices[(x + 1) % n]) for x in range(n)]
    latency, slope = np.max(hops, axis=0)
    return 2 * (n - 1) * float(latency), 2 * (n - 1) / n * float(slope)


def _slowest(rings: Sequence[Ring]) -> Ring:
    return max(r[0] for r in rings), max(r[1] for r in rings)


def tensor_space(
    graph: nx.DiGraph, order: Sequence[str], devices: Sequence[torch.device | str], cost: CostModel,
    problem: SearchProblem, shardable: Shardable | None,
) -> tuple[Degrees | None, SplitGroups, dict[int, list[Ring]]]:
    """The degrees a stage of the device-list search may split over (module docstring), the groups each splits and
    its tensor rings (by the index of its problems); (None, {}, {}) where nothing can split."""
    devs = [torch.device(d) for d in devices]
    D = len(devs)
    if shardable is None or not shardable.groups or D < 2 or problem.fixed_times.shape[0] != 1:
        return None, {}, {}
    degrees, groups, rings = [], {}, {}
    for t in sorted({t for g in shardable.groups for t in g.degrees if 1 < t <= D}):
        chosen = split_groups(shardable, t, order, alone=True)
        if not chosen:
            continue
        at = [_ring(cost, devs[u : u + t]) for u in range(D - t + 1)]  # the tensor group from device u
        index: dict[tuple[int, int], int] = {}
        reduce: dict[tuple[int, int], LinkCost] = {}
        found: dict[Ring, int] = {}
        for w in range(D):
            for r in range(1, (D - w) // t + 1):
                ring = _slowest([at[w + j * t] for j in range(r)])
                index[w, r] = found.setdefault(ring, len(found))
                reduce[w, r] = _slowest([_ring(cost, devs[w + i : w + r * t : t]) for i in range(t)]) if r > 1 \
                    else None
        problems = [split_problem(problem, graph, order, devs[0], cost, t, chosen, ring) for ring in found]
        degrees.append(TensorDegree.of(t, problems, chosen, order, ring=index, reduce=reduce))
        groups[t], rings[t] = chosen, list(found)
    if not degrees:
        return None, {}, {}
    return Degrees((TensorDegree(1, (problem,)), *degrees)), groups, rings


def configuration(replicas: Sequence[int], tensors: Sequence[int]) -> str:
    """How `plan.alternatives` names a configuration: each stage's replicas, and tensor degrees where one splits."""
    if all(t == 1 for t in tensors):
        return f"replicas {list(replicas)}"
    return f"replicas {list(replicas)} x tensor {list(tensors)}"


def place_solution(
    graph: nx.DiGraph, order: Sequence[str], solution: DeviceSolution, names: Sequence[str], cost: CostModel,
    capacity: np.ndarray, optimizer: str, space: Degrees | None = None, groups: SplitGroups | None = None,
    rings: dict[int, list[Ring]] | None = None,
) -> Plan:
    """The Plan of a device-list solution (module docstring) on devices `names` (one per rank)."""
    m, tensors = solution.micro_batches, solution.tensors
    starts = np.cumsum([0, *(r * t for r, t in zip(solution.replicas, tensors))])
    ranks = [list(range(int(a), int(a) + r * t, t)) for a, r, t in zip(starts, solution.replicas, tensors)]
    caps = [float(capacity[a:b].min()) for a, b in zip(starts, starts[1:])]
    nodes = [list(order[a:b]) for a, b in zip(solution.bounds, solution.bounds[1:])]
    split, held = graph, []
    for s, t in enumerate(tensors):
        inside = set(nodes[s])
        held.append([g for g in (groups or {}).get(t, []) if inside.issuperset(g.nodes)] if t > 1 else [])
        if held[-1]:
            split = split_graph(split, held[-1], t)
    plan = assemble(
        per_micro_batch(split, m), nodes, [names[r[0]] for r in ranks], cost, micro_batches=m,
        schedule=solution.schedule, stage_ranks=ranks, rank_devices=list(names), placement="hybrid",
        optimizer=optimizer, capacity_bytes=[int(c) if np.isfinite(c) else None for c in caps],
    )
    if all(t == 1 for t in tensors):
        return plan
    if space is None or rings is None:
        raise ValueError("a solution that splits layers needs the Degrees, groups and rings that priced it")
    batch = batch_size(graph)
    size = batch / m if batch else 1.0
    for stage, t, mine, first in zip(plan.stages, tensors, held, starts):
        if t == 1:
            continue
        ring = rings[t][space.degree(t).ring[int(first), len(stage.ranks)]]
        for group in mine:
            forward, backward = collective_seconds(graph, group, ring, size)
            stage.forward_ms += 1e3 * forward
            stage.backward_ms += 1e3 * backward
        stage.compute_ms = stage.forward_ms + stage.backward_ms
        stage.predicted_ms = (stage.compute_ms + stage.comm_ms) / len(stage.ranks)
        stage.tensor, stage.tensor_groups = t, [g.spec() for g in mine]
    finish(plan)  # simulated again with the collectives (each replica's first rank stands for its tensor ranks)
    plan.programs = []
    return plan
