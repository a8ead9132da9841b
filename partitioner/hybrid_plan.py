"""Hybrid planning for a traced graph: costs into a HybridProblem, the solution into a Plan.

The numbers and the search live in partitioner/hybrid.py; this module asks the cost model
(node times, links, all-reduce, memory) and builds the runtime Plan with ranks filled.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import networkx as nx
import numpy as np
import torch

from cost_model.interface import BACKWARD_FACTOR, CostModel
from cost_model.memory import optimizer_states, saved_activation_bytes
from partitioner.errors import PartitionError
from partitioner.hybrid import SCHEDULES, HybridProblem, _Grid, solve_hybrid
from runtime.plan import Plan, StagePlan

__all__ = ["hybrid_problem", "plan_hybrid"]


def _affine(time: Callable[..., float], *args: Any) -> tuple[float, float]:
    """(latency, seconds per byte) of `time(nbytes, *args)`, a cost affine in the bytes moved."""
    one, big = time(1.0, *args), time(1.0 + (1 << 20), *args)
    slope = (big - one) / (1 << 20)
    return max(0.0, one - slope), max(0.0, slope)


def _device_key(cost: CostModel, device: torch.device) -> Any:
    spec = getattr(cost, "spec", None)
    if callable(spec):
        s = spec(device)
        return (s.flops_per_s, s.bytes_per_s, s.op_overhead_s, s.kind or device.type)
    return str(device)


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
    kind = np.array([keys.setdefault(_device_key(cost, d), len(keys)) for d in devs])
    fixed, batch = np.zeros((len(keys), n)), np.zeros((len(keys), n))
    for k in range(len(keys)):
        dev = devs[int(np.argmax(kind == k))]
        for i, name in enumerate(order):
            attrs = graph.nodes[name]
            whole = cost.node_time(attrs, dev)
            half = cost.node_time({**attrs, "flops": attrs.get("flops", 0) / 2, "out_bytes": attrs.get("out_bytes", 0) / 2}, dev)
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
    for w, r in ((w, r) for w in range(D) for r in range(2, D - w + 1)):
        if callable(reduce):
            allreduce[w, r] = _affine(reduce, devs[w : w + r])
        else:  # ring all-reduce over the slowest hop (cost_model/comm.py)
            lat, slope = np.max([link[w + x, w + (x + 1) % r] for x in range(r)], axis=0)
            allreduce[w, r] = (2 * (r - 1) * lat, 2 * (r - 1) / r * slope)
    spec = getattr(cost, "spec", None)
    if memory_bytes is not None and len(memory_bytes) != D:
        raise PartitionError(f"memory_bytes has {len(memory_bytes)} entries for {D} devices; give one per device")
    totals = [headroom * float(spec(d).memory_bytes) if callable(spec) else 0.0 for d in devs]
    capacity = np.array([float(x) for x in memory_bytes] if memory_bytes is not None else [t if t > 0 else np.inf for t in totals])
    first = next((a for _, a in graph.nodes(data=True) if a["op"] == "placeholder" and a.get("shapes")), None)
    size = first["shapes"][0][0] if first and first["shapes"][0] else None
    try:
        states = optimizer_states(optimizer)
    except ValueError as exc:
        raise PartitionError(str(exc)) from None
    return HybridProblem(
        fixed, batch, kind, np.array(producers, dtype=np.int64), consumers, np.array(sizes), params, saved,
        link, allreduce, capacity, states, int(size) if size else None, [str(d) for d in devs],
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
    m, names = sol.micro_batches, problem.names or []
    grid, w, out, allreduce = _Grid(problem, np.asarray(sol.bounds)), 0, [], []
    for s, (r, a, b) in enumerate(zip(sol.replicas, sol.bounds, sol.bounds[1:])):
        kinds = np.unique(problem.device_kind[w : w + r])
        compute = max(float(problem.fixed_times[k, a:b].sum() + problem.batch_times[k, a:b].sum() / m) for k in kinds)
        params = float(grid.params[s + 1] - grid.params[s])
        lat, slope = problem.allreduce[w, r] if r > 1 and params > 0 else (0.0, 0.0)
        reduce = float(lat + slope * params)
        per_mb = (sol.work_s[s] - reduce) / math.ceil(m / r)
        allreduce.append(reduce * 1e3)
        out.append(StagePlan(
            index=s, device=names[w], nodes=list(order[a:b]), predicted_ms=sol.work_s[s] / m * 1e3,
            compute_ms=compute * 1e3, forward_ms=compute * 1e3 / (1 + BACKWARD_FACTOR),
            backward_ms=compute * 1e3 * BACKWARD_FACTOR / (1 + BACKWARD_FACTOR), comm_ms=max(0.0, per_mb - compute) * 1e3,
            param_bytes=int(params), activation_bytes=int(sol.memory[s] - (2 + problem.optimizer_states) * params),
            recv_bytes=int(grid.recv[s, s + 1] / m), send_bytes=int(grid.send[s, s + 1] / m), ranks=list(range(w, w + r)),
        ))
        w += r
    notes = {"planner": "hybrid", "replicas": sol.replicas, "allreduce_ms": allreduce, "memory_bytes": sol.memory,
             "capacity_bytes": [float(c) if np.isfinite(c) else None for c in problem.capacity]}
    return Plan(stages=out, micro_batches=m, schedule=sol.schedule, predicted_step_ms=sol.step_s * 1e3, notes=notes)
