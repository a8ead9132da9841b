"""The cluster search's best candidates simulated as the runtime orders them: the second look that picks among them.

The search's objective (cluster/search.py: fill(m, p, d) x the slowest stage's work) ranks
configurations; the TOP distinct ones are then simulated on replica 0's pipeline (`replica_step`,
the schedule simulator on stage times) with each stage's exposed data-parallel collectives, and the
fastest kept. See [Note: replicas in the runtime's order].
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from cost_model.cluster_shape import Cluster
from cost_model.data_parallel import DataParallelCost
from partitioner.place.cluster.candidate import evaluate_cluster, refine, solve_candidate, space_of, windows
from partitioner.place.cluster.space import Axes, Candidate, ClusterSolution, layout
from partitioner.place.cluster.stages import stage_units
from partitioner.place.search.boundaries import boundary_bytes
from partitioner.place.search.compare import priced_schedule
from partitioner.place.search.problem import SearchProblem
from partitioner.predict.schedule_sim import simulate_schedule
from runtime.plan import Plan, StagePlan
from runtime.schedule_ranks import rank_schedule

__all__ = ["replica_step", "runtime_step_s", "second_look"]


def second_look(space: Axes | SearchProblem, cluster: Cluster, solution: ClusterSolution, share: np.ndarray,
                schedules: Sequence[str]) -> ClusterSolution:
    """The search's best candidates simulated in the order the runtime runs them, the fastest kept.

    [Note: replicas in the runtime's order] runtime/schedule_ranks.py gives replica j of a stage the
    micro-batches i = j mod d, and under 1F1B each replica runs its own 1F1B over them, so d equal replicas
    of every stage are d pipelines of m / d micro-batches (the objective's fill(m, p, d) counts that, but
    not the all-reduce's overlap or uneven stage times). Each candidate (and schedule) is simulated on
    replica 0's pipeline (exact for equal replicas: replica_fold.py); the objective's best is kept only
    where it is also the fastest here. Sharded replicas (data_split "slice") run every micro-batch on
    their slice in lockstep: d pipelines of m / d micro-batches too.
    """
    space = space_of(space)
    best: tuple[float, Candidate, str] | None = None
    timed: dict[str, float] = {}
    for candidate in solution.candidates:
        for schedule in schedules:
            step = runtime_step_s(space, cluster, candidate, schedule, share)
            extra = (f", t={candidate.tensor}" if candidate.tensor > 1 else "") + (
                f", {candidate.sharding}" if candidate.sharding != "none" else "")
            timed[f"{len(candidate.bounds) - 1}x{candidate.d}, m={candidate.m}, {candidate.order}{extra}, "
                  f"{schedule}"] = step
            if step < (best[0] if best is not None else np.inf):
                best = (step, candidate, schedule)
    if best is None or solution.cuts is None:
        return solution
    _, chosen, schedule = best
    mode = priced_schedule(schedules)
    found = solve_candidate(space, cluster, refine(space, cluster, chosen, solution.cuts, mode), (schedule,))
    found.tried, found.searched, found.pruned = timed, solution.searched, solution.pruned
    found.candidates, found.cuts = solution.candidates, solution.cuts
    return found


def runtime_step_s(space: Axes | SearchProblem, cluster: Cluster, candidate: Candidate, schedule: str,
                   share: np.ndarray) -> float:
    """Seconds of one step of a candidate as the runtime orders it (see second_look); inf over memory."""
    space = space_of(space)
    m, d, order, bounds, t, sharding = candidate[1:]
    problem = space.degree(t).problem
    p, capacity = len(bounds) - 1, float(problem.capacity.min())
    wins = windows(cluster, layout(p, d, order, t), capacity)
    _, _, memory = evaluate_cluster(space, wins, bounds, m, schedule, t, sharding)
    if max(memory) > capacity:
        return float("inf")
    times = problem.micro_batch_times(m)[0]
    recv = _boundary_bytes(problem, bounds)
    forward, backward, message, reduce = [], [], [0.0] * p, []
    rule = space.rule
    for s, (a, b) in enumerate(zip(bounds, bounds[1:])):
        total, fwd = float(times[a:b].sum()), float((times[a:b] * share[a:b]).sum())
        params, ring, link = float(problem.param_bytes[a:b].sum()), wins[s][4], wins[s][2]
        if rule is None or rule.legacy(sharding):
            forward.append(fwd)
            backward.append(total - fwd)
            reduce.append(ring[0] + ring[1] * params if ring is not None and params > 0 else 0.0)
        else:
            blocks = space.blocks if space.blocks is not None else np.full(problem.n, -1)
            unit, _ = stage_units(problem.param_bytes, blocks, a, b)
            c, g = rule.states.itemsize("compute"), rule.states.itemsize("grad")
            dp = DataParallelCost(sharding, d, (ring[0], ring[1]) if ring is not None else (0.0, 0.0), c, g)
            elements = params / rule.itemsize
            unit = min(unit / rule.itemsize, elements)
            before, after = dp.gathers(elements, unit, fwd, total - fwd)
            forward.append(fwd + before)
            backward.append(total - fwd + after)
            reduce.append(float(dp.per_step(elements, unit, fwd, total - fwd)))
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


def _boundary_bytes(problem: SearchProblem, bounds: Sequence[int]) -> list[float]:
    """Bytes (whole batch) each stage receives from earlier ones, for cuts `bounds`."""
    cuts = np.asarray(bounds, dtype=np.int64)
    recv, _ = boundary_bytes(problem.producers, problem.consumers, problem.value_bytes, problem.n, cuts)
    return [float(recv[s, s + 1]) for s in range(len(bounds) - 1)]
