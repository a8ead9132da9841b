"""Draw a Plan: a self-contained HTML page, PNG/SVG through matplotlib, or DOT text for Graphviz.

    pipe.plan.visualize("plan.html")   # graph by stage, compute and memory bars, schedule timeline
    visualize(plan, "plan.png", measured=trace)

The page and the static pictures are built from one plain-data description (`page_data`):
the plan's stages and devices, the graph stored in `Plan.graph` (partitioner/predict/graph_data.py), and
the simulated schedule timeline, plus a measured one when given.
"""

from __future__ import annotations

import colorsys
from dataclasses import fields
from pathlib import Path
from typing import Any

from partitioner.errors import PartitionError
from partitioner.export.from_torch import ActionsSource, from_torch_schedule
from partitioner.export.torch_schedule import TorchSchedule, to_torch_schedule
from partitioner.export.torchtitan import to_torchtitan
from partitioner.predict.memory_kinds import memory_kinds
from partitioner.predict.replica_fold import rank_span
from partitioner.predict.simulator import simulate
from partitioner.show.hosts import by_host
from partitioner.show.html import render_html
from partitioner.show.measured import with_stage_errors
from partitioner.show.rows import timeline_data
from partitioner.show.split import split_summary
from partitioner.show.static import render_static, to_dot
from runtime import plan as runtime_plan
from runtime.plan import micro_batch_words

__all__ = ["DrawablePlan", "color", "page_data", "simulated_timeline", "visualize"]

# Tableau 10: one color per stage; later stages get hues spaced by the golden angle.
PALETTE = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac"]
_SUFFIXES = {
    ".html": "html", ".htm": "html", ".png": "static", ".svg": "static", ".pdf": "static", ".dot": "dot", ".gv": "dot",
}


class DrawablePlan(runtime_plan.Plan):
    """A runtime Plan that can draw itself: `plan.visualize("plan.html")` (exported as `partitioner.Plan`)."""

    @classmethod
    def from_plan(cls, plan: runtime_plan.Plan) -> DrawablePlan:
        """The same plan (sharing its stages and graph) as a drawable plan."""
        if isinstance(plan, cls):
            return plan
        return cls(**{f.name: getattr(plan, f.name) for f in fields(runtime_plan.Plan)})

    def visualize(self, path: str | Path, timeline: Any = None, measured: Any = None, depth: int | None = None) -> Path:
        """Write the plan's picture to `path`; see `partitioner.show.visualizer.visualize`."""
        return visualize(self, path, timeline=timeline, measured=measured, depth=depth)

    def to_torch_schedule(self) -> TorchSchedule:
        """Each rank's compute actions for torch.distributed.pipelining (`.csv()`, `.write_csv(path)`), the
        stage-to-rank map and the split points; see `partitioner.export.to_torch_schedule`."""
        return to_torch_schedule(self)

    def to_torchtitan(self, csv_path: str | Path = "schedule.csv", *, microbatch: int | None = None) -> str:
        """torchtitan's [parallelism] config for the plan as TOML, naming the schedule CSV at `csv_path`; see
        `partitioner.export.to_torchtitan`."""
        return to_torchtitan(self, csv_path, microbatch=microbatch)

    def summary(self) -> str:
        """The plan as a fixed-width table, one row per stage, and where a stage is split, sharded or replicated
        across a cluster, how: ranks, replicas, tensor degree, sharding and memory per GPU by kind."""
        split = split_summary(self)
        return super().summary() + (f"\n{split}" if split else "")

    @classmethod
    def from_torch_schedule(cls, source: ActionsSource, plan: runtime_plan.Plan, *,
                            name: str | None = None) -> DrawablePlan:
        """`plan` running a torch/torchtitan schedule CSV (or rows of actions): checked, lowered and simulated;
        see `partitioner.export.from_torch_schedule`."""
        return cls.from_plan(from_torch_schedule(source, plan, name=name))




def color(stage: int) -> str:
    """The color of a stage (grey for inputs and outputs)."""
    if stage < 0:
        return "#9e9e9e"
    if stage < len(PALETTE):
        return PALETTE[stage]
    r, g, b = colorsys.hls_to_rgb((stage * 137.508 % 360) / 360, 0.55, 0.5)
    return f"#{round(r * 255):02x}{round(g * 255):02x}{round(b * 255):02x}"


def simulated_timeline(plan: runtime_plan.Plan) -> tuple[Any, str | None]:
    """The simulator's timeline of the plan's programs (None if they cannot run), and a note or None."""
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
            "ranks": list(s.ranks), "reads_from": list(s.reads_from), "replicas": s.replicas, "tensor": s.tensor,
            "context": s.context, "expert": s.expert, "sharding": s.sharding, "kinds": memory_kinds(plan, s),
        }
        for s in plan.stages
    ]
    devices: dict[str, dict[str, Any]] = {}
    for s in plan.stages:  # a cluster plan's stages sit on ranks of their own: a row each (one rank's memory)
        key = f"stage {s.index}: ranks {rank_span(s.all_ranks)}" if plan.gpus_per_host else s.device
        d = devices.setdefault(key, {"name": key, "stages": [], "param_bytes": 0, "activation_bytes": 0})
        d["stages"].append(s.index)
        d["param_bytes"] += s.param_bytes
        d["activation_bytes"] += s.activation_bytes
        kinds = memory_kinds(plan, s)
        d["kinds"] = {k: d.get("kinds", {}).get(k, 0) + v for k, v in kinds.items()}
    known = {s.device: s.capacity_bytes for s in plan.stages if s.capacity_bytes is not None}  # the planner's, first
    by_stage = {s.index: s.capacity_bytes for s in plan.stages}
    for d in devices.values():
        d["grad_bytes"] = d["param_bytes"]
        name = plan.stages[d["stages"][0]].device if plan.gpus_per_host else d["name"]
        d["capacity_bytes"] = by_stage[d["stages"][0]] if plan.gpus_per_host else known.get(name, capacity.get(name))
        d["memory_bytes"] = sum(plan.stages[k].memory_bytes for k in d["stages"])  # what the plan predicts, in all
    timelines = []
    if timeline is not None:
        timelines.append(_replica_numbers(plan, by_host(timeline_data(timeline, "predicted (simulator)"), timeline,
                                                        gpus_per_host=plan.gpus_per_host)))  # folded, host headings
    if measured is not None:
        timelines.append(timeline_data(measured, "measured (runtime trace)"))
    if graph is None:
        notes.append("no graph attached: plans made by partition() carry one; attach one to a loaded plan "
                     "with partitioner.predict.graph_data.attach_graph(plan, build_graph(...))")  # fmt: skip
    return with_stage_errors({
        "title": _title(plan),
        "plan": {"micro_batches": plan.micro_batches, "pieces": plan.pieces, "data_split": plan.data_split,
                 "micro_batch_words": micro_batch_words(plan), "schedule": plan.schedule, "placement": plan.placement,
                 "kernels": plan.kernels,
                 "gradient_sync": sorted({s.gradient_sync for s in plan.stages if s.sharding != "none"}),
                 "predicted_step_ms": plan.predicted_step_ms, "bottleneck_ms": plan.bottleneck_ms,
                 "allreduce_ms": sum(s.allreduce_ms for s in plan.stages), "alternatives": dict(plan.alternatives)},
        "stages": stages,
        "devices": list(devices.values()),
        "graph": {"nodes": graph["nodes"], "edges": graph["edges"]} if graph else None,
        "timelines": timelines,
        "notes": notes,
    })


def _replica_numbers(plan: runtime_plan.Plan, drawn: dict[str, Any]) -> dict[str, Any]:
    """A sliced plan's timeline with each replica's micro-batches numbered 0 .. micro_batches - 1, as it runs them.

    The simulator runs d sliced replicas as d dealt ones (see [Note: sliced replicas as dealt ones] in
    partitioner/predict/simulator.py): replica j's k-th micro-batch is numbered k d + j there, but the
    runtime runs micro-batch k on every replica, each on its slice. Other plans are left as they are.
    """
    d = max((s.replicas for s in plan.stages), default=1)
    if plan.data_split != "slice" or d == 1:
        return drawn
    rows = [{**row, "events": [{**e, "mb": e["mb"] // d if e["mb"] >= 0 else e["mb"]} for e in row["events"]]}
            for row in drawn["rows"]]
    return {**drawn, "rows": rows}


def _title(plan: runtime_plan.Plan) -> str:
    """'2-stage plan on cpu, cuda:0'; a cluster plan: its GPUs, hosts, tensor degree, sharding and precision."""
    stages = f"{len(plan.stages)}-stage plan"
    if not plan.gpus_per_host:
        return f"{stages} on {', '.join(dict.fromkeys(plan.devices))}"
    ranks = {r for s in plan.stages for r in s.all_ranks}
    hosts = {plan.host_of(r) for r in ranks}
    tensor = max(s.tensor for s in plan.stages)
    context, expert = max(s.context for s in plan.stages), max(s.expert for s in plan.stages)
    sharding = sorted({s.sharding for s in plan.stages} - {"none"})
    extra = (f", {tensor} tensor ranks per replica" if tensor > 1 else "") + (
        f", sequence split over {context} ranks" if context > 1 else "") + (
        f", experts split over {expert} replicas" if expert > 1 else "") + (
        f", replicas sharded {'/'.join(sharding)}" if sharding else "") + (
        f", precision {plan.precision.get('name') or plan.precision.get('compute')}" if plan.precision else "")
    return f"{stages} on {len(ranks)} GPUs ({len(hosts)} hosts x {plan.gpus_per_host}){extra}"


def visualize(
    plan: runtime_plan.Plan, path: str | Path, timeline: Any = None, measured: Any = None, depth: int | None = None
) -> Path:
    """Write a picture of `plan` to `path`; the suffix picks the kind.

    Args:
        plan: the plan; its `graph` (partitioner/predict/graph_data.py) is drawn when present.
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
        path.write_text(render_html(data, depth), encoding="utf-8")
    elif kind == "dot":
        path.write_text(to_dot(data, depth), encoding="utf-8")
    else:
        render_static(data, path, depth)
    return path

