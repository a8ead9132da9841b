"""In-place operations as dependencies: later readers of a mutated tensor read it after the mutation.

A traced graph only has data edges. `h.mul_(2)` whose result is unused leaves no edge to the
nodes that read `h` afterwards, so a planner may put a reader in a stage that runs before
(or beside) the mutation, or receives an unmutated copy. `order_mutations` makes every later
use of the written tensor read the in-place op's result (the same tensor), and every later
use of a tensor written through a view read `after(x, op)`, which returns `x` once `op` ran:
edges the planner and both runtimes respect, across stages, ranks and threads. `check_cuts`
refuses a plan that would let a stage read `x` from a copy the write never reached.

    x ─► mul_(x, 2)               x ─► mul_(x, 2) ─► reader     (mul_ returns the x it wrote)
    x ─────────────► reader   =>
    v = x[0]; v.add_(1); x ─► r   =>  after(x, add_) ─► r    (a view written: x, read after the write)

`mutated_inputs` names the placeholders the graph writes into; `inputs_written_with_grad` those
it writes outside its own `no_grad` regions; `input_aliases` the values that are inputs written in place.

A stage writes into its own copies of the inputs it writes into (`own_copies`): a stage that read
the value before the write (in graph order) may run beside or after it on another thread, and
nothing orders them (they share no edge); with a copy it reads the value as it was, as the
plain model reads it before the write. Later readers read the write's result (the edges above),
and the caller's tensors get what was written (runtime.steps.write_back).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree

__all__ = ["after", "check_cuts", "check_reads_first", "input_aliases", "inputs_written_with_grad", "mutated_inputs",
           "order_mutations", "own_copies"]

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


# Graph calls that switch grad mode (runtime.stage.set_grad_mode, torch's own).
_GRAD_SWITCHES = {"set_grad_mode", "_set_grad_enabled", "set_grad_enabled"}


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
        for value in dict.fromkeys([target, _base(target)]):
            later = [
                u for u in value.users if u is not n and position.get(u, -1) > position[n] and u.target is not after
            ]
            if not later:
                continue
            if value is target and n.target is not operator.setitem:
                ordered = n  # an in-place op returns the tensor it wrote: later readers take it from there
            else:  # written through a view (or by setitem): read the same tensor once the write is done
                with gm.graph.inserting_after(n):
                    ordered = gm.graph.call_function(after, (value, n))
                position[ordered] = position[n]
            for u in later:
                u.replace_input_with(value, ordered)
    if found:
        gm.graph.lint()
        gm.recompile()
    return found


def inputs_written_with_grad(gm: torch.fx.GraphModule) -> list[str]:
    """Placeholders (by name) the graph writes into, directly or through a view, outside its own
    `no_grad` regions: where autograd refuses a leaf that requires grad."""
    names: list[str] = []
    grad = True
    for n in gm.graph.nodes:
        if n.op == "call_function" and _name(n.target) in _GRAD_SWITCHES and n.args:
            grad = n.args[0] is not False  # False: a no_grad region; True or the caller's mode: back on
            continue
        target = mutated_arg(n, gm) if grad else None
        if target is not None:
            base = _base(target)
            if base.op == "placeholder" and base.name not in names:
                names.append(base.name)
    return names


def input_aliases(graphs: list[torch.fx.GraphModule], inputs: list[str]) -> dict[str, str]:
    """{value name: input name} for the values of `graphs` (stages, in order) that are a pipeline input
    after an in-place write into it (`x.add_(1)` returns x): a later stage writing into one writes into the input."""
    aliases = {name: name for name in inputs}
    for gm in graphs:
        for n in gm.graph.nodes:
            target = n.args[0] if n.target is after else mutated_arg(n, gm)  # after(x, write) is x too
            base = _base(target) if isinstance(target, torch.fx.Node) else None
            if base is not None and base.name in aliases:
                aliases[n.name] = aliases[base.name]
    return aliases


def own_copies(names: list[str], values: list[Any], writes: list[str]) -> list[Any]:
    """A stage's input `values` (by `names`) with each tensor of those it writes into (`writes`) cloned."""
    return [pytree.tree_map(_clone, v) if n in writes else v for n, v in zip(names, values)]


def _clone(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value


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


def check_cuts(gm: torch.fx.GraphModule, stage_of: dict[str, int]) -> None:
    """Raise ValueError where a cut would lose a write through a view (aliasing does not cross stages), or
    where a plan runs a read after the in-place write that forward runs after it (`check_reads_first`).

    For `after(x, write)` (x written through a view), the view must be made in the writing
    stage, and x must be read there or come from a stage that does the write itself.
    """
    check_reads_first(gm, stage_of)
    for node in gm.graph.nodes:
        if node.target is not after or node.name not in stage_of:
            continue
        value, *writes = node.args
        if not isinstance(value, torch.fx.Node):
            continue
        producer = stage_of.get(value.name, -1)
        for write in writes:
            if not isinstance(write, torch.fx.Node) or write.name not in stage_of:
                continue
            where = stage_of[write.name]
            view = mutated_arg(write, gm)
            chain = []
            while view is not None and view is not value and view.op != "placeholder":
                chain.append(view)
                view = view.args[0] if view.args and isinstance(view.args[0], torch.fx.Node) else None
            apart = [v.name for v in chain if stage_of.get(v.name, where) != where]
            if apart or (producer != where and stage_of[node.name] != where):
                raise ValueError(
                    f"{write.name} (stage {where}) writes into {value.name} through a view"
                    + (f" made in another stage ({', '.join(apart)})" if apart else "")
                    + f", but stage {stage_of[node.name]} would read {value.name} from a copy made before that write; "
                    f"keep {value.name}'s views, the write and its later readers in one stage "
                    "(a plan with other cuts), "
                    "or write into the tensor itself rather than a view"
                )


def check_reads_first(gm: torch.fx.GraphModule, stage_of: dict[str, int]) -> None:
    """Raise ValueError where the plan (`stage_of`, node -> stage in the plan's order: Plan.stage_of) runs a
    read of a tensor after an in-place write that forward runs after the read.

    Nothing in the graph orders such a read before the write (no edge joins them), so a hand-made plan may
    list it after; it would read the written tensor. It may sit in a later stage only where the writing stage
    writes into its own copy (runtime.mutation.own_copies): the tensor comes from another stage, not the
    caller's input or the model's buffer.
    """
    order = {name: k for k, name in enumerate(stage_of)}
    position = {n: k for k, n in enumerate(gm.graph.nodes)}
    for write in gm.graph.nodes:
        target = mutated_arg(write, gm)
        if target is None or write.name not in order:
            continue
        for value in dict.fromkeys([target, _base(target)]):
            copied = value.op not in ("placeholder", "get_attr") and stage_of.get(value.name) != stage_of[write.name]
            for read in value.users:
                if read is write or position[read] > position[write] or read.name not in order:
                    continue
                later = stage_of[read.name] > stage_of[write.name]
                if order[read.name] > order[write.name] and not (later and copied):
                    raise ValueError(
                        f"{read.name} (stage {stage_of[read.name]}) reads {value.name} before {write.name} (stage "
                        f"{stage_of[write.name]}) writes into it in place, as forward runs them, but the plan runs "
                        f"{read.name} after the write and would read the written tensor; list {read.name} before "
                        f"{write.name} (in its stage or an earlier one)")
