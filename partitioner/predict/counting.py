"""A placement's per-stage times and bytes: the counting rules of [Note: stage counting rules] (assemble.py).

Times, messages, parameter bytes and weight groups of stages placed on devices, by one set of
rules for every planner; `assemble` adds memory, programs and predictions.
"""

from __future__ import annotations

from typing import Any, Collection, Mapping, Sequence

import networkx as nx
import torch

from cost_model.interface import CostModel, forward_time
from partitioner.errors import PartitionError
from runtime.plan import Plan, StagePlan

__all__ = ["allreduce_seconds", "count_stages", "device_key", "output_bytes", "stage_edges", "weight_groups"]


def count_stages(
    graph: nx.DiGraph, stage_nodes: Sequence[Sequence[str]], stage_devices: Sequence[str], ranks: list[list[int]],
    device_of: Mapping[int, torch.device], cost: CostModel,
) -> tuple[list[StagePlan], dict[tuple[int, int], float]]:
    """Each stage's times and bytes (memory aside), and the ms of one message per (src, dst) stage."""
    devices = [list(dict.fromkeys(device_of[r] for r in rs)) for rs in ranks]
    edges = stage_edges(graph, stage_nodes)
    message = {(a, b): _message_ms(cost, nbytes, devices[a], devices[b]) for (a, b), nbytes in edges.items()}
    message.update({(b, a): _message_ms(cost, nbytes, devices[b], devices[a]) for (a, b), nbytes in edges.items()})
    params = _param_bytes(graph, stage_nodes)
    stages = []
    for s, names in enumerate(stage_nodes):
        same = {device_key(cost, d): d for d in devices[s]}  # replicas on devices of equal rates: time one
        compute, fwd = max(_times(graph, names, d, cost) for d in same.values())
        comm = sum(t for (a, b), t in message.items() if s in (a, b))
        reduce = allreduce_seconds(cost, params[s], [device_of[r] for r in ranks[s]]) * 1e3
        stages.append(StagePlan(
            index=s, device=stage_devices[s], nodes=list(names), predicted_ms=(compute + comm) / len(ranks[s]),
            compute_ms=compute, forward_ms=fwd, backward_ms=compute - fwd, comm_ms=comm, allreduce_ms=reduce,
            param_bytes=params[s], recv_bytes=sum(n for (a, b), n in edges.items() if b == s),
            send_bytes=sum(n for (a, b), n in edges.items() if a == s), ranks=ranks[s],
            reads_from=sorted(a for a, b in edges if b == s),
        ))
    return stages, message


def stage_edges(graph: nx.DiGraph, stage_nodes: Sequence[Sequence[str]]) -> dict[tuple[int, int], int]:
    """Bytes per micro-batch each stage reads from each earlier one: {(producer, reader): bytes}.

    Raises:
        PartitionError: a stage reads a value made by a later stage.
    """
    stage_of = {n: s for s, names in enumerate(stage_nodes) for n in names}
    last = len(stage_nodes) - 1
    edges: dict[tuple[int, int], int] = {}
    seen: set[tuple[str, int]] = set()

    def read(value: str, reader: int) -> None:
        producer = stage_of.get(value)
        if producer is None or producer == reader or (value, reader) in seen:
            return
        if producer > reader:
            raise PartitionError(f"stage {reader} reads {value!r} made by the later stage {producer}; "
                                 "number stages in topological order")
        seen.add((value, reader))
        edges[(producer, reader)] = edges.get((producer, reader), 0) + int(graph.nodes[value].get("out_bytes", 0) or 0)

    for s, names in enumerate(stage_nodes):
        for n in names:
            for u in graph.predecessors(n):
                read(u, s)
    for n, attrs in graph.nodes(data=True):
        if attrs.get("op") == "output":
            for u in graph.predecessors(n):
                read(u, last)
    return edges


def output_bytes(graph: nx.DiGraph, names: Collection[str] | None = None) -> int:
    """Bytes of the values the model returns (what its loss reads), of those made by `names` where given."""
    return sum(int(graph.nodes[u].get("out_bytes", 0) or 0) for n, a in graph.nodes(data=True)
               if a.get("op") == "output" for u in graph.predecessors(n) if names is None or u in names)


def allreduce_seconds(cost: Any, nbytes: float, devices: Sequence[torch.device]) -> float:
    """All-reduce of `nbytes` over `devices`: the cost model's `allreduce_time`, else a ring of its transfers.

    The ring: 2 (n - 1) steps, each moving nbytes / n over every hop, paced by the slowest hop.
    """
    n = len(devices)
    if n < 2 or nbytes <= 0:
        return 0.0
    method = getattr(cost, "allreduce_time", None)
    if callable(method):
        return float(method(nbytes, list(devices)))
    hop = max(cost.transfer_time(nbytes / n, devices[i], devices[(i + 1) % n]) for i in range(n))
    return 2 * (n - 1) * float(hop)


def device_key(cost: Any, device: torch.device) -> Any:
    """Devices with equal keys take equal node times: the cost model's rates where it has them, else the name."""
    spec = getattr(cost, "spec", None)
    if callable(spec):
        r = spec(device)
        return (r.flops_per_s, r.bytes_per_s, r.op_overhead_s, r.kind or device.type)
    return str(device)


def _times(graph: nx.DiGraph, names: Sequence[str], device: torch.device, cost: CostModel) -> tuple[float, float]:
    """(forward + backward, forward) ms of one micro-batch of `names` on `device`."""
    total = sum(cost.node_time(graph.nodes[n], device) for n in names)
    return float(total) * 1e3, float(sum(forward_time(cost, graph.nodes[n], device) for n in names)) * 1e3


def _message_ms(cost: CostModel, nbytes: int, src: Sequence[torch.device], dst: Sequence[torch.device]) -> float:
    """Ms of one message between two stages: the slowest pair of their replicas' devices."""
    if nbytes <= 0:
        return 0.0
    return 1e3 * max((float(cost.transfer_time(nbytes, a, b)) for a in src for b in dst), default=0.0)


def _param_bytes(graph: nx.DiGraph, stage_nodes: Sequence[Sequence[str]]) -> list[int]:
    """Each stage's weights: its nodes' own, plus each weight node (get_attr) in its first reading stage."""
    stage_of = {n: s for s, names in enumerate(stage_nodes) for n in names}
    out = [int(sum(graph.nodes[n].get("param_bytes", 0) or 0 for n in names)) for names in stage_nodes]
    for n, attrs in graph.nodes(data=True):
        readers = [stage_of[u] for u in graph.successors(n) if u in stage_of]
        if attrs.get("op") == "get_attr" and readers:
            out[min(readers)] += int(attrs.get("param_bytes", 0) or 0)
    return out


def weight_groups(graph: nx.DiGraph, plan: Plan) -> list[tuple[list[int], list[int], int]]:
    """(ranks, stages, bytes) of each weight node (get_attr) read by stages on several ranks."""
    stage_of = plan.stage_of()
    out = []
    for n, attrs in graph.nodes(data=True):
        stages = sorted({stage_of[u] for u in graph.successors(n) if u in stage_of})
        ranks = sorted({r for s in stages for r in plan.stages[s].ranks})
        if attrs.get("op") == "get_attr" and len(ranks) > 1 and len(stages) > 1 and attrs.get("param_bytes"):
            out.append((ranks, stages, int(attrs["param_bytes"])))
    return out
