"""A plan into per-rank programs: the one lowering that planners and simulators call, and its all-reduce groups.

`runtime.program.plan_programs` does the lowering (see [Note: one agreed order] there); this
module names the weight groups it all-reduces and turns a schedule that cannot run a layout
into the error its caller reports: a PartitionError while planning (`lower_plan`), a
ScheduleError while simulating a plan that has no programs (`default_programs`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping, Sequence

from partitioner.errors import PartitionError
from partitioner.predict.schedule_sim import ScheduleError
from runtime.plan import Plan
from runtime.program import Program, plan_programs

__all__ = ["Groups", "default_programs", "lower_plan", "merge_groups", "reduced_groups", "replica_groups"]

Groups = Sequence[tuple[Sequence[int], Sequence[int]]]  # (ranks, stages) of weights held by several ranks


def lower_plan(plan: Plan, groups: Groups, devices: Mapping[int, str] | None = None) -> list[Program]:
    """`runtime.program.plan_programs`, with a schedule that cannot run this layout as a PartitionError."""
    try:
        return plan_programs(plan, groups, devices=devices)
    except ValueError as exc:
        raise PartitionError(f"the plan cannot run its schedule {plan.schedule!r}: {exc}") from None


def default_programs(plan: Plan) -> list[Program]:
    """Programs for a plan that has none; a plan without any `reads_from` is read as a chain.

    Raises:
        ScheduleError: the plan's schedule cannot run its layout.
    """
    if len(plan.stages) > 1 and not any(s.reads_from for s in plan.stages):
        plan = replace(plan, stages=[replace(s, reads_from=[s.index - 1] if s.index else []) for s in plan.stages])
    try:
        return lower_plan(plan, replica_groups(plan))
    except PartitionError as exc:
        raise ScheduleError(f"cannot lower the plan's schedule into programs: {exc}") from None


def replica_groups(plan: Plan) -> list[tuple[list[int], list[int]]]:
    """(ranks, [stage]) of every replicated stage: the weights its replicas all-reduce."""
    return [(list(s.ranks), [s.index]) for s in plan.stages if len(set(s.ranks)) > 1]


def merge_groups(groups: Groups) -> list[tuple[list[int], list[int]]]:
    """One group per set of ranks (the runtime all-reduces the weights held by exactly those ranks together)."""
    merged: dict[tuple[int, ...], set[int]] = {}
    for ranks, stages in groups:
        key = tuple(sorted(set(ranks)))
        if len(key) > 1:
            merged.setdefault(key, set()).update(stages)
    return [(list(k), sorted(v)) for k, v in sorted(merged.items())]


def reduced_groups(plan: Plan) -> Groups:
    """(ranks, stages) of the all-reduces the plan's programs already run: each group with the stages on its ranks."""
    groups = sorted({op.group for program in plan.programs for op in program.ops if op.kind == "AR"})
    return [
        (list(g), [s.index for s in plan.stages if set(s.ranks or [s.index]) & set(g)])
        for g in groups
    ]
