"""The tensor degrees and sharding modes a cluster plan searches, each degree with its problem (cluster.space.Axes).

    tensor degrees   1, and each degree of the model's split groups (partitioner.capture.shardable) that
                     divides the GPUs and a host's (tensor ranks share its NVLink / NVSwitch), and twice
                     a host (priced across hosts; kept only where that is faster): cluster.space.tensor_degrees,
                     of which the search space allows some (search.space.SearchSpace.tensor_degrees)
    sharding modes   what the space allows (SearchSpace.sharding_modes): by default "none", and with a
                     training precision given, "zero1", "zero2", "zero3" (FSDP2 over a stage's replicas,
                     rules/sharding.py); without one, plans are priced as before precision was an input
                     (every state at the model's dtype, the all-reduce after the backward)

A degree t prices the groups it splits (search.degrees.split_groups: t among their degrees, no cut
candidate inside) on a tensor group of t consecutive ranks from rank 0 (one host where t divides its GPUs).
"""

from __future__ import annotations

from typing import Sequence

import networkx as nx
import numpy as np
import torch

from cost_model.cluster_shape import Cluster
from cost_model.collectives import ring_of
from cost_model.interface import CostModel
from cost_model.precision import DTYPE_BYTES, dtype_name
from partitioner.capture.shardable_groups import Shardable, ShardGroup
from partitioner.place.cluster.space import Axes
from partitioner.place.search.blocks import block_ids
from partitioner.place.search.degrees import Degrees, TensorDegree, split_groups
from partitioner.place.search.problem import SearchProblem
from partitioner.place.search.space import SearchSpace
from partitioner.place.search.states import StateRule
from partitioner.place.search.tensor_split import split_problem

__all__ = ["cluster_axes", "param_itemsize"]


def param_itemsize(graph: nx.DiGraph) -> int:
    """Bytes of one weight element in the graph: the dtype of the first weight read (get_attr), else of the first
    layer with weights (its output's), else 4."""
    for op in ("get_attr", "call_module"):
        for _, attrs in graph.nodes(data=True):
            if attrs.get("op") == op and attrs.get("param_bytes") and attrs.get("dtypes"):
                try:
                    return DTYPE_BYTES[dtype_name(attrs["dtypes"][0])]
                except ValueError:
                    continue
    return 4


def cluster_axes(
    graph: nx.DiGraph, order: Sequence[str], cluster: Cluster, cost: CostModel, plain: SearchProblem,
    share: np.ndarray, cuts: np.ndarray | None, degrees: Sequence[int], *, space: SearchSpace,
    shardable: Shardable | None, optimizer: str = "adam",
) -> tuple[Axes, dict[int, list[ShardGroup]]]:
    """The Axes of a cluster search (module docstring) over tensor `degrees` (space.tensor_degrees'), and the groups
    each degree splits."""
    modes = space.sharding_modes()
    device = torch.device("cuda:0")
    splits, groups = [], {}
    for t in degrees:
        chosen = split_groups(shardable, t, order, cuts) if shardable is not None else []
        if t > 1 and not chosen:
            continue
        problem = split_problem(plain, graph, order, device, cost, t, chosen, ring_of(cluster, range(t)),
                                space.sequence_parallel)
        splits.append(TensorDegree.of(t, [problem], chosen, order))
        groups[t] = chosen
    rule = StateRule(space.precision, param_itemsize(graph), optimizer)
    blocks = np.array(block_ids([str(graph.nodes[x].get("module", "") or "") for x in order]), dtype=np.int64)
    return Axes(Degrees(tuple(splits)), modes, rule, blocks, share), groups
