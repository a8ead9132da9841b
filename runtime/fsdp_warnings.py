"""FSDP2's warning that a unit returned a view: hidden where the stage cannot do what it warns of, explained once.

[Note: FSDP2's view warning] FSDP2 hooks every tensor a unit returns, to gather the unit's weights
again for its backward (zero3) and to follow its backward, and warns "FSDP2-wrapped module (...)
returned a view tensor" on each forward where one is a view (an nn.Linear on a 3-D input returns
one), because an in-place operation on that view would drop the hook (torch moves a view written in
place onto a new autograd node): its backward would then run on freed or stale weights. Whether
that can happen is a fact of the stage's graph: it does only where the graph writes in place into a
unit's output, or into a view or part of it. The runtime itself writes into no stage value (sends
read them, micro-batches are merged by copying, a stage writing into its input writes into its own
copy: runtime.mutation). So `explain_view_warning` checks the graph when a stage is sharded: where
nothing writes into a unit's output the warning is about nothing here, and is filtered (process-wide:
worker threads run stages, and warning filters are not per thread) with one line saying why; where
something does, the filter is taken out again and the nodes are named in a warning of our own.
"""

from __future__ import annotations

import logging
import operator
import warnings
from typing import Any, Sequence, cast

import torch
import torch.fx
from torch import nn

from runtime.mutation import mutated_arg, mutated_inputs

__all__ = ["VIEW_WARNING", "explain_view_warning", "unit_outputs_written"]

log = logging.getLogger(__name__)

VIEW_WARNING = r"FSDP2-wrapped module \(.*\) returned a view tensor"  # torch 2.13's FSDPState warning
_VIEWS = {"view", "view_as", "reshape", "reshape_as", "transpose", "permute", "t", "unsqueeze", "squeeze", "expand",
          "expand_as", "narrow", "select", "flatten", "unflatten", "unbind", "split", "chunk", "as_strided",
          "diagonal", "movedim", "swapaxes", "contiguous", "getitem", "alias"}  # and aten ops whose result aliases
_explained = False


def _owner(node: torch.fx.Node) -> torch.fx.Node:
    """The node whose tensor (or tuple of tensors) `node` is a view or part of."""
    while node.op in ("call_method", "call_function") and node.args and isinstance(node.args[0], torch.fx.Node):
        target = node.target
        name = str(target) if node.op == "call_method" else getattr(target, "__name__", str(target))
        aliases = isinstance(target, torch._ops.OpOverload) and any(
            r.alias_info is not None and not r.alias_info.is_write for r in target._schema.returns)
        if not (aliases or target is operator.getitem or name.split(".")[0] in _VIEWS):
            break
        node = node.args[0]
    return node


def unit_outputs_written(graph_module: torch.fx.GraphModule, units: Sequence[nn.Module]) -> list[str]:
    """The nodes of `graph_module` that write in place into what a unit call returned (or a view or part of it),
    directly or inside a submodule that writes into its input."""
    ids = {id(u) for u in units}
    calls = {n for n in graph_module.graph.nodes
             if n.op == "call_module" and id(graph_module.get_submodule(str(n.target))) in ids}
    found = []
    for node in graph_module.graph.nodes:
        written = [mutated_arg(node, graph_module)]
        if node.op == "call_module":
            module = graph_module.get_submodule(str(node.target))
            if isinstance(module, torch.fx.GraphModule):  # a segment writing into one of its inputs
                names = [p.name for p in module.graph.nodes if p.op == "placeholder"]
                written += [a for a, name in zip(node.args, names) if name in mutated_inputs(module)]
        if any(isinstance(w, torch.fx.Node) and _owner(w) in calls for w in written):
            found.append(node.name)
    return found


def explain_view_warning(graphs: Sequence[nn.Module], units: Sequence[nn.Module]) -> None:
    """Filter FSDP2's view warning where no graph of the stage writes into a unit's output (said once, at INFO);
    where one does, keep it and name the nodes. See [Note: FSDP2's view warning]."""
    global _explained
    written = [name for g in graphs if isinstance(g, torch.fx.GraphModule) for name in unit_outputs_written(g, units)]
    if written:
        filters = cast(list[Any], warnings.filters)  # the filter an earlier stage added would hide a true warning
        filters[:] = [f for f in filters if not (f[0] == "ignore" and getattr(f[1], "pattern", None) == VIEW_WARNING)]
        warnings.warn(f"the sharded stage writes in place into the output of an FSDP2 unit ({', '.join(written)}): "
                      "if that output is a view, FSDP2 drops the hook that gathers the unit's weights for its "
                      "backward. Write out of place in the model (h = h + x, not h += x)", stacklevel=3)
        return
    warnings.filterwarnings("ignore", message=VIEW_WARNING, category=UserWarning)
    if not _explained:
        _explained = True
        log.info("FSDP2's warning that a unit 'returned a view tensor' is not shown: it warns that an in-place "
                 "operation on that view would skip the unit's gather for backward, and no sharded stage here writes "
                 "into a unit's output (see [Note: FSDP2's view warning] in runtime/fsdp_warnings.py)")
