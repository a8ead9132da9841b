"""Fold identical data-parallel replicas: simulate one pipeline of a plan and let it stand for all of them.

A plan whose every stage has R replicas (`StagePlan.ranks`, micro-batch i on `ranks[i % R]`),
with R dividing the micro-batches, runs R pipelines side by side: replica j of every stage
takes micro-batches j, j + R, j + 2R, ... and exchanges values only inside its pipeline; the
pipelines meet only in the gradient all-reduces. Where every replica's program equals its
replica-0 rank's up to that renumbering (micro-batch j + kR -> kR, peer -> the peer's replica-0
rank), every pipeline runs the same step at the same times, so simulating the replica-0 ranks
is exact: an all-reduce starts when its representatives have posted it (all members post at
the same time) and is priced for its whole group.

    2 stages x 8192 replicas: 2 programs simulated, 2 rows
    ranks 0-8191 (8192 replicas)      FFFF....BBBB~~
    ranks 8192-16383 (8192 replicas)  ..FFFFBBBB..~~

Without `plan.programs`, only the representatives are lowered: a rank's lock-step ticks depend
only on its own pipeline (every message stays inside it), so lowering replica 0's action lists
alone gives the ticks, messages and all-reduces the full lowering gives those ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from runtime.plan import Plan
from runtime.program import Op, Program, lower
from runtime.schedule import Action
from runtime.schedule_ranks import rank_schedule

__all__ = ["Fold", "fold", "rank_span"]


@dataclass
class Fold:
    """The programs to simulate for a plan and which ranks each one stands for."""

    programs: list[Program]  # one per representative rank (replica 0's ranks, and ranks that run no stage)
    members: dict[int, list[int]]  # representative rank -> every rank it stands for (itself first)
    representative: dict[int, int]  # rank -> its representative


@dataclass
class _Layout:
    replicas: int
    replica_of: dict[int, int]  # rank -> j: the replica index it holds in every stage it runs
    representative: dict[int, int]  # rank -> the rank holding replica 0 of its stages


def fold(plan: Plan) -> Fold | None:
    """The replica-0 programs of `plan` and the ranks each stands for, or None where replicas differ.

    None (simulate every rank) when a stage has one replica, stages have different replica
    counts, the replica count does not divide the micro-batches, a rank holds different
    replica indices in two stages, or a replica's program is not replica 0's renumbered.
    """
    layout = _layout(plan)
    if layout is None:
        return None
    members: dict[int, list[int]] = {}
    for rank in sorted(layout.representative, key=lambda r: (layout.replica_of[r], r)):
        members.setdefault(layout.representative[rank], []).append(rank)
    if plan.programs:
        programs = _fold_given(plan.programs, layout)
    else:
        programs = _lower_representatives(plan, layout)
    if programs is None:
        return None
    representative = dict(layout.representative)
    tensor = _tensor_ranks(plan)  # a replica's other tensor ranks run its program on their shards
    others = {rank for ranks in tensor.values() for rank in ranks}
    programs = [p for p in programs if p.rank not in others]
    for program in programs:  # ranks that run no stage stand for themselves
        representative.setdefault(program.rank, program.rank)
        members.setdefault(program.rank, [program.rank])
    for rep, ranks in members.items():
        members[rep] = [r for first in ranks for r in (first, *tensor.get(first, ()))]
    for first, rest in tensor.items():
        for rank in rest:
            representative[rank] = representative.get(first, first)
    return Fold(programs, members, representative)


def _tensor_ranks(plan: Plan) -> dict[int, list[int]]:
    """Each replica's first rank -> its other tensor ranks ([Note: ranks of a split stage] in runtime/plan.py)."""
    out: dict[int, list[int]] = {}
    for stage in plan.stages:
        for group in stage.rank_groups:
            if len(group) > 1:
                out.setdefault(group[0], group[1:])
    return out


def rank_span(ranks: Sequence[int]) -> str:
    """'0-8191', '0-14 step 2', '3,5,9': a short name for a set of ranks."""
    ordered = sorted(set(ranks))
    if len(ordered) <= 3:
        return ",".join(map(str, ordered))
    step = ordered[1] - ordered[0]
    if all(b - a == step for a, b in zip(ordered, ordered[1:])):
        return f"{ordered[0]}-{ordered[-1]}" + (f" step {step}" if step > 1 else "")
    return f"{ordered[0]},{ordered[1]},...,{ordered[-1]}"


def _layout(plan: Plan) -> _Layout | None:
    """Replica index and representative of every rank, or None where the plan is not R identical pipelines."""
    counts = {len(s.ranks) for s in plan.stages}
    if len(counts) != 1:
        return None
    replicas = counts.pop()
    if replicas < 2 or plan.micro_batches % replicas:
        return None
    replica_of: dict[int, int] = {}
    representative: dict[int, int] = {}
    for stage in plan.stages:
        if len(set(stage.ranks)) != replicas:
            return None
        for j, rank in enumerate(stage.ranks):
            if replica_of.setdefault(rank, j) != j or representative.setdefault(rank, stage.ranks[0]) != stage.ranks[0]:
                return None
    if len({(representative[r], j) for r, j in replica_of.items()}) != len(replica_of):
        return None
    return _Layout(replicas, replica_of, representative)


def _canonical(op: Op, j: int, layout: _Layout) -> Op | None:
    """`op` of a replica-j rank as replica 0 would run it, or None when it is not replica j's."""
    if op.microbatch < 0:
        return op
    if op.microbatch % layout.replicas != j:
        return None
    peer = layout.representative.get(op.peer, op.peer) if op.peer >= 0 else op.peer
    return replace(op, microbatch=op.microbatch - j, peer=peer)


def _fold_given(programs: Sequence[Program], layout: _Layout) -> list[Program] | None:
    """The representatives of `programs` after checking every other replica's program is theirs renumbered."""
    by_rank = {p.rank: p for p in programs}
    for program in programs:
        rep = layout.representative.get(program.rank, program.rank)
        if rep == program.rank:
            continue
        if rep not in by_rank:
            return None
        j = layout.replica_of[program.rank]
        if [_canonical(op, j, layout) for op in program.ops] != by_rank[rep].ops:
            return None
    return [p for p in programs if layout.representative.get(p.rank, p.rank) == p.rank]


def _lower_representatives(plan: Plan, layout: _Layout) -> list[Program] | None:
    """Lower only replica 0's action lists (as `runtime.program.plan_programs` would), after checking the rest."""
    stage_ranks = [list(s.ranks) for s in plan.stages]
    producers = [list(s.reads_from) for s in plan.stages]
    if len(plan.stages) > 1 and not any(producers):
        producers = [[s - 1] if s else [] for s in range(len(plan.stages))]  # read as a chain, as simulate does
    try:
        lists = rank_schedule(plan.schedule, plan.micro_batches, stage_ranks, producers)
    except ValueError:
        return None  # the full lowering names the problem
    whole = {s.index for s in plan.stages if s.recompute == "selective"}
    lists = [[a for a in actions if not (a.kind == "W" and a.stage in whole)] for actions in lists]
    for rank, actions in enumerate(lists):
        rep = layout.representative.get(rank, rank)
        if rep != rank:
            j = layout.replica_of[rank]
            if [Action(a.stage, a.kind, a.microbatch - j) for a in actions] != lists[rep]:
                return None
    names: dict[int, str] = {}
    for stage in plan.stages:
        for rank in stage.ranks:
            names.setdefault(rank, stage.device)
    # Lower with the representatives numbered first and only their lists, so the work grows with the
    # representatives, not the world; then name every rank back.
    reps = sorted(set(layout.representative.values()) | (set(range(len(lists))) - set(layout.representative)))
    order = reps + sorted(set(range(len(lists))) - set(reps))
    new = {rank: k for k, rank in enumerate(order)}
    renamed = [[new[r] for r in ranks] for ranks in stage_ranks]
    groups = [(ranks, [s]) for s, ranks in enumerate(renamed)]
    try:
        lowered = lower([lists[r] for r in reps], producers, renamed, [names.get(r, "cpu") for r in reps], groups)
    except ValueError:
        return None

    def back(op: Op) -> Op:
        if op.kind == "AR":
            return replace(op, group=tuple(sorted(order[k] for k in op.group)))
        return replace(op, peer=order[op.peer]) if op.peer >= 0 else op

    return [Program(order[p.rank], p.device, [back(op) for op in p.ops]) for p in lowered]
