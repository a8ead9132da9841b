"""What a simulated message and all-reduce cost: as given, else as earlier programs recorded, else the stage fields.

A plan's programs carry each op's predicted (start, end) from the simulation that made them
(`assemble.predict`), so a plan whose micro-batches or schedule change is priced again as its
programs were: a message by the duration its SEND recorded, an all-reduce by its AR's.
"""

from __future__ import annotations

from typing import Callable, Mapping, NamedTuple, Sequence

from partitioner.predict.schedule_sim import StageMs, TransferMs, plan_transfer, stage_ms
from runtime.plan import Plan
from runtime.program import Program

__all__ = ["Group", "GroupMs", "Prices", "group_price", "message_price", "recorded_prices"]

Group = tuple[int, ...]
GroupMs = Mapping[Group, float] | Callable[[Group], float]


class Prices(NamedTuple):
    """Durations (ms) recorded in programs' `predicted`: per message (src, dst stage) and per AR group."""

    messages: dict[tuple[int, int], float]
    groups: dict[Group, float]


def recorded_prices(programs: Sequence[Program]) -> Prices:
    """The durations a previous simulation wrote into `programs` (ops without times are skipped)."""
    messages: dict[tuple[int, int], float] = {}
    groups: dict[Group, float] = {}
    for program in programs:
        if len(program.predicted) != len(program.ops):
            continue
        for op, (start, end) in zip(program.ops, program.predicted):
            if op.kind == "SEND":
                messages.setdefault((op.src, op.dst), end - start)
            elif op.kind == "AR":
                groups.setdefault(op.group, end - start)
    return Prices(messages, groups)


def message_price(
    plan: Plan, programs: Sequence[Program], transfer_ms: TransferMs | None
) -> Callable[[int, int], float]:
    """(src stage, dst stage) -> ms of one message: `transfer_ms`, else as `programs` recorded, else stage fields."""
    def nbytes(src: int, dst: int) -> int:
        return plan.stages[max(src, dst)].recv_bytes

    if transfer_ms is not None:
        return lambda src, dst: float(transfer_ms(src, dst, nbytes(src, dst)))
    recorded, fallback = recorded_prices(programs).messages, plan_transfer(plan)
    return lambda src, dst: recorded[(src, dst)] if (src, dst) in recorded else fallback(src, dst, nbytes(src, dst))


def group_price(
    plan: Plan, programs: Sequence[Program], group_ms: GroupMs | None, allreduce_ms: StageMs | None
) -> Callable[[Group], float]:
    """Group ranks -> ms of its all-reduce: `group_ms`, else its replicated stage's, else as `programs` recorded."""
    if callable(group_ms):
        return group_ms
    given = dict(group_ms or {})
    per_stage, recorded = stage_ms(allreduce_ms, plan), recorded_prices(programs).groups

    def price(group: Group) -> float:
        if group in given:
            return float(given[group])
        replicas = [s.index for s in plan.stages if tuple(sorted(set(s.ranks))) == group]
        if replicas:
            return sum(float(per_stage(s)) for s in replicas)
        return recorded.get(group, 0.0)

    return price
