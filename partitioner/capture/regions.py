"""Fork/join regions of a graph: the independent branches between a fork and the vertex where they meet.

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

from dataclasses import dataclass, field
from typing import Iterable, Iterator, TypeGuard

import networkx as nx

__all__ = ["ForkJoinRegion", "fork_join_regions", "is_compute", "iter_regions", "topo_positions"]

_COMPUTE = ("call_function", "call_method", "call_module")
# Virtual vertices; tuples never clash with fx node names.
_SOURCE = ("<source>",)
_SINK = ("<sink>",)


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


def is_compute(name: object, graph: nx.DiGraph) -> TypeGuard[str]:
    """A vertex of the graph (so a node name, not a virtual vertex) that computes."""
    return name in graph and graph.nodes[name].get("op", "call_function") in _COMPUTE


def topo_positions(graph: nx.DiGraph) -> dict[str, int]:
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
        self.positions = topo_positions(graph)
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
        meets_at_end = join == _SINK or not is_compute(join, graph)
        branches: list[list[str]] = []
        shortcut = join in self.flow.successors(fork)
        interior: set[object] = set()
        groups = _components(self.flow, heads, join)
        for _, group in groups:
            work = sorted((n for n in group if is_compute(n, graph)), key=positions.__getitem__)
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
            if len(heads) >= 2 or is_compute(join, self.graph):
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
