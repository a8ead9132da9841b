"""Collapse a plan's graph to module level and lay it out in stage bands (static pictures and DOT).

[Note: plan picture layout] The HTML page (templates/plan.html) does the same in JavaScript so
it can expand groups on click; keep the two in step. The rules:

- Grouping: walk the nodes in topological order; a node's key is its owning module path cut
  to `depth` parts (inputs are "inputs", the output "output"). A group is a maximal run of
  consecutive nodes with the same key and stage, so a module split by a stage boundary
  becomes two groups and the grouped graph stays acyclic. Depth NODES shows every node.
- Bands: inputs, then stage 0, 1, ..., then the output, top to bottom. Inside a band a
  group's level is one more than its deepest predecessor in the same band.
- Lanes: level by level, a group takes the first free lane at or right of its
  predecessors' leftmost lane, so chains run straight down and parallel branches sit side
  by side. Edges that skip levels run straight down a lane of their own on the levels
  they pass (the first free one at or right of their source's, chosen after the boxes of
  the first level passed; one lane per source), so no box sits on them.

      inputs    x
      ─────────  │
      stage 0   tok
                 │
                blocks.0
      ───────── ─┼─ 1.5 KiB   (a cut edge, labeled with the bytes it carries)
      stage 1   blocks.1
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

__all__: list[str] = []

NODES = 99  # depth meaning "every node on its own"
INPUTS, OUTPUT = "inputs", "output"


@dataclass
class Group:
    """A run of graph nodes drawn as one box."""

    id: str
    key: str
    stage: int  # -1 for inputs and output
    band: int
    members: list[dict[str, Any]] = field(default_factory=list)
    level: int = 0  # top to bottom, over all bands
    lane: int = 0  # left to right

    @property
    def label(self) -> str:
        """The box's title: a node's name, or the module path with the numbered children it covers."""
        if len(self.members) == 1 and (self.key.startswith("node:") or self.key in (INPUTS, OUTPUT)):
            return str(self.members[0]["name"])
        if self.key.startswith("node:") or self.key in (INPUTS, OUTPUT):
            return self.key
        return (self.key or "(top level)") + children_range(self.key, self.members)

    @property
    def time(self) -> float:
        return float(sum(m.get("time", 0.0) for m in self.members))

    @property
    def position(self) -> int:
        return int(self.members[0]["position"])


@dataclass
class Edge:
    """Data from one group to another: bytes of the distinct values it carries."""

    src: str
    dst: str
    bytes: int
    cut: bool  # between two different stages
    lane: int = -1  # the lane it runs down on the levels it passes (-1: it passes none)


def node_key(node: Mapping[str, Any], depth: int) -> str:
    """The group key of a node at `depth` (see [Note: plan picture layout])."""
    if node["op"] == "placeholder":
        return INPUTS
    if node["op"] == "output":
        return OUTPUT
    if depth >= NODES:
        return "node:" + str(node["name"])
    module = str(node.get("module", ""))
    parts = module.split(".") if module else []
    return ".".join(parts[:depth])


def children_range(key: str, members: Sequence[Mapping[str, Any]]) -> str:
    """' [0 … 7]' when the members run through numbered children of `key` (blocks.0 .. blocks.7), else ''."""
    parts = key.split(".") if key else []
    kids = []
    for m in members:
        path = str(m.get("module", "")).split(".") if m.get("module") else []
        if len(path) > len(parts) and path[: len(parts)] == parts:
            kids.append(path[len(parts)])
    if not kids or not all(k.isdigit() for k in kids) or not parts:
        return ""
    return f" [{kids[0]}]" if kids[0] == kids[-1] else f" [{kids[0]} … {kids[-1]}]"


def max_depth(graph: Mapping[str, Any]) -> int:
    """Deepest module path among the nodes (at least 1)."""
    return max([len(str(n.get("module", "")).split(".")) for n in graph["nodes"] if n.get("module")] or [1])


def band_of(node: Mapping[str, Any], stages: int) -> int:
    if node["op"] == "placeholder":
        return 0
    if node["op"] == "output":
        return stages + 1
    return int(node["stage"]) + 1


def collapse(graph: Mapping[str, Any], depth: int, stages: int) -> tuple[list[Group], list[Edge]]:
    """Groups (runs of nodes sharing key and stage) and the edges between them."""
    nodes = sorted(graph["nodes"], key=lambda n: n["position"])
    groups: list[Group] = []
    group_of: dict[str, Group] = {}
    for node in nodes:
        key = node_key(node, depth)
        band = band_of(node, stages)
        if not groups or groups[-1].key != key or groups[-1].band != band:
            groups.append(Group(f"g{len(groups)}", key, int(node.get("stage", -1)), band))
        groups[-1].members.append(node)
        group_of[node["name"]] = groups[-1]
    out_bytes = {n["name"]: int(n.get("out_bytes", 0)) for n in nodes}
    carried: dict[tuple[str, str], set[str]] = {}
    for e in graph["edges"]:
        a, b = group_of.get(e["src"]), group_of.get(e["dst"])
        if a is not None and b is not None and a is not b:
            carried.setdefault((a.id, b.id), set()).add(e["src"])
    by_id = {g.id: g for g in groups}
    edges = [
        Edge(a, b, sum(out_bytes[s] for s in srcs), _is_cut(by_id[a], by_id[b]))
        for (a, b), srcs in sorted(carried.items(), key=lambda kv: (int(kv[0][0][1:]), int(kv[0][1][1:])))
    ]
    return groups, edges


def _is_cut(a: Group, b: Group) -> bool:
    return a.stage >= 0 and b.stage >= 0 and a.stage != b.stage


def layout(groups: Sequence[Group], edges: Sequence[Edge]) -> int:
    """Set each group's level and lane; returns the number of levels."""
    preds: dict[str, list[Group]] = {g.id: [] for g in groups}
    by_id = {g.id: g for g in groups}
    for e in edges:
        preds[e.dst].append(by_id[e.src])
    layer: dict[str, int] = {}
    for g in groups:  # groups are in topological order
        layer[g.id] = max([layer[p.id] + 1 for p in preds[g.id] if p.band == g.band] or [0])
    width: dict[int, int] = {}
    for g in groups:
        width[g.band] = max(width.get(g.band, 0), layer[g.id] + 1)
    start, levels = {}, 0
    for band in sorted(width):
        start[band] = levels
        levels += width[band]
    for g in groups:
        g.level = start[g.band] + layer[g.id]
    far: dict[str, list[Edge]] = {}  # per source, its edges that pass levels
    for e in edges:
        if by_id[e.dst].level > by_id[e.src].level + 1:
            far.setdefault(e.src, []).append(e)
    by_level: dict[int, list[Group]] = {}
    for g in groups:
        by_level.setdefault(g.level, []).append(g)
    reserved: dict[int, set[int]] = {}  # lanes kept for edges passing a level
    for level in sorted(by_level):  # predecessors sit on earlier levels, so their lanes are set
        wanted = {g.id: min([p.lane for p in preds[g.id]] or [0]) for g in by_level[level]}
        used = reserved.setdefault(level, set())
        for g in sorted(by_level[level], key=lambda g: (wanted[g.id], g.position)):
            g.lane = _free(used, wanted[g.id])
        for g in sorted(by_level.get(level - 1, []), key=lambda g: g.position):
            if g.id in far:  # its passing edges share one lane, chosen after this level's boxes
                lane = _free(used, g.lane)
                last = max(by_id[e.dst].level for e in far[g.id])
                for e in far[g.id]:
                    e.lane = lane
                for passed in range(level + 1, last):
                    reserved.setdefault(passed, set()).add(lane)
    return levels


def _free(used: set[int], lane: int) -> int:
    """The first lane at or right of `lane` not in `used`, now marked used."""
    while lane in used:
        lane += 1
    used.add(lane)
    return lane


def choose_depth(graph: Mapping[str, Any], stages: int, limit: int = 24) -> int:
    """The finest grouping with at most `limit` boxes: NODES when every node fits, else a module depth."""
    if len(graph["nodes"]) <= limit:
        return NODES
    best = 1
    for depth in range(1, max_depth(graph) + 1):
        if len(collapse(graph, depth, stages)[0]) <= limit:
            best = depth
    return best
