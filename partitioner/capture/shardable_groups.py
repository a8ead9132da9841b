"""One tensor-parallel group found in a graph: its nodes, shardings, degrees, FLOPs, bytes and collectives."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Collection, Literal, Sequence

import networkx as nx
import torch
import torch.fx

from runtime.tensor_parallel_spec import ShardedParam, TensorParallelGroup

__all__ = ["Collective", "GroupKind", "ShardGroup", "Shardable", "Unsplit", "build_group", "divisors", "unique_names"]

GroupKind = Literal["attention", "mlp", "embedding", "vocab", "head"]


def divisors(n: int) -> tuple[int, ...]:
    """The divisors of n, ascending (the tensor degrees that split n evenly)."""
    return tuple(d for d in range(1, n + 1) if n % d == 0) if n > 0 else (1,)


@dataclass(frozen=True)
class Collective:
    """One collective of a group per micro-batch: on `value`'s tensor in forward, on its gradient in backward.

    `bytes` is the whole tensor's size; how much each rank sends (2(t-1)/t of it for a ring all-reduce,
    (t-1)/t for an all-gather or a reduce-scatter) is the cost model's business.
    """

    kind: Literal["all_reduce", "all_gather", "reduce_scatter"]
    phase: Literal["forward", "backward"]
    value: str
    bytes: int


@dataclass(frozen=True)
class ShardGroup:
    """Layers split together across a tensor-parallel group (see partitioner.capture.shardable).

    `flops`, `weight_bytes` and `split_bytes` are whole: each of t ranks runs and holds 1/t of them;
    `replicated_bytes` (rowwise biases) every rank holds whole. `inputs` enter replicated (their
    gradients are what the backward all-reduce sums), `side_inputs` (masks, rotary tables) are read
    whole, `outputs` leave replicated after the forward collective. `collectives` is without sequence
    parallelism, `sequence_collectives` with it (values outside the group split on the sequence).
    """

    name: str
    kind: GroupKind
    nodes: tuple[str, ...]
    params: tuple[ShardedParam, ...]
    degrees: tuple[int, ...]
    sizes: dict[str, int]
    flops: int
    weight_bytes: int
    replicated_bytes: int
    split_bytes: int
    inputs: tuple[tuple[str, int], ...]
    side_inputs: tuple[tuple[str, int], ...]
    outputs: tuple[tuple[str, int], ...]
    collectives: tuple[Collective, ...]
    sequence_collectives: tuple[Collective, ...]
    # gathered outputs that are model outputs (the graph's output reads them, nothing else): a training step's loss
    # reads them split by their last dimension, not gathered (runtime/loss_split.py); forward-only runs gather them
    loss_outputs: tuple[str, ...] = ()

    def spec(self) -> TensorParallelGroup:
        """The plain data runtime.tensor_parallel splits it by."""
        return TensorParallelGroup(self.name, self.params)

    def flops_per_rank(self, t: int) -> float:
        return self.flops / self._check(t)

    def weight_bytes_per_rank(self, t: int) -> float:
        return self.weight_bytes / self._check(t) + self.replicated_bytes

    def _check(self, t: int) -> int:
        if t not in self.degrees:
            raise ValueError(f"group {self.name!r} cannot be split {t} ways; its degrees are {self.degrees}")
        return t


@dataclass(frozen=True)
class Unsplit:
    """Layers left whole on every rank of a tensor-parallel group, and why."""

    nodes: tuple[str, ...]
    params: tuple[str, ...]
    reason: str


@dataclass
class Shardable:
    """Everything find_shardable found in one graph."""

    groups: list[ShardGroup] = field(default_factory=list)
    unsplit: list[Unsplit] = field(default_factory=list)

    def specs(self, degree: int | None = None) -> list[TensorParallelGroup]:
        """The groups to split (those `degree` divides evenly, if given) as runtime data."""
        return [g.spec() for g in self.groups if degree is None or degree in g.degrees]

    def by_name(self) -> dict[str, ShardGroup]:
        return {g.name: g for g in self.groups}

    def within(self, nodes: Collection[str]) -> list[ShardGroup]:
        """The groups whose nodes all lie in `nodes` (a pipeline stage's): only those can be split there."""
        inside = set(nodes)
        return [g for g in self.groups if inside.issuperset(g.nodes)]


def _module_prefix(paths: Sequence[str]) -> str:
    parts = [p.split(".") for p in paths if p]
    if not parts:
        return ""
    common: list[str] = []
    for column in zip(*parts):
        if len(set(column)) != 1:
            break
        common.append(column[0])
    return ".".join(common)


def _bytes(graph: nx.DiGraph, name: str) -> int:
    return int(graph.nodes[name].get("out_bytes", 0)) if name in graph.nodes else 0


def _span(params: Sequence[ShardedParam]) -> str:
    """'first..last': the modules of a group's first and last parameters."""
    owners = list(dict.fromkeys(p.name.rpartition(".")[0] for p in params))
    return owners[0] if len(owners) == 1 else f"{owners[0]}..{owners[-1]}"


def unique_names(groups: list[ShardGroup]) -> list[ShardGroup]:
    """Groups sharing a module name (two pairs in one nn.Sequential) are named by their first and last layers."""
    counts: dict[str, int] = {}
    for g in groups:
        counts[g.name] = counts.get(g.name, 0) + 1
    renamed = [replace(g, name=_span(g.params)) if counts[g.name] > 1 else g for g in groups]
    seen: dict[str, int] = {}
    for k, g in enumerate(renamed):
        seen[g.name] = seen.get(g.name, 0) + 1
        if seen[g.name] > 1:
            renamed[k] = replace(g, name=f"{g.name}#{seen[g.name]}")
    return renamed


def build_group(
    graph: nx.DiGraph,
    gm: torch.fx.GraphModule,
    kind: GroupKind,
    nodes: Sequence[torch.fx.Node],
    grad_inputs: Sequence[torch.fx.Node],
    summed: Sequence[torch.fx.Node],
    gathered: Sequence[torch.fx.Node],
    params: Sequence[ShardedParam],
    sizes: Sequence[int],
    named: dict[str, int],
) -> ShardGroup:
    """A group's record: `grad_inputs` are the values entering whose gradients it all-reduces, `summed`
    the nodes whose partial outputs it all-reduces (rowwise layers, embeddings), `gathered` those whose
    split outputs it all-gathers (heads). Its name is the module holding its nodes (see `unique_names`)."""
    inside = set(nodes)
    dense = {p.name for p in params}
    own = nodes if kind in ("attention", "mlp") else [*summed, *gathered][:1]
    modules = [graph.nodes[n.name].get("module", "") for n in own if n.name in graph.nodes]
    name = _module_prefix([m for m in modules if m]) or _span(params)
    inputs = {x.name: _bytes(graph, x.name) for x in grad_inputs}
    side: dict[str, int] = {}
    for n in nodes:
        for p in n.all_input_nodes:
            if p in inside or p.name in inputs or p.op == "get_attr" and str(p.target) in dense:
                continue
            if graph.nodes[p.name].get("shapes") if p.name in graph.nodes else False:
                side[p.name] = _bytes(graph, p.name)
    outputs = {n.name: _bytes(graph, n.name) for n in (*summed, *gathered)}
    forward: list[Collective] = [Collective("all_reduce", "forward", n.name, outputs[n.name]) for n in summed]
    forward += [Collective("all_gather", "forward", n.name, outputs[n.name]) for n in gathered]
    backward = [Collective("all_reduce", "backward", x, b) for x, b in inputs.items()]
    seq = [Collective("all_gather", "forward", x, b) for x, b in inputs.items()]
    seq += [Collective("reduce_scatter", "forward", n.name, outputs[n.name]) for n in summed]
    seq += [Collective("all_gather", "forward", n.name, outputs[n.name]) for n in gathered]
    seq += [Collective("reduce_scatter", "backward", x, b) for x, b in inputs.items()]
    seq += [Collective("all_gather", "backward", n.name, outputs[n.name]) for n in summed]
    weight = replicated = 0
    for param in params:
        t = gm.get_parameter(param.name)
        size = t.numel() * t.element_size()
        if param.dim is None:
            replicated += size
        else:
            weight += size
    whole = set(outputs)
    return ShardGroup(
        name=name, kind=kind, nodes=tuple(n.name for n in nodes), params=tuple(params),
        degrees=divisors(math.gcd(*sizes) if sizes else 1), sizes=dict(named),
        flops=sum(int(graph.nodes[n.name].get("flops", 0)) for n in nodes if n.name in graph.nodes),
        weight_bytes=weight, replicated_bytes=replicated,
        split_bytes=sum(_bytes(graph, n.name) for n in nodes if n.name not in whole),
        inputs=tuple(inputs.items()), side_inputs=tuple(side.items()), outputs=tuple(outputs.items()),
        collectives=tuple(forward + backward), sequence_collectives=tuple(seq),
        loss_outputs=tuple(n.name for n in gathered if n.users and all(u.op == "output" for u in n.users)),
    )

