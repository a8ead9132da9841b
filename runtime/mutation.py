"""In-place operations as dependencies: later readers of a mutated tensor read it after the mutation.

A traced graph only has data edges. `h.mul_(2)` whose result is unused leaves no edge to the
nodes that read `h` afterwards, so a planner may put a reader in a stage that runs before
(or beside) the mutation, or receives an unmutated copy. `order_mutations` rewrites every
later use of the mutated tensor (or of the tensor a mutated view belongs to) into
`after(h, mul_)`, which returns `h` once `mul_` has run: an edge the planner and both
runtimes respect, across stages, ranks and threads.

    x ─► mul_(x, 2)               x ─► mul_(x, 2) ─┐
    x ─────────────► reader   =>  x ───────────────┴► after ─► reader

`mutated_inputs` names the placeholders the graph writes into, so micro-batches of those
inputs get their own storage (views of one batch share a version counter).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx

__all__ = ["after", "mutated_inputs", "order_mutations"]

_INPLACE_OPERATORS = {
    operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv, operator.imod,
    operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift, operator.irshift, operator.setitem,
}
# Methods and functions whose result shares the input's storage: mutating it mutates the input.
_VIEWS = {
    "view", "view_as", "reshape", "reshape_as", "transpose", "permute", "t", "unsqueeze", "squeeze", "expand",
    "expand_as", "narrow", "select", "flatten", "unflatten", "unbind", "split", "chunk", "as_strided", "detach",
    "diagonal", "movedim", "swapaxes", "T", "mT", "real", "imag", "contiguous",
}


def after(value: Any, *mutations: Any) -> Any:
    """`value`, read once `mutations` (in-place operations on it) have run."""
    return value


def _name(target: Any) -> str:
    return str(getattr(target, "__name__", target))


def mutated_arg(node: torch.fx.Node, root: torch.nn.Module | None = None) -> torch.fx.Node | None:
    """The node whose tensor `node` writes into, or None for an operation that writes nothing."""
    first = node.args[0] if node.args and isinstance(node.args[0], torch.fx.Node) else None
    if first is None:
        return None
    if node.kwargs.get("inplace") is True:
        return first
    out = node.kwargs.get("out")
    if isinstance(out, torch.fx.Node):
        return out
    if node.op == "call_method":
        name = str(node.target)
        return first if name.endswith("_") and not name.endswith("__") else None
    if node.op == "call_function":
        if node.target in _INPLACE_OPERATORS:
            return first
        if isinstance(node.target, torch._ops.OpOverload):
            mutable = [a for a in node.target._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
            return first if mutable else None
        name = _name(node.target)
        return first if name.endswith("_") and not name.endswith("__") and not name.startswith("_") else None
    if node.op == "call_module" and root is not None:
        module = root.get_submodule(str(node.target))
        return first if getattr(module, "inplace", False) is True else None
    return None


def _base(node: torch.fx.Node) -> torch.fx.Node:
    """The tensor whose storage `node` shares, following views (and getitem of a split)."""
    while True:
        name = str(node.target) if node.op == "call_method" else _name(node.target)
        if node.op in ("call_method", "call_function") and (name in _VIEWS or node.target is operator.getitem):
            first = node.args[0] if node.args else None
            if isinstance(first, torch.fx.Node):
                node = first
                continue
        return node


def order_mutations(gm: torch.fx.GraphModule) -> int:
    """Make every read of a mutated tensor after the mutation depend on it; returns how many
    in-place operations were found. Values and results are unchanged: only edges are added."""
    nodes = list(gm.graph.nodes)
    position = {n: k for k, n in enumerate(nodes)}
    found = 0
    for n in nodes:
        target = mutated_arg(n, gm)
        if target is None:
            continue
        found += 1
        aliases = {target, _base(target)}
        for value in aliases:
            later = [
                u for u in value.users if u is not n and position.get(u, -1) > position[n] and u.target is not after
            ]
            if not later:
                continue
            with gm.graph.inserting_after(n):
                ordered = gm.graph.call_function(after, (value, n))
            position[ordered] = position[n]
            for u in later:
                u.replace_input_with(value, ordered)
    if found:
        gm.graph.lint()
        gm.recompile()
    return found


def mutated_inputs(gm: torch.fx.GraphModule) -> list[str]:
    """Placeholders (by name) the graph writes into, directly or through a view."""
    names: list[str] = []
    for n in gm.graph.nodes:
        target = mutated_arg(n, gm)
        if target is not None:
            base = _base(target)
            if base.op == "placeholder" and base.name not in names:
                names.append(base.name)
    return names
