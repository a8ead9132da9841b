"""Where a priced configuration's step goes: its slowest stage's work by kind, the bubble, for benchmarks/published.py.

For the slowest stage of a cluster solution (cluster.fixed.price_fixed), per step (n = micro-batches a
pipeline runs):

    GEMMs                n x forward + backward of the nodes that count FLOPs inside Linear layers
    attention products   n x the other FLOP-counting nodes (score products, fused attention)
    memory-bound ops     n x every other node (norms, softmax, dropout, element-wise, copies)
    recomputed forward   n x the stage's forward again (full recomputation)
    tensor collectives   n x the split groups' collectives on the tensor group's ring
    pipeline sends       n x 2 directions x v crossings x (receive + send) on the stage's slowest link
    data-parallel, rest  the stage's work less the above (its replicas' collectives, overheads)
    pipeline bubble      the step less the stage's work (fill: (n + (p - 1) / v) / n)

Every figure comes from the same cost model and collectives the search used.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Sequence

import networkx as nx
import numpy as np
import torch

from cost_model.cluster_shape import Cluster
from cost_model.collectives import ring_of
from cost_model.interface import CostModel, forward_time
from cost_model.ops import classify
from partitioner.capture.shardable_groups import Shardable
from partitioner.place.cluster.candidate import slowest_pair
from partitioner.place.cluster.fixed import Fixed
from partitioner.place.cluster.space import ClusterSolution
from partitioner.place.search.blocks import block_cuts
from partitioner.place.search.degrees import split_groups
from partitioner.place.search.graph_costs import batch_size, per_micro_batch
from partitioner.place.search.tensor_split import collective_seconds, split_graph

__all__ = ["step_parts"]

_DEVICE = torch.device("cuda:0")


def _kind(attrs: dict[str, Any]) -> str:
    if classify(attrs, attrs.get("kind")) not in ("gemm", "conv"):
        return "memory-bound ops"
    return "GEMMs" if str(attrs.get("kind", "")) in ("Linear", "Conv1d", "Conv2d") else "attention products"


def step_parts(graph: nx.DiGraph, order: Sequence[str], shardable: Shardable | None, cluster: Cluster,
               cost: CostModel, fixed: Fixed, found: ClusterSolution) -> dict[str, float]:
    """Seconds of one step by kind (module docstring), for the slowest stage of `found`."""
    t, m, d, v = fixed.tensor, found.micro_batches, found.replicas, found.virtual
    n = m // d
    cuts = block_cuts([str(graph.nodes[x].get("module", "") or "") for x in order])
    groups = split_groups(shardable, t, order, cuts) if shardable is not None and t > 1 else []
    split = split_graph(graph, groups, t, fixed.sequence_parallel) if t > 1 else graph
    per_mb = per_micro_batch(split, m)
    s = int(np.argmax(found.work_s))
    names = list(order[found.bounds[s]:found.bounds[s + 1]])
    inside = set(names)
    parts: dict[str, float] = defaultdict(float)
    for name in names:
        attrs = per_mb.nodes[name]
        whole, forward = cost.node_time(attrs, _DEVICE), forward_time(cost, attrs, _DEVICE)
        parts[_kind(attrs)] += n * whole
        if fixed.recompute == "full":
            parts["recomputed forward"] += n * forward
    ring, batch = ring_of(cluster, range(t)), float(batch_size(graph) or 1)
    for group in groups:
        if inside.issuperset(group.nodes):
            parts["tensor collectives"] += n * sum(collective_seconds(graph, group, ring, batch / m))
    compute = set(order)
    recv = sum(float(per_mb.nodes[u].get("out_bytes", 0) or 0) for u in
               {u for x in names for u in per_mb.predecessors(x) if u not in inside and u in compute})
    send = sum(float(per_mb.nodes[x].get("out_bytes", 0) or 0) for x in names
               if any(w not in inside and w in compute for w in per_mb.successors(x)))
    ranks = found.ranks
    for other, nbytes in ((s - 1, recv), (s + 1, send)):
        if 0 <= other < len(ranks) and nbytes > 0:
            a, b = slowest_pair(cluster, ranks[min(s, other)], ranks[max(s, other)])
            parts["pipeline sends"] += n * 2 * v * cluster.transfer_time(nbytes, a, b)
    work = found.work_s[s]
    parts["data-parallel, rest"] = max(0.0, work - sum(parts.values()))
    parts["pipeline bubble"] = max(0.0, found.step_s - work)
    return dict(parts)
