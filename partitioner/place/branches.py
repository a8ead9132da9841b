"""Branch placement: the parallel branches of fork/join regions side by side on different devices.

For each region with two or more working branches (an Inception block, a multi-tower
model), the branches are assigned to devices to minimize the region's time, paying for the
tensors that cross to other devices and back (exhaustive search over assignments when they
are few, longest-branch-first otherwise). Everything else stays on the first device. The
result is a DAG of stages: one per (device, region) group of branches and one per stretch
of the main line, numbered in topological order:

    x ─► [stem] ─┬─► [b1 b3]  device 0 ─┬─► [join, head]
                 └─► [b2 b4]  device 1 ─┘
"""

from __future__ import annotations

import heapq
import itertools
from typing import Sequence

import networkx as nx
import torch

from cost_model.analytic import CostModel
from cost_model.interface import forward_time
from partitioner.capture.regions import fork_join_regions, iter_regions
from partitioner.predict.assemble import assemble
from runtime.plan import Plan

__all__ = ["assign_branches", "plan_branches"]

_EXHAUSTIVE_LIMIT = 20000  # assignments tried exhaustively; beyond, longest-branch-first


def _crossing(graph: nx.DiGraph, group: set[str]) -> tuple[float, float]:
    """Bytes entering `group` from outside and leaving it (weights excluded), each value once."""
    into = {u for n in group for u in graph.predecessors(n) if u not in group and graph.nodes[u]["op"] != "get_attr"}
    out = {n for n in group if any(v not in group for v in graph.successors(n))}
    size = lambda names: float(sum(graph.nodes[x]["out_bytes"] for x in names))  # noqa: E731
    return size(into), size(out)


def assign_branches(
    branch_times: Sequence[Sequence[tuple[float, float]]],
    comm_times: Sequence[Sequence[float]],
    home: int,
) -> tuple[list[int], float]:
    """Devices for branches minimizing the region's time in training.

    The join waits for every branch's forward and the fork for every branch's backward,
    so the region takes (slowest device's forward load) + (slowest device's backward
    load): the two phases are balanced separately (a branch heavy in forward, such as max
    pooling, pairs with ones heavy in backward).

    Args:
        branch_times: [branch][device] (forward, backward) time of the branch there.
        comm_times: [branch][device] time to move the branch's inputs there and its
            outputs back, forward and backward together (zero on `home`).
        home: the device that runs the region's fork and join.

    Returns:
        (device per branch, the region's time).
    """
    k, d = len(branch_times), len(branch_times[0])

    def makespan(choice: Sequence[int | None]) -> float:
        fwd, bwd = [0.0] * d, [0.0] * d
        for b, dev in enumerate(choice):
            if dev is None:  # not placed yet
                continue
            f, w = branch_times[b][dev]
            fwd[dev] += f + comm_times[b][dev] / 2
            bwd[dev] += w + comm_times[b][dev] / 2
        return max(fwd) + max(bwd)

    if d**k <= _EXHAUSTIVE_LIMIT:
        best = min(itertools.product(range(d), repeat=k), key=lambda c: (makespan(c), sum(x != home for x in c)))
        return list(best), makespan(best)
    partial: list[int | None] = [None] * k
    for b in sorted(range(k), key=lambda b: -sum(branch_times[b][home])):
        spans = []
        for dev in range(d):
            partial[b] = dev
            spans.append((makespan(partial), dev != home, dev))
        partial[b] = min(spans)[2]
    choice = [int(x) for x in partial if x is not None]
    return choice, makespan(choice)


def plan_branches(
    graph: nx.DiGraph,
    order: Sequence[str],
    devices: Sequence[torch.device],
    cost: CostModel,
    micro_batches: int,
    min_gain: float = 0.05,
) -> Plan:
    """A Plan placing parallel branches on different devices (slot i runs on devices[i]).

    A region is split only where that cuts its predicted time by more than `min_gain`.
    Each stage's `ranks` holds its device slot: the rank under torchrun, the worker in one
    process (a slot left unused runs an empty program). The numbers come from `assemble`.
    """
    position = {name: i for i, name in enumerate(order)}
    slots = range(len(devices))
    times = {d: {n: cost.node_time(graph.nodes[n], d) for n in order} for d in set(devices)}
    forward = {d: {n: forward_time(cost, graph.nodes[n], d) for n in order} for d in set(devices)}
    slot_of = dict.fromkeys(order, 0)
    region_of: dict[str, int] = {}

    for index, (_, region) in enumerate(iter_regions(fork_join_regions(graph))):
        if not region.parallel or any(n in region_of for n in region.nodes):
            continue
        branches = [[n for n in b if n in position] for b in region.branches]
        branches = [b for b in branches if b]
        if len(branches) < 2:
            continue
        home = slot_of.get(region.fork, 0) if region.fork in position else 0
        bt = [
            [(sum(forward[devices[d]][n] for n in b), sum(times[devices[d]][n] - forward[devices[d]][n] for n in b))
             for d in slots]
            for b in branches
        ]
        ct = []
        for b in branches:
            into, out = _crossing(graph, set(b))
            ct.append([
                0.0 if d == home else 2 * (cost.transfer_time(into, devices[home], devices[d])
                                           + cost.transfer_time(out, devices[d], devices[home]))
                for d in slots
            ])
        choice, span = assign_branches(bt, ct, home)
        if span >= (1 - min_gain) * sum(sum(t[home]) for t in bt):
            continue
        for b, dev in zip(branches, choice):
            for n in b:
                slot_of[n] = dev
                region_of[n] = index

    # Stages: runs of one label (slot, region) in a topological order that stays on a label
    # while it can, so a region's branches on one device form one stage.
    label_of = {n: (slot_of[n], region_of.get(n, -1)) for n in order}
    grouped = _grouped_order(graph, order, label_of)
    ordered: list[list[str]] = []
    for n in grouped:
        if ordered and label_of[ordered[-1][-1]] == label_of[n]:
            ordered[-1].append(n)
        else:
            ordered.append([n])
    slots_used = [slot_of[g[0]] for g in ordered]
    return assemble(
        graph, ordered, [devices[slot] for slot in slots_used], cost, micro_batches=micro_batches,
        stage_ranks=[[slot] for slot in slots_used], rank_devices=devices, placement="branches",
    )


def _grouped_order(graph: nx.DiGraph, order: Sequence[str], label_of: dict[str, tuple[int, int]]) -> list[str]:
    """A topological order of `order` that, among ready nodes, keeps to the last node's label."""
    position = {n: i for i, n in enumerate(order)}
    waiting = {n: sum(1 for u in graph.predecessors(n) if u in position) for n in order}
    by_label: dict[tuple[int, int], list[tuple[int, str]]] = {}
    anywhere: list[tuple[int, str]] = []

    def push(n: str) -> None:
        heapq.heappush(by_label.setdefault(label_of[n], []), (position[n], n))
        heapq.heappush(anywhere, (position[n], n))

    for n in order:
        if waiting[n] == 0:
            push(n)
    done: set[str] = set()
    out: list[str] = []
    while anywhere:
        heap = by_label.get(label_of[out[-1]]) if out else None
        while heap and heap[0][1] in done:
            heapq.heappop(heap)
        source = heap if heap else anywhere
        while source[0][1] in done:
            heapq.heappop(source)
        _, n = heapq.heappop(source)
        done.add(n)
        out.append(n)
        for v in graph.successors(n):
            if v in waiting:
                waiting[v] -= 1
                if waiting[v] == 0:
                    push(v)
        while anywhere and anywhere[0][1] in done:
            heapq.heappop(anywhere)
    return out
