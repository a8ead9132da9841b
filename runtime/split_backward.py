"""Split backward: B computes a stage's input gradients now, W its weight gradients later.

Zero-bubble schedules (runtime.schedule: zb1, zbv) run a stage's backward in two ops. B
sends the previous stage what it waits for as soon as possible; W, which nobody waits for,
fills a bubble later. W must not redo B's work, so B records where the two parts meet.

[Note: where input and weight gradients meet]
Walk the autograd graph from the stage's roots (outputs with their gradients, or the loss):

    roots ─► ... ─► I ─► ... ─► input leaves      B-side: nodes with a path to an input (B runs them)
                    │
                    └─► T ─► weight leaves        W-side: the other nodes with a path to a weight
                         (a matmul node I computes the input's and the weight's gradient; T = transpose)

B runs `torch.autograd.grad` to the inputs (engine work on B-side nodes only, weight outputs
skipped) with the graph retained, and a pre-hook on each B-side node I with an edge into the
W-side captures the gradient flowing into I. W re-runs only those nodes from their captured
gradients, to the weights (`torch.autograd.backward(..., inputs=weights)`, so gradients
accumulate into `.grad` exactly as an ordinary backward's AccumulateGrad would, tied weights
summed). A root that lies on the W-side (it reaches no input) seeds W with its own gradient.

W runs once per group of W-side nodes connected to each other, so one group's call never
walks down another group's B-side path. Inside a group a B-side path may lead from one
captured node to another (a weight used twice in one stage); a pre-hook then pins every
captured node to its captured gradient, so nothing is counted twice (that path is
recomputed, the only repeated work).

"Weights" are every leaf the graph accumulates into apart from the inputs: parameters, and
caller tensors that require grad. A stage with no input needing gradients (the first stage)
has an empty B: its W runs the whole backward, since nobody waits for it. A weight the graph
never reaches keeps `.grad` as it was, as with an ordinary backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Collection, Sequence

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

__all__ = ["WeightWork", "backward_input", "backward_weight"]


@dataclass
class _Group:
    """The W-side nodes connected to each other: what one W call needs."""

    captured: list[Node] = field(default_factory=list)  # B-side nodes feeding the W-side
    seeds: list[tuple[GradientEdge, torch.Tensor]] = field(default_factory=list)  # W-side roots and their gradients
    weights: list[torch.Tensor] = field(default_factory=list)


@dataclass
class WeightWork:
    """What W needs of one stage's micro-batch: the groups and the gradients B captured."""

    groups: list[_Group] = field(default_factory=list)
    grads: dict[Node, tuple[torch.Tensor | None, ...]] = field(default_factory=dict)
    owners: list[GradientEdge] = field(default_factory=list)  # keep Python-defined nodes' graph alive


def backward_input(
    roots: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None], inputs: Sequence[torch.Tensor]
) -> WeightWork:
    """The input-gradient part of `torch.autograd.backward(roots, grads)`.

    Accumulates into each input's `.grad` what an ordinary backward would, touches no other
    leaf, and returns the rest of the work for `backward_weight` (see [Note: where input and
    weight gradients meet]). A `None` gradient stands for ones (a scalar loss).

    Raises:
        ValueError: an input that is not a leaf tensor.
        RuntimeError: a `None` gradient for a root with more than one element.
    """
    wanted = [x for x in inputs if x.requires_grad]
    if any(not x.is_leaf for x in wanted):
        raise ValueError("backward_input needs the stage's inputs as leaf tensors (x.detach().requires_grad_()), "
                         "so that gradients stop there")
    seeds = [(r, get_gradient_edge(r), _implicit(r, g)) for r, g in zip(roots, grads) if r.requires_grad]
    parents = _parents([edge.node for _, edge, _ in seeds])
    input_nodes = {get_gradient_edge(x).node for x in wanted}
    b_side = _ancestors(input_nodes, parents)
    weight_nodes = [n for n in parents if n not in input_nodes and _leaf_of(n) is not None]
    w_side = _ancestors(weight_nodes, parents, stop=b_side | input_nodes) | set(weight_nodes)

    work = WeightWork()
    group_of: dict[Node, _Group] = {}
    for members, captured in _connect(w_side, b_side, parents):
        group = _Group(captured, weights=[t for n in weight_nodes if n in members and (t := _leaf_of(n)) is not None])
        work.groups.append(group)
        group_of.update(dict.fromkeys(members, group))
    for _, edge, g in seeds:
        if edge.node in group_of:  # a root on the W-side: W starts there with its own gradient
            group_of[edge.node].seeds.append((edge, g))
    held = [n for group in work.groups for n in group.captured + [edge.node for edge, _ in group.seeds]]
    if any(isinstance(n, torch._C._FunctionBase) for n in held):  # see get_gradient_edge: Python nodes need an owner
        work.owners = [edge for _, edge, _ in seeds]

    b_pairs = [(r, g) for r, edge, g in seeds if edge.node in b_side or edge.node in input_nodes]
    if not wanted or not b_pairs:
        return work
    handles = [n.register_prehook(_capture(work.grads, n)) for group in work.groups for n in group.captured]
    try:  # retained: W runs the captured nodes again
        found = torch.autograd.grad([r for r, _ in b_pairs], wanted, [g for _, g in b_pairs],
                                    retain_graph=any(group.captured for group in work.groups), allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    for x, g in zip(wanted, found):
        if g is not None:
            x.grad = _like(x, g) if x.grad is None else x.grad + g
    return work


def backward_weight(work: WeightWork) -> None:
    """The weight-gradient part: accumulate into every weight's `.grad` what B left to do."""
    for group in work.groups:
        edges = [e for e, _ in group.seeds]
        values = [g for _, g in group.seeds]
        for node in group.captured:
            for k, g in enumerate(work.grads.get(node, ())):
                if g is not None:
                    edges.append(GradientEdge(node, k))
                    values.append(g)
        if not edges or not group.weights:
            continue
        pins = [n.register_prehook(_pin(work.grads[n])) for n in group.captured if n in work.grads]
        try:
            torch.autograd.backward(edges, values, inputs=group.weights, retain_graph=True)
        finally:
            for h in pins:
                h.remove()
    work.groups.clear()
    work.grads.clear()
    work.owners.clear()


def _implicit(root: torch.Tensor, grad: torch.Tensor | None) -> torch.Tensor:
    if grad is not None:
        return grad
    if root.numel() != 1:
        raise RuntimeError(f"a root of shape {tuple(root.shape)} has no gradient; only a one-element root "
                           "(a loss) may pass None")
    return torch.ones_like(root)


def _like(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """`g` laid out as `x` (dense, x's strides), as AccumulateGrad stores a first gradient (an expanded one too)."""
    if g.stride() == x.stride() or not g.layout == x.layout == torch.strided:
        return g
    return torch.empty_strided(x.shape, x.stride(), dtype=g.dtype, device=g.device).copy_(g)


def _leaf_of(node: Node) -> torch.Tensor | None:
    """The tensor an AccumulateGrad node accumulates into, or None for other nodes."""
    variable = getattr(node, "variable", None)
    return variable if isinstance(variable, torch.Tensor) else None


def _parents(roots: Sequence[Node]) -> dict[Node, list[Node]]:
    """Every node reachable from `roots`, with the nodes that have an edge to it."""
    parents: dict[Node, list[Node]] = {n: [] for n in roots}
    stack = list(parents)
    while stack:
        node = stack.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child not in parents:
                parents[child] = []
                stack.append(child)
            parents[child].append(node)
    return parents


def _ancestors(nodes: Collection[Node], parents: dict[Node, list[Node]], stop: Collection[Node] = ()) -> set[Node]:
    """Nodes with a path to one of `nodes` (not counting themselves), not walking through `stop`."""
    found: set[Node] = set()
    stack = list(nodes)
    while stack:
        for parent in parents.get(stack.pop(), ()):
            if parent not in found and parent not in stop:
                found.add(parent)
                stack.append(parent)
    return found


def _connect(
    w_side: set[Node], b_side: set[Node], parents: dict[Node, list[Node]]
) -> list[tuple[set[Node], list[Node]]]:
    """Split the W-side into groups of connected nodes, each with the B-side nodes feeding it (graph order)."""
    order = [n for n in parents if n in w_side]
    root_of: dict[Node, Node] = {n: n for n in order}

    def find(n: Node) -> Node:
        while root_of[n] is not n:
            root_of[n] = root_of[root_of[n]]
            n = root_of[n]
        return n

    feeds: dict[Node, list[Node]] = {}  # B-side node -> the W-side nodes it has edges to
    for node in order:
        for parent in parents[node]:
            if parent in w_side:
                root_of[find(parent)] = find(node)
            elif parent in b_side:
                feeds.setdefault(parent, []).append(node)
    for targets in feeds.values():
        for other in targets[1:]:
            root_of[find(other)] = find(targets[0])
    members: dict[Node, set[Node]] = {}
    for node in order:
        members.setdefault(find(node), set()).add(node)
    captured: dict[Node, list[Node]] = {}
    for node in parents:
        if node in feeds:
            captured.setdefault(find(feeds[node][0]), []).append(node)
    return [(nodes, captured.get(key, [])) for key, nodes in members.items()]


Hook = Callable[[tuple[torch.Tensor | None, ...]], tuple[torch.Tensor | None, ...] | None]


def _capture(store: dict[Node, tuple[torch.Tensor | None, ...]], node: Node) -> Hook:
    def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        store[node] = tuple(grad_outputs)

    return hook


def _pin(saved: tuple[torch.Tensor | None, ...]) -> Hook:
    def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> tuple[torch.Tensor | None, ...]:
        return saved

    return hook
