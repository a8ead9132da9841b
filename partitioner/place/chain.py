"""Split the graph into contiguous stages, one per device, minimizing the slowest stage.

Stage s runs compute nodes [a, b) of the topological order on devices[s]. Its time for one
micro-batch is forward + backward compute plus moving its boundary tensors both ways:

    T_s(a, b) = C_s[b] - C_s[a] + 2 * (recv_s(R[a, b]) + send_s(S[a, b]))

R[a, b] is the bytes of values made before a and read in [a, b) (skips come straight from
the stage that made them); S[a, b] the bytes made in [a, b) and read at b or later. A
dynamic program over (stage, end) finds the split whose largest T_s is smallest, exactly;
R and S for every (a, b) come from 2-D difference arrays in O(n^2) numpy work.

T_s is the search's objective only: the returned Plan is counted and simulated by
partitioner/predict/assemble.py, as every planner's is.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Sequence

import networkx as nx
import numpy as np
import torch

from cost_model.analytic import CostModel
from partitioner.errors import PartitionError
from partitioner.place.search.boundaries import boundary_bytes
from partitioner.predict.assemble import assemble
from runtime.plan import Plan, Schedule

__all__ = ["SplitProblem", "plan_pipeline", "solve"]

log = logging.getLogger(__name__)

# Above this many nodes, cuts are only considered every few nodes (memory is O(cuts^2)).
MAX_CUTS = 3000


@dataclass
class SplitProblem:
    """The numbers the split needs, with no torch or graph objects."""

    node_times: np.ndarray  # [stages, n] forward+backward seconds of node i on stage s's device
    producers: np.ndarray  # [v] position of the producing node (-1: a pipeline input)
    consumers: list[np.ndarray]  # [v] sorted positions reading the value (n: the model output)
    value_bytes: np.ndarray  # [v]
    recv_link: np.ndarray  # [stages, 2] (latency s, seconds per byte) into stage s
    send_link: np.ndarray  # [stages, 2] out of stage s
    replicas: np.ndarray | None = None  # [stages] copies of each stage sharing its micro-batches
    forced: np.ndarray | None = None  # positions every split must cut before (pipe_split markers)

    @property
    def n(self) -> int:
        return int(self.node_times.shape[1])

    @property
    def stages(self) -> int:
        return int(self.node_times.shape[0])

    def bytes_in_out(self, a: int, b: int) -> tuple[float, float]:
        """Reference (slow, direct) recv and send bytes of a stage covering [a, b)."""
        recv = send = 0.0
        n = self.n
        for p, cons, nbytes in zip(self.producers, self.consumers, self.value_bytes):
            if p < a and any(a <= c < b for c in cons):
                recv += nbytes
            last = cons.max() if len(cons) else -1
            if a <= p < b and (last >= b if last < n else b < n):
                send += nbytes
        return recv, send

    def stage_time(self, s: int, a: int, b: int) -> float:
        """Reference (slow, direct) time of stage s covering [a, b)."""
        recv, send = self.bytes_in_out(a, b)
        compute = float(self.node_times[s, a:b].sum())
        total = compute + 2 * (_link(self.recv_link[s], recv) + _link(self.send_link[s], send))
        return float(total) / self.replicas_of(s)

    def replicas_of(self, s: int) -> int:
        return 1 if self.replicas is None else int(self.replicas[s])


def _link(link: np.ndarray, nbytes: Any) -> Any:
    return np.where(np.asarray(nbytes) > 0, link[0] + link[1] * np.asarray(nbytes), 0.0)


def solve(problem: SplitProblem, max_cuts: int = MAX_CUTS) -> tuple[list[int], float]:
    """Stage boundaries [0, b1, ..., n] minimizing the largest stage time, and that time."""
    n, p = problem.n, problem.stages
    if p > n:
        raise PartitionError(f"{p} stages but the graph has only {n} compute nodes; pass at most {n} devices")
    forced = np.unique(problem.forced) if problem.forced is not None else np.zeros(0, dtype=np.int64)
    forced = forced[(forced > 0) & (forced < n)]
    among = len(forced) + 1 > p  # fewer stages than marked segments: cut only at markers, the best p - 1 of them
    if among:
        log.info("the model's pipe_split() markers (or split_spec) make %d segments for %d stages: the cost model "
                 "chooses %d of the %d marked cuts", len(forced) + 1, p, p - 1, len(forced))
        cuts = np.unique(np.concatenate([[0], forced, [n]])).astype(np.int64)
    else:
        step = max(1, math.ceil(n / max_cuts))
        cuts = np.unique(np.concatenate([np.arange(0, n, step), np.arange(0, p), [n], forced]).astype(np.int64))
    recv, send = boundary_bytes(problem.producers, problem.consumers, problem.value_bytes, n, cuts)
    k = len(cuts)
    not_after = cuts[None, :] <= cuts[:, None]  # b <= a: no such stage
    if len(forced) and not among:  # a stage may not span a marker: [cuts[i], cuts[j]) holds none strictly inside
        is_forced = np.isin(cuts, forced).astype(np.int64)
        upto = np.cumsum(is_forced)  # markers at grid points <= j
        inside = (upto[None, :] - is_forced[None, :]) - upto[:, None]
        not_after = not_after | (inside > 0)
    comm_of: dict[tuple[float, ...], np.ndarray] = {}  # one matrix per distinct pair of links
    dp = np.full(k, math.inf)
    dp[0] = 0.0
    choice = np.zeros((p, k), dtype=np.int64)
    columns = np.arange(k)
    for s in range(p):
        key = (*problem.recv_link[s], *problem.send_link[s])
        if key not in comm_of:
            comm = 2 * (_link(problem.recv_link[s], recv) + _link(problem.send_link[s], send))
            comm[not_after] = math.inf
            comm_of[key] = comm
        prefix = np.concatenate([[0.0], np.cumsum(problem.node_times[s])])[cuts]
        t = comm_of[key] + prefix[None, :]
        t -= prefix[:, None]
        if problem.replicas_of(s) != 1:
            t /= problem.replicas_of(s)  # r replicas share the micro-batches
        np.maximum(t, dp[:, None], out=t)
        choice[s] = t.argmin(axis=0)
        dp = t[choice[s], columns]
    picks = [k - 1]
    for s in range(p - 1, -1, -1):
        picks.append(int(choice[s, picks[-1]]))
    picks.reverse()
    return [int(cuts[i]) for i in picks], float(dp[k - 1])


def _affine(cost: CostModel, src: torch.device, dst: torch.device) -> tuple[float, float]:
    """(latency, seconds per byte) of the link, read off two transfer sizes."""
    one, big = cost.transfer_time(1, src, dst), cost.transfer_time(1 + (1 << 20), src, dst)
    slope = (big - one) / (1 << 20)
    return one - slope, slope


def make_problem(
    graph: nx.DiGraph, order: Sequence[str], devices: Sequence[torch.device], cost: CostModel
) -> SplitProblem:
    """Gather per-node times on each stage's device and the values crossing positions."""
    position = {name: i for i, name in enumerate(order)}
    n = len(order)
    per_device = {d: np.array([cost.node_time(graph.nodes[name], d) for name in order]) for d in set(devices)}
    producers, consumers, sizes = [], [], []
    for name, attrs in graph.nodes(data=True):
        if attrs["op"] != "placeholder" and name not in position:
            continue
        cons = sorted(
            {position[u] if u in position else n for u in graph.successors(name)
             if u in position or graph.nodes[u]["op"] == "output"}
        )
        if cons:
            producers.append(position.get(name, -1))
            consumers.append(np.array(cons, dtype=np.int64))
            sizes.append(float(attrs["out_bytes"]))
    p = len(devices)
    none = (0.0, 0.0)
    recv = [none] + [_affine(cost, devices[s - 1], devices[s]) for s in range(1, p)]
    send = [_affine(cost, devices[s], devices[s + 1]) for s in range(p - 1)] + [none]
    return SplitProblem(
        node_times=np.stack([per_device[d] for d in devices]) if n else np.zeros((p, 0)),
        producers=np.array(producers, dtype=np.int64),
        consumers=consumers,
        value_bytes=np.array(sizes),
        recv_link=np.array(recv),
        send_link=np.array(send),
    )


def plan_pipeline(
    graph: nx.DiGraph,
    order: Sequence[str],
    devices: Sequence[torch.device],
    cost: CostModel,
    micro_batches: int,
    replicas: Sequence[int] | None = None,
    schedule: Schedule = "gpipe",
    *,
    stage_ranks: Sequence[Sequence[int]] | None = None,
    forced: Sequence[int] = (),
) -> Plan:
    """The best contiguous split of `order` over `devices` (one entry per stage), as a Plan.

    With `replicas`, stage s runs on replicas[s] ranks (numbered stage by stage) that share
    its micro-batches, so its time counts 1 / replicas[s]; `stage_ranks` names the ranks
    instead (interleaved: stage s on rank s % world). The split minimizes the bottleneck
    above; the Plan's numbers come from `partitioner.predict.assemble`. `forced` are positions in
    `order` every split cuts before (pipe_split markers): as many stages as segments put the
    cuts exactly there; more stages split the segments further by cost.
    """
    if stage_ranks is None and replicas is not None:
        starts = np.cumsum([0, *replicas])
        stage_ranks = [list(range(int(a), int(b))) for a, b in zip(starts, starts[1:])]
    problem = make_problem(graph, order, devices, cost)
    if stage_ranks is not None:
        problem.replicas = np.asarray([len(r) for r in stage_ranks], dtype=np.int64)
    if forced:
        problem.forced = np.asarray(forced, dtype=np.int64)
    bounds, _ = solve(problem)
    plan = assemble(
        graph, [list(order[a:b]) for a, b in zip(bounds, bounds[1:])], devices, cost,
        micro_batches=micro_batches, schedule=schedule, stage_ranks=stage_ranks,
    )
    for stage, start in zip(plan.stages, bounds):
        stage.cut_from_marker = start in set(forced)
    return plan
