"""The cluster search over every axis it prices, whether the runtime runs it or not: what a published run is set beside.

    search_priced(graph, order, cluster, cost, ...) -> (ClusterSolution, recompute mode)

plan_on_cluster (cluster/plan.py) searches what the runtime runs and makes a Plan of it. A published
run may use what the search can price but the runtime does not run: interleaved 1F1B with replicas
(search/virtual_stages.py) and sequence parallelism beside the tensor degree (search/tensor_split.py). This search
adds both axes to the others (tensor degree, stages, replicas and their sharding, micro-batches,
schedule, rank order, cuts) and recomputation none or full, and returns the solution with the smallest
objective, so its space holds every configuration cluster.fixed.price_fixed can be given: its
objective is at most a fixed configuration's, priced the same way. Nothing here makes a Plan.
"""

from __future__ import annotations

import math
from typing import Literal, Sequence

import networkx as nx

from cost_model.cluster_shape import Cluster
from cost_model.interface import CostModel
from cost_model.precision import Precision
from partitioner.capture.shardable_groups import Shardable
from partitioner.place.cluster.axes import SplitChoice, recomputed
from partitioner.place.cluster.plan import prepare_search, recomputing
from partitioner.place.cluster.search import search_cluster
from partitioner.place.cluster.space import ClusterSolution
from partitioner.place.search.compare import SCHEDULES
from partitioner.place.search.infeasible import InfeasibleError

__all__ = ["VIRTUAL", "search_priced"]

VIRTUAL = (1, 2, 3, 4, 8)  # chunks per rank searched (SC'21 runs 2 to 5, Llama 3 405B 8)


def search_priced(
    graph: nx.DiGraph, order: Sequence[str], cluster: Cluster, cost: CostModel, *,
    precision: Precision | None = None, shardable: Shardable | None = None, optimizer: str = "adam",
    headroom: float = 0.9, virtual: Sequence[int] = VIRTUAL, sequence_parallel: bool = True,
) -> tuple[ClusterSolution, Literal["none", "full"]]:
    """The best solution over every priced axis (module docstring) and its recomputation mode.

    Args:
        virtual: chunks per rank to try (interleaved 1F1B where v > 1).
        sequence_parallel: split layers' neighbours run on 1/t of the sequence wherever t > 1 (it only
            removes work and memory, so it is not searched against its absence).

    Raises:
        InfeasibleError: nothing fits, naming the memory per GPU needed; PartitionError: bad arguments.
    """
    if precision is not None:
        optimizer = precision.optimizer
    prepared = prepare_search(graph, order, cluster, cost, None, optimizer=optimizer, headroom=headroom,
                              precision=precision, shardable=shardable,
                              choice=SplitChoice(sequence_parallel=sequence_parallel))
    best: tuple[ClusterSolution, Literal["none", "full"]] | None = None
    failure: InfeasibleError | None = None
    for mode in ("none", "full"):
        problem, axes = prepared.plain, prepared.axes
        if mode == "full":
            problem = recomputing(problem, prepared.share, prepared.segment)
            axes = recomputed(axes, lambda x: recomputing(x, prepared.share, prepared.segment))
        try:
            found = search_cluster(problem, cluster, micro_batches=prepared.micro_batches, schedules=SCHEDULES,
                                   cuts=prepared.cuts, axes=axes, virtual=virtual,
                                   better_than=best[0].step_s if best is not None else math.inf)
        except InfeasibleError as exc:
            failure = exc
            continue
        if best is None or found.step_s < best[0].step_s:
            best = (found, mode)
    if best is None:
        raise failure if failure is not None else InfeasibleError("nothing fits", [])
    return best
