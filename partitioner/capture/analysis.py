"""Graph analysis: the critical path, cheap cut points and a printable report (fork/join regions: regions.py).

All functions take the DiGraph of `partitioner.capture.graph.build_graph` (or any DiGraph whose
vertices carry `op`; a vertex without `op` counts as compute). get_attr vertices are weights
and are ignored; placeholders are sources and the output node is a sink.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from itertools import accumulate
from typing import Callable, Mapping, Sequence

import networkx as nx

from partitioner.capture.regions import fork_join_regions, is_compute, iter_regions, topo_positions

__all__ = ["CriticalPath", "Cut", "CutPoints", "critical_path", "cut_points", "describe"]

NodeTime = Mapping[str, float] | Callable[[str], float]


@dataclass
class CriticalPath:
    """The longest path by node time, its length and the total time of all vertices."""

    nodes: list[str]
    length: float
    total: float

    @property
    def parallelism(self) -> float:
        """total / length: how many devices the graph could keep busy at best."""
        return self.total / self.length if self.length > 0 else 1.0


@dataclass
class Cut:
    """A cut after `order[position]`: `bytes` of values cross it."""

    position: int
    before: str
    after: str
    bytes: int


@dataclass
class CutPoints:
    """`crossing[i]`: bytes crossing the cut between order[i] and order[i + 1]; the cheapest cuts."""

    crossing: list[int]
    cheapest: list[Cut]


def _time_of(graph: nx.DiGraph, node_time: NodeTime) -> Callable[[str], float]:
    if callable(node_time):
        return node_time
    missing = [n for n in graph if is_compute(n, graph) and n not in node_time]
    if missing:
        raise ValueError(
            f"node_time has no time for {len(missing)} compute vertices, e.g. {missing[:5]}; "
            "give every call_* vertex a time (placeholders and outputs may be left out)"
        )
    return lambda name: float(node_time.get(name, 0.0))


def critical_path(graph: nx.DiGraph, node_time: NodeTime) -> CriticalPath:
    """The longest path through `graph` when vertex v takes `node_time(v)` (get_attr ignored).

    Args:
        graph: the annotated DiGraph.
        node_time: name -> seconds, as a mapping or a callable.

    Raises:
        ValueError: a compute vertex has no time, a time is negative, or the graph has a cycle.
    """
    time_of = _time_of(graph, node_time)
    positions = topo_positions(graph)
    best: dict[str, float] = {}
    back: dict[str, str | None] = {}
    total = 0.0
    for name in sorted(positions, key=positions.__getitem__):
        if graph.nodes[name].get("op") == "get_attr":
            continue
        t = float(time_of(name))
        if t < 0:
            raise ValueError(f"node_time({name!r}) is {t}; times must be >= 0 seconds")
        total += t
        preds = [p for p in graph.predecessors(name) if p in best]
        prev = max(preds, key=best.__getitem__, default=None)
        best[name] = t + (best[prev] if prev is not None else 0.0)
        back[name] = prev
    end = max(best, key=lambda name: (best[name], positions[name]), default=None)  # ties: reach the sink
    length = best[end] if end is not None else 0.0
    path: list[str] = []
    while end is not None:
        path.append(end)
        end = back[end]
    return CriticalPath(nodes=path[::-1], length=length, total=total)


def _value_bytes(graph: nx.DiGraph, name: str) -> int:
    attrs = graph.nodes[name]
    if "out_bytes" in attrs:
        return int(attrs["out_bytes"])
    return max((int(b) for _, _, b in graph.out_edges(name, data="bytes", default=0)), default=0)


def cut_points(graph: nx.DiGraph, order: Sequence[str], k: int = 5) -> CutPoints:
    """Bytes crossing each cut of a topological `order` (usually the compute vertices) and the cheapest k.

    A value made by `order[a]` crosses every cut from after position a up to its last reader
    in `order` (or to the end when the model output reads it); it counts once however many
    readers follow. Inputs and weights come from outside and are not counted.

    Raises:
        ValueError: `order` names an unknown vertex, repeats one, or is not topological.
    """
    if k < 0:
        raise ValueError(f"k={k}; ask for k >= 0 cheapest cuts")
    position: dict[str, int] = {}
    for i, name in enumerate(order):
        if name not in graph:
            raise ValueError(f"order[{i}]={name!r} is not a vertex of the graph; pass vertex names from build_graph")
        if name in position:
            raise ValueError(f"order lists {name!r} twice (positions {position[name]} and {i}); list each vertex once")
        position[name] = i
    n = len(order)
    diff = [0] * max(n, 1)
    for a, name in enumerate(order):
        last = -1
        for succ in graph.successors(name):
            if succ in position:
                if position[succ] <= a:
                    raise ValueError(
                        f"order is not topological: {name!r} (position {a}) feeds {succ!r} "
                        f"(position {position[succ]}); sort it by the vertices' `position`"
                    )
                last = max(last, position[succ])
            elif graph.nodes[succ].get("op") == "output":
                last = n - 1
        if last > a:
            nbytes = _value_bytes(graph, name)
            diff[a] += nbytes
            diff[last] -= nbytes
    crossing = list(accumulate(diff[: n - 1]))
    ranked = heapq.nsmallest(k, range(len(crossing)), key=lambda i: (crossing[i], i))
    cheapest = [Cut(position=i, before=order[i], after=order[i + 1], bytes=crossing[i]) for i in ranked]
    return CutPoints(crossing=crossing, cheapest=cheapest)


def _human(value: float, base: int, unit: str) -> str:
    prefixes = ("", "Ki", "Mi", "Gi", "Ti") if base == 1024 else ("", "k", "M", "G", "T")
    i = 0
    while i < len(prefixes) - 1 and abs(value) >= base:
        value /= base
        i += 1
    prefix = prefixes[i]
    return f"{value:.1f} {prefix}{unit}" if prefix else f"{value:.0f} {unit}"


def _short(names: Sequence[str], limit: int = 8) -> str:
    if len(names) <= limit:
        return " -> ".join(names)
    half = limit // 2
    return " -> ".join([*names[:half], f"... ({len(names) - limit} more)", *names[-half:]])


def describe(graph: nx.DiGraph, node_time: NodeTime | None = None, k: int = 5, max_regions: int = 30) -> str:
    """A text report of the regions, critical path and cheapest cuts, for `print`.

    Args:
        graph: the annotated DiGraph.
        node_time: name -> seconds for the critical path; by default the vertices' FLOPs.
        k: how many cheapest cuts to list.
        max_regions: how many regions to list before eliding the rest.
    """
    ops: dict[str, int] = {}
    for _, op in graph.nodes(data="op", default="call_function"):
        ops[op] = ops.get(op, 0) + 1
    counts = ", ".join(f"{count} {op}" for op, count in sorted(ops.items()))
    lines = [f"graph: {graph.number_of_nodes()} vertices ({counts}), {graph.number_of_edges()} edges"]

    regions = list(iter_regions(fork_join_regions(graph)))
    parallel = sum(r.parallel for _, r in regions)
    deepest = max((d for d, _ in regions), default=-1) + 1
    lines.append(f"fork/join regions: {len(regions)} ({parallel} with parallel branches), nested {deepest} deep")
    for depth, region in regions[:max_regions]:
        sizes = ", ".join(str(len(b)) for b in region.branches)
        skip = " + shortcut" if region.shortcut else ""
        fork = region.fork or "(inputs)"
        join = region.join or "(separate outputs)"
        count = f"{len(region.branches)} branch{'es' if len(region.branches) != 1 else ''}"
        lines.append(f"{'  ' * (depth + 1)}{fork} -> {join}: {count} ({sizes} vertices){skip}")
    if len(regions) > max_regions:
        lines.append(f"  ... and {len(regions) - max_regions} more")

    compute = sorted((n for n in graph if is_compute(n, graph)), key=topo_positions(graph).__getitem__)
    if node_time is None:
        path = critical_path(graph, lambda n: float(graph.nodes[n].get("flops", 0)))
        length, total = _human(path.length, 1000, "FLOP"), _human(path.total, 1000, "FLOP")
    else:
        path = critical_path(graph, node_time)
        length, total = f"{path.length * 1e3:.3f} ms", f"{path.total * 1e3:.3f} ms"
    lines.append(
        f"critical path: {len(path.nodes)} vertices, {length} of {total} (parallelism {path.parallelism:.2f})"
    )
    lines.append(f"  {_short(path.nodes)}")

    cuts = cut_points(graph, compute, k)
    lines.append(f"cheapest cuts of the {len(compute)} compute vertices (bytes crossing):")
    lines += [f"  after {c.before} (position {c.position}): {_human(c.bytes, 1024, 'B')}" for c in cuts.cheapest]
    return "\n".join(lines)
