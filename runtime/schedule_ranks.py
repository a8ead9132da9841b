"""A schedule's name and a layout of stage replicas into each rank's action list (the one dispatcher).

The schedule's `ScheduleSpec` (rules.schedules: the registry) gives its generator and layout;
this module checks the layout, calls the generator and deals a chain's lists to the ranks of
each stage's replicas. A new schedule is a registered spec: nothing here changes.
"""

from __future__ import annotations

from typing import Sequence

from rules.actions import Action, check_counts
from rules.generators import dag_levels
from rules.schedules import either, layout_ranks, schedule_names, schedule_spec

__all__ = ["rank_schedule"]


def rank_schedule(
    schedule: str,
    micro_batches: int,
    stage_ranks: Sequence[Sequence[int]],
    producers: Sequence[Sequence[int]],
) -> list[list[Action]]:
    """Each rank's forward and backward (and W) actions, in order, for the named schedule.

    The one place a schedule name becomes action lists. `stage_ranks[s]` are the ranks of
    stage s's replicas (micro-batch i on replica i mod r); `producers[s]` the stages s reads.

    Raises:
        ValueError: an unknown schedule, or one that cannot run this layout or micro-batch
            count (the message says what can).
    """
    spec = schedule_spec(schedule)
    p = len(stage_ranks)
    check_counts(micro_batches, p)
    world = 1 + max(r for ranks in stage_ranks for r in ranks)
    levels = dag_levels(producers)
    single = all(len(ranks) == 1 for ranks in stage_ranks)
    layout = [list(r) for r in stage_ranks]
    if spec.layout != "chain":
        per_rank = max(1, p // world)
        if layout != layout_ranks(spec.layout, world, per_rank):
            where = (f"2 x {world} stages in a V over the {world} ranks (stage s on rank s, then 2p - 1 - s: "
                     f"{layout_ranks('v', world, 2)})" if spec.layout == "v"
                     else f"a chain of stages round robin over the ranks (stage s on rank s % {world})")
            raise ValueError(f"{schedule} runs {where}, one replica each; got stage ranks {layout}")
        _accept(spec.accepts(micro_batches, world, per_rank))
        return spec.actions(micro_batches, world, per_rank)
    _accept(spec.accepts(micro_batches, p, 1))
    # A chain order is built for a chain; stages numbered in topological order that depend on fewer
    # stages (a cut inside a fork/join region) only wait less, so it stays valid.
    if spec.dag is not None and single:
        return spec.dag(micro_batches, levels, [ranks[0] for ranks in stage_ranks])
    if not single and not spec.replicas:
        raise ValueError(f"{schedule} runs one replica per stage; got stage ranks {layout}")
    # [Note: a replica runs its own 1F1B] With every stage on r replicas, micro-batch i runs on
    # replica i mod r of every stage: r independent pipelines of m / r micro-batches, as data
    # parallelism over pipelines runs. Replica j then runs micro-batches j, j + r, ... in the
    # order the schedule gives a stage with that many (local index k is micro-batch j + k r), so
    # it warms up min(p - s, m / r) forwards. Dealing one list over all m in turn would give it
    # about (p - s) / r and serialize each pipeline. Unequal replica counts keep the dealt list:
    # there a replica's own warm-up can wait on a micro-batch the stage before holds back
    # (tests/test_schedule.py lowers both). GPipe runs every forward first: dealt or not, the same.
    equal = len({len(ranks) for ranks in stage_ranks}) == 1
    dealt = None if equal else spec.actions(micro_batches, p, 1)
    orders: dict[int, list[list[Action]]] = {}
    lists: list[list[Action]] = [[] for _ in range(world)]
    owner: dict[int, int] = {}
    for s, ranks in enumerate(stage_ranks):
        by_replica: list[list[Action]] = [[] for _ in ranks]
        if dealt is not None:
            for a in dealt[s]:
                by_replica[a.microbatch % len(ranks)].append(a)
        for j, r in enumerate(ranks):
            if owner.setdefault(r, s) != s:
                several = [n for n in schedule_names() if schedule_spec(n).layout != "chain"]
                raise ValueError(
                    f"rank {r} runs stages {owner[r]} and {s} under {schedule!r}; give each rank one stage "
                    f"(or use {either(several)} for several stages per rank)"
                )
            mine = range(j, micro_batches, len(ranks))
            if dealt is None and len(mine):
                if len(mine) not in orders:  # one generator call per micro-batch count, not per rank
                    orders[len(mine)] = spec.actions(len(mine), p, 1)
                by_replica[j] = [Action(s, a.kind, mine[a.microbatch]) for a in orders[len(mine)][s]]
            lists[r] += by_replica[j]
    return lists


def _accept(problem: str | None) -> None:
    """Raise the schedule's own reason for refusing a micro-batch count (`ScheduleSpec.accepts`)."""
    if problem:
        raise ValueError(problem)
