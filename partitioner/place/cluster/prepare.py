"""What a cluster search of one graph needs, worked out once: micro-batch counts, cut candidates, the problem, axes.

`cluster_problem` asks the cost model for the node arrays at each micro-batch size the counts make (one
GPU type: the search prices links by rank); `prepare_search` adds the cut candidates (the model's blocks),
each node's forward share and recomputation segment, and the axes the space allows (cluster/axes.py:
tensor degrees with their problems, sharding modes). plan_on_cluster, price_fixed and search_priced
start from it.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import networkx as nx
import numpy as np
import torch

from cost_model.cluster_shape import Cluster
from cost_model.interface import CostModel
from cost_model.memory import optimizer_states
from partitioner.capture.shardable_groups import Shardable, ShardGroup
from partitioner.errors import PartitionError
from partitioner.place.cluster.axes import cluster_axes
from partitioner.place.cluster.space import Axes, tensor_degrees
from partitioner.place.search.axes import Choice, NodeFacts, priced
from partitioner.place.search.blocks import block_cuts
from partitioner.place.search.counts import cluster_counts, given_counts
from partitioner.place.search.graph_costs import batch_size, forward_share, graph_values, node_times
from partitioner.place.search.problem import SearchProblem
from partitioner.place.search.recompute import node_segments
from partitioner.place.search.space import SearchSpace

__all__ = ["Prepared", "cluster_problem", "memory_bandwidth", "prepare_search"]

DEVICE = torch.device("cuda:0")  # every GPU of a cluster is priced as one


def cluster_problem(
    graph: nx.DiGraph, order: Sequence[str], device: torch.device, cost: CostModel, micro_batches: Sequence[int],
    *, optimizer: str = "adam", headroom: float = 0.9,
) -> SearchProblem:
    """The node arrays of a SearchProblem (search/problem.py) for one GPU type (no per-device arrays: the
    search prices links by rank), node times asked at each micro-batch size `micro_batches` make."""
    size = batch_size(graph)
    probes: set[int] = set()
    if size is not None and size > 1:
        probes = {size, size // 2}
        for m in micro_batches:
            low, extra = divmod(size, m)
            probes |= {low, low + 1} if extra else {low}
    fixed, batch, size_times = node_times(graph, order, [device], cost, probes)
    producers, consumers, sizes, params, saved = graph_values(graph, order, device.type)
    spec = getattr(cost, "spec", None)
    memory = headroom * float(spec(device).memory_bytes) if callable(spec) else 0.0
    try:
        states = optimizer_states(optimizer)
    except ValueError as exc:
        raise PartitionError(str(exc)) from None
    return SearchProblem(
        fixed, batch, np.zeros(1, dtype=np.int64), np.array(producers, dtype=np.int64), consumers, np.array(sizes),
        params, saved, np.zeros((1, 1, 2)), np.zeros((1, 2, 2)), np.array([memory if memory > 0 else np.inf]), states,
        size, [str(device)], np.array([float(graph.nodes[x].get("out_bytes", 0) or 0) for x in order]),
        size_times or None, step_bytes_per_s=memory_bandwidth(cost, device),
    )


def memory_bandwidth(cost: CostModel, device: torch.device) -> float:
    """The HBM bytes/s `cost` prices `device`'s memory-bound kernels at (the optimizer step streams at it too);
    0 where the cost model has no table GPU for it."""
    rates = getattr(cost, "gpu_rates", None)
    found = rates(device) if callable(rates) else None
    return float(found[2]) if found is not None else 0.0


class Prepared(NamedTuple):
    """What a cluster search of one graph needs: micro-batch counts, cut candidates, the node arrays, each node's
    forward share, the axes (tensor degrees with their problems, sharding modes) and each degree's split groups."""

    micro_batches: list[int]
    cuts: np.ndarray | None
    plain: SearchProblem
    share: np.ndarray
    axes: Axes
    groups: dict[int, list[ShardGroup]]
    segment: np.ndarray  # [n] each node's recomputation segment (rules.segments), for `recomputing`

    def nodes(self, graph: nx.DiGraph, order: Sequence[str], cost: CostModel) -> NodeFacts:
        """The per-node facts a search axis prices with (search/axes.py), from those worked out here."""
        return NodeFacts(graph, order, DEVICE, cost, share=self.share, segment=self.segment)

    def priced(self, choice: Choice, nodes: NodeFacts) -> tuple[SearchProblem, Axes]:
        """The problem and the axes as `choice` runs them (search.axes.priced)."""
        return priced(self.plain, choice, nodes), self.axes.priced(lambda x: priced(x, choice, nodes))


def prepare_search(
    graph: nx.DiGraph, order: Sequence[str], cluster: Cluster, cost: CostModel, space: SearchSpace, *,
    optimizer: str = "adam", headroom: float = 0.9, shardable: Shardable | None = None,
) -> Prepared:
    """The inputs of `search_cluster` for `order` on `cluster` (module docstring), in what `space` allows.

    Raises:
        PartitionError: a tensor degree or sharding mode the model or cluster cannot take.
    """
    cuts = block_cuts([str(graph.nodes[x].get("module", "") or "") for x in order])
    limit = min(len(order), len(cuts) - 1 if cuts is not None else len(order))
    legal = sorted({t for g in shardable.groups for t in g.degrees}) if shardable is not None else []
    degrees = space.tensor_degrees(tensor_degrees(cluster.size, cluster.gpus_per_host, legal), cluster.shape)
    if space.micro_batches is None:
        ms = sorted({m for t in degrees for m in cluster_counts(cluster.size // t, batch_size(graph), limit)})
    else:
        ms = sorted(given_counts(space.micro_batches))
    ds = {cluster.size // t // p for t in degrees for p in range(1, limit + 1) if cluster.size % (t * p) == 0}
    ms = [m for m in ms if any(m % d == 0 for d in ds)] or ms  # counts no replica count divides are never tried
    plain = cluster_problem(graph, order, DEVICE, cost, ms, optimizer=optimizer, headroom=headroom)
    share = forward_share(graph, order, DEVICE, cost)
    axes, groups = cluster_axes(graph, order, cluster, cost, plain, share, cuts, degrees, space=space,
                                shardable=shardable, optimizer=optimizer)
    segment = node_segments([(x, str(graph.nodes[x].get("module", "") or "")) for x in order])
    return Prepared(ms, cuts, plain, share, axes, groups, segment)
