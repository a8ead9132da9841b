"""Draw a Plan: a self-contained HTML page, PNG/SVG through matplotlib, or DOT text for Graphviz.

    pipe.plan.visualize("plan.html")   # graph by stage, compute and memory bars, schedule timeline
    visualize(plan, "plan.png", measured=trace)

The page and the static pictures are built from one plain-data description (`page_data`):
the plan's stages and devices, the graph stored in `Plan.graph` (see `attach_graph`), and
the simulated schedule timeline, plus a measured one when given.
"""

from __future__ import annotations

import colorsys
from dataclasses import fields
from pathlib import Path
from typing import Any, Mapping, Sequence

import networkx as nx
import torch

from partitioner.show.hosts import by_host
from runtime import plan as runtime_plan

__all__ = ["Plan", "attach_graph", "page_data", "visualize", "with_graph"]

# Tableau 10: one color per stage; later stages get hues spaced by the golden angle.
PALETTE = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac"]
_KINDS = {
    "F": "F", "forward": "F", "fwd": "F", "compute-forward": "F",
    "B": "B", "backward": "B", "bwd": "B", "compute-backward": "B",
    "W": "W", "weight": "W", "compute-weight": "W",
    "send": "send", "recv": "recv", "allreduce": "allreduce", "all-reduce": "allreduce",
}  # fmt: skip
_SUFFIXES = {
    ".html": "html", ".htm": "html", ".png": "static", ".svg": "static", ".pdf": "static", ".dot": "dot", ".gv": "dot",
}


class Plan(runtime_plan.Plan):
    """A runtime Plan that can draw itself: `plan.visualize("plan.html")`."""

    @classmethod
    def from_plan(cls, plan: runtime_plan.Plan) -> Plan:
        """The same plan (sharing its stages and graph) as a drawable Plan."""
        if isinstance(plan, cls):
            return plan
        return cls(**{f.name: getattr(plan, f.name) for f in fields(runtime_plan.Plan)})

    def visualize(self, path: str | Path, timeline: Any = None, measured: Any = None, depth: int | None = None) -> Path:
        """Write the plan's picture to `path`; see `partitioner.show.visualizer.visualize`."""
        return visualize(self, path, timeline=timeline, measured=measured, depth=depth)


def color(stage: int) -> str:
    """The color of a stage (grey for inputs and outputs)."""
    if stage < 0:
        return "#9e9e9e"
    if stage < len(PALETTE):
        return PALETTE[stage]
    r, g, b = colorsys.hls_to_rgb((stage * 137.508 % 360) / 360, 0.55, 0.5)
    return f"#{round(r * 255):02x}{round(g * 255):02x}{round(b * 255):02x}"


def attach_graph(plan: runtime_plan.Plan, graph: nx.DiGraph, node_ms: Mapping[str, float] | None = None) -> None:
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


def with_graph(plan: runtime_plan.Plan, graph: nx.DiGraph, cost: Any = None) -> Plan:
    """`plan` as a drawable Plan with `graph` attached; node times from `cost` when it is given.

    `cost` is a cost model (anything with `node_time(attrs, device)` in seconds); a node's
    time is then taken on its stage's device. Where it cannot answer (a device absent here),
    each stage's compute time is shared out instead, as without `cost`.
    """
    drawable = Plan.from_plan(plan)
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
    attach_graph(drawable, graph, node_ms)
    return drawable


def _estimate_ms(plan: runtime_plan.Plan, nodes: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
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
            from cost_model.devices import host_memory

            return int(host_memory()[0])
    except (RuntimeError, ValueError, AssertionError):
        return None
    return None


def _field(obj: Any, name: str, default: Any = None) -> Any:
    return obj.get(name, default) if isinstance(obj, Mapping) else getattr(obj, name, default)


def timeline_data(timeline: Any, title: str) -> dict[str, Any]:
    """A Timeline (simulator), or a trace as plain data, as rows of events for drawing.

    Accepted: anything with `devices`, each with `device` and `events` (objects or dicts with
    kind, stage, microbatch, start, end in ms); or a flat list of such events that also name
    their `device`. Kinds: F/forward, B/backward, send, recv, allreduce; idle is skipped.
    """
    devices = _field(timeline, "devices")
    if devices is None and isinstance(timeline, Sequence):
        by_device: dict[str, list[Any]] = {}
        for e in timeline:
            by_device.setdefault(str(_field(e, "device", "?")), []).append(e)
        devices = [{"device": d, "events": evs} for d, evs in by_device.items()]
    if devices is None:
        raise TypeError(
            f"cannot draw a timeline from {type(timeline).__name__}; pass a simulator Timeline or "
            "{'devices': [{'device': ..., 'events': [{kind, stage, microbatch, start, end}]}]}"
        )
    rows, makespan, busy = [], 0.0, 0.0
    for d in devices:
        events: list[dict[str, Any]] = []
        for e in _field(d, "events", []):
            kind = _KINDS.get(str(_field(e, "kind", "")))
            if kind is None:
                continue
            start = float(_field(e, "start", _field(e, "start_ms", 0.0)))
            end = float(_field(e, "end", _field(e, "end_ms", start)))
            events.append({"kind": kind, "stage": int(_field(e, "stage", -1)), "mb": int(_field(e, "microbatch", -1)),
                           "start": start, "end": end})  # fmt: skip
            makespan = max(makespan, end)
            busy += end - start if kind in ("F", "B", "W") else 0.0
        stages = sorted({e["stage"] for e in events if e["stage"] >= 0})
        rows.append({"device": str(_field(d, "device", "")), "stages": stages, "events": events})
    makespan = float(_field(timeline, "makespan_ms", None) or makespan)
    bubble = 1.0 - busy / (len(rows) * makespan) if rows and makespan > 0 else 0.0
    return {"title": title, "makespan": makespan, "bubble": bubble, "rows": rows}


def simulated_timeline(plan: runtime_plan.Plan) -> tuple[Any, str | None]:
    """The simulator's timeline of the plan's programs (None if they cannot run), and a note or None."""
    from partitioner.errors import PartitionError
    from partitioner.predict.simulator import simulate

    try:
        return simulate(plan), None
    except (PartitionError, ValueError, KeyError, IndexError) as exc:
        return None, f"no simulated timeline: {exc}"


def page_data(plan: runtime_plan.Plan, timeline: Any = None, measured: Any = None) -> dict[str, Any]:
    """Everything the pictures show, as JSON-ready plain data."""
    notes: list[str] = []
    if timeline is None:
        timeline, note = simulated_timeline(plan)
        notes += [note] if note else []
    graph = plan.graph
    capacity = dict((graph or {}).get("capacity", {}))
    stages = [
        {
            "index": s.index, "device": s.device, "color": color(s.index), "nodes": len(s.nodes),
            "predicted_ms": s.predicted_ms, "compute_ms": s.compute_ms, "forward_ms": s.forward_ms,
            "backward_ms": s.backward_ms, "comm_ms": s.comm_ms, "param_bytes": s.param_bytes,
            "activation_bytes": s.activation_bytes, "recv_bytes": s.recv_bytes, "send_bytes": s.send_bytes,
            "allreduce_ms": s.allreduce_ms, "memory_bytes": s.memory_bytes, "capacity_bytes": s.capacity_bytes,
            "ranks": list(s.ranks), "reads_from": list(s.reads_from),
        }
        for s in plan.stages
    ]
    devices: dict[str, dict[str, Any]] = {}
    for s in plan.stages:
        d = devices.setdefault(s.device, {"name": s.device, "stages": [], "param_bytes": 0, "activation_bytes": 0})
        d["stages"].append(s.index)
        d["param_bytes"] += s.param_bytes
        d["activation_bytes"] += s.activation_bytes
    known = {s.device: s.capacity_bytes for s in plan.stages if s.capacity_bytes is not None}  # the planner's, first
    for d in devices.values():
        d["grad_bytes"] = d["param_bytes"]
        d["capacity_bytes"] = known.get(d["name"], capacity.get(d["name"]))
    timelines = []
    if timeline is not None:
        timelines.append(by_host(timeline_data(timeline, "predicted (simulator)"), timeline,
                                 gpus_per_host=plan.gpus_per_host))  # folded replicas, host headings
    if measured is not None:
        timelines.append(timeline_data(measured, "measured (runtime trace)"))
    if graph is None:
        notes.append("no graph attached: plans made by partition() carry one; attach one to a loaded plan "
                     "with partitioner.show.visualizer.attach_graph(plan, build_graph(...))")  # fmt: skip
    from partitioner.show.measured import with_stage_errors

    return with_stage_errors({
        "title": f"{len(plan.stages)}-stage plan on {', '.join(dict.fromkeys(plan.devices))}",
        "plan": {"micro_batches": plan.micro_batches, "schedule": plan.schedule, "placement": plan.placement,
                 "predicted_step_ms": plan.predicted_step_ms, "bottleneck_ms": plan.bottleneck_ms,
                 "allreduce_ms": sum(s.allreduce_ms for s in plan.stages), "alternatives": dict(plan.alternatives)},
        "stages": stages,
        "devices": list(devices.values()),
        "graph": {"nodes": graph["nodes"], "edges": graph["edges"]} if graph else None,
        "timelines": timelines,
        "notes": notes,
    })


def visualize(
    plan: runtime_plan.Plan, path: str | Path, timeline: Any = None, measured: Any = None, depth: int | None = None
) -> Path:
    """Write a picture of `plan` to `path`; the suffix picks the kind.

    Args:
        plan: the plan; its `graph` (see `attach_graph`) is drawn when present.
        path: .html (interactive, self-contained), .png/.svg/.pdf (matplotlib) or .dot/.gv.
        timeline: a simulator Timeline to draw; by default the plan's programs, simulated.
        measured: a measured timeline (a runtime trace, see `timeline_data`) drawn below it.
        depth: module depth of the grouped graph (99: every node); default: readable size.

    Raises:
        ValueError: an unknown suffix.
        ImportError: a static picture without matplotlib installed.
    """
    path = Path(path)
    kind = _SUFFIXES.get(path.suffix.lower())
    if kind is None:
        raise ValueError(f"cannot write {path.name!r}: use a name ending in one of {', '.join(sorted(_SUFFIXES))}")
    data = page_data(plan, timeline, measured)
    if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int) or depth < 1):
        raise ValueError(f"depth must be an integer >= 1 (99 for every node), got {depth!r}")
    if kind == "html":
        from partitioner.show.html import render_html

        path.write_text(render_html(data, depth), encoding="utf-8")
    elif kind == "dot":
        from partitioner.show.static import to_dot

        path.write_text(to_dot(data, depth), encoding="utf-8")
    else:
        from partitioner.show.static import render_static

        render_static(data, path, depth)
    return path

