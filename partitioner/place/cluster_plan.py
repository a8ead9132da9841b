"""A cluster-scale plan: a traced graph and a Cluster into a count search (cluster_search.py), then a Plan.

The Plan is counted as for every planner (`assemble`), on one pipeline standing for all: with d
replicas and d | m, replica j of every stage takes micro-batches j, j + d, ..., so each replica
runs the same m / d micro-batches of the same program (see partitioner/predict/replica_fold.py). Its
numbers are then priced by where the ranks sit: messages between replica j of neighbouring
stages (the slowest pair), each stage's all-reduce over its ranks (Cluster.allreduce_time).

Stage devices are local names (`cuda:{rank % gpus_per_host}`): torch caps a device index at 127,
and a rank's GPU is its host's local one; `stages[s].ranks` hold the global positions. Plans up to
EAGER_RANKS ranks and EAGER_WORK micro-batches x stages are lowered and simulated here
(partitioner/predict/simulator.py). Larger plans keep `programs` empty and are lowered where they run
(runtime/distributed.py lowers a plan without programs; `simulate(plan)` lowers one replica of each
stage: replica_fold.py), so a 16,384-rank plan is a few hundred KB; their predicted step is replica
0's chain of stages as the runtime orders it, simulated on stage times (`replica_step`, equal to the
program simulator's: tests/test_cluster_search.py), which takes far less than lowering every rank.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Sequence

import networkx as nx
import numpy as np
import torch

from cost_model.cluster_shape import Cluster, ClusterDeviceSet
from cost_model.interface import CostModel, forward_time
from cost_model.memory import optimizer_states
from partitioner.errors import PartitionError
from partitioner.place.chain import boundary_bytes
from partitioner.place.cluster_search import (
    Candidate,
    ClusterSolution,
    block_cuts,
    default_micro_batches,
    evaluate_cluster,
    layout,
    refine,
    search_cluster,
    slowest_pair,
    solve_candidate,
    windows,
)
from partitioner.place.graph_costs import batch_size, graph_values, node_times, per_micro_batch
from partitioner.place.hybrid import SCHEDULES, InfeasibleError
from partitioner.place.hybrid_problem import HybridProblem
from partitioner.predict.assemble import assemble, predict
from partitioner.predict.counting import stage_edges
from partitioner.predict.lowering import lower_plan, replica_groups
from partitioner.predict.schedule_sim import simulate_schedule
from runtime.plan import Plan, RecomputeMode, StagePlan
from runtime.schedule_ranks import rank_schedule

__all__ = [
    "EAGER_RANKS", "EAGER_WORK", "cluster_of", "cluster_problem", "forward_share", "local_device",
    "plan_on_cluster", "replica_step", "runtime_step_s", "second_look", "solution_plan",
]

EAGER_RANKS = 512  # plans on more ranks keep `programs` empty (lowered where they run)
EAGER_WORK = 20_000  # ... and plans of more micro-batches x stages


def cluster_of(cost: Any) -> Cluster | None:
    """The Cluster a cost model prices (AnalyticCostModel over a ClusterDeviceSet, possibly wrapped), or None."""
    for model in (cost, getattr(cost, "base", None), getattr(cost, "fallback", None)):
        devices = getattr(model, "device_set", None)
        if isinstance(devices, ClusterDeviceSet):
            return devices.cluster
    return None


def local_device(cluster: Cluster, rank: int) -> str:
    """The torch name of `rank`'s GPU on its own host."""
    return f"cuda:{rank % cluster.gpus_per_host}"


def cluster_problem(
    graph: nx.DiGraph, order: Sequence[str], device: torch.device, cost: CostModel, micro_batches: Sequence[int],
    *, optimizer: str = "adam", headroom: float = 0.9,
) -> HybridProblem:
    """The node arrays of a HybridProblem (hybrid_problem.py) for one GPU type (no per-device arrays: the
    search prices links by rank), node times asked at each micro-batch size `micro_batches` make."""
    size = batch_size(graph)
    probes: set[int] = set()
    if size is not None and size > 1:
        probes = {size, size // 2}
        for m in micro_batches:
            low, extra = divmod(size, m)
            probes |= {low, low + 1} if extra else {low}
    fixed, batch, size_times = node_times(graph, order, [device], cost, probes)
    producers, consumers, sizes, params, saved = graph_values(graph, order)
    spec = getattr(cost, "spec", None)
    memory = headroom * float(spec(device).memory_bytes) if callable(spec) else 0.0
    try:
        states = optimizer_states(optimizer)
    except ValueError as exc:
        raise PartitionError(str(exc)) from None
    return HybridProblem(
        fixed, batch, np.zeros(1, dtype=np.int64), np.array(producers, dtype=np.int64), consumers, np.array(sizes),
        params, saved, np.zeros((1, 1, 2)), np.zeros((1, 2, 2)), np.array([memory if memory > 0 else np.inf]), states,
        size, [str(device)], np.array([float(graph.nodes[x].get("out_bytes", 0) or 0) for x in order]),
        size_times or None,
    )


def plan_on_cluster(
    graph: nx.DiGraph,
    order: Sequence[str],
    cluster: Cluster,
    cost: CostModel,
    *,
    micro_batches: int | Sequence[int] | None = None,
    schedules: Sequence[str] = SCHEDULES,
    stages: int | None = None,
    replicate: bool = True,
    optimizer: str = "adam",
    headroom: float = 0.9,
    recompute: Literal["none", "full", "auto"] = "none",
) -> tuple[Plan, ClusterSolution]:
    """Plan `order` onto every GPU of `cluster`: stages, replicas, micro-batches, schedule and rank placement.

    Args:
        graph: annotated for one step's whole batch.
        cost: node times on the cluster's GPU (its device `cuda:0`); links and all-reduces come from `cluster`.
        micro_batches: the count, or candidates (default: cluster_search.default_micro_batches).
        recompute: "full" searches with every stage recomputing its forward in backward (it keeps only its
            inputs; the forward runs twice), as the final plan then runs (`StagePlan.recompute`);
            "auto" searches without and, only if nothing fits, with it.

    Raises:
        InfeasibleError: nothing fits; the message names the memory per GPU needed.
    """
    device = torch.device("cuda:0")
    cuts = block_cuts([str(graph.nodes[x].get("module", "") or "") for x in order])
    limit = min(len(order), len(cuts) - 1 if cuts is not None else len(order))
    if micro_batches is None:
        ms = default_micro_batches(cluster.size, batch_size(graph), limit)
    else:
        ms = sorted({micro_batches} if isinstance(micro_batches, int) else set(micro_batches))
    if not ms or any(isinstance(m, bool) or not isinstance(m, int) or m < 1 for m in ms):
        raise PartitionError(f"micro_batches={micro_batches!r}: give a positive integer or a list of them")
    ds = {cluster.size // p for p in range(1, limit + 1) if cluster.size % p == 0}
    ms = [m for m in ms if any(m % d == 0 for d in ds)] or ms  # counts no replica count divides are never tried
    if recompute not in ("none", "full", "auto"):
        raise PartitionError(f"recompute={recompute!r}; use 'none', 'full' or 'auto'")
    plain = cluster_problem(graph, order, device, cost, ms, optimizer=optimizer, headroom=headroom)
    share = forward_share(graph, order, device, cost)
    for mode in ("none", "full") if recompute == "auto" else (recompute,):
        problem = plain if mode == "none" else recomputing(plain, share)
        try:
            solution = search_cluster(problem, cluster, micro_batches=ms, schedules=schedules, stages=stages,
                                      replicate=replicate, cuts=cuts)
        except InfeasibleError:
            if mode == "full" or recompute != "auto":
                raise
            continue
        solution = second_look(problem, cluster, solution, share, schedules)
        capacity = float(problem.capacity[0])
        return solution_plan(graph, order, solution, cluster, cost, optimizer=optimizer, capacity=capacity,
                             recompute=mode), solution
    raise AssertionError("unreachable: the last mode raises or returns")


def recomputing(problem: HybridProblem, share: np.ndarray) -> HybridProblem:
    """`problem` as full recomputation runs it: nothing saved but the stage inputs (the receive bytes the
    search counts anyway), and every node's forward once more in backward (its time x (1 + forward share))."""
    grow = 1.0 + share
    return dataclasses.replace(
        problem, saved_bytes=np.zeros_like(problem.saved_bytes), fixed_times=problem.fixed_times * grow,
        batch_times=problem.batch_times * grow,
        size_times={k: v * grow for k, v in problem.size_times.items()} if problem.size_times else None)


def forward_share(graph: nx.DiGraph, order: Sequence[str], device: torch.device, cost: CostModel) -> np.ndarray:
    """[n] the forward's fraction of each node's forward + backward time (whole batch)."""
    out = np.full(len(order), 1 / 3)
    for i, name in enumerate(order):
        whole = cost.node_time(graph.nodes[name], device)
        if whole > 0:
            out[i] = forward_time(cost, graph.nodes[name], device) / whole
    return out


def second_look(problem: HybridProblem, cluster: Cluster, solution: ClusterSolution, share: np.ndarray,
                schedules: Sequence[str]) -> ClusterSolution:
    """The search's best candidates simulated in the order the runtime runs them, the fastest kept.

    [Note: replicas in the runtime's order] runtime/schedule_ranks.py gives replica j of a stage the
    micro-batches i = j mod d, and under 1F1B each replica runs its own 1F1B over them, so d equal replicas
    of every stage are d pipelines of m / d micro-batches (the objective's fill(m, p, d) counts that, but
    not the all-reduce's overlap or uneven stage times). Each candidate (and schedule) is simulated on
    replica 0's pipeline (exact for equal replicas: replica_fold.py); the objective's best is kept only
    where it is also the fastest here.
    """
    best: tuple[float, Candidate, str] | None = None
    timed: dict[str, float] = {}
    for candidate in solution.candidates:
        for schedule in schedules:
            step = runtime_step_s(problem, cluster, candidate, schedule, share)
            _, m, d, order, bounds = candidate
            timed[f"{len(bounds) - 1}x{d}, m={m}, {order}, {schedule}"] = step
            if step < (best[0] if best is not None else np.inf):
                best = (step, candidate, schedule)
    if best is None or solution.cuts is None:
        return solution
    _, chosen, schedule = best
    mode = "1f1b" if "1f1b" in schedules else "gpipe"
    found = solve_candidate(problem, cluster, refine(problem, cluster, chosen, solution.cuts, mode), (schedule,))
    found.tried, found.searched, found.pruned = timed, solution.searched, solution.pruned
    found.candidates, found.cuts = solution.candidates, solution.cuts
    return found


def runtime_step_s(problem: HybridProblem, cluster: Cluster, candidate: Candidate, schedule: str,
                   share: np.ndarray) -> float:
    """Seconds of one step of a candidate as the runtime orders it (see second_look); inf over memory."""
    _, m, d, order, bounds = candidate
    p, capacity = len(bounds) - 1, float(problem.capacity.min())
    wins = windows(cluster, layout(p, d, order), capacity)
    _, _, memory = evaluate_cluster(problem, wins, bounds, m, schedule)
    if max(memory) > capacity:
        return float("inf")
    times = problem.micro_batch_times(m)[0]
    recv = _boundary_bytes(problem, bounds)
    forward, backward, message, reduce = [], [], [0.0] * p, []
    for s, (a, b) in enumerate(zip(bounds, bounds[1:])):
        total, fwd = float(times[a:b].sum()), float((times[a:b] * share[a:b]).sum())
        forward.append(fwd)
        backward.append(total - fwd)
        params, ring, link = float(problem.param_bytes[a:b].sum()), wins[s][4], wins[s][2]
        reduce.append(ring[0] + ring[1] * params if ring is not None and params > 0 else 0.0)
        if link is not None and recv[s] > 0:
            message[s] = link[0] + link[1] * recv[s] / m  # between stage s - 1 and s, either way
    return replica_step(schedule, m, d, forward, backward, message, reduce)


def replica_step(schedule: str, m: int, d: int, forward: Sequence[float], backward: Sequence[float],
                 message: Sequence[float], reduce: Sequence[float]) -> float:
    """One step of p stages with d equal replicas each over m micro-batches, as the runtime runs it: d
    pipelines of m / d micro-batches ([Note: a replica runs its own 1F1B] in runtime/schedule_ranks.py), so
    replica 0's chain is simulated (partitioner/predict/schedule_sim.py) on its stage times; `message[s]` is a message
    between stages s - 1 and s, either way, and `reduce[s]` stage s's all-reduce after its last backward."""
    p, n = len(forward), m // d
    chain = [[s - 1] if s else [] for s in range(p)]
    stages = [StagePlan(index=s, device=f"stage {s}", nodes=[], forward_ms=forward[s], backward_ms=backward[s],
                        reads_from=chain[s]) for s in range(p)]
    lists = rank_schedule(schedule, n, [[s] for s in range(p)], chain)
    return simulate_schedule(Plan(stages=stages, micro_batches=n), lists,
                             transfer_ms=lambda src, dst, nbytes: message[max(src, dst)],
                             allreduce_ms=lambda stage: reduce[stage]).makespan_ms


def _boundary_bytes(problem: HybridProblem, bounds: Sequence[int]) -> list[float]:
    """Bytes (whole batch) each stage receives from earlier ones, for cuts `bounds`."""
    cuts = np.asarray(bounds, dtype=np.int64)
    recv, _ = boundary_bytes(problem.producers, problem.consumers, problem.value_bytes, problem.n, cuts)
    return [float(recv[s, s + 1]) for s in range(len(bounds) - 1)]


def solution_plan(
    graph: nx.DiGraph, order: Sequence[str], solution: ClusterSolution, cluster: Cluster, cost: CostModel, *,
    optimizer: str = "adam", capacity: float = float("inf"), recompute: RecomputeMode = "none",
) -> Plan:
    """The Plan of a cluster solution (module docstring): one pipeline assembled, then priced by its ranks."""
    p, d, m = solution.stages, solution.replicas, solution.micro_batches
    if m % d:
        raise PartitionError(f"{m} micro-batches over {d} replicas: the cluster plan needs d | m")
    bounds = solution.bounds
    stage_nodes = [list(order[a:b]) for a, b in zip(bounds, bounds[1:])]
    graph_mb = per_micro_batch(graph, m)
    cap = int(capacity) if np.isfinite(capacity) else None
    plan = assemble(graph_mb, stage_nodes, ["cuda:0"] * p, cost, micro_batches=m // d,
                    schedule=solution.schedule,
                    stage_ranks=[[s] for s in range(p)], placement="hybrid", groups=[], optimizer=optimizer,
                    capacity_bytes=[cap] * p, recompute=[recompute] * p)
    ranks = solution.ranks  # one pipeline of m / d micro-batches holds what each replica holds in flight
    message: dict[tuple[int, int], float] = {}
    for (a, b), nbytes in stage_edges(graph_mb, stage_nodes).items():
        if nbytes > 0:
            src, dst = slowest_pair(cluster, ranks[a], ranks[b])
            message[(a, b)] = message[(b, a)] = 1e3 * cluster.transfer_time(nbytes, src, dst)
    reduce: dict[tuple[int, ...], float] = {}
    for stage in plan.stages:
        s = stage.index
        stage.ranks = list(ranks[s])
        stage.device = local_device(cluster, ranks[s][0])
        stage.comm_ms = sum(t for (a, b), t in message.items() if s in (a, b))
        stage.allreduce_ms = 1e3 * cluster.allreduce_time(stage.param_bytes, stage.ranks) if d > 1 else 0.0
        stage.predicted_ms = (stage.compute_ms + stage.comm_ms) / d
        reduce[tuple(sorted(stage.ranks))] = stage.allreduce_ms
    plan.micro_batches, plan.gpus_per_host, plan.programs = m, cluster.gpus_per_host, []
    plan.alternatives = {name: 1e3 * s for name, s in sorted(solution.tried.items(), key=lambda kv: kv[1])[:8]}
    if cluster.size > EAGER_RANKS or m * p > EAGER_WORK:  # replica 0's pipeline in the runtime's order
        plan.predicted_step_ms = replica_step(
            plan.schedule, m, d, [s.forward_ms for s in plan.stages], [s.backward_ms for s in plan.stages],
            [message.get((s - 1, s), 0.0) for s in range(p)], [s.allreduce_ms for s in plan.stages])
        return plan
    devices = {r: local_device(cluster, r) for rs in ranks for r in rs}
    plan.programs = lower_plan(plan, replica_groups(plan), devices)
    predict(plan, lambda src, dst, nbytes: message.get((src, dst), 0.0),
            lambda group: reduce.get(tuple(sorted(group)), 0.0))
    return plan
