"""Graph analysis: fork/join regions (independent branches), the critical path and cheap cut points.

All functions take the DiGraph of `partitioner.capture.graph.build_graph` (or any DiGraph whose
vertices carry `op`; a vertex without `op` counts as compute). get_attr vertices are weights
and are ignored; placeholders are sources and the output node is a sink.

[Note: fork/join regions] A fork is a vertex with two or more successors; its join is its
immediate post-dominator, the first vertex every path from the fork passes through. The
vertices reachable from the fork without passing the join are the region's interior, and
they are all post-dominated by the join, so regions nest properly. Interior vertices that
connect (two successors whose paths meet before the join) form one branch; a branch with no
compute vertex, or an edge straight from fork to join, is a shortcut (a residual skip).
Successors of one fork that meet before its join (their nearest common post-dominator)
make a nested region with the same fork.

    x ─┬─ b1 ──────────────────┐
       ├─ b2_0 ── b2_1 ────────┤
       ├─ b3_0 ─┬─ a ─┬─ cat_1 ┼─ cat     x -> cat: 4 branches; the third holds
       │        └─ b ─┘        │          the nested region b3_0 -> cat_1
       └─ pool ── conv ────────┘

Post-dominators come from networkx's `immediate_dominators` on the reversed graph with one
virtual sink, so the cost is near-linear plus the total size of the regions found.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Callable, Iterable, Iterator, Mapping, Sequence, TypeGuard

import networkx as nx

__all__ = ["CriticalPath", "Cut", "CutPoints", "ForkJoinRegion", "critical_path", "cut_points", "describe",
           "fork_join_regions", "iter_regions"]  # fmt: skip

_COMPUTE = ("call_function", "call_method", "call_module")
# Virtual vertices; tuples never clash with fx node names.
_SOURCE = ("<source>",)
_SINK = ("<sink>",)

NodeTime = Mapping[str, float] | Callable[[str], float]


@dataclass
class ForkJoinRegion:
    """Parallel branches between a fork vertex and the vertex where they meet.

    Attributes:
        fork: the vertex that fans out; None when the branches start at different graph inputs.
        join: the vertex where they meet; None when they only end at different sinks.
        branches: compute vertex names per branch, each in topological order; branches are
            ordered by their first vertex.
        shortcut: some path goes from fork to join without compute (a residual skip).
        nested: regions whose fork lies inside one of the branches, outermost first.
    """

    fork: str | None
    join: str | None
    branches: list[list[str]]
    shortcut: bool = False
    nested: list[ForkJoinRegion] = field(default_factory=list)

    @property
    def parallel(self) -> bool:
        """Two or more branches do work, so they could run on different devices."""
        return len(self.branches) >= 2

    @property
    def nodes(self) -> list[str]:
        """All branch vertices, branch by branch."""
        return [name for branch in self.branches for name in branch]


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


def _is_compute(name: object, graph: nx.DiGraph) -> TypeGuard[str]:
    """A vertex of the graph (so a node name, not a virtual vertex) that computes."""
    return name in graph and graph.nodes[name].get("op", "call_function") in _COMPUTE


def _positions(graph: nx.DiGraph) -> dict[str, int]:
    """Topological index of every vertex: the fx `position` when all have one."""
    positions = dict(graph.nodes(data="position"))
    if all(p is not None for p in positions.values()):
        return positions
    try:
        return {name: i for i, name in enumerate(nx.topological_sort(graph))}
    except nx.NetworkXUnfeasible as error:
        cycle = [u for u, _ in nx.find_cycle(graph)]
        raise ValueError(f"the graph has a cycle through {cycle}; analysis needs a DAG like build_graph's") from error


def _flow_graph(graph: nx.DiGraph) -> nx.DiGraph:
    """The graph without get_attr vertices, plus one virtual source and one virtual sink."""
    keep = [name for name, op in graph.nodes(data="op") if op != "get_attr"]  # graph order: deterministic
    kept = set(keep)
    flow = nx.DiGraph()
    flow.add_nodes_from(keep)
    flow.add_edges_from((u, v) for u, v in graph.edges if u in kept and v in kept)
    flow.add_edges_from((_SOURCE, name) for name in keep if flow.in_degree(name) == 0)
    flow.add_edges_from((name, _SINK) for name in keep if flow.out_degree(name) == 0)
    flow.add_nodes_from((_SOURCE, _SINK))
    return flow


def _components(flow: nx.DiGraph, heads: list[object], join: object) -> list[tuple[list[object], set[object]]]:
    """Vertices reachable from each head before `join`, grouped where paths meet: (heads, vertices)."""
    parent = list(range(len(heads)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict[object, int] = {}
    for k, head in enumerate(heads):
        if head in owner:
            parent[root(k)] = root(owner[head])
            continue
        owner[head] = k
        stack = [head]
        while stack:
            for succ in flow.successors(stack.pop()):
                if succ == join or succ == _SINK:
                    continue
                if succ in owner:
                    parent[root(k)] = root(owner[succ])
                else:
                    owner[succ] = k
                    stack.append(succ)
    groups: dict[int, tuple[list[object], set[object]]] = {}
    for k, head in enumerate(heads):
        groups.setdefault(root(k), ([], set()))[0].append(head)
    for name, k in owner.items():
        groups[root(k)][1].add(name)
    return list(groups.values())


class _Finder:
    """Builds regions fork by fork; see [Note: fork/join regions]."""

    def __init__(self, graph: nx.DiGraph) -> None:
        self.graph = graph
        self.positions = _positions(graph)
        self.flow = _flow_graph(graph)
        self.ipdom = nx.immediate_dominators(self.flow.reverse(copy=False), _SINK)
        self.ipdom.pop(_SINK, None)  # networkx < 3.5 maps the start to itself
        self.depth: dict[object, int] = {_SINK: 0}
        for name in sorted(self.positions, key=self.positions.__getitem__, reverse=True):
            if name in self.ipdom:
                self.depth[name] = self.depth[self.ipdom[name]] + 1
        if _SOURCE in self.ipdom:
            self.depth[_SOURCE] = self.depth[self.ipdom[_SOURCE]] + 1
        # (region, interior vertices, parent region when nested by construction)
        self.found: list[tuple[ForkJoinRegion, set[object], ForkJoinRegion | None]] = []

    def meet(self, heads: list[object]) -> object:
        """The nearest vertex that post-dominates every head (their LCA in the post-dominator tree)."""
        meet = heads[0]
        for other in heads[1:]:
            while meet != other:
                if self.depth[meet] >= self.depth[other]:
                    meet = self.ipdom[meet]
                else:
                    other = self.ipdom[other]
        return meet

    def add(self, fork: object, join: object, heads: list[object], parent: ForkJoinRegion | None, inner: bool) -> None:
        """Record the region from `fork` through `heads` to `join`, and regions of heads meeting earlier."""
        graph, positions = self.graph, self.positions
        meets_at_end = join == _SINK or not _is_compute(join, graph)
        branches: list[list[str]] = []
        shortcut = join in self.flow.successors(fork)
        interior: set[object] = set()
        groups = _components(self.flow, heads, join)
        for _, group in groups:
            work = sorted((n for n in group if _is_compute(n, graph)), key=positions.__getitem__)
            interior |= group
            if work:
                branches.append(work)
            else:
                shortcut = True
        keep = len(branches) + shortcut >= 2 and not (meets_at_end and len(branches) < 2)
        # Same-fork regions (heads meeting before the join) are only kept when they have parallel work.
        keep = keep and (not inner or len(branches) >= 2)
        region = None
        if keep:
            branches.sort(key=lambda b: positions[b[0]])
            region = ForkJoinRegion(
                fork=None if fork == _SOURCE else str(fork),
                join=None if join == _SINK else str(join),
                branches=branches,
                shortcut=shortcut,
            )
            self.found.append((region, interior, parent))
        for group_heads, _ in groups:
            if len(group_heads) >= 2:
                meet = self.meet(group_heads)
                if meet != join:
                    self.add(fork, meet, [h for h in group_heads if h != meet], region or parent, True)

    def regions(self) -> list[ForkJoinRegion]:
        for fork in self.flow:
            if self.flow.out_degree(fork) < 2:
                continue
            join = self.ipdom[fork]
            heads = [s for s in self.flow.successors(fork) if s != join]
            if len(heads) >= 2 or _is_compute(join, self.graph):
                self.add(fork, join, heads, None, False)
        # Nesting: a region's parent is the smallest region whose interior holds its fork.
        innermost: dict[object, ForkJoinRegion] = {}
        for region, interior, _ in sorted(self.found, key=lambda f: len(f[1])):
            for name in interior:
                innermost.setdefault(name, region)

        def start(region: ForkJoinRegion) -> tuple[int, int]:
            fork = -1 if region.fork is None else self.positions[region.fork]
            return fork, -len(region.nodes)

        top: list[ForkJoinRegion] = []
        for region, _, parent in sorted(self.found, key=lambda f: start(f[0])):
            if parent is None and region.fork is not None:
                parent = innermost.get(region.fork)
            (parent.nested if parent is not None else top).append(region)
        return top


def fork_join_regions(graph: nx.DiGraph) -> list[ForkJoinRegion]:
    """The fork/join regions of `graph`, outermost first; inner ones sit in `nested`.

    A region is kept when at least two paths (branches or a shortcut) lead from fork to
    join; when the paths only meet at the model output, it needs two branches. Branches of
    one fork that meet before its join form a nested region with the same fork (the
    parallel part of an Inception-ResNet block). See [Note: fork/join regions].

    Raises:
        ValueError: the graph has a cycle.
    """
    return _Finder(graph).regions()


def iter_regions(regions: Iterable[ForkJoinRegion], depth: int = 0) -> Iterator[tuple[int, ForkJoinRegion]]:
    """Every region with its nesting depth, depth-first, parents before children."""
    for region in regions:
        yield depth, region
        yield from iter_regions(region.nested, depth + 1)


def _time_of(graph: nx.DiGraph, node_time: NodeTime) -> Callable[[str], float]:
    if callable(node_time):
        return node_time
    missing = [n for n in graph if _is_compute(n, graph) and n not in node_time]
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
    positions = _positions(graph)
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

    compute = sorted((n for n in graph if _is_compute(n, graph)), key=_positions(graph).__getitem__)
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
