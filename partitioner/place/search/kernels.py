"""The kernel set as a search axis (search/axes.py registers it): a problem and a Plan as the fused kernels run them.

cost_model/fused_kernels.py says, node by node, what the fused kernel set keeps for backward and which nodes
it runs inside another's kernel. Here that is applied to what a search prices and to the Plan it returns:

    SearchProblem    saved_bytes x (fused / eager saved bytes of the node), out_bytes x (fused / eager: no
                     score matrix), the backward's working set 2 of the largest output, not 3 (a fused loss
                     keeps no log-probabilities: rules.kernels.WORKING_OUTPUTS); fixed, batch and size times x 0
                     for the nodes run inside another's kernel (x 1 for the rest). Priced before recomputation
                     (search/axes.py registers it first), so a recomputing stage's working set is the fused one
    Plan             kernels = "fused"; each stage's activation bytes x its fused / eager saved bytes (where it
                     recomputes, less the largest difference of one segment's, per micro-batch: it keeps its
                     segments' inputs, the same either way, and recomputes one segment at a time) and its
                     peak with them, the last stage's one model output less (its loss holds 2, not 3); its
                     forward and backward x (1 - the forward time share of the nodes run inside another's
                     kernel); the predicted step x the bottleneck stage's change

"eager" changes nothing (the problem itself is returned: the searches reuse what they priced).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import networkx as nx
import numpy as np
import torch

from cost_model.fused_kernels import attention_core, fused_away, fused_outputs, fused_saved
from cost_model.interface import CostModel, forward_time
from cost_model.recompute_cost import graph_nodes, saved_bytes_per_node
from partitioner.place.search.problem import SearchProblem
from partitioner.predict.counting import output_bytes
from rules.kernels import WORKING_OUTPUTS
from runtime.plan import Plan

__all__ = ["FusedFacts", "fused_facts", "fused_plan", "fused_problem"]


@dataclasses.dataclass(frozen=True)
class FusedFacts:
    """Per node of the order: eager and fused saved bytes, forward seconds, whether it runs inside another's kernel."""

    names: list[str]
    eager: np.ndarray
    fused: np.ndarray
    forward: np.ndarray
    away: np.ndarray  # bool
    out_eager: np.ndarray  # each node's output bytes, eager and fused (no score matrix: fused_outputs)
    out_fused: np.ndarray
    output: float = 0.0  # bytes of the model's output (what its loss reads), whole batch
    segment: np.ndarray | None = None  # each node's recomputation segment (search/recompute.py), where known
    scores: np.ndarray | None = None  # bool: attention scores; core: what Megatron's selective recomputation reruns
    core: np.ndarray | None = None

    @property
    def saved_ratio(self) -> np.ndarray:
        return np.where(self.eager > 0, self.fused / np.maximum(self.eager, 1.0), 1.0)

    @property
    def out_ratio(self) -> np.ndarray:
        return np.where(self.out_eager > 0, self.out_fused / np.maximum(self.out_eager, 1.0), 1.0)


def fused_facts(graph: nx.DiGraph, order: Sequence[str], device: torch.device, cost: CostModel,
                segment: np.ndarray | None = None) -> FusedFacts:
    """The facts of `order` (the whole graph's compute nodes) the fused kernel set changes."""
    nodes = graph_nodes(graph, order)
    eager, fused, away = saved_bytes_per_node(nodes, device.type), fused_saved(nodes, device.type), fused_away(nodes)
    times = [forward_time(cost, graph.nodes[n], device) for n in order]
    outputs = fused_outputs(nodes)
    scores, core = attention_core(nodes)
    return FusedFacts(list(order), np.array([float(eager[n]) for n in order]),
                      np.array([float(fused[n]) for n in order]), np.array(times), np.array([n in away for n in order]),
                      np.array([float(graph.nodes[n].get("out_bytes", 0) or 0) for n in order]),
                      np.array([float(outputs[n]) for n in order]), float(output_bytes(graph)), segment,
                      np.array([n in scores for n in order], dtype=bool),
                      np.array([n in core for n in order], dtype=bool))


def fused_problem(problem: SearchProblem, facts: FusedFacts) -> SearchProblem:
    """`problem` as the fused kernel set runs it (module docstring); unchanged where its nodes are not `facts`'."""
    if problem.n != len(facts.names):
        return problem
    keep = np.where(facts.away, 0.0, 1.0)
    sizes = {k: v * keep for k, v in problem.size_times.items()} if problem.size_times else problem.size_times
    out = problem.out_bytes * facts.out_ratio if problem.out_bytes is not None else None
    return dataclasses.replace(problem, saved_bytes=problem.saved_bytes * facts.saved_ratio, out_bytes=out,
                               fixed_times=problem.fixed_times * keep, batch_times=problem.batch_times * keep,
                               size_times=sizes, working_outputs=float(WORKING_OUTPUTS["fused"]))


def fused_plan(plan: Plan, facts: FusedFacts) -> None:
    """Give `plan` the fused kernel set's numbers (module docstring)."""
    at = {n: i for i, n in enumerate(facts.names)}
    before = max((s.predicted_ms for s in plan.stages), default=0.0)
    for stage in plan.stages:
        idx = [at[n] for n in stage.nodes if n in at]
        if not idx:
            continue
        eager, fused = float(facts.eager[idx].sum()), float(facts.fused[idx].sum())
        held = stage.activation_bytes
        if stage.recompute == "none" and eager > 0:
            held = int(stage.activation_bytes * fused / eager)
        elif stage.recompute == "full" and facts.segment is not None:  # one segment recomputed at a time
            less = np.bincount(facts.segment[idx], weights=facts.eager[idx] - facts.fused[idx])
            held = max(0, stage.activation_bytes - int(less.max() / max(1, plan.pieces)))
        if stage.index == len(plan.stages) - 1:  # the loss keeps the logits, not log-probabilities besides
            loss = facts.output / max(1, plan.pieces) * (WORKING_OUTPUTS["eager"] - WORKING_OUTPUTS["fused"])
            held = max(0, held - int(loss))  # one micro-batch's output (facts are the whole batch's)
        if stage.memory_bytes:
            stage.memory_bytes -= stage.activation_bytes - held
        stage.activation_bytes = held
        total = float(facts.forward[idx].sum())
        kept = 1.0 - (float(facts.forward[idx][facts.away[idx]].sum()) / total if total > 0 else 0.0)
        stage.forward_ms, stage.backward_ms = stage.forward_ms * kept, stage.backward_ms * kept
        stage.compute_ms = stage.forward_ms + stage.backward_ms
        stage.predicted_ms = (stage.compute_ms + stage.comm_ms) / stage.replicas
    after = max((s.predicted_ms for s in plan.stages), default=0.0)
    if before > 0:
        plan.predicted_step_ms *= after / before
    plan.kernels = "fused"
