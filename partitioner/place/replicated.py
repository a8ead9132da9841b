"""replicas="auto": which search plans the stages, replicas, tensor degrees and sharding, and which plan is kept.

    on all GPUs of a Cluster     the search by counts (cluster/plan.py); up to EXHAUSTIVE_GPUS GPUs, without a
                                 precision and without a fixed degree > 1 or sharding mode, the device-list
                                 search too (devices/plan.py: uneven replicas), the plan simulated faster kept
    on a list of devices         the device-list search alone
    experts or a long sequence   on all GPUs of a Cluster, where the graph has stacks of experts or a long causal
                                 sequence that split (`splits`): the search over expert and context degrees with
                                 the other axes (cluster/split_plan.py), alone

Neither search imports the other: this module, beside planning.py, is where they meet.
"""

from __future__ import annotations

from typing import Sequence

import networkx as nx
import torch

from cost_model.cluster_shape import Cluster
from cost_model.interface import CostModel
from cost_model.precision import Precision
from partitioner.capture.shardable_groups import Shardable
from partitioner.errors import PartitionError
from partitioner.place.cluster.plan import cluster_of, plan_on_cluster, solution_plan
from partitioner.place.cluster.split_axes import Split, search_split, split_made
from partitioner.place.devices.plan import plan_devices
from partitioner.place.search.experts_context import SplitFacts
from partitioner.place.search.space import ANY, SearchSpace
from runtime.plan import Plan

__all__ = ["EXHAUSTIVE_GPUS", "plan_hybrid", "plan_split"]

EXHAUSTIVE_GPUS = 16  # clusters up to this size also run the search over device lists (uneven replicas)


def plan_hybrid(
    graph: nx.DiGraph,
    order: Sequence[str],
    devices: Sequence[torch.device | str],
    cost: CostModel,
    *,
    space: SearchSpace = ANY,
    stages: int | None = None,
    replicate: bool = True,
    memory_bytes: Sequence[float] | None = None,
    optimizer: str = "adam",
    headroom: float = 0.9,
    shardable: Shardable | None = None,
    splits: SplitFacts | None = None,
) -> Plan:
    """Plan `order` (compute nodes, topological) onto all of `devices`: stages, replicas, m, schedule.

    Args:
        graph: annotated for one step's whole batch (`build_graph` on the full inputs).
        devices: every device (rank) of the job, in rank order; stage replicas take
            consecutive ones, and a stage's time is that of its slowest device.
        space: what the searches may choose (search/space.py: micro-batch counts, default 1, 2, 4, ...;
            schedules, "gpipe" only in one process; recomputation and precision, which the cluster search
            alone prices; tensor degrees and sharding modes: a degree > 1 or a sharding mode fixed there is
            planned by the cluster search alone, tensor (1,) splits nothing).
        stages: force this many stages; replicate=False puts one stage on each device.
        memory_bytes: usable bytes per device (default: headroom x the spec's memory).
        shardable: the layer groups tensor parallelism may split (partitioner.capture.shardable), for
            the cluster search and, on devices of one kind, the search over device lists
            (devices/split.py: a tensor degree per stage, kept only where it splits a layer and is
            predicted faster, or where nothing fits whole); None: every layer whole.
        splits: the stacks of experts and the long causal sequence the graph splits (cluster/split_plan.py's
            found_splits); None or nothing found: no expert or context degree.

    Raises:
        InfeasibleError: no split fits; the message names the memory each device would need.

    Which search runs: the module docstring (not the device-list search with a precision: it counts every
    state at the model's dtype).
    """
    cluster = cluster_of(cost) if memory_bytes is None else None
    if cluster is not None and len(devices) == cluster.size and splits is not None and (
            splits.has_experts or splits.has_context):
        return plan_split(graph, order, cluster, cost, splits, space=space, shardable=shardable, optimizer=optimizer,
                          headroom=headroom)[0]
    fixed = space.cluster_only  # what the device-list search cannot honour: the cluster search plans alone
    counted: tuple[Plan, float] | None = None
    if cluster is not None and len(devices) == cluster.size:
        alone = cluster.size > EXHAUSTIVE_GPUS or space.precision is not None or bool(fixed)
        try:
            made, found = plan_on_cluster(graph, order, cluster, cost, space=space, stages=stages,
                                          replicate=replicate, optimizer=optimizer, headroom=headroom,
                                          shardable=shardable)
            counted = made, found.step_s
        except PartitionError:
            if alone:
                raise
        if counted is not None and alone:
            return counted[0]  # the device-list search counts states at the model's dtype only
    if fixed:
        raise PartitionError(f"{' and '.join(fixed)} are planned by the search over a cluster's GPUs only "
                             "(plan(cluster=...)); on a list of devices use tensor='auto' or 1 and sharding='auto' "
                             "or 'none'")
    try:  # recomputation is chosen per stage afterwards (planning.choose_recompute)
        plan = plan_devices(graph, order, devices, cost, space=space.but(recompute="none"), stages=stages,
                            replicate=replicate, memory_bytes=memory_bytes, optimizer=optimizer, headroom=headroom,
                            shardable=None if space.unsplit else shardable)
    except PartitionError:
        if counted is None:
            raise
        return counted[0]
    if cluster is not None:
        _local_names(plan, cluster.gpus_per_host)
    if counted is not None and counted[0].predicted_step_ms < plan.predicted_step_ms:
        return counted[0]  # both simulated: their objectives count a replicated pipeline's fill differently
    return plan


def _local_names(plan: Plan, gpus_per_host: int) -> None:
    """A cluster plan names each rank's GPU on its own host (cuda:r % gpus_per_host); ranks say where it is."""
    for stage in plan.stages:
        stage.device = f"cuda:{stage.ranks[0] % gpus_per_host}" if stage.ranks else stage.device
    for program in plan.programs:
        program.device = f"cuda:{program.rank % gpus_per_host}"
    plan.gpus_per_host = gpus_per_host


def plan_split(
    graph: nx.DiGraph, order: Sequence[str], cluster: Cluster, cost: CostModel, facts: SplitFacts, *,
    space: SearchSpace | None = None, precision: Precision | None = None, shardable: Shardable | None = None,
    skew: float = 1.0, expert: int | None = None, context: int | None = None, optimizer: str = "adam",
    headroom: float = 0.9,
) -> tuple[Plan, Split]:
    """The Plan of the best configuration over expert and context degrees and the cluster search's other axes
    (cluster/split_axes.py): searched, made a Plan as any cluster solution (on the cluster as a context group
    sees it), then given its real ranks and degrees. `expert`/`context`: force that degree; `skew`: the busiest
    expert rank's load over the mean (1: uniform routing).

    Raises:
        InfeasibleError: nothing fits, naming the memory per GPU needed.
    """
    space = space if space is not None else SearchSpace(recompute="auto", precision=precision)
    optimizer = space.optimizer(optimizer)
    split = search_split(graph, order, cluster, cost, facts, space=space, shardable=shardable, skew=skew,
                         expert=expert, context=context, optimizer=optimizer, headroom=headroom)
    mode = split.solution.choice.get("recompute", "none")
    made = solution_plan(graph, order, split.solution, split.view, cost, optimizer=optimizer,
                         capacity=float(split.plain.capacity[0]), recompute="full" if mode == "full" else "none",
                         space=split.axes, groups=split.groups)
    return split_made(made, split, graph, order, cluster, facts, space.precision), split
