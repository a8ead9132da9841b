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

import torch
import torch.fx
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
    return split_module(gm, gm, lambda node: segments.get(node.name, 0), keep_original_order=True)
