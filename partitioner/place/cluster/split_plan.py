"""A Plan of experts and sequences split over ranks: the cluster search over expert and context degrees
(cluster/split_axes.py), made into the Plan the runtime runs (runtime/plan_axes.py's rules).

    plan_split(graph, order, cluster, cost, facts, ...) -> (Plan, Split)

The chosen configuration is made a Plan as any cluster solution is (cluster.plan.solution_plan, on the
cluster as a context group sees it: `coarse`), then given what the split changes:

    ranks               r x c on the real cluster: replica j of a stage on t x c consecutive ranks from there
    context, context_attention   every stage (the same degree), the causal attentions among its nodes
    expert, expert_layers        the stages holding a stack of experts (e of their consecutive replicas)
    forward_ms, backward_ms      scaled by the stage's time as one rank of the groups runs it over its time whole
                                 (search.experts_context.split_problem: / c, all-to-alls, gathered K/V)
    memory_bytes, activation_bytes  the search's count (expert states / e, activations / c)
    data_split "slice", m / d micro-batches per replica, programs lowered where they run; the step is replica 0's
    pipeline in the runtime's order (cluster.look.replica_step).
"""

from __future__ import annotations

from typing import Sequence

import networkx as nx
import numpy as np

from cost_model.cluster_shape import Cluster
from cost_model.interface import CostModel
from cost_model.precision import Precision
from partitioner.capture.shardable_groups import Shardable
from partitioner.place.cluster.candidate import slowest_pair
from partitioner.place.cluster.look import replica_step
from partitioner.place.cluster.plan import local_device, solution_plan
from partitioner.place.cluster.split_axes import Split, search_split
from partitioner.place.search.experts_context import SplitFacts
from partitioner.place.search.graph_costs import per_micro_batch
from partitioner.place.search.space import SearchSpace
from partitioner.predict.counting import stage_edges
from runtime.plan import Plan

__all__ = ["plan_split"]


def plan_split(
    graph: nx.DiGraph, order: Sequence[str], cluster: Cluster, cost: CostModel, facts: SplitFacts, *,
    experts: Sequence[tuple[str, str]] = (), attentions: Sequence[tuple[str, str]] = (),
    space: SearchSpace | None = None, precision: Precision | None = None, shardable: Shardable | None = None,
    skew: float = 1.0, expert: int | None = None, context: int | None = None, optimizer: str = "adam",
    headroom: float = 0.9,
) -> tuple[Plan, Split]:
    """The Plan of the best configuration over expert and context degrees (module docstring).

    Args:
        experts: (node, module path) of each stack of experts that splits (capture.experts.ExpertLayer's).
        attentions: (node, module path) of each causal attention whose sequence splits (capture.sequence's).
        expert, context: force that degree (None: searched).

    Raises:
        InfeasibleError: nothing fits, naming the memory per GPU needed.
    """
    space = space if space is not None else SearchSpace(recompute="auto", precision=precision)
    split = search_split(graph, order, cluster, cost, facts, space=space, shardable=shardable, skew=skew,
                         expert=expert, context=context, optimizer=optimizer, headroom=headroom)
    found, c, e = split.solution, split.context, split.expert
    mode = found.choice.get("recompute", "none")
    made = solution_plan(graph, order, found, split.view, cost, optimizer=space.optimizer(optimizer),
                         capacity=float(split.plain.capacity[0]), recompute="full" if mode == "full" else "none",
                         space=split.axes, groups=split.groups)
    if space.precision is not None:
        made.precision = space.precision.to_dict()
    m, d = found.micro_batches, found.replicas
    rank_one = split.axes.degree(found.tensor).problem.micro_batch_times(m)[0]
    whole = split.plain.micro_batch_times(m)[0]
    expert_at = dict(experts)
    attention_at = dict(attentions)
    for stage, a, b, ranks in zip(made.stages, found.bounds, found.bounds[1:], split.ranks):
        before = float(whole[a:b].sum())
        scale = float(rank_one[a:b].sum()) / before if before > 0 else 1.0
        stage.forward_ms *= scale
        stage.backward_ms *= scale
        stage.compute_ms = stage.forward_ms + stage.backward_ms
        stage.memory_bytes = int(found.memory[stage.index])
        stage.activation_bytes = int(split.kinds[stage.index].get("activations", 0.0))
        stage.ranks, stage.device = list(ranks), local_device(cluster, ranks[0])
        stage.context = c
        stage.context_attention = list(dict.fromkeys(attention_at[n] for n in stage.nodes if n in attention_at)) \
            if c > 1 else []
        layers = list(dict.fromkeys(expert_at[n] for n in stage.nodes if n in expert_at)) if e > 1 else []
        stage.expert, stage.expert_layers = (e, layers) if layers else (1, [])
    stage_nodes = [list(s.nodes) for s in made.stages]
    message = [0.0] * len(made.stages)
    for (a, b), nbytes in stage_edges(per_micro_batch(graph, m), stage_nodes).items():
        if nbytes > 0 and b == a + 1:
            src, dst = slowest_pair(cluster, made.stages[a].ranks, made.stages[b].ranks)
            message[b] = max(message[b], 1e3 * cluster.transfer_time(nbytes, src, dst))
    made.predicted_step_ms = replica_step(made.schedule, m, d, [s.forward_ms for s in made.stages],
                                          [s.backward_ms for s in made.stages], message,
                                          [s.allreduce_ms for s in made.stages])
    made.micro_batches, made.data_split, made.programs = m // d, "slice", []
    made.gpus_per_host = cluster.gpus_per_host
    made.alternatives = {f"expert {x} x context {y}": 1e3 * step for (x, y), step in sorted(split.tried.items())
                         if np.isfinite(step)}
    made.check()
    return made, split
