"""A plan bound to a graph by the model's structure, not by the trace's node names.

[Note: binding a plan by structure]
fx and torch.export name nodes by counting (`mul_13`), so two traces of one model can give the same
operation different names: a trace on meta keeps a `.contiguous()` a trace with weights drops (Falcon,
GPT-J), another torch or transformers version adds a cast. A plan made from one trace (on meta, on a
cluster described by hand) and run on another (real weights, under torchrun) must still cut the model
where it was planned. So a plan records the structure it was made on (`Plan.node_keys`: each compute
node's name and key, in order; a key says what the node calls inside which module), and binding aligns
that sequence with the running graph's, keeping order (difflib, as the two train/eval graphs of one
model are paired):

    planned   embed  ln  mm  contiguous  mul  | mm ...        (stage 0 | stage 1)
    running   embed  ln  mm              mul  | mm ...        a node without a partner takes the stage of
                                                              its inputs (a chain: not before the one before it)

Node names matching is the common case and changes nothing. A plan saved before keys were recorded
binds by names only, and says so when they do not match.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
from typing import Sequence

import torch

from partitioner.capture.graph import compute_nodes, owning_module
from partitioner.errors import PartitionError
from runtime.plan import Plan

__all__ = ["align", "bind", "node_key", "structure"]

log = logging.getLogger(__name__)


def node_key(node: torch.fx.Node) -> str:
    """What `node` does, without its name: its kind, what it calls, and the module whose forward made it."""
    target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    return f"{node.op}:{target}@{owning_module(node)}"


def structure(gm: torch.fx.GraphModule) -> list[tuple[str, str]]:
    """(name, key) of every compute node of `gm`, in order: what a plan records to bind by (`Plan.node_keys`)."""
    return [(n.name, node_key(n)) for n in compute_nodes(gm)]


def align(nodes: Sequence[torch.fx.Node], planned: Sequence[tuple[str, str]], stage_of: dict[str, int], *,
          chain: bool) -> dict[str, int]:
    """Each node of `nodes` (a graph's compute nodes, in order) -> a stage: that of its partner among `planned`
    ((name, key) of the graph the stages were planned on, in order) by an order-keeping alignment of keys; a
    node without one takes the latest stage among its inputs (on a chain, not earlier than the node before).
    See [Note: binding a plan by structure]."""
    matcher = difflib.SequenceMatcher(None, [node_key(n) for n in nodes], [k for _, k in planned], autojunk=False)
    partner = {nodes[i + k].name: planned[j + k][0]
               for i, j, size in matcher.get_matching_blocks() for k in range(size)}
    assigned: dict[str, int] = {}
    previous = 0
    for node in nodes:
        s = stage_of.get(partner.get(node.name, ""))
        if s is None:
            s = max((assigned.get(p.name, 0) for p in node.all_input_nodes), default=0)
            if chain:
                s = max(s, previous)
        assigned[node.name] = previous = s
    return assigned


def bind(plan: Plan, gm: torch.fx.GraphModule) -> None:
    """Name `plan`'s stages by the nodes of `gm`, the graph it runs on (in place; nothing else changes).

    Raises:
        PartitionError: the plan names nodes `gm` lacks and records no structure to bind by (a plan saved
            by an older version, or edited by hand), with the fix.
    """
    running = structure(gm)
    names = {name for name, _ in running}
    stage_of = plan.stage_of()
    if plan.node_keys == running or (not plan.node_keys and set(stage_of) <= names):
        return
    if not plan.node_keys:
        missing = [n for n in stage_of if n not in names]
        raise PartitionError(
            f"the plan names {len(missing)} nodes this trace of the model does not have ({', '.join(missing[:5])}"
            f"{' ...' if len(missing) > 5 else ''}): it was made from another trace (a model on meta, other example "
            "shapes, another torch or transformers version) and records no structure to bind by (a plan saved "
            "before node keys, or edited by hand). Plan again with this version (its plans bind by structure), or "
            "trace the model as it was traced for the plan")
    nodes = compute_nodes(gm)
    assigned = align(nodes, plan.node_keys, stage_of, chain=plan.placement == "pipeline")
    kept = sum(1 for n in nodes if n.name in stage_of and stage_of[n.name] == assigned[n.name])
    log.info("the plan was made on a trace of %d nodes, this one has %d: bound by structure (%d in the same stage "
             "under the same name, %d placed by their partner or neighbours, %d planned nodes not here)",
             len(plan.node_keys), len(nodes), kept, len(nodes) - kept,
             sum(1 for name, _ in plan.node_keys if name not in names))
    plan.stages = [dataclasses.replace(stage, nodes=[n for n, s in assigned.items() if s == stage.index])
                   for stage in plan.stages]
    plan.node_keys = running
