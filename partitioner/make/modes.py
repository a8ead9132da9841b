"""The model's other train/eval mode: its own graph, cut where the traced mode's plan cuts."""

from __future__ import annotations

import dataclasses

import torch

from partitioner.capture.graph import compute_nodes
from partitioner.errors import PartitionError
from runtime.plan import Plan
from runtime.stage import stage_io

__all__ = ["same_cuts"]


def same_cuts(gm: torch.fx.GraphModule, plan: Plan) -> Plan:
    """`plan` for another graph of the same model (the other train/eval mode): nodes it shares stay
    in their stage; a node of its own joins the stage of its latest input."""
    stage_of = plan.stage_of()
    assigned: dict[str, int] = {}
    for node in compute_nodes(gm):
        s = stage_of.get(node.name)
        if s is None:
            s = max((assigned.get(p.name, 0) for p in node.all_input_nodes), default=0)
        assigned[node.name] = s
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
