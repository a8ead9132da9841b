"""Simulate a Plan: one step of its programs (what the runtime runs), or of an explicit schedule.

`simulate(plan)` runs `plan.programs` (see runtime/program.py) through the program simulator
(partitioner/predict/program_run.py: how each op is timed, with a worked example), so what
is predicted and drawn is what runs.

Prices: compute from each stage's `forward_ms` and `backward_ms`; a message from
`transfer_ms`, else the duration the plan's programs already record for it, else a share of
the stages' `comm_ms`; an all-reduce from `group_ms`, else the `allreduce_ms` of the stage
whose replicas form the group, else what the programs record. Identical data-parallel replicas
(every stage on R ranks, R dividing the micro-batches) are simulated once and drawn as one row
standing for R ranks (partitioner/predict/replica_fold.py; `rows="ranks"` for a row each). An explicit schedule
(`simulate(plan, gpipe(m, p))`) is simulated on stage times instead: see schedule_sim.
`simulate(plan, calibration=c)` prices the programs with a fitted Calibration (overheads, links,
shared cores, fixed step cost): see calibrated_sim.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Literal, Sequence

from cost_model.calibration import Calibration
from partitioner.predict.calibrated_sim import simulate_calibrated
from partitioner.predict.lowering import default_programs
from partitioner.predict.prices import GroupMs, group_price, message_price
from partitioner.predict.program_run import ProgramRun
from partitioner.predict.replica_fold import fold
from partitioner.predict.schedule_sim import (
    ScheduleCheck,
    ScheduleError,
    StageMs,
    TransferMs,
    check_schedule,
    simulate_schedule,
)
from partitioner.predict.timeline import (
    ALLREDUCE,
    BACKWARD,
    FORWARD,
    IDLE,
    RECV,
    SEND,
    WEIGHT,
    DeviceTimeline,
    Event,
    Timeline,
)
from runtime.flushless import Stream, StreamError
from runtime.plan import Plan
from runtime.program import Op, Program
from runtime.schedule import Action

__all__ = [
    "ALLREDUCE",
    "BACKWARD",
    "FORWARD",
    "IDLE",
    "RECV",
    "SEND",
    "WEIGHT",
    "DeviceTimeline",
    "Event",
    "ScheduleCheck",
    "ScheduleError",
    "Timeline",
    "check_schedule",
    "simulate",
    "steady_step_ms",
]


def simulate(
    plan: Plan,
    schedule: Sequence[Sequence[Action]] | None = None,
    *,
    transfer_ms: TransferMs | None = None,
    allreduce_ms: StageMs | None = None,
    group_ms: GroupMs | None = None,
    micro_batches: int | None = None,
    producers: Sequence[Sequence[int]] | None = None,
    rows: Literal["replicas", "ranks"] = "replicas",
    calibration: Calibration | None = None,
) -> Timeline:
    """One step of `plan`: its programs (the default), or an explicit `schedule` on its stage times.

    Args:
        plan: stage s computes for `forward_ms` per forward and `backward_ms` per backward.
            Without `schedule`, `plan.programs` run (lowered here, with each replicated
            stage's all-reduce, when the plan has none).
        schedule: per device, ordered actions (e.g. `gpipe(m, p)`); see schedule_sim.
        transfer_ms: (src stage, dst stage, bytes) -> ms of one message.
        allreduce_ms: stage -> ms of its gradient all-reduce (default: its `allreduce_ms`).
        group_ms: programs only: AR group (ranks) -> ms; a mapping falls back to the rules
            in the module docstring for groups it lacks, a callable answers for all.
        micro_batches, producers: explicit schedules only (see `simulate_schedule`).
        rows: programs only: "replicas" simulates identical data-parallel replicas once and
            shows them as one row (partitioner/predict/replica_fold.py: exact, and what keeps a
            16,384-rank plan to a few rows and seconds); "ranks" simulates a row per rank.
        calibration: programs only: price every op with a fitted Calibration (per-kind compute
            factors, per-task overhead, link, fixed step cost, cores shared by CPU ranks);
            see partitioner/predict/calibrated_sim.py. One row per rank.

    [Note: sliced replicas as dealt ones] A plan whose replicas run every micro-batch on their slice
    (`data_split="slice"`: m micro-batches, d replicas in lockstep) has every replica run m micro-batches
    of batch / (m d) samples, as d replicas dealt m d micro-batches of that size do: simulated so, each
    replica's timeline is the sliced plan's (its stage times are one slice's).

    Raises:
        ScheduleError: the schedule or programs are incomplete or deadlock (says where).
    """
    if schedule is not None:
        return simulate_schedule(plan, schedule, transfer_ms=transfer_ms, allreduce_ms=allreduce_ms,
                                 micro_batches=micro_batches, producers=producers)
    if calibration is not None:
        return simulate_calibrated(plan, calibration, transfer_ms=transfer_ms, allreduce_ms=allreduce_ms,
                                   group_ms=group_ms)
    if plan.data_split == "slice" and not plan.programs:  # see [Note: sliced replicas as dealt ones]
        plan = replace(plan, micro_batches=plan.pieces, data_split="deal")
    folded = fold(plan) if rows == "replicas" else None
    if folded is None:
        programs = plan.programs or default_programs(plan)
        return ProgramRun(plan, programs, message_price(plan, programs, transfer_ms),
                          group_price(plan, programs, group_ms, allreduce_ms)).run()
    priced = plan.programs or folded.programs
    timeline = ProgramRun(plan, folded.programs, message_price(plan, priced, transfer_ms),
                          group_price(plan, priced, group_ms, allreduce_ms), folded.members).run()
    if plan.programs:  # every program's times: those of the representative it equals, renumbered
        times = {p.rank: t for p, t in zip(folded.programs, timeline.predicted)}
        timeline.predicted = [times[folded.representative[p.rank]] for p in plan.programs]
    return timeline


def steady_step_ms(plan: Plan, *, transfer_ms: TransferMs | None = None) -> float:
    """Milliseconds per batch of an asynchronous plan (`plan.update` "2bw"/"stash") once the stream is full.

    With no flush between batches (runtime.flushless) a step costs the stream's period, not a
    fill-and-drain makespan: a stream of a few batches is simulated with the prices of the
    plan's own programs, and the time between the starts of consecutive steady batches
    (stage 0's first forward of each) is averaged over two batches.

    Raises:
        ScheduleError: the plan cannot run as a stream (the message says why).
    """
    try:
        stream = Stream(plan.micro_batches, [s.ranks[0] if s.ranks else s.index for s in plan.stages],
                        [list(s.reads_from) for s in plan.stages],
                        [s.device for s in sorted(plan.stages, key=lambda s: s.ranks[0] if s.ranks else s.index)])
    except StreamError as exc:
        raise ScheduleError(str(exc)) from None
    batches = stream.t0 + 4
    programs = [Program(rank=r, device=plan.stages[0].device, ops=[*ops, Op("STEP")])
                for r, ops in enumerate(stream.lowered(batches))]
    run = ProgramRun(plan, programs, message_price(plan, plan.programs, transfer_ms),
                     group_price(plan, plan.programs, None, None))
    timeline = run.run()
    starts = {op.microbatch: times[0] for program, predicted in zip(programs, timeline.predicted)
              for op, times in zip(program.ops, predicted) if op.kind == "F" and op.stage == 0}
    m, t = plan.micro_batches, stream.t0 + 1
    return (starts[(t + 2) * m] - starts[t * m]) / 2
