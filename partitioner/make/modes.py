"""The model's other train/eval mode: its own graph, cut where the traced mode's plan cuts.

[Note: the other mode's cuts] The two graphs of one model (traced in training and in eval mode)
mostly hold the same operations in the same order; a mode adds or drops a few (dropout in training,
a `.contiguous()` that torch.export keeps in one mode only). Node names cannot pair them: fx and
export number repeated operations (`mul_6`), so one added node renames every later one. The graphs
are paired by an alignment of their operation sequences instead (what each node calls, in which
module): a node of the other graph takes the stage of its partner, and a node of its own the stage
of the operation before it (the latest stage among its inputs, where stages are not a chain). An
alignment keeps order, so on a chain every node is read in its stage or a later one. It is the alignment
a plan binds to another trace of the model by (partitioner.make.bind, [Note: binding a plan by structure]).
"""

from __future__ import annotations

import dataclasses

import torch

from partitioner.capture.graph import compute_nodes
from partitioner.errors import PartitionError
from partitioner.make.bind import align, structure
from runtime.plan import Plan
from runtime.stage import stage_io

__all__ = ["same_cuts"]


def same_cuts(gm: torch.fx.GraphModule, plan: Plan, traced: torch.fx.GraphModule) -> Plan:
    """`plan`, made for the graph `traced`, for another graph of the same model, `gm` (the other train/eval
    mode), cut at the same places (see [Note: the other mode's cuts])."""
    assigned = align(compute_nodes(gm), structure(traced), plan.stage_of(), chain=plan.placement == "pipeline")
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
