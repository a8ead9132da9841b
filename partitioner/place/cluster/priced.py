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

from typing import Literal, Sequence

import networkx as nx

from cost_model.cluster_shape import Cluster
from cost_model.interface import CostModel
from cost_model.precision import Precision
from partitioner.capture.shardable_groups import Shardable
from partitioner.place.cluster.prepare import prepare_search
from partitioner.place.cluster.search import search_cluster
from partitioner.place.cluster.space import ClusterSolution
from partitioner.place.search.axes import Choice, search_choices
from partitioner.place.search.space import SearchSpace

__all__ = ["VIRTUAL", "search_priced"]

VIRTUAL = (1, 2, 3, 4, 8)  # chunks per rank searched (SC'21 runs 2 to 5, Llama 3 405B 8)


def search_priced(
    graph: nx.DiGraph, order: Sequence[str], cluster: Cluster, cost: CostModel, *,
    precision: Precision | None = None, shardable: Shardable | None = None, optimizer: str = "adam",
    headroom: float = 0.9, virtual: Sequence[int] = VIRTUAL, sequence_parallel: bool = True,
    kernels: str = "eager",
) -> tuple[ClusterSolution, Literal["none", "full"]]:
    """The best solution over every priced axis (module docstring) and its recomputation mode.

    Args:
        virtual: chunks per rank to try (interleaved 1F1B where v > 1).
        sequence_parallel: split layers' neighbours run on 1/t of the sequence wherever t > 1 (it only
            removes work and memory, so it is not searched against its absence).
        kernels: the kernel set priced, "eager" or "fused" (search/kernels.py), as the run being compared ran.

    Raises:
        InfeasibleError: nothing fits, naming the memory per GPU needed; PartitionError: bad arguments.
    """
    space = SearchSpace(recompute="auto", precision=precision, sequence_parallel=sequence_parallel, kernels=kernels)
    prepared = prepare_search(graph, order, cluster, cost, space, optimizer=space.optimizer(optimizer),
                              headroom=headroom, shardable=shardable)
    nodes = prepared.nodes(graph, order, cost)

    def run(choice: Choice, bound: float) -> tuple[ClusterSolution, float]:
        problem, axes = prepared.priced(choice, nodes)
        found = search_cluster(problem, cluster, micro_batches=prepared.micro_batches, schedules=space.schedules,
                               cuts=prepared.cuts, axes=axes, virtual=virtual, better_than=bound)
        return found, found.step_s

    solution, choice = search_choices(space, run)
    solution.choice = choice
    return solution, "full" if solution.choice.get("recompute") == "full" else "none"
