"""The layer groups of a traced graph that tensor parallelism can split with one collective each way.

[Note: finding shardable groups]
Found from the graph's structure, not from model names. Every Linear-like op (nn.Linear, F.linear /
aten.linear, and addmm with a weight, which is how Hugging Face's Conv1D traces: weight [in, out]) is
tried as a *colwise* layer: its output is split on its features, and that split is carried forward
node by node (partitioner.capture.shardable_rules) through element-wise ops, views into heads,
transposes, attention and the split of a fused q/k/v output, until a Linear reads it on its input
features: a *rowwise* layer, whose partial sums one all-reduce adds up. Colwise layers whose split
values meet (gate and up, q, k and v) form one group; a group fails when a split value reaches a node
that would need communication (a reduction over it, the graph's output, an unknown op), and its
layers are tried again as whole values (so the next Linear may start a pair). What is left:
- an embedding is split by vocabulary rows (with the LM head that shares its weight);
- a Linear with no Linear after it (an LM head, a classifier) is split colwise alone, its output gathered;
- every other Linear, embedding and convolution is reported unsplit, with the reason.
Legal degrees are the divisors of every split size met on the way (features, heads, KV heads, vocab).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Literal

import networkx as nx
import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from partitioner.capture.shardable_groups import Collective, Shardable, ShardGroup, Unsplit, build_group, unique_names
from partitioner.capture.shardable_rules import Blocked, Split, State, carry
from runtime.tensor_parallel_spec import ShardedParam

__all__ = ["Collective", "Dense", "ShardGroup", "Shardable", "Unsplit", "dense_ops", "find_shardable"]

Layout = Literal["linear", "conv1d", "embedding"]


@dataclass(frozen=True)
class Dense:
    """A layer with a weight matrix: its node, layout, parameters and feature counts."""

    node: torch.fx.Node
    layout: Layout
    weight: str
    bias: str | None
    inputs: int  # input features (embedding: vocabulary rows)
    outputs: int  # output features (embedding: its width)
    x: torch.fx.Node | None  # the activation it multiplies (embedding: the indices)

    def params(self, style: str) -> tuple[ShardedParam, ...]:
        """Its parameters split `style`: colwise or a head (output features), rowwise (input features), vocab."""
        out_dim = 1 if self.layout == "conv1d" else 0
        if style == "rowwise":
            found = [ShardedParam(self.weight, "rowwise", 1 - out_dim)]
            return tuple(found + ([ShardedParam(self.bias, "rowwise", None)] if self.bias else []))
        if style == "vocab":
            return (ShardedParam(self.weight, "vocab", 0),)
        found = [ShardedParam(self.weight, "colwise", out_dim)]
        return tuple(found + ([ShardedParam(self.bias, "colwise", 0)] if self.bias else []))


_LINEAR = {F.linear, torch.ops.aten.linear.default}
_ADDMM = {torch.addmm, torch.ops.aten.addmm.default}
_EMBEDDING = {F.embedding, torch.ops.aten.embedding.default}
_CONV = {F.conv1d, F.conv2d, F.conv3d, torch.ops.aten.convolution.default, torch.ops.aten.conv2d.default,
         torch.ops.aten.conv1d.default, torch.ops.aten.conv3d.default}


def _attr(node: object, gm: torch.fx.GraphModule) -> str | None:
    """The name of the parameter a get_attr node reads, or None."""
    if not isinstance(node, torch.fx.Node) or node.op != "get_attr":
        return None
    value = operator.attrgetter(str(node.target))(gm)
    return str(node.target) if isinstance(value, nn.Parameter) else None


def _node(value: object) -> torch.fx.Node | None:
    return value if isinstance(value, torch.fx.Node) else None


def dense_ops(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, Dense]:
    """Every Linear, Conv1D-style addmm and embedding of `gm` whose weight is a parameter."""
    found: dict[torch.fx.Node, Dense] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            m = gm.get_submodule(str(node.target))
            x = node.args[0] if node.args and isinstance(node.args[0], torch.fx.Node) else None
            if isinstance(m, nn.Linear):
                bias = f"{node.target}.bias" if m.bias is not None else None
                found[node] = Dense(node, "linear", f"{node.target}.weight", bias, m.in_features, m.out_features, x)
            elif isinstance(m, nn.Embedding):
                found[node] = Dense(node, "embedding", f"{node.target}.weight", None, m.num_embeddings,
                                    m.embedding_dim, x)
        elif node.op == "call_function" and node.target in _LINEAR:
            weight, bias = _attr(node.args[1], gm), node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
            if weight is not None and (bias is None or _attr(bias, gm) is not None):
                out, inp = gm.get_parameter(weight).shape
                found[node] = Dense(node, "linear", weight, _attr(bias, gm), inp, out, _node(node.args[0]))
        elif node.op == "call_function" and node.target in _ADDMM and len(node.args) == 3 and not node.kwargs:
            table, weight = _attr(node.args[0], gm), _attr(node.args[2], gm)
            if weight is not None and table is not None and gm.get_parameter(weight).dim() == 2:
                inp, out = gm.get_parameter(weight).shape
                found[node] = Dense(node, "conv1d", weight, table, inp, out, _node(node.args[1]))
        elif node.op == "call_function" and node.target in _EMBEDDING:
            rows_of, idx = (node.args[1], node.args[0]) if node.target is F.embedding else node.args[:2]
            name = _attr(rows_of, gm)
            if name is not None:
                rows, width = gm.get_parameter(name).shape
                found[node] = Dense(node, "embedding", name, None, rows, width, _node(idx))
    return found


def _readers(gm: torch.fx.GraphModule) -> dict[str, set[torch.fx.Node]]:
    """Parameter name -> the compute nodes that read it (get_attr users, calls of its module)."""
    readers: dict[str, set[torch.fx.Node]] = {}
    for node in gm.graph.nodes:
        name = _attr(node, gm)
        if name is not None:
            readers.setdefault(name, set()).update(node.users)
        if node.op == "call_module":
            for attr, _ in gm.get_submodule(str(node.target)).named_parameters(recurse=False):
                readers.setdefault(f"{node.target}.{attr}", set()).add(node)
    return readers


class _Groups:
    """Union-find over the groups one propagation starts."""

    def __init__(self) -> None:
        self.parent: list[int] = []

    def new(self) -> int:
        self.parent.append(len(self.parent))
        return len(self.parent) - 1

    def find(self, g: int) -> int:
        while self.parent[g] != g:
            self.parent[g] = self.parent[self.parent[g]]
            g = self.parent[g]
        return g

    def join(self, a: int, b: int) -> None:
        self.parent[self.find(b)] = self.find(a)


@dataclass
class _Pass:
    """One propagation: each group's colwise seeds, rowwise ends, nodes, split sizes, fused blocks, heads."""

    groups: _Groups
    seeds: dict[int, list[torch.fx.Node]]
    rows: dict[int, list[torch.fx.Node]]
    nodes: dict[int, list[torch.fx.Node]]
    sizes: dict[int, list[int]]
    fused: dict[str, int]
    heads: dict[str, int]
    blocked: dict[int, str]


def _group_of(state: State) -> int | None:
    if isinstance(state, Split):
        return state.group
    if isinstance(state, tuple):
        return next((s.group for s in state if isinstance(s, Split)), None)
    return None


def _learned(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """The nodes whose values depend on a trainable parameter (their gradients flow back)."""
    found: set[torch.fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "get_attr" and _attr(node, gm) is not None and gm.get_parameter(str(node.target)).requires_grad:
            found.add(node)
        elif node.op == "call_module" and any(p.requires_grad for p in gm.get_submodule(str(node.target)).parameters()):
            found.add(node)
        elif any(n in found for n in node.all_input_nodes):
            found.add(node)
    return found


def _propagate(gm: torch.fx.GraphModule, shapes: dict[str, list[tuple[int, ...]]], dense: dict[torch.fx.Node, Dense],
               skip: set[torch.fx.Node]) -> _Pass:
    run = _Pass(_Groups(), {}, {}, {}, {}, {}, {}, {})
    states: dict[torch.fx.Node, State] = {}
    learned = _learned(gm)
    for node in gm.graph.nodes:
        d = dense.get(node)
        if d is not None and d.layout != "embedding" and node not in skip:
            s = states.get(d.x) if d.x is not None else None
            if isinstance(s, Split):
                if d.x is not None and s.dim != len(shapes[d.x.name][0]) - 1:
                    run.blocked.setdefault(s.group, f"{node.name} reads a value split on dim {s.dim}, not its inputs")
                run.rows.setdefault(s.group, []).append(node)
            elif shapes.get(node.name):
                seed = run.groups.new()
                states[node] = Split(seed, len(shapes[node.name][0]) - 1, node.name, node.name)
                run.seeds[seed] = [node]
                run.sizes[seed] = [d.outputs]
            continue
        try:
            carried = carry(node, gm, states, shapes, learned)
        except Blocked as why:
            for n in node.all_input_nodes:
                blocked = _group_of(states.get(n))
                if blocked is not None:
                    run.blocked.setdefault(blocked, str(why))
            continue
        states[node] = carried.state
        g = _group_of(carried.state)
        for other in carried.joins:
            run.groups.join(carried.joins[0], other)
        if g is not None:
            run.nodes.setdefault(g, []).append(node)
            run.sizes.setdefault(g, []).extend(carried.sizes)
        if carried.fused is not None:
            linear, blocks = carried.fused
            if run.fused.setdefault(linear, blocks) != blocks and g is not None:
                run.blocked.setdefault(g, f"{linear}'s output is split into {blocks} and {run.fused[linear]} parts")
        if carried.heads is not None:
            run.heads.setdefault(*carried.heads)
    return run


def _merged(run: _Pass) -> dict[int, dict[str, list[torch.fx.Node]]]:
    """The groups of a pass after their unions: root -> seeds, rows, nodes."""
    merged: dict[int, dict[str, list[torch.fx.Node]]] = {}
    for table, key in ((run.seeds, "seeds"), (run.rows, "rows"), (run.nodes, "nodes")):
        for g, nodes in table.items():
            merged.setdefault(run.groups.find(g), {"seeds": [], "rows": [], "nodes": []})[key].extend(nodes)
    return merged


def find_shardable(gm: torch.fx.GraphModule, graph: nx.DiGraph) -> Shardable:
    """The groups of `gm` (traced, fx or export path) that split across a tensor-parallel group.

    `graph` is partitioner.capture.graph.build_graph(gm, inputs): its shapes, bytes and FLOPs.
    See [Note: finding shardable groups].
    """
    shapes = {n: list(graph.nodes[n].get("shapes", [])) for n in graph.nodes}
    dense = dense_ops(gm)
    readers = _readers(gm)
    found = Shardable()
    reasons: dict[torch.fx.Node, str] = {}

    def shared(d: Dense, allowed: set[torch.fx.Node]) -> str | None:
        for name in filter(None, (d.weight, d.bias)):
            others = sorted(n.name for n in readers.get(name, set()) - allowed)
            if others:
                return f"its weight {name} is also read by {', '.join(others[:3])}"
        return None

    taken: set[torch.fx.Node] = set()  # not tried as colwise seeds
    grouped: set[torch.fx.Node] = set()  # in a group found
    for d in dense.values():  # vocabulary-parallel embeddings, with the LM heads tied to them
        if d.layout != "embedding" or d.node in taken:
            continue
        tied = sorted((dense[n] for n in readers.get(d.weight, set()) if n in dense and n is not d.node),
                      key=lambda t: t.node.name)
        why = shared(d, {d.node} | {t.node for t in tied})
        if why is None and any(t.layout == "embedding" or t.bias for t in tied):
            why = "its table is also read by another embedding or by a head with a bias"
        taken.add(d.node)
        if why is not None:
            reasons[d.node] = why
            continue
        taken.update(t.node for t in tied)
        heads = [t.node for t in tied]
        grouped.update([d.node, *heads])
        found.groups.append(build_group(
            graph, gm, "vocab" if tied else "embedding", [d.node, *heads], [t.x for t in tied if t.x is not None],
            [d.node], heads, d.params("vocab"), [d.inputs], {"vocab": d.inputs}))

    skip = set(taken) | {n for n, d in dense.items() if shared(d, {n}) is not None}
    while True:  # pairs; the seeds of failed groups run whole next time (so a later Linear may start one)
        run = _propagate(gm, shapes, dense, skip)
        merged = _merged(run)
        failed: dict[int, str] = {}
        for root, parts in merged.items():
            blocked = [run.blocked[g] for g in run.blocked if run.groups.find(g) == root]
            if blocked or not parts["rows"]:
                failed[root] = blocked[0] if blocked else "no Linear reads its split output"
        new = {s: failed[root] for root in failed for s in merged[root]["seeds"]}
        if not new:
            break
        for seed, why in new.items():
            reasons.setdefault(seed, why)
        skip |= set(new)
    for root, parts in merged.items():
        seeds, rows = parts["seeds"], parts["rows"]
        if not seeds:
            continue
        params = [p for s in seeds for p in _fused(dense[s].params("colwise"), run.fused.get(s.name, 1))]
        params += [p for r in rows for p in dense[r].params("rowwise")]
        sizes = [size for g, table in run.sizes.items() if run.groups.find(g) == root for size in table]
        counts = [run.heads[s.name] for s in seeds if s.name in run.heads]
        named = {"features": math.gcd(*[dense[s].outputs // run.fused.get(s.name, 1) for s in seeds])}
        if counts:
            named.update(heads=max(counts), kv_heads=min(counts))
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        nodes = sorted(set(seeds + rows + parts["nodes"]), key=order.__getitem__)
        inputs = list(dict.fromkeys(x for x in (dense[s].x for s in seeds) if x is not None))
        found.groups.append(build_group(graph, gm, "attention" if counts else "mlp", nodes, inputs, rows, [],
                                        params, sizes, named))
        grouped.update(seeds + rows)
    last = _last_dense(gm, dense)
    for n, d in dense.items():
        if n in grouped:
            continue
        why = reasons.get(n) or shared(d, {n})
        if d.layout != "embedding" and n in last and shared(d, {n}) is None:
            kind_size = "vocab" if _is_vocab(d, dense) else "features"
            found.groups.append(build_group(graph, gm, "head", [n], [d.x] if d.x is not None else [], [], [n],
                                            d.params("colwise"), [d.outputs], {kind_size: d.outputs}))
            continue
        found.unsplit.append(Unsplit((n.name,), tuple(filter(None, (d.weight, d.bias))), why or (
            "a Linear whose output is read whole (by ops that need it whole) before any Linear could take it split")))
    for node in gm.graph.nodes:
        if (node.op == "call_module" and isinstance(gm.get_submodule(str(node.target)), nn.modules.conv._ConvNd)) or (
                node.op == "call_function" and node.target in _CONV):
            found.unsplit.append(Unsplit((node.name,), (), "a convolution: kept data-parallel (splitting its "
                                         "channels is not implemented)"))
    order = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    found.groups = unique_names(sorted(found.groups, key=lambda g: order[g.nodes[0]]))
    found.unsplit.sort(key=lambda u: order[u.nodes[0]])
    return found


def _fused(params: tuple[ShardedParam, ...], blocks: int) -> tuple[ShardedParam, ...]:
    return tuple(ShardedParam(p.name, p.style, p.dim, blocks) for p in params) if blocks > 1 else params


def _last_dense(gm: torch.fx.GraphModule, dense: dict[torch.fx.Node, Dense]) -> set[torch.fx.Node]:
    """Dense layers with no dense layer after them on any path (LM heads, classifiers)."""
    after: dict[torch.fx.Node, bool] = {}
    for node in reversed(list(gm.graph.nodes)):
        after[node] = any(u in dense or after.get(u, False) for u in node.users)
    return {n for n in dense if not after[n]}


def _is_vocab(d: Dense, dense: dict[torch.fx.Node, Dense]) -> bool:
    return any(e.layout == "embedding" and e.inputs == d.outputs for e in dense.values())
