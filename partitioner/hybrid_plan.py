"""Hybrid planning for a traced graph: costs into a HybridProblem, the solution into a Plan.

The numbers and the search live in partitioner/hybrid.py; this module asks the cost model
(node times, links, all-reduce, memory) for them, and hands the chosen placement (stages,
ranks, micro-batches, schedule) to partitioner/assemble.py, which counts the Plan's numbers
as for every planner: the search's objective ranks configurations, the simulator predicts
the chosen one.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import networkx as nx
import numpy as np
import torch

from cost_model.interface import CostModel
from cost_model.memory import optimizer_states, saved_activation_bytes
from partitioner.assemble import assemble, device_key
from partitioner.errors import PartitionError
from partitioner.hybrid import SCHEDULES, HybridProblem, solve_hybrid
from runtime.plan import Plan

__all__ = ["hybrid_problem", "per_micro_batch", "plan_hybrid"]


def _affine(time: Callable[..., float], *args: Any) -> tuple[float, float]:
    """(latency, seconds per byte) of `time(nbytes, *args)`, a cost affine in the bytes moved."""
    one, big = time(1.0, *args), time(1.0 + (1 << 20), *args)
    slope = (big - one) / (1 << 20)
    return max(0.0, one - slope), max(0.0, slope)


def hybrid_problem(
    graph: nx.DiGraph,
    order: Sequence[str],
    devices: Sequence[torch.device | str],
    cost: CostModel,
    memory_bytes: Sequence[float] | None = None,
    optimizer: str = "adam",
    headroom: float = 0.9,
) -> HybridProblem:
    """Gather a HybridProblem from a graph annotated for one step's whole batch.

    Node times are asked twice per kind of device (same rates), at the whole batch and at
    half of it (FLOPs and bytes halved), and fitted as overhead + batch part. Capacity is
    `memory_bytes` per device, else `headroom` times the cost model's spec memory, else no limit.
    """
    devs = [torch.device(d) for d in devices]
    position = {name: i for i, name in enumerate(order)}
    n, D = len(order), len(devs)
    keys: dict[Any, int] = {}
    kind = np.array([keys.setdefault(device_key(cost, d), len(keys)) for d in devs])
    fixed, batch = np.zeros((len(keys), n)), np.zeros((len(keys), n))
    for k in range(len(keys)):
        dev = devs[int(np.argmax(kind == k))]
        for i, name in enumerate(order):
            attrs = graph.nodes[name]
            whole = cost.node_time(attrs, dev)
            halved = {**attrs, "flops": attrs.get("flops", 0) / 2, "out_bytes": attrs.get("out_bytes", 0) / 2}
            half = cost.node_time(halved, dev)
            part = min(max(2.0 * (whole - half), 0.0), whole)
            fixed[k, i], batch[k, i] = whole - part, part
    producers, consumers, sizes = [], [], []
    params = np.array([float(graph.nodes[x].get("param_bytes", 0) or 0) for x in order])
    saved = np.array([float(saved_activation_bytes([graph.nodes[x]])) for x in order])
    for name, attrs in graph.nodes(data=True):
        if attrs["op"] == "get_attr":
            users = [position[u] for u in graph.successors(name) if u in position]
            if users:
                params[min(users)] += float(attrs.get("param_bytes", 0) or 0)
        if attrs["op"] != "placeholder" and name not in position:
            continue
        outs = {position.get(u, n) for u in graph.successors(name) if u in position or graph.nodes[u]["op"] == "output"}
        if outs:
            producers.append(position.get(name, -1))
            consumers.append(np.array(sorted(outs), dtype=np.int64))
            sizes.append(float(attrs.get("out_bytes", 0) or 0))
    link = np.zeros((D, D, 2))
    for i, j in ((i, j) for i in range(D) for j in range(D) if i != j):  # ranks: a device may repeat
        link[i, j] = _affine(cost.transfer_time, devs[i], devs[j])
    allreduce, reduce = np.zeros((D, D + 1, 2)), getattr(cost, "allreduce_time", None)
    for w, r in [(first, r) for first in range(D) for r in range(2, D - first + 1)]:
        if callable(reduce):
            allreduce[w, r] = _affine(reduce, devs[w : w + r])
        else:  # ring all-reduce over the slowest hop (cost_model/comm.py)
            lat, slope = np.max([link[w + x, w + (x + 1) % r] for x in range(r)], axis=0)
            allreduce[w, r] = (2 * (r - 1) * lat, 2 * (r - 1) / r * slope)
    spec = getattr(cost, "spec", None)
    if memory_bytes is not None and len(memory_bytes) != D:
        raise PartitionError(f"memory_bytes has {len(memory_bytes)} entries for {D} devices; give one per device")
    totals = [headroom * float(spec(d).memory_bytes) if callable(spec) else 0.0 for d in devs]
    given = [float(x) for x in memory_bytes] if memory_bytes is not None else None
    capacity = np.array(given if given is not None else [t if t > 0 else np.inf for t in totals])
    first = next((a for _, a in graph.nodes(data=True) if a["op"] == "placeholder" and a.get("shapes")), None)
    size = first["shapes"][0][0] if first and first["shapes"][0] else None
    try:
        states = optimizer_states(optimizer)
    except ValueError as exc:
        raise PartitionError(str(exc)) from None
    return HybridProblem(
        fixed, batch, kind, np.array(producers, dtype=np.int64), consumers, np.array(sizes), params, saved,
        link, allreduce, capacity, states, int(size) if size else None, [str(d) for d in devs],
        np.array([float(graph.nodes[x].get("out_bytes", 0) or 0) for x in order]),
    )


def plan_hybrid(
    graph: nx.DiGraph,
    order: Sequence[str],
    devices: Sequence[torch.device | str],
    cost: CostModel,
    *,
    micro_batches: int | Sequence[int] | None = None,
    schedules: Sequence[str] = SCHEDULES,
    stages: int | None = None,
    replicate: bool = True,
    memory_bytes: Sequence[float] | None = None,
    optimizer: str = "adam",
    headroom: float = 0.9,
) -> Plan:
    """Plan `order` (compute nodes, topological) onto all of `devices`: stages, replicas, m, schedule.

    Args:
        graph: annotated for one step's whole batch (`build_graph` on the full inputs).
        devices: every device (rank) of the job, in rank order; stage replicas take
            consecutive ones, and a stage's time is that of its slowest device.
        micro_batches: the count to use, or candidates to choose from (default 1, 2, 4, ...).
        schedules: the schedules the runtime may run ("gpipe" only in one process).
        stages: force this many stages; replicate=False puts one stage on each device.
        memory_bytes: usable bytes per device (default: headroom x the spec's memory).

    Raises:
        InfeasibleError: no split fits; the message names the memory each device would need.
    """
    problem = hybrid_problem(graph, order, devices, cost, memory_bytes, optimizer, headroom)
    sol = solve_hybrid(problem, micro_batches, schedules, stages, replicate)
    names, m = problem.names or [str(d) for d in devices], sol.micro_batches
    starts = np.cumsum([0, *sol.replicas])
    ranks = [list(range(int(a), int(b))) for a, b in zip(starts, starts[1:])]
    capacity = [float(problem.capacity[r].min()) for r in ranks]
    return assemble(
        per_micro_batch(graph, m), [list(order[a:b]) for a, b in zip(sol.bounds, sol.bounds[1:])],
        [names[r[0]] for r in ranks], cost, micro_batches=m, schedule=sol.schedule,  # type: ignore[arg-type]
        stage_ranks=ranks, rank_devices=names, placement="hybrid", optimizer=optimizer,
        capacity_bytes=[int(c) if np.isfinite(c) else None for c in capacity],
    )


def per_micro_batch(graph: nx.DiGraph, micro_batches: int) -> nx.DiGraph:
    """A copy of a whole-batch graph describing one micro-batch: FLOPs and bytes moved divided by m."""
    out = graph.copy()
    for _, attrs in out.nodes(data=True):
        for key in ("flops", "out_bytes"):
            attrs[key] = (attrs.get(key, 0) or 0) / micro_batches
    for _, _, data in out.edges(data=True):
        if "bytes" in data:
            data["bytes"] = data["bytes"] / micro_batches
    return out
