"""Which stages read each weight, and which ranks hold each trainable weight together.

A parameter or buffer belongs to the stage of the leaf module holding it and is read by every stage using it
(a tied weight, a stage's replicas); its gradient is all-reduced over exactly the ranks of those stages.
runtime.stage moves each to its owner's device; runtime.distributed and the planners group the ranks.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx
from torch import nn

__all__ = ["tensor_stages", "weight_groups"]


def _tensors_of(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, nn.Module):
        return list(obj.parameters()) + list(obj.buffers())
    return [obj] if isinstance(obj, torch.Tensor) else []


def tensor_stages(gm: torch.fx.GraphModule, stage_of: dict[str, int]) -> dict[int, tuple[torch.Tensor, list[int]]]:
    """Each parameter/buffer (by id) and the stages that read it, its owner first.

    The owner is the stage of the leaf module holding it, else the first stage reading it.
    """
    found: dict[int, tuple[torch.Tensor, list[int]]] = {}
    for op in ("call_module", "get_attr"):
        for node in gm.graph.nodes:
            if node.op != op:
                continue
            if op == "call_module":
                users = [stage_of[node.name]] if node.name in stage_of else []
            else:
                users = sorted({stage_of[u.name] for u in node.users if u.name in stage_of})
            for t in _tensors_of(operator.attrgetter(str(node.target))(gm)):
                entry = found.setdefault(id(t), (t, []))
                entry[1].extend(u for u in users if u not in entry[1])
    return {k: v for k, v in found.items() if v[1]}


def weight_groups(
    gm: torch.fx.GraphModule, stage_of: dict[str, int], stage_ranks: list[list[int]], model: nn.Module
) -> list[tuple[tuple[int, ...], list[int]]]:
    """(ranks, stages) of every set of trainable weights held by several ranks, sorted.

    A weight is held by the ranks of every stage reading it (replicas of a stage, or a tied
    weight read by two stages); its gradient is all-reduced over exactly those ranks. Only
    the model's own parameters count (what `model.named_parameters()` lists).
    """
    own = {id(p) for p in model.parameters()}
    found: dict[tuple[int, ...], set[int]] = {}
    for t, stages in tensor_stages(gm, stage_of).values():
        if isinstance(t, nn.Parameter) and t.requires_grad and id(t) in own:
            ranks = tuple(sorted({r for s in stages for r in stage_ranks[s]}))
            if len(ranks) > 1:
                found.setdefault(ranks, set()).update(stages)
    return sorted((ranks, sorted(stages)) for ranks, stages in found.items())
