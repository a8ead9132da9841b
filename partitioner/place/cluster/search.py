"""Planning at cluster scale: a homogeneous cluster searched by counts, not by device lists.

On `hosts x gpus_per_host` GPUs of one type, GPUs differ only by which host they sit on, so a
plan is a handful of counts (tensor degree t, stages p, replicas d of every stage with t * p * d = GPUs,
micro-batches m with d | m, schedule, sharding of the replicas), a rank order, and p - 1 cuts:

    for (p, d, m, t, sharding) in order of a lower bound      pruned: the states of P / p weights alone are over
                                                                     capacity, or the bound is no better than the best
        for each rank order (RANK_ORDERS)
            windows: each stage's receive/send links and all-reduce, priced by where its ranks sit (Cluster)
            DP over cut candidates: f_s[j] = min_i max(f_{s-1}[i], W_s[i, j])        p K^2, K candidates
    refine: node-level candidates around the chosen cuts, same DP for the chosen counts

W_s (a stage's work per step) and its memory are devices/search.py's; the step is fill(m, p, d) * max W, with
fill = (m/d + p - 1) / (m/d): d equal replicas of every stage are d pipelines of m/d micro-batches
(runtime/schedule_ranks.py), each filling in p - 1 micro-batch times (devices/search.py's (m + p - 1) / m at d = 1).
W and memory come from search/stage_costs.py (`stage_parts`, `replica_in_flight`), as devices/search.py's do, so where
both searches price a layout alike (one host, equal replicas) the DP over every cut is exact for each count.
Micro-batch i runs on `ranks[i % d]` of each stage, so replica j of stage s talks to replica j of
s + 1; a stage's link is the slowest of those pairs. Cut candidates come from the caller (the
model's repeated blocks), else every position of a small graph, else equal counts and equal times.
Tensor degrees and sharding modes (cluster.space.Axes): a tensor degree t prices its own problem (each
of t ranks runs 1/t of the split layers, their collectives added: search/tensor_split.py) on the first rank
of each replica (cluster.space.layout: TP innermost); a sharding mode prices the replicas' collectives
and states (search/split_costs.py), then each stage of the chosen plan takes the fastest mode that fits it
(cheapest_modes: stages holding fewer micro-batches may gather less). Without Axes: stages, replicas, m alone.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from cost_model.cluster_shape import Cluster
from partitioner.errors import PartitionError
from partitioner.place.cluster.candidate import Pricer, dp, fill, refine, solve_candidate, windows
from partitioner.place.cluster.space import (
    Axes,
    Candidate,
    ClusterSolution,
    RankOrder,
    layout,
)
from partitioner.place.search.compare import SCHEDULES, priced_schedule
from partitioner.place.search.infeasible import InfeasibleError, held_text, size_text
from partitioner.place.search.problem import SearchProblem, Window
from partitioner.place.search.progress import report as _report
from partitioner.place.search.split_costs import lower_static_bytes
from partitioner.place.search.stage_costs import cut_candidates
from partitioner.place.search.virtual_stages import scaled_windows
from rules.schedules import searched_names

__all__ = ["COARSE", "TOP", "search_cluster"]

COARSE = 256  # cut candidates of the first pass when the caller gives none
TOP = 3  # candidates (best of distinct stages x replicas x tensor x sharding) kept for a second look (cluster/plan.py)


def _key(p: int, d: int, m: int, order: str, t: int, sharding: str) -> str:
    """How `tried` names a configuration (tensor and sharding only where they are not 1 and "none")."""
    extra = (f", t={t}" if t > 1 else "") + (f", {sharding}" if sharding != "none" else "")
    return f"{p}x{d}, m={m}, {order}{extra}"


def search_cluster(
    problem: SearchProblem,
    cluster: Cluster,
    *,
    micro_batches: Sequence[int],
    schedules: Sequence[str] = SCHEDULES,
    stages: int | None = None,
    replicate: bool = True,
    cuts: np.ndarray | None = None,
    orders: Sequence[RankOrder] = ("replicas-together", "pipelines-together"),
    axes: Axes | None = None,
    virtual: int | Sequence[int] = 1,
    better_than: float = math.inf,
    refine_cuts: bool = True,
    named: str | None = None,
) -> ClusterSolution:
    """The counts, rank order and cuts with the smallest objective (module docstring) on all of `cluster`.

    Args:
        problem: node arrays (cluster.plan.cluster_problem); its per-device fields are unused.
        micro_batches: candidate counts; a count is tried with the replica counts that divide it.
        stages: force this many stages; replicate=False: one replica per stage.
        cuts: first-pass cut candidates (positions 0..n, e.g. `block_cuts`); default: all or `COARSE` even ones.
        axes: tensor degrees (each with its problem) and sharding modes to try; default: t = 1, no sharding.
        virtual: chunks per rank under interleaved 1F1B (search/virtual_stages.py; 1: the schedules given), or the
            counts to search: v > 1 where p >= 2, m / d is a multiple of p and p v chunks have a cut
            candidate each (the solution's `virtual`; its `candidates` are then those of v = 1).
        better_than: an objective (s) already found elsewhere: configurations whose bound is no better are
            skipped, and InfeasibleError (no memory named) says when nothing beats it.
        refine_cuts: False: the cuts are chosen among `cuts` alone, not refined around them (a run's own stage
            boundaries: `cuts` holds exactly them and `stages` their count).
        named: the cluster as errors name it, where `cluster` is one rank's view of the caller's (a context
            group's: cluster/split_axes.py); default `cluster.shape`.

    Raises:
        PartitionError: bad arguments; InfeasibleError (memory per GPU named) when nothing fits.
    """
    D, n = cluster.size, problem.n
    if not schedules or any(s not in searched_names() for s in schedules):
        raise PartitionError(f"schedules={list(schedules)!r}; use a non-empty subset of {list(searched_names())}")
    mode = priced_schedule(schedules)
    capacity = float(problem.capacity.min())
    given = np.unique(np.concatenate([cuts, [0, n]])).astype(np.int64) if cuts is not None else None
    coarse = given if given is not None else cut_candidates(problem, COARSE)
    space = axes if axes is not None else Axes.whole(problem)
    pricers = {s.tensor: Pricer(s.problem, s.allowed(coarse), space, s) for s in space.degrees}
    states = 2 + problem.optimizer_states
    pairs = [(p, D // p) for p in range(1, min(D, n, len(coarse) - 1) + 1) if D % p == 0
             and (stages is None or p == stages) and (replicate or D // p == 1)]
    if not pairs:
        raise PartitionError(f"stages={stages}, replicate={replicate}: no stage count p <= {min(D, n)} with "
                             f"{D} GPUs = p x replicas; give stages that divide {D}, or drop stages=")
    vs = sorted({virtual} if isinstance(virtual, int) else set(virtual))
    if not vs or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in vs):
        raise PartitionError(f"virtual={virtual!r}: give chunks per rank, a whole number 1 or more, or a list of them")
    pruned = 0
    configs = []
    for split in space.degrees:
        t, total_params = split.tensor, float(split.problem.param_bytes.sum())
        for p, d in [(p, D // t // p) for p in range(1, min(D // t, n) + 1) if D % (t * p) == 0] if t > 1 else pairs:
            if (stages is not None and p != stages) or (not replicate and d != 1) or p > len(pricers[t].cuts) - 1:
                continue
            if d % space.expert:  # experts split over `expert` replicas of each stage
                continue
            for sharding in space.modes_for(d):
                least = lower_static_bytes(total_params / p, space.rule, sharding, d, 1) if space.rule else math.nan
                if (states * total_params / p if math.isnan(least) else least) > capacity:  # states alone: too much
                    pruned += 1
                    continue
                for m in (m for m in micro_batches if m % d == 0):
                    least = float(split.problem.micro_batch_times(m).min(0).sum())
                    for v in vs:
                        if v == 1 or (p >= 2 and (m // d) % p == 0 and p * v <= len(pricers[t].cuts) - 1):
                            configs.append((fill(m, p, d, mode, v) * (m // d) * least / p, p, d, m, t, sharding, v))
    configs.sort()
    best: tuple[Candidate, int] | None = None
    found: list[tuple[Candidate, int]] = []
    tried: dict[str, float] = {}
    searched = 0
    made: dict[tuple[int, int, str, int, int], list[Window]] = {}
    for done, (bound, p, d, m, t, sharding, v) in enumerate(configs):
        _report(f"{p} stages x {d} replicas" + (f" x {t} tensor" if t > 1 else "") + f", {m} micro-batches",
                done, len(configs))
        if bound >= (best[0].step if best is not None else better_than):
            pruned += 1
            continue
        for order in orders:
            if (d == 1 or p == 1) and order != orders[0]:  # one layout whatever the order
                continue
            if (p, d, order, t, v) not in made:
                made[p, d, order, t, v] = scaled_windows(windows(cluster, layout(p, d, order, t), capacity), v)
            searched += 1
            pricer = pricers[t]
            value, idx = dp(pricer.values(made[p, d, order, t, v], m, mode, sharding=sharding, virtual=v))
            step = fill(m, p, d, mode, v) * value
            if np.isfinite(step):
                tried[_key(p, d, m, order, t, sharding) + (f", v={v}" if v > 1 else "")] = step
                found.append((Candidate(step, m, d, order, [int(pricer.cuts[i]) for i in idx], t, sharding), v))
                if step < (best[0].step if best is not None else better_than):
                    best = found[-1]
    _report("refining cuts", len(configs), len(configs))
    if best is None and math.isfinite(better_than):
        raise InfeasibleError(f"nothing fits with an objective below {better_than:.4g} s", [])
    if best is None:
        raise _infeasible(space, cluster, micro_batches, mode, pricers, capacity, stages, replicate, vs[0],
                          named or cluster.shape)
    found.sort(key=lambda c: c[0].step)
    distinct: dict[tuple[int, int, int, str], Candidate] = {}  # the best of each (stages, replicas, tensor, sharding)
    for candidate, v in found:
        if v == 1:
            distinct.setdefault((len(candidate.bounds) - 1, candidate.d, candidate.tensor, candidate.sharding),
                                candidate)
    chosen, v = best
    refined = refine(space, cluster, chosen, coarse, mode, v) if refine_cuts else chosen
    solution = solve_candidate(space, cluster, refined, schedules, v)
    solution.tried, solution.searched, solution.pruned = tried, searched, pruned
    solution.candidates, solution.cuts = list(distinct.values())[:TOP], coarse
    return solution


def _infeasible(
    space: Axes, cluster: Cluster, micro_batches: Sequence[int], mode: str, pricers: dict[int, Pricer],
    capacity: float, stages: int | None, replicate: bool, virtual: int, named: str,
) -> InfeasibleError:
    """The error naming the memory per GPU the least demanding configuration would need."""
    least: tuple[float, int, int, int, int, str] | None = None
    fullest: tuple[list[Window], list[int]] = ([], [])  # the least one's windows and cuts
    D = cluster.size
    for split in space.degrees:
        t = split.tensor
        for p in (p for p in range(1, min(D // t, len(pricers[t].cuts) - 1) + 1) if D % (t * p) == 0):
            d = D // t // p
            if (stages is not None and p != stages) or (not replicate and d != 1):
                continue
            for sharding in space.modes_for(d):
                for m in (m for m in micro_batches if m % d == 0):
                    wins = scaled_windows(windows(cluster, layout(p, d, "replicas-together", t), capacity), virtual)
                    need, idx = dp(pricers[t].values(wins, m, mode, memory=True, sharding=sharding, virtual=virtual))
                    if np.isfinite(need) and (least is None or need < least[0]):
                        least, fullest = (need, p, d, m, t, sharding), (wins, idx)
    problem = space.degrees.degrees[0].problem
    if least is None:
        return InfeasibleError(
            f"no configuration puts all {cluster.size} GPUs of {named} to work: stages x replicas must be "
            f"{cluster.size}, with at most {problem.n} stages and replicas dividing the micro-batches "
            f"{list(micro_batches)[:12]}; allow other micro-batch counts or use another cluster size", [])
    need, p, d, m, t, sharding = least
    held = pricers[t].held(fullest[0], m, mode, fullest[1], sharding=sharding, virtual=virtual)
    how = (f", tensor {t}" if t > 1 else "") + (f", {sharding}" if sharding != "none" else "") + (
        f", {virtual} chunks a rank, interleaved" if virtual > 1 else "")
    batch = problem.batch or 0
    smaller = f"more micro-batches (micro_batches up to {batch}: smaller ones), " if max(micro_batches) < batch else ""
    tried = f"micro-batches {list(micro_batches)}" if len(micro_batches) < 4 else "micro-batches"
    return InfeasibleError(
        f"the model does not fit on {named}: under every choice of stages, replicas and {tried} "
        f"some stage is over the memory per GPU. At least {size_text(need)} per GPU is needed ({p} stages x "
        f"{d} replicas, {m} micro-batches, {mode}{how}); a {cluster.gpu.name} has {size_text(capacity)} usable. "
        f"{held_text(held)} "
        f"Fix: {smaller}more GPUs (more stages), GPUs with more memory, an optimizer with fewer states, or "
        "recomputation.",
        [int(math.ceil(need))] * cluster.size, held=held,
    )
