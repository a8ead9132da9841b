"""A graph as t tensor-parallel ranks each run it: split layers' work, weights and activations / t, collectives added.

A group of partitioner.capture.shardable splits across t ranks (its degrees: t divides them). Each
rank of the group runs every node of it on 1/t of the values:

    node role                     FLOPs   output bytes   shapes (what the GEMM efficiency reads)
    output split (colwise, heads) / t     / t            linear: N / t (last dim); batched matmul: heads / t
    output summed (rowwise, vocab) / t    whole          whole (K / t: FLOPs / (2 M N))
    output gathered (lone head)   / t     whole          whole
    model output (head into loss) / t     / t            linear: N / t   (not gathered: runtime/loss_split.py)

so a GEMM of 1/t the width is priced at its own shape's efficiency (cost_model.ops.gemm_efficiency),
not at 1/t the time, and memory-bound ops at 1/t of their bytes. Weights split by the group are / t
(replicated biases stay whole); what a node saves for backward follows the output bytes it reads
(cost_model.recompute_cost), so a rowwise layer saves its split input / t and a colwise one its
replicated input whole. Nodes outside the groups (norms, residual adds) run whole on every rank, as
eager DTensor without sequence parallelism runs them. Each group adds its collectives
(`ShardGroup.collectives`: an all-reduce of the summed outputs in forward and of the inputs'
gradients in backward, an all-gather of gathered outputs) on the tensor group's ring, not
overlapped with compute (eager DTensor waits for each). A gathered output that is a model output (an LM head's
logits) is not gathered in training: the loss reads it split by vocabulary (DTensor's loss_parallel), its
reductions over the vocabulary (its maximum, the sum of exponentials, the target's logit: three all-reduces of
b x s fp32 numbers, 12 b s bytes against the 2 b s V of the bf16 all-gather they replace) are not priced.

With sequence parallelism (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models",
https://arxiv.org/abs/2205.05198: what Megatron-LM and Llama 3 run beside tensor parallelism) the nodes outside
the groups run on 1/t of the sequence, and a summed output is reduce-scattered to that share: their FLOPs,
output bytes and saved bytes are / t, and so are the values crossing stage boundaries; the all-reduce
becomes a reduce-scatter and an all-gather of the same bytes (cost_model.collectives prices each as half an
all-reduce), so the collectives' time does not change. The runtime does not run it (eager DTensor without
SequenceParallel): the search prices it only for a configuration given whole (cluster/fixed.py).

Which groups a degree splits, and where a stage of it may not be cut, are search/degrees.py's.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import networkx as nx
import numpy as np
import torch

from cost_model.collectives import Ring, all_gather, all_reduce, reduce_scatter
from cost_model.interface import CostModel
from partitioner.capture.shardable_groups import ShardGroup
from partitioner.place.search.graph_costs import at_batch, batch_size, fixed_and_batch, graph_values
from partitioner.place.search.problem import SearchProblem

__all__ = ["collective_seconds", "split_attrs", "split_graph", "split_problem"]

_BATCHED = ("matmul", "bmm", "einsum", "attention", "baddbmm")


def split_attrs(attrs: dict[str, Any], t: int, role: str) -> dict[str, Any]:
    """A node's attributes as one of t ranks runs it: role "split" (its output split), "summed" or "gathered"."""
    out = dict(attrs)
    out["flops"] = (attrs.get("flops", 0) or 0) / t
    if role != "split":
        return out
    out["out_bytes"] = (attrs.get("out_bytes", 0) or 0) / t
    name = str(attrs.get("kind") or attrs.get("target") or "").lower()
    batched = any(k in name for k in _BATCHED)
    shapes = []
    for shape in attrs.get("shapes") or []:
        dims = list(shape)
        at = 1 if batched and len(dims) >= 3 else len(dims) - 1
        if dims and at >= 0:
            dims[at] = max(1, round(dims[at] / t))
        shapes.append(tuple(dims))
    if "shapes" in attrs:
        out["shapes"] = shapes
    return out


def _roles(group: ShardGroup) -> dict[str, str]:
    outputs = {name for name, _ in group.outputs} - set(group.loss_outputs)  # logits into the loss stay split
    gathered = {c.value for c in group.collectives if c.kind == "all_gather" and c.phase == "forward"}
    return {n: ("gathered" if n in gathered else "summed") if n in outputs else "split" for n in group.nodes}


def split_graph(graph: nx.DiGraph, groups: Sequence[ShardGroup], t: int, sequence: bool = False) -> nx.DiGraph:
    """A copy of `graph` as each of t ranks runs it (module docstring): the groups' nodes and weights split; with
    `sequence` (sequence parallelism) every other node's work and output, and the summed outputs, / t too."""
    out = graph.copy()
    if t == 1:
        return out
    inside: set[str] = set()
    holders: dict[str, str] = {}  # a parameter's name -> the get_attr node reading it
    for name, attrs in graph.nodes(data=True):
        if attrs.get("op") == "get_attr":
            holders[str(attrs.get("target"))] = name
    for group in groups:
        whole = group.weight_bytes + group.replicated_bytes
        share = (group.weight_bytes / t + group.replicated_bytes) / whole if whole else 1.0
        for name, role in _roles(group).items():
            inside.add(name)
            attrs = split_attrs(graph.nodes[name], t, role)
            if sequence and role == "summed":  # reduce-scattered over the sequence
                attrs["out_bytes"] = (attrs.get("out_bytes", 0) or 0) / t
            if attrs.get("param_bytes"):
                attrs["param_bytes"] = attrs["param_bytes"] * share
            out.nodes[name].update(attrs)
        for param in group.params:
            holder = holders.get(param.name)
            if holder is not None and param.dim is not None:
                out.nodes[holder]["param_bytes"] = (graph.nodes[holder].get("param_bytes", 0) or 0) / t
    if sequence:
        for name, attrs in graph.nodes(data=True):
            if name not in inside and attrs.get("op") not in ("placeholder", "get_attr", "output"):
                out.nodes[name].update(flops=(attrs.get("flops", 0) or 0) / t,
                                       out_bytes=(attrs.get("out_bytes", 0) or 0) / t)
    return out


def collective_seconds(graph: nx.DiGraph, group: ShardGroup, ring: Ring, size: float) -> tuple[float, float]:
    """(forward, backward) seconds of one group's collectives on `ring` for a micro-batch of `size` samples
    (bytes from `graph`, annotated for its whole batch)."""
    batch = batch_size(graph)
    scale = size / batch if batch else 1.0
    times = {"forward": 0.0, "backward": 0.0}
    price = {"all_reduce": all_reduce, "all_gather": all_gather, "reduce_scatter": reduce_scatter}
    for c in group.collectives:
        if c.value in group.loss_outputs:  # not gathered: the loss reduces them split (b x s numbers, not priced)
            continue
        nbytes = float(graph.nodes[c.value].get("out_bytes", 0) or 0) * scale if c.value in graph else c.bytes
        times[c.phase] += float(price[c.kind](ring, nbytes))
    return times["forward"], times["backward"]


def split_problem(problem: SearchProblem, graph: nx.DiGraph, order: Sequence[str], device: torch.device,
                  cost: CostModel, t: int, groups: Sequence[ShardGroup], ring: Ring,
                  sequence: bool = False) -> SearchProblem:
    """`problem` (cluster.plan.cluster_problem of `graph`) as each of t tensor ranks runs it: the groups' nodes
    priced again on their split attributes (at every probed micro-batch size), their collectives added at their
    last node, weights and saved activations from the split graph; with `sequence` (sequence parallelism), every
    node priced again and the values between nodes from the split graph too."""
    if t == 1 or not groups:
        return problem
    split = split_graph(graph, groups, t, sequence)
    position = {name: i for i, name in enumerate(order)}
    size = batch_size(graph)
    probes = dict(problem.size_times or {})
    times = {s: v.copy() for s, v in probes.items()}
    repriced = list(order) if sequence else [name for group in groups for name in group.nodes]
    for name in repriced:
        i = position[name]
        for s in times:
            times[s][0, i] = cost.node_time(at_batch(split.nodes[name], batch=size, size=s), device)
    for group in groups:
        last = max(position[n] for n in group.nodes)
        for s in times:
            times[s][0, last] += sum(collective_seconds(graph, group, ring, s))
    _, _, sizes, params, saved = graph_values(split, order, device.type)
    if size is not None and size > 1 and times:
        fixed, batch = fixed_and_batch(times, size)
    else:  # no batch to probe: scale the whole-batch arrays by each node's FLOP share kept
        keep = np.ones(problem.n)
        for group in groups:
            for name in group.nodes:
                keep[position[name]] = 1.0 / t
        fixed, batch = problem.fixed_times * keep, problem.batch_times * keep
    out = dataclasses.replace(problem, fixed_times=fixed, batch_times=batch, param_bytes=params, saved_bytes=saved,
                              size_times=times or None)
    if sequence:
        out = dataclasses.replace(out, value_bytes=np.array(sizes), out_bytes=np.array(
            [float(split.nodes[x].get("out_bytes", 0) or 0) for x in order]))
    return out
