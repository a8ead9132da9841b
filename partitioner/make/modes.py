"""The model's other train/eval mode: its own graph, cut where the traced mode's plan cuts.

[Note: the other mode's cuts] The two graphs of one model (traced in training and in eval mode)
mostly hold the same operations in the same order; a mode adds or drops a few (dropout in training,
a `.contiguous()` that torch.export keeps in one mode only). Node names cannot pair them: fx and
export number repeated operations (`mul_6`), so one added node renames every later one. The graphs
are paired by an alignment of their operation sequences instead (what each node calls, in which
module): a node of the other graph takes the stage of its partner, and a node of its own the stage
of the operation before it (the latest stage among its inputs, where stages are not a chain). An
alignment keeps order, so on a chain every node is read in its stage or a later one.
"""

from __future__ import annotations

import dataclasses
import difflib

import torch

from partitioner.capture.graph import compute_nodes, owning_module
from partitioner.errors import PartitionError
from runtime.plan import Plan
from runtime.stage import stage_io

__all__ = ["same_cuts"]


def _signature(node: torch.fx.Node) -> tuple[str, str, str]:
    return node.op, str(getattr(node.target, "__name__", node.target)), owning_module(node)


def _partners(ours: list[torch.fx.Node], theirs: list[torch.fx.Node]) -> dict[str, str]:
    """Node name in `ours` -> its partner's name in `theirs`, by an order-keeping alignment of signatures."""
    matcher = difflib.SequenceMatcher(None, [_signature(n) for n in ours], [_signature(n) for n in theirs],
                                      autojunk=False)
    return {ours[i + k].name: theirs[j + k].name
            for i, j, size in matcher.get_matching_blocks() for k in range(size)}


def same_cuts(gm: torch.fx.GraphModule, plan: Plan, traced: torch.fx.GraphModule) -> Plan:
    """`plan`, made for the graph `traced`, for another graph of the same model, `gm` (the other train/eval
    mode), cut at the same places (see [Note: the other mode's cuts])."""
    stage_of = plan.stage_of()
    nodes = compute_nodes(gm)
    partner = _partners(nodes, compute_nodes(traced))
    chain = plan.placement == "pipeline"
    assigned: dict[str, int] = {}
    previous = 0
    for node in nodes:
        s = stage_of.get(partner.get(node.name, ""))
        if s is None:
            s = max((assigned.get(p.name, 0) for p in node.all_input_nodes), default=0)
            if chain:
                s = max(s, previous)
        assigned[node.name] = previous = s
    stages = [
        dataclasses.replace(st, nodes=[n for n, s in assigned.items() if s == st.index], reads_from=[])
        for st in plan.stages
    ]
    other = dataclasses.replace(plan, stages=stages, programs=[], graph=None)
    try:
        stage_io(gm, other)
    except ValueError as exc:
        raise PartitionError(f"the model's graph in its other train/eval mode cannot be cut where this one is: {exc}; "
                             "partition the model in the mode you run it in") from None
    return other
