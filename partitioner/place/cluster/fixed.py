"""A configuration given whole (a published run's) priced by the cluster search instead of chosen by it.

    Fixed(tensor=8, stages=8, micro_batch_size=2, virtual_stages=2, recompute="full")
        -> price_fixed(graph, order, cluster, cost, fixed, ...) -> ClusterSolution

The search runs over that one configuration: tensor degree t, p stages, d = GPUs / (t p) replicas with
`sharding`, m = batch / micro_batch_size micro-batches, the schedule (interleaved with v > 1 chunks per rank:
search/virtual_stages.py), recomputation and rank order; only the cuts are searched (the DP over cut candidates,
each stage a run of whole blocks), so what separates a chosen plan from a published one is the search,
and what separates a published configuration's prediction from its published step is the prices.
Nothing here makes a Plan: the runtime does not run interleaving with replicas (use plan_on_cluster with
`stages=`, `micro_batches=` and `choice=` for a configuration it runs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import networkx as nx

from cost_model.cluster_shape import Cluster
from cost_model.interface import CostModel
from cost_model.precision import Precision
from partitioner.capture.shardable_groups import Shardable
from partitioner.errors import PartitionError
from partitioner.place.cluster.prepare import prepare_search
from partitioner.place.cluster.search import search_cluster
from partitioner.place.cluster.space import ClusterSolution, RankOrder
from partitioner.place.search.axes import Choice, search_choices
from partitioner.place.search.graph_costs import batch_size
from partitioner.place.search.space import PRICED_ONLY_RECOMPUTE, SearchSpace
from partitioner.place.search.virtual_stages import check_virtual
from rules.schedules import searched_names

__all__ = ["Fixed", "price_fixed"]


@dataclass(frozen=True)
class Fixed:
    """Every choice of a cluster plan but its cuts (see the module docstring).

    Args:
        tensor: ranks per replica, the split groups across them (t).
        stages: pipeline stages (p); the replicas are GPUs / (t p).
        micro_batch_size: samples per micro-batch; the global batch (the graph's) / it is the micro-batch count.
        sharding: "none", "zero1", "zero2" or "zero3" over the replicas (needs a precision).
        schedule: "1f1b" or "gpipe"; with virtual_stages > 1, interleaved 1F1B.
        virtual_stages: chunks per rank (v), interleaved as Megatron-LM runs them.
        recompute: "none", "full" (every stage recomputes its forward in backward), "attention" (the attention
            core only: Megatron-LM's selective recomputation) or "selective-op" (torchtitan's selective op policy:
            every second product's output and the attention's kept); search/recompute.py.
        order: which ranks share hosts (cluster.space.RankOrder): Megatron-LM puts a stage's replicas
            together ("replicas-together"), Llama 3's [TP, CP, PP, DP] puts a pipeline together.
        sequence_parallel: layers outside the split groups run on 1/t of the sequence (search/tensor_split.py).
        gradient_sync: when sharded stages reduce gradients: "last" (accumulated whole, reduced once a step),
            "every" (reduce-scattered per micro-batch: FSDP's FULL_SHARD under zero3); None: the cheaper that fits.
        kernels: the kernel set priced, "eager" or "fused" (rules/kernels.py).
    """

    tensor: int = 1
    stages: int = 1
    micro_batch_size: int = 1
    sharding: str = "none"
    schedule: str = "1f1b"
    virtual_stages: int = 1
    recompute: Literal["none", "full", "attention", "selective-op"] = "none"
    order: RankOrder = "replicas-together"
    sequence_parallel: bool = False
    gradient_sync: str | None = None
    kernels: str = "eager"


def price_fixed(
    graph: nx.DiGraph, order: list[str], cluster: Cluster, cost: CostModel, fixed: Fixed, *,
    precision: Precision | None = None, shardable: Shardable | None = None, optimizer: str = "adam",
    headroom: float = 0.9,
) -> ClusterSolution:
    """The best cuts of `fixed` on `cluster` and what they predict: step (objective, s), work and memory per stage.

    Raises:
        PartitionError: a configuration that does not divide the cluster or the batch, or that the model cannot
            take (tensor degree, sharding); InfeasibleError (devices/search.py) when it does not fit in memory, naming
            the memory per GPU it needs.
    """
    t, p = fixed.tensor, fixed.stages
    batch = batch_size(graph) or 1
    if cluster.size % (t * p) or batch % fixed.micro_batch_size:
        raise PartitionError(f"tensor {t} x stages {p} must divide the {cluster.size} GPUs of {cluster.shape}, and "
                             f"micro_batch_size {fixed.micro_batch_size} the batch of {batch}")
    d, m = cluster.size // (t * p), batch // fixed.micro_batch_size
    if m % d:
        raise PartitionError(f"{m} micro-batches of {fixed.micro_batch_size} cannot be dealt to {d} replicas; "
                             "give a micro-batch size that leaves a multiple of the replicas")
    check_virtual(fixed.virtual_stages, p, m // d)
    if fixed.schedule not in searched_names() or fixed.recompute not in ("none", "full", *PRICED_ONLY_RECOMPUTE):
        raise PartitionError(f"schedule={fixed.schedule!r}, recompute={fixed.recompute!r}: use one of "
                             f"{list(searched_names())} (virtual_stages > 1 for interleaved) and 'none', 'full', "
                             "'attention' or 'selective-op'")
    space = SearchSpace(micro_batches=m, schedules=(fixed.schedule,), recompute=fixed.recompute, precision=precision,
                        tensor=(t,), sharding=(fixed.sharding,), sequence_parallel=fixed.sequence_parallel,
                        gradient_sync=(fixed.gradient_sync,) if fixed.gradient_sync is not None else None,
                        kernels=fixed.kernels)
    prepared = prepare_search(graph, order, cluster, cost, space, optimizer=space.optimizer(optimizer),
                              headroom=headroom, shardable=shardable)
    nodes = prepared.nodes(graph, order, cost)

    def run(choice: Choice, bound: float) -> tuple[ClusterSolution, float]:
        problem, axes = prepared.priced(choice, nodes)
        found = search_cluster(problem, cluster, micro_batches=[m], schedules=(fixed.schedule,), stages=p,
                               cuts=prepared.cuts, orders=(fixed.order,), axes=axes, virtual=fixed.virtual_stages,
                               better_than=bound)
        return found, found.step_s

    solution, choice = search_choices(space, run)
    solution.choice = choice
    return solution
