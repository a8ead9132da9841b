"""A schedule's name and a layout of stage replicas into each rank's action list (the one dispatcher).

`runtime/schedule.py` holds the generators, one per schedule; this module picks one for a
layout (chain, DAG, replicas, interleaved, V) and deals its lists to ranks, so a new
schedule is a generator there and a branch here.
"""

from __future__ import annotations

from typing import Sequence

from runtime.schedule import (
    V_SCHEDULES,
    Action,
    _check_counts,
    dag_gpipe,
    dag_levels,
    dualpipe_v,
    interleaved_one_f_one_b,
    one_f_one_b,
    v_stage_ranks,
    zero_bubble_h1,
    zero_bubble_v,
)

__all__ = ["rank_schedule"]


def rank_schedule(
    schedule: str,
    micro_batches: int,
    stage_ranks: Sequence[Sequence[int]],
    producers: Sequence[Sequence[int]],
) -> list[list[Action]]:
    """Each rank's forward and backward (and W) actions, in order, for the named schedule.

    The one place a schedule name becomes action lists: a new schedule is a generator above
    and a branch here. `stage_ranks[s]` are the ranks of stage s's replicas (micro-batch i on
    replica i mod r); `producers[s]` the stages s reads.

    Raises:
        ValueError: the schedule cannot run this layout (the message says what can).
    """
    p = len(stage_ranks)
    _check_counts(micro_batches, p)
    world = 1 + max(r for ranks in stage_ranks for r in ranks)
    levels = dag_levels(producers)
    single = all(len(ranks) == 1 for ranks in stage_ranks)
    if schedule == "interleaved":
        if not single or any(ranks[0] != s % world for s, ranks in enumerate(stage_ranks)) or p % world:
            raise ValueError(
                f"interleaved runs a chain of stages round robin over the ranks (stage s on rank s % {world}), one "
                f"replica each; got stage ranks {[list(r) for r in stage_ranks]}"
            )
        return interleaved_one_f_one_b(micro_batches, world, p // world)
    if schedule in V_SCHEDULES:
        if [list(r) for r in stage_ranks] != v_stage_ranks(world):
            raise ValueError(
                f"{schedule} runs 2 x {world} stages in a V over the {world} ranks (stage s on rank s, then "
                f"2p - 1 - s: {v_stage_ranks(world)}), one replica each; "
                f"got stage ranks {[list(r) for r in stage_ranks]}"
            )
        return zero_bubble_v(micro_batches, world) if schedule == "zbv" else dualpipe_v(micro_batches, world)
    if schedule not in ("gpipe", "1f1b", "zb1"):
        raise ValueError(
            f"unknown schedule {schedule!r}; use 'gpipe', '1f1b', 'interleaved', 'zb1', 'zbv' or 'dualpipev'"
        )
    # 1F1B's (and ZB-H1's) per-stage order is built for a chain; stages numbered in topological order
    # that depend on fewer stages (a cut inside a fork/join region) only wait less, so it stays valid.
    if schedule == "gpipe" and single:
        return dag_gpipe(micro_batches, levels, [ranks[0] for ranks in stage_ranks])
    # [Note: a replica runs its own 1F1B] With every stage on r replicas, micro-batch i runs on
    # replica i mod r of every stage: r independent pipelines of m / r micro-batches, as data
    # parallelism over pipelines runs. Replica j then runs micro-batches j, j + r, ... in the
    # order the schedule gives a stage with that many (local index k is micro-batch j + k r), so
    # it warms up min(p - s, m / r) forwards. Dealing one list over all m in turn would give it
    # about (p - s) / r and serialize each pipeline. Unequal replica counts keep the dealt list:
    # there a replica's own warm-up can wait on a micro-batch the stage before holds back
    # (tests/test_schedule.py lowers both). GPipe runs every forward first anyway: always dealt.
    counts = {len(ranks) for ranks in stage_ranks}
    generate = {"1f1b": one_f_one_b, "zb1": zero_bubble_h1}.get(schedule) if len(counts) == 1 else None
    per_stage = {"1f1b": one_f_one_b, "zb1": zero_bubble_h1}.get(schedule)
    dealt = None if generate is not None else (per_stage(micro_batches, p) if per_stage is not None
                                                else dag_gpipe(micro_batches, levels, list(range(p))))
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
                raise ValueError(
                    f"rank {r} runs stages {owner[r]} and {s} under {schedule!r}; give each rank one stage "
                    "(or use 'interleaved', 'zbv' or 'dualpipev' for several stages per rank)"
                )
            mine = range(j, micro_batches, len(ranks))
            if generate is not None and len(mine):
                if len(mine) not in orders:  # one generator call per micro-batch count, not per rank
                    orders[len(mine)] = generate(len(mine), p)
                order = orders[len(mine)]
                by_replica[j] = [Action(s, a.kind, mine[a.microbatch]) for a in order[s]]
            lists[r] += by_replica[j]
    return lists
