"""A traced graph and a cost model into the device-list search's problem: node times per device kind, links, rings.

search/graph_costs.py asks the cost model for node times and values; this adds what a list of devices
holds: the kind of each device, the link between every two, the all-reduce over every run of
consecutive devices, and each device's capacity.
"""

from __future__ import annotations

from typing import Any, Sequence

import networkx as nx
import numpy as np
import torch

from cost_model.interface import CostModel
from cost_model.memory import optimizer_states
from partitioner.errors import PartitionError
from partitioner.place.search.counts import micro_batch_counts
from partitioner.place.search.graph_costs import affine, batch_size, graph_values, node_times
from partitioner.place.search.problem import SearchProblem
from partitioner.predict.counting import device_key

__all__ = ["device_problem"]


def device_problem(
    graph: nx.DiGraph,
    order: Sequence[str],
    devices: Sequence[torch.device | str],
    cost: CostModel,
    memory_bytes: Sequence[float] | None = None,
    optimizer: str = "adam",
    headroom: float = 0.9,
    *,
    micro_batches: int | Sequence[int] | None = None,
) -> SearchProblem:
    """Gather a SearchProblem from a graph annotated for one step's whole batch.

    Node times are asked per kind of device (same rates) at each micro-batch size that the
    candidate counts (`micro_batches`, default search.counts.micro_batch_counts) make, with the
    node's shapes cut along the batch (`at_batch`), so a matrix product of a smaller batch is
    priced with a smaller M, not a smaller K. Whole batch and half of it also give the fit
    overhead + batch part (cut candidates; counts not priced). Capacity is `memory_bytes` per
    device, else `headroom` times the cost model's spec memory, else no limit.
    """
    devs = [torch.device(d) for d in devices]
    D = len(devs)
    keys: dict[Any, int] = {}
    kind = np.array([keys.setdefault(device_key(cost, d), len(keys)) for d in devs])
    size = batch_size(graph)
    probes: set[int] = set()
    if size is not None and size > 1:
        probes = {size, size // 2}
        for m in micro_batch_counts(D, size, micro_batches):
            low, extra = divmod(size, m)
            probes |= {low, low + 1} if extra else {low}
    kinds = [devs[int(np.argmax(kind == k))] for k in range(len(keys))]
    fixed, batch, size_times = node_times(graph, order, kinds, cost, probes)
    producers, consumers, sizes, params, saved = graph_values(
        graph, order, "cpu" if all(d.type == "cpu" for d in devs) else "cuda")
    link = np.zeros((D, D, 2))
    for i, j in ((i, j) for i in range(D) for j in range(D) if i != j):  # ranks: a device may repeat
        link[i, j] = affine(cost.transfer_time, devs[i], devs[j])
    allreduce, reduce = np.zeros((D, D + 1, 2)), getattr(cost, "allreduce_time", None)
    for w, r in [(first, r) for first in range(D) for r in range(2, D - first + 1)]:
        if callable(reduce):
            allreduce[w, r] = affine(reduce, devs[w : w + r])
        else:  # ring all-reduce over the slowest hop (cost_model/comm.py)
            lat, slope = np.max([link[w + x, w + (x + 1) % r] for x in range(r)], axis=0)
            allreduce[w, r] = (2 * (r - 1) * lat, 2 * (r - 1) / r * slope)
    spec = getattr(cost, "spec", None)
    if memory_bytes is not None and len(memory_bytes) != D:
        raise PartitionError(f"memory_bytes has {len(memory_bytes)} entries for {D} devices; give one per device")
    totals = [headroom * float(spec(d).memory_bytes) if callable(spec) else 0.0 for d in devs]
    given = [float(x) for x in memory_bytes] if memory_bytes is not None else None
    capacity = np.array(given if given is not None else [t if t > 0 else np.inf for t in totals])
    try:
        states = optimizer_states(optimizer)
    except ValueError as exc:
        raise PartitionError(str(exc)) from None
    return SearchProblem(
        fixed, batch, kind, np.array(producers, dtype=np.int64), consumers, np.array(sizes), params, saved,
        link, allreduce, capacity, states, size, [str(d) for d in devs],
        np.array([float(graph.nodes[x].get("out_bytes", 0) or 0) for x in order]), size_times or None,
    )
