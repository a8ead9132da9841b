"""Modules the graph keeps whole: each call of a stack of experts becomes one node, so no cut splits it.

[Note: a stack of experts is one node] torch.export inlines a mixture-of-experts block (Mixtral,
Qwen3-MoE, GPT-OSS) into some thirty nodes: routing, a sort of the tokens by expert, grouped matmuls
over the experts' weights, the weighted sum. A cut among them would send the sorted tokens and
their per-expert offsets between stages and split one layer's weights over two devices, and an
expert-parallel axis needs the experts as one unit. So the nodes of each call of such a module are
moved into a nested graph, called by one `run_whole` node (weights stay get_attr nodes of the
outer graph, passed in, so each stays the model's own tensor, placed and materialized as any
other). The planner sees one node with the region's FLOPs and bytes, the stage builder gives the
nested graph its stage's device as it does export's own nested graphs, and autograd runs through
it as through the inlined nodes: the values and gradients are the same.

A stack of experts is a module holding, itself, two or more parameters of 3 dimensions or more
with the same leading size (the number of experts): `gate_up_proj` (E, 2I, H) and `down_proj`
(E, H, I). A call whose nodes cannot move together (a node outside it both reads from it and
feeds it) is left inlined.
"""

from __future__ import annotations

import logging
import operator
from typing import Any

import torch
import torch.fx
from torch import nn

from partitioner.capture.graph import owning_module

__all__ = ["expert_stacks", "keep_experts_whole", "run_whole"]

log = logging.getLogger(__name__)

_CALLS = ("call_function", "call_method", "call_module")
_CHECK = torch.ops.aten._assert_tensor_metadata.default


def run_whole(region: torch.fx.GraphModule, *inputs: Any) -> Any:
    """Run a module's call kept whole (see [Note: a stack of experts is one node])."""
    return region(*inputs)


def expert_stacks(model: nn.Module) -> list[str]:
    """Paths of the modules holding a stack of experts (two or more own parameters of 3+ dims, one leading size)."""
    found = []
    for path, module in model.named_modules():
        leading = [p.shape[0] for p in module.parameters(recurse=False) if p.dim() >= 3]
        if len(leading) >= 2 and len(set(leading)) == 1 and leading[0] >= 2:
            found.append(path)
    return found


def _inside(node: torch.fx.Node, path: str) -> bool:
    """A tensor op of the module at `path` (size arithmetic stays outside: export shares it between modules)."""
    owner = owning_module(node)
    size = isinstance(node.meta.get("val"), (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool))
    return node.op in _CALLS and not size and (owner == path or owner.startswith(path + "."))


def _movable(gm: torch.fx.GraphModule, region: list[torch.fx.Node]) -> bool:
    """Whether no node outside `region` lies between two of its nodes on a path (reads from it, then feeds it)."""
    members = set(region)
    first = region[0]
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    reached: set[torch.fx.Node] = set()  # outside nodes downstream of the region
    for node in gm.graph.nodes:
        if order[node] < order[first]:
            continue
        if node in members:
            if any(p in reached for p in node.all_input_nodes):
                return False
        elif any(p in members or p in reached for p in node.all_input_nodes):
            reached.add(node)
    return True


def _hoist_feeders(gm: torch.fx.GraphModule, region: list[torch.fx.Node]) -> None:
    """Outside nodes placed among the region's that feed it, moved (in order) before its first node."""
    members = set(region)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    start = order[region[0]]
    feeders: set[torch.fx.Node] = set()
    todo = [p for n in region for p in n.all_input_nodes]
    while todo:
        n = todo.pop()
        if n in members or n in feeders or order[n] < start:
            continue
        feeders.add(n)
        todo.extend(n.all_input_nodes)
    for n in sorted(feeders, key=order.__getitem__):
        region[0].prepend(n)


def _collapse(gm: torch.fx.GraphModule, path: str, region: list[torch.fx.Node], index: int) -> None:
    """Move `region`'s nodes into a nested graph called by one node placed where the region began."""
    members = set(region)
    _hoist_feeders(gm, region)
    inputs: list[torch.fx.Node] = []
    for node in region:
        for p in node.all_input_nodes:
            if p not in members and p not in inputs:
                inputs.append(p)
    outputs = [n for n in region if any(u not in members for u in n.users)]
    inner = torch.fx.Graph()
    env = {p: inner.placeholder(p.name) for p in inputs}
    for node in region:
        env[node] = inner.node_copy(node, lambda n: env[n])
    inner.output(tuple(env[n] for n in outputs))
    for node in list(inner.nodes):
        if node.target is _CHECK and not node.users:  # as the stage builder drops them (see capture.export)
            inner.erase_node(node)
    nested = torch.fx.GraphModule(gm, inner, f"whole_{index}")
    name = f"whole_{index}"
    gm.add_submodule(name, nested)
    kept = {}
    for key, (owner, kind) in region[0].meta.get("nn_module_stack", {}).items():
        kept[key] = (owner, kind)
        if owner == path:
            break
    with gm.graph.inserting_before(region[0]):
        attr = gm.graph.get_attr(name)
        call = gm.graph.call_function(run_whole, (attr, *inputs))
        call.meta["nn_module_stack"] = kept
        call.meta["whole"] = path
        pieces = []
        for k, out in enumerate(outputs):
            piece = gm.graph.call_function(operator.getitem, (call, k))
            piece.meta = {**out.meta, "nn_module_stack": kept}
            pieces.append(piece)
    for out, piece in zip(outputs, pieces):
        out.replace_all_uses_with(piece)
    for node in reversed(region):
        gm.graph.erase_node(node)


def keep_experts_whole(gm: torch.fx.GraphModule, model: nn.Module) -> list[str]:
    """Collapse every call of `model`'s stacks of experts in `gm` (exported from it) into one node; return
    the module paths kept whole (see [Note: a stack of experts is one node])."""
    kept: list[str] = []
    for path in expert_stacks(model):
        region = [n for n in gm.graph.nodes if _inside(n, path)]
        if not region:
            continue
        if not _movable(gm, region):
            log.info("%s: its nodes interleave with others that depend on them, so they stay inlined (a cut may "
                     "fall among them)", path)
            continue
        _collapse(gm, path, region, len(kept))
        kept.append(path)
    if kept:
        gm.graph.lint()
        gm.recompile()
        log.info("kept whole, one node each (a cut never splits them): %s", ", ".join(kept))
    return kept
