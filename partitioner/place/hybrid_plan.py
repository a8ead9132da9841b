"""Hybrid planning for a traced graph: stages, replicas, micro-batches and schedule on a list of devices, as a Plan.

The search over device lists lives in partitioner/place/hybrid.py, the search by counts on a
Cluster in partitioner/place/cluster_plan.py; partitioner/place/graph_costs.py asks the cost
model (node times, links, all-reduce, memory) for their numbers. This module runs them and hands
the chosen placement (stages, ranks, micro-batches, schedule) to partitioner/predict/assemble.py,
which counts the Plan's numbers as for every planner: the search's objective ranks
configurations, the simulator predicts the chosen one.
"""

from __future__ import annotations

from typing import Literal, Sequence

import networkx as nx
import numpy as np
import torch

from cost_model.interface import CostModel
from cost_model.precision import Precision
from partitioner.capture.shardable_groups import Shardable
from partitioner.errors import PartitionError
from partitioner.place.cluster_plan import cluster_of, plan_on_cluster
from partitioner.place.graph_costs import hybrid_problem, per_micro_batch
from partitioner.place.hybrid import SCHEDULES, solve_hybrid
from partitioner.predict.assemble import assemble
from runtime.plan import Plan

__all__ = ["EXHAUSTIVE_GPUS", "plan_hybrid"]

EXHAUSTIVE_GPUS = 16  # clusters up to this size also run the search over device lists (uneven replicas)


def plan_hybrid(
    graph: nx.DiGraph,
    order: Sequence[str],
    devices: Sequence[torch.device | str],
    cost: CostModel,
    *,
    micro_batches: int | Sequence[int] | None = None,
    schedules: Sequence[str] = SCHEDULES,
    stages: int | None = None,
    replicate: bool = True,
    memory_bytes: Sequence[float] | None = None,
    optimizer: str = "adam",
    headroom: float = 0.9,
    recompute: Literal["none", "full", "auto"] = "none",
    precision: Precision | None = None,
    shardable: Shardable | None = None,
) -> Plan:
    """Plan `order` (compute nodes, topological) onto all of `devices`: stages, replicas, m, schedule.

    Args:
        graph: annotated for one step's whole batch (`build_graph` on the full inputs).
        devices: every device (rank) of the job, in rank order; stage replicas take
            consecutive ones, and a stage's time is that of its slowest device.
        micro_batches: the count to use, or candidates to choose from (default 1, 2, 4, ...).
        schedules: the schedules the runtime may run ("gpipe" only in one process).
        stages: force this many stages; replicate=False puts one stage on each device.
        memory_bytes: usable bytes per device (default: headroom x the spec's memory).
        recompute: on a Cluster, search with full recomputation ("full"), or only when nothing fits
            without it ("auto"); `plan()` then chooses each stage's mode (planning.choose_recompute).
        precision, shardable: on a Cluster, the training precision states are counted at (and replicas
            may be sharded under) and the layer groups tensor parallelism may split (cluster_plan.py).

    Raises:
        InfeasibleError: no split fits; the message names the memory each device would need.

    On all GPUs of a Cluster (the cost model prices one: `plan(cluster=...)`) the search is by counts
    (partitioner/place/cluster_plan.py: stages x equal replicas, micro-batches, schedule, rank placement);
    up to EXHAUSTIVE_GPUS GPUs this search over device lists (uneven replicas) runs too, and the
    plan simulated faster is kept (not with a `precision`: that search counts every state at the model's dtype).
    """
    cluster = cluster_of(cost) if memory_bytes is None else None
    counted: tuple[Plan, float] | None = None
    if cluster is not None and len(devices) == cluster.size:
        try:
            made, found = plan_on_cluster(graph, order, cluster, cost, micro_batches=micro_batches,
                                          schedules=schedules, stages=stages, replicate=replicate,
                                          optimizer=optimizer, headroom=headroom, recompute=recompute,
                                          precision=precision, shardable=shardable)
            counted = made, found.step_s
        except PartitionError:
            if cluster.size > EXHAUSTIVE_GPUS or precision is not None:
                raise
        if counted is not None and (cluster.size > EXHAUSTIVE_GPUS or precision is not None):
            return counted[0]  # the device-list search counts states at the model's dtype only
    problem = hybrid_problem(
        graph, order, devices, cost, memory_bytes, optimizer, headroom, micro_batches=micro_batches
    )
    try:
        sol = solve_hybrid(problem, micro_batches, schedules, stages, replicate)
    except PartitionError:
        if counted is None:
            raise
        return counted[0]
    names, m = problem.names or [str(d) for d in devices], sol.micro_batches
    starts = np.cumsum([0, *sol.replicas])
    ranks = [list(range(int(a), int(b))) for a, b in zip(starts, starts[1:])]
    capacity = [float(problem.capacity[r].min()) for r in ranks]
    plan = assemble(
        per_micro_batch(graph, m), [list(order[a:b]) for a, b in zip(sol.bounds, sol.bounds[1:])],
        [names[r[0]] for r in ranks], cost, micro_batches=m, schedule=sol.schedule,
        stage_ranks=ranks, rank_devices=names, placement="hybrid", optimizer=optimizer,
        capacity_bytes=[int(c) if np.isfinite(c) else None for c in capacity],
    )
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
