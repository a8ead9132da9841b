"""Hybrid planning for a traced graph: costs into a HybridProblem, the solution into a Plan.

The numbers and the search live in partitioner/place/hybrid.py; this module asks the cost model
(node times, links, all-reduce, memory) for them, and hands the chosen placement (stages,
ranks, micro-batches, schedule) to partitioner/predict/assemble.py, which counts the Plan's numbers
as for every planner: the search's objective ranks configurations, the simulator predicts
the chosen one.
"""

from __future__ import annotations

from typing import Any, Callable, Literal, Sequence

import networkx as nx
import numpy as np
import torch

from cost_model.interface import CostModel
from cost_model.memory import optimizer_states
from cost_model.recompute_cost import graph_nodes, saved_bytes_per_node
from partitioner.errors import PartitionError
from partitioner.place.hybrid import SCHEDULES, HybridProblem, micro_batch_counts, solve_hybrid
from partitioner.predict.assemble import assemble, device_key
from runtime.plan import Plan

__all__ = [
    "EXHAUSTIVE_GPUS", "at_batch", "batch_size", "graph_values", "hybrid_problem", "node_times", "per_micro_batch",
    "plan_hybrid",
]

EXHAUSTIVE_GPUS = 16  # clusters up to this size also run the search over device lists (uneven replicas)


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
    *,
    micro_batches: int | Sequence[int] | None = None,
) -> HybridProblem:
    """Gather a HybridProblem from a graph annotated for one step's whole batch.

    Node times are asked per kind of device (same rates) at each micro-batch size that the
    candidate counts (`micro_batches`, default hybrid.micro_batch_counts) make, with the
    node's shapes cut along the batch (`at_batch`), so a matrix product of a smaller batch is
    priced with a smaller M, not a smaller K. Whole batch and half of it also give the fit
    overhead + batch part (cut candidates; counts not priced). Capacity is `memory_bytes` per
    device, else `headroom` times the cost model's spec memory, else no limit.
    """
    devs = [torch.device(d) for d in devices]
    D = len(devs)
    keys: dict[Any, int] = {}
    kind = np.array([keys.setdefault(device_key(cost, d), len(keys)) for d in devs])
    size = batch_size(graph)
    probes: set[int] = set()
    if size is not None and size > 1:
        probes = {size, size // 2}
        for m in micro_batch_counts(D, size, micro_batches):
            low, extra = divmod(size, m)
            probes |= {low, low + 1} if extra else {low}
    kinds = [devs[int(np.argmax(kind == k))] for k in range(len(keys))]
    fixed, batch, size_times = node_times(graph, order, kinds, cost, probes)
    producers, consumers, sizes, params, saved = graph_values(graph, order)
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
    try:
        states = optimizer_states(optimizer)
    except ValueError as exc:
        raise PartitionError(str(exc)) from None
    return HybridProblem(
        fixed, batch, kind, np.array(producers, dtype=np.int64), consumers, np.array(sizes), params, saved,
        link, allreduce, capacity, states, size, [str(d) for d in devs],
        np.array([float(graph.nodes[x].get("out_bytes", 0) or 0) for x in order]), size_times or None,
    )


def node_times(
    graph: nx.DiGraph, order: Sequence[str], kinds: Sequence[torch.device], cost: CostModel, probes: set[int]
) -> tuple[np.ndarray, np.ndarray, dict[int, np.ndarray]]:
    """(fixed, whole-batch, {samples: times}) seconds per device kind and node (HybridProblem's arrays).

    Node times are asked at each probed micro-batch size with the node's shapes cut along the
    batch (`at_batch`); whole batch and half of it give the fit overhead + batch part.
    """
    n, size = len(order), batch_size(graph)
    size_times = {s: np.zeros((len(kinds), n)) for s in probes}
    for k, dev in enumerate(kinds):
        for i, name in enumerate(order):
            attrs = graph.nodes[name]
            for s in probes:
                size_times[s][k, i] = cost.node_time(at_batch(attrs, batch=size, size=s), dev)
    fixed, batch = np.zeros((len(kinds), n)), np.zeros((len(kinds), n))
    if size is not None and size > 1:
        whole, half = size_times[size], size_times[size // 2]
        part = np.clip((whole - half) * size / (size - size // 2), 0.0, whole)
        fixed, batch = whole - part, part
    else:  # batch unknown: halve FLOPs and bytes
        for k, dev in enumerate(kinds):
            for i, name in enumerate(order):
                attrs = graph.nodes[name]
                whole_s = cost.node_time(attrs, dev)
                halved = {**attrs, "flops": attrs.get("flops", 0) / 2, "out_bytes": attrs.get("out_bytes", 0) / 2}
                part_s = min(max(2.0 * (whole_s - cost.node_time(halved, dev)), 0.0), whole_s)
                fixed[k, i], batch[k, i] = whole_s - part_s, part_s
    return fixed, batch, size_times


def graph_values(
    graph: nx.DiGraph, order: Sequence[str]
) -> tuple[list[int], list[np.ndarray], list[float], np.ndarray, np.ndarray]:
    """(producers, consumers, value bytes, param bytes, saved bytes) of HybridProblem, by position in `order`."""
    position = {name: i for i, name in enumerate(order)}
    n = len(order)
    producers, consumers, sizes = [], [], []
    params = np.array([float(graph.nodes[x].get("param_bytes", 0) or 0) for x in order])
    saved = np.array([float(x) for x in saved_bytes_per_node(graph_nodes(graph, order)).values()])
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
    return producers, consumers, sizes, params, saved


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
    recompute: Literal["none", "full", "auto"] = "none",
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
        recompute: on a Cluster, search with full recomputation ("full"), or only when nothing fits
            without it ("auto"); `plan()` then chooses each stage's mode (planning.choose_recompute).

    Raises:
        InfeasibleError: no split fits; the message names the memory each device would need.

    On all GPUs of a Cluster (the cost model prices one: `plan(cluster=...)`) the search is by counts
    (partitioner/place/cluster_plan.py: stages x equal replicas, micro-batches, schedule, rank placement);
    up to EXHAUSTIVE_GPUS GPUs this search over device lists (uneven replicas) runs too, and the
    plan simulated faster is kept.
    """
    from partitioner.place.cluster_plan import cluster_of, plan_on_cluster  # it builds on this module's helpers

    cluster = cluster_of(cost) if memory_bytes is None else None
    counted: tuple[Plan, float] | None = None
    if cluster is not None and len(devices) == cluster.size:
        try:
            made, found = plan_on_cluster(graph, order, cluster, cost, micro_batches=micro_batches,
                                          schedules=schedules, stages=stages, replicate=replicate,
                                          optimizer=optimizer, headroom=headroom, recompute=recompute)
            counted = made, found.step_s
        except PartitionError:
            if cluster.size > EXHAUSTIVE_GPUS:
                raise
        if counted is not None and cluster.size > EXHAUSTIVE_GPUS:
            return counted[0]
    problem = hybrid_problem(
        graph, order, devices, cost, memory_bytes, optimizer, headroom, micro_batches=micro_batches
    )
    try:
        sol = solve_hybrid(problem, micro_batches, schedules, stages, replicate)
    except PartitionError:
        if counted is None:
            raise
        return counted[0]
    names, m = problem.names or [str(d) for d in devices], sol.micro_batches
    starts = np.cumsum([0, *sol.replicas])
    ranks = [list(range(int(a), int(b))) for a, b in zip(starts, starts[1:])]
    capacity = [float(problem.capacity[r].min()) for r in ranks]
    plan = assemble(
        per_micro_batch(graph, m), [list(order[a:b]) for a, b in zip(sol.bounds, sol.bounds[1:])],
        [names[r[0]] for r in ranks], cost, micro_batches=m, schedule=sol.schedule,  # type: ignore[arg-type]
        stage_ranks=ranks, rank_devices=names, placement="hybrid", optimizer=optimizer,
        capacity_bytes=[int(c) if np.isfinite(c) else None for c in capacity],
    )
    if cluster is not None:
        _local_names(plan, cluster.gpus_per_host)
    if counted is not None and counted[0].predicted_step_ms < plan.predicted_step_ms:
        return counted[0]  # both simulated: their objectives count a replicated pipeline's fill differently
    return plan


def _local_names(plan: Plan, gpus_per_host: int) -> None:
    """A cluster plan names each rank's GPU on its own host (cuda:r % gpus_per_host); ranks say where it is."""
    for stage in plan.stages:
        stage.device = f"cuda:{stage.ranks[0] % gpus_per_host}" if stage.ranks else stage.device
    for program in plan.programs:
        program.device = f"cuda:{program.rank % gpus_per_host}"
    plan.gpus_per_host = gpus_per_host


def batch_size(graph: nx.DiGraph) -> int | None:
    """Samples per step: dim 0 of the first placeholder with a shape (None: no shapes recorded)."""
    first = next((a for _, a in graph.nodes(data=True) if a["op"] == "placeholder" and a.get("shapes")), None)
    return int(first["shapes"][0][0]) if first and first["shapes"][0] else None


def at_batch(attrs: dict[str, Any], *, batch: int | None, size: float) -> dict[str, Any]:
    """A node's attributes for `size` of the `batch` samples: FLOPs and output bytes scaled by size / batch,
    and dim 0 of every output whose dim 0 is the batch set to `size` (rounded, at least 1), so the cost
    model reads the matrix shapes of the smaller batch (see cost_model/ops.py `gemm_dims`)."""
    if not batch:
        return dict(attrs)
    scale, rows = size / batch, max(1, round(size))
    shapes = [(rows, *s[1:]) if len(s) and s[0] == batch else s for s in attrs.get("shapes") or []]
    out = {**attrs, "flops": (attrs.get("flops", 0) or 0) * scale}
    out["out_bytes"] = (attrs.get("out_bytes", 0) or 0) * scale
    if "shapes" in attrs:
        out["shapes"] = shapes
    return out


def per_micro_batch(graph: nx.DiGraph, micro_batches: int) -> nx.DiGraph:
    """A copy of a whole-batch graph describing one micro-batch: FLOPs and bytes moved divided by m, and
    batch-sized shapes cut to batch / m samples (`at_batch`)."""
    out = graph.copy()
    batch = batch_size(graph)
    for name, attrs in out.nodes(data=True):
        if batch:
            out.nodes[name].update(at_batch(attrs, batch=batch, size=batch / micro_batches))
        else:
            for key in ("flops", "out_bytes"):
                attrs[key] = (attrs.get(key, 0) or 0) / micro_batches
    for _, _, data in out.edges(data=True):
        if "bytes" in data:
            data["bytes"] = data["bytes"] / micro_batches
    return out
