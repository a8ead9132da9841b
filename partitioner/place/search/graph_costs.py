"""A traced graph and a cost model into the searches' numbers (SearchProblem), and a whole batch into micro-batches.

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

from cost_model.interface import CostModel, forward_time
from cost_model.recompute_cost import graph_nodes, saved_bytes_per_node

__all__ = [
    "affine", "at_batch", "batch_size", "fixed_and_batch", "forward_share", "graph_values", "node_times",
    "per_micro_batch",
]


def affine(time: Callable[..., float], *args: Any) -> tuple[float, float]:
    """(latency, seconds per byte) of `time(nbytes, *args)`, a cost affine in the bytes moved."""
    one, big = time(1.0, *args), time(1.0 + (1 << 20), *args)
    slope = (big - one) / (1 << 20)
    return max(0.0, one - slope), max(0.0, slope)


def node_times(
    graph: nx.DiGraph, order: Sequence[str], kinds: Sequence[torch.device], cost: CostModel, probes: set[int]
) -> tuple[np.ndarray, np.ndarray, dict[int, np.ndarray]]:
    """(fixed, whole-batch, {samples: times}) seconds per device kind and node (SearchProblem's arrays).

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
    graph: nx.DiGraph, order: Sequence[str], device_type: str = "cpu"
) -> tuple[list[int], list[np.ndarray], list[float], np.ndarray, np.ndarray]:
    """(producers, consumers, value bytes, param bytes, saved bytes) of SearchProblem, by position in `order`;
    `device_type` the devices' (a dropout mask: a float on CPU, a byte on a GPU)."""
    position = {name: i for i, name in enumerate(order)}
    n = len(order)
    producers, consumers, sizes = [], [], []
    params = np.array([float(graph.nodes[x].get("param_bytes", 0) or 0) for x in order])
    saved = np.array([float(x) for x in saved_bytes_per_node(graph_nodes(graph, order), device_type).values()])
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


def forward_share(graph: nx.DiGraph, order: Sequence[str], device: torch.device, cost: CostModel) -> np.ndarray:
    """[n] the forward's fraction of each node's forward + backward time (whole batch)."""
    out = np.full(len(order), 1 / 3)
    for i, name in enumerate(order):
        whole = cost.node_time(graph.nodes[name], device)
        if whole > 0:
            out[i] = forward_time(cost, graph.nodes[name], device) / whole
    return out
