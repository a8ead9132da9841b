"""A plan's graph as plain data: `plan.graph` holds the traced graph's nodes and edges, with node times.

What a plan carries for drawing and for readers: each node's stage, shapes, bytes, FLOPs and
forward + backward time (from the cost model where it can answer), and each device's memory
where this machine can tell. Plain node-link data, so it travels in the plan's JSON; the
pictures (partitioner/show/) read it from there.
"""

from __future__ import annotations

from typing import Any, Mapping

import networkx as nx
import torch

from cost_model.devices import host_memory
from runtime.plan import Plan

__all__ = ["attach_graph", "store_graph"]


def attach_graph(plan: Plan, graph: nx.DiGraph, node_ms: Mapping[str, float] | None = None) -> None:
    """Store `graph` (from `partitioner.capture.graph.build_graph`) in `plan.graph` as plain node-link data.

    Weights (get_attr vertices) are folded into their first reader's `param_bytes`; vertices
    in no stage other than inputs and the output do no work and are left out. `node_ms` gives
    each node's forward + backward ms per micro-batch; without it, each stage's `compute_ms`
    is shared among its nodes by a roofline estimate.
    """
    stage_of = plan.stage_of()
    nodes: dict[str, dict[str, Any]] = {}
    for name, attrs in graph.nodes(data=True):
        op = attrs.get("op", "call_function")
        if op == "get_attr" or (op not in ("placeholder", "output") and name not in stage_of):
            continue
        nodes[name] = {
            "name": str(name),
            "op": op,
            "target": str(attrs.get("target", "")),
            "module": str(attrs.get("module", "")),
            "position": int(attrs.get("position", len(nodes))),
            "stage": stage_of.get(name, -1),
            "shapes": [list(s) for s in attrs.get("shapes", [])],
            "dtypes": list(attrs.get("dtypes", [])),
            "out_bytes": int(attrs.get("out_bytes", 0)),
            "param_bytes": int(attrs.get("param_bytes", 0)),
            "flops": int(attrs.get("flops", 0)),
            "time": 0.0,
        }
    for name, attrs in graph.nodes(data=True):
        if attrs.get("op") == "get_attr":
            readers = sorted((nodes[r]["position"], r) for r in graph.successors(name) if r in nodes)
            if readers:
                nodes[readers[0][1]]["param_bytes"] += int(attrs.get("param_bytes", 0))
    times = dict(node_ms) if node_ms is not None else _estimate_ms(plan, nodes)
    for name, node in nodes.items():
        node["time"] = float(times.get(name, 0.0))
    edges = [
        {"src": str(a), "dst": str(b), "bytes": int(data.get("bytes", nodes[a]["out_bytes"]))}
        for a, b, data in graph.edges(data=True)
        if a in nodes and b in nodes
    ]
    plan.graph = {"nodes": sorted(nodes.values(), key=lambda n: n["position"]), "edges": edges}
    plan.graph["capacity"] = {d: _capacity(d) for d in dict.fromkeys(plan.devices)}


def store_graph(plan: Plan, graph: nx.DiGraph, cost: Any = None) -> Plan:
    """Store `graph` in `plan.graph` with node times from `cost` when it is given; returns the same plan.

    `cost` is a cost model (anything with `node_time(attrs, device)` in seconds); a node's
    time is then taken on its stage's device. Where it cannot answer (a device absent here),
    each stage's compute time is shared out instead, as without `cost` (see `attach_graph`).
    """
    node_ms: dict[str, float] | None = None
    if cost is not None:
        try:
            node_ms = {
                name: float(cost.node_time(graph.nodes[name], torch.device(stage.device))) * 1e3
                for stage in plan.stages
                for name in stage.nodes
                if name in graph
            }
        except (RuntimeError, ValueError):
            node_ms = None
    attach_graph(plan, graph, node_ms)
    return plan


def _estimate_ms(plan: Plan, nodes: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
    """Each stage's compute_ms shared by a nominal roofline (10 TFLOP/s, 100 GB/s, 5 us per op)."""
    times: dict[str, float] = {}
    for stage in plan.stages:
        weights = {}
        for name in stage.nodes:
            n = nodes.get(name)
            if n is not None:
                moved = 2.0 * n["out_bytes"] + n["param_bytes"]
                weights[name] = 5e-6 + max(n["flops"] / 1e13, moved / 1e11)
        total = sum(weights.values())
        for name, w in weights.items():
            times[name] = stage.compute_ms * w / total if total > 0 else 0.0
    return times


def _capacity(device: str) -> int | None:
    """Total memory of `device` when this machine can tell, else None."""
    try:
        dev = torch.device(device)
        if dev.type == "cuda" and torch.cuda.is_available() and (dev.index or 0) < torch.cuda.device_count():
            return int(torch.cuda.get_device_properties(dev.index or 0).total_memory)
        if dev.type == "cpu":
            return int(host_memory()[0])
    except (RuntimeError, ValueError, AssertionError):
        return None
    return None
