"""Recomputation in segments: one checkpoint per repeated block of a stage, not one for the whole stage.

A checkpointed region recomputes all of its forward at the first saved tensor its backward needs
(torch.utils.checkpoint), so while one micro-batch's backward runs, a stage checkpointed whole
holds everything "none" would keep for it: with 1F1B's last stage (one micro-batch in flight)
recomputation saves nothing at the peak. Cut into segments, the backward of segment j holds
the values crossing between segments (kept) plus segment j's own recomputation only.

Which nodes form a segment is [Note: recomputation segments] in rules/segments.py, the one rule
this module cuts by and cost_model/recompute_cost.py prices.

A stage is not cut when it writes in place anywhere (a later segment could write into a value an
earlier one recomputes from) or has only one segment: it is checkpointed whole, as before.
"""

from __future__ import annotations

import operator

import torch
import torch.fx
from torch import nn
from torch.fx.passes.split_module import split_module

from rules.segments import segment_key, segments
from runtime.mutation import mutated_arg

__all__ = ["segment_key", "segment_of", "split_segments"]


def _path(node: torch.fx.Node) -> str:
    """The dotted path of the module whose forward made `node` (torch.fx records nn_module_stack)."""
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack")
    if stack:
        path = str(list(stack.values())[-1][0])
        return "" if path.startswith("_empty") else path
    return ""


def segment_of(gm: torch.fx.GraphModule) -> dict[str, int]:
    """Each call node's segment index (0, 1, ...), in graph order, by [Note: recomputation segments]."""
    calls = ("call_function", "call_method", "call_module")
    return segments((node.name, _path(node)) for node in gm.graph.nodes if node.op in calls)


def split_segments(gm: torch.fx.GraphModule) -> torch.fx.GraphModule | None:
    """`gm` as a GraphModule calling one submodule per segment (`submod_0`, ...), or None where it is
    not cut (one segment, or an in-place write; see the module docstring). Same inputs and outputs."""
    if any(mutated_arg(n, gm) is not None for n in gm.graph.nodes):
        return None
    segments = segment_of(gm)
    if len(set(segments.values())) < 2:
        return None
    root = split_module(gm, gm, lambda node: segments.get(node.name, 0), keep_original_order=True)
    _own_weights(root)
    return root


def _own_weights(root: torch.fx.GraphModule) -> None:
    """Move each weight (a tensor attribute) that one segment alone reads into that segment.

    split_module reads tensor attributes in the root and passes them to the segments as arguments (graphs from
    torch.export read every weight so), which leaves each segment's weights held by the root: FSDP2 could then
    make no segment a unit of its own (runtime.sharding), and a stage would gather all its weights at once. A
    weight two segments read (a tied embedding) stays in the root. Same computation, same tensors.
    """
    calls = {str(n.target): n for n in root.graph.nodes if n.op == "call_module"}
    for node in list(root.graph.nodes):
        if node.op != "get_attr" or not node.users:
            continue
        value = operator.attrgetter(str(node.target))(root)
        users: list[torch.fx.Node] = list(node.users)
        if not isinstance(value, torch.Tensor) or len(users) != 1 or users[0].op != "call_module" \
                or calls.get(str(users[0].target)) is not users[0] or node in users[0].kwargs.values():
            continue
        call = users[0]
        segment = root.get_submodule(str(call.target))
        if not isinstance(segment, torch.fx.GraphModule):
            continue
        placeholders = [n for n in segment.graph.nodes if n.op == "placeholder"]
        positions = [k for k, a in enumerate(call.args) if a is node]
        if len(placeholders) != len(call.args) or not positions:
            continue
        name = str(node.target)
        _attach(segment, name, value)
        first = next(n for n in segment.graph.nodes if n.op != "placeholder")
        with segment.graph.inserting_before(first):
            read = segment.graph.get_attr(name)
        for k in positions:
            placeholders[k].replace_all_uses_with(read)
            segment.graph.erase_node(placeholders[k])
        call.args = tuple(a for k, a in enumerate(call.args) if k not in positions)
        root.graph.erase_node(node)
        if not any(n.op == "get_attr" and n.target == node.target for n in root.graph.nodes):
            _detach(root, name)
        segment.recompile()
    root.recompile()


def _attach(module: nn.Module, path: str, value: torch.Tensor) -> None:
    """Hold `value` at the dotted `path` under `module` (as a parameter where it is one), making the parents."""
    *parents, last = path.split(".")
    for part in parents:
        child = module._modules.get(part)
        if child is None:
            child = nn.Module()
            module.add_module(part, child)
        module = child
    if isinstance(value, nn.Parameter):
        module.register_parameter(last, value)
    else:
        module.register_buffer(last, value)


def _detach(module: nn.Module, path: str) -> None:
    """Drop the tensor at the dotted `path` under `module`, and the parents it leaves empty."""
    *parents, last = path.split(".")
    chain = [module]
    for part in parents:
        child = chain[-1]._modules[part]
        if child is None:
            return
        chain.append(child)
    owner = chain[-1]
    owner._parameters.pop(last, None)
    owner._buffers.pop(last, None)
    for parent, part, child in reversed(list(zip(chain, parents, chain[1:]))):
        if child._parameters or child._buffers or child._modules:
            break
        del parent._modules[part]
