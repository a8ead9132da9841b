"""A traced graph and a cost model into the searches' numbers (HybridProblem), and a whole batch into micro-batches.

Node times are asked per kind of device at each micro-batch size the candidate counts make,
with the node's shapes cut along the batch (`at_batch`); values, weights and saved activations
by position in the compute order; links, all-reduce rings and capacities per device. devices/search.py
and cluster/search.py search the result; assemble counts the chosen plan on `per_micro_batch`.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import networkx as nx
import numpy as np
import torch

from cost_model.interface import CostModel
from cost_model.memory import optimizer_states
from cost_model.recompute_cost import graph_nodes, saved_bytes_per_node
from partitioner.errors import PartitionError
from partitioner.place.devices.search import micro_batch_counts
from partitioner.place.search.problem import HybridProblem
from partitioner.predict.counting import device_key

__all__ = [
    "at_batch", "batch_size", "fixed_and_batch", "graph_values", "hybrid_problem", "node_times", "per_micro_batch",
]


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
    candidate counts (`micro_batches`, default devices.search.micro_batch_counts) make, with the
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
        fixed, batch = fixed_and_batch(size_times, size)
    else:  # batch unknown: halve FLOPs and bytes
        for k, dev in enumerate(kinds):
            for i, name in enumerate(order):
                attrs = graph.nodes[name]
                whole_s = cost.node_time(attrs, dev)
                halved = {**attrs, "flops": attrs.get("flops", 0) / 2, "out_bytes": attrs.get("out_bytes", 0) / 2}
                part_s = min(max(2.0 * (whole_s - cost.node_time(halved, dev)), 0.0), whole_s)
                fixed[k, i], batch[k, i] = whole_s - part_s, part_s
    return fixed, batch, size_times


def fixed_and_batch(size_times: dict[int, np.ndarray], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(fixed, whole-batch) seconds from the times at the whole batch and half of it: the part that grows
    with the samples, clipped to the whole, and the rest (op overheads)."""
    whole, half = size_times[size], size_times[size // 2]
    part = np.clip((whole - half) * size / (size - size // 2), 0.0, whole)
    return whole - part, part


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
