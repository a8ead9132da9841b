"""Simulate a Plan's programs: each rank's timeline of compute, transfers, all-reduce and idle.

`simulate(plan)` prices the ops the runtime runs (`plan.programs`, see runtime/program.py),
so what is predicted and drawn is what runs. A rank runs its ops in order:

    F s i   starts when the rank is free and stage s's inputs for micro-batch i are there
            (from its own earlier forward, or the RECV of another rank's SEND);
    B s i   likewise, after F s i and the gradients of the stages that read s;
    W s i   after B s i (the weight part of a split backward; see [Note: pricing a split
            backward] in schedule_sim for how B and W share `backward_ms`);
    SEND    starts the transfer when posted (after the tick's compute) and the directed
            link is free; it runs beside compute, one transfer per link at a time;
    RECV    marks where the message arrives; the compute that reads it waits for it;
    AR      starts when every rank of the group posted it and their all-reduce stream is
            free; asynchronous, it overlaps later compute;
    STEP    ends the rank's step after its compute, transfers and all-reduces.

    GPipe, m=2, stage 0 on ranks 0 and 1 (one micro-batch each), stage 1 on rank 2; F 1 ms,
    B 2 ms, free transfers, all-reduce 1.5 ms; one char = 0.5 ms (`Timeline.chart(0.5)`):

    rank 0  FF............BBBB~~~   F0, B0 at 7; the all-reduce waits for both replicas,
    rank 1  FF........BBBB....~~~   runs 9 .. 10.5 and ends the step: predicted 10.5 ms,
    rank 2  ..FFFFBBBBBBBB.......   not 9 (tests/test_assemble.py computes it by hand)

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
from typing import Callable, Literal, Mapping, NamedTuple, Sequence

from cost_model.calibration import Calibration
from partitioner.errors import PartitionError
from partitioner.predict.replica_fold import fold
from partitioner.predict.schedule_sim import (
    ScheduleCheck,
    ScheduleError,
    StageMs,
    TransferMs,
    check_schedule,
    compute_ms,
    plan_transfer,
    simulate_schedule,
    stage_ms,
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
    compute_kind,
    fill_idle,
)
from runtime.plan import Plan
from runtime.program import Op, Program
from runtime.schedule import Action
from runtime.stream import Stream, StreamError

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
    "GroupMs",
    "Prices",
    "ScheduleCheck",
    "ScheduleError",
    "Timeline",
    "check_schedule",
    "group_price",
    "in_flight",
    "message_price",
    "recorded_prices",
    "replica_groups",
    "simulate",
    "steady_step_ms",
]

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


def replica_groups(plan: Plan) -> list[tuple[list[int], list[int]]]:
    """(ranks, [stage]) of every replicated stage: the weights its replicas all-reduce."""
    return [(list(s.ranks), [s.index]) for s in plan.stages if len(set(s.ranks)) > 1]


def in_flight(programs: Sequence[Program], stages: int) -> list[int]:
    """Per stage, the most micro-batches one rank has forwarded but not yet backwarded (its W, where split)."""
    peak = [0] * stages
    for program in programs:
        live = [0] * stages
        for op in program.ops:
            if op.kind in ("F", "W") or (op.kind == "B" and not op.split):
                live[op.stage] += 1 if op.kind == "F" else -1
                peak[op.stage] = max(peak[op.stage], live[op.stage])
    return peak


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

    Raises:
        ScheduleError: the schedule or programs are incomplete or deadlock (says where).
    """
    if schedule is not None:
        return simulate_schedule(plan, schedule, transfer_ms=transfer_ms, allreduce_ms=allreduce_ms,
                                 micro_batches=micro_batches, producers=producers)
    if calibration is not None:
        from partitioner.predict.calibrated_sim import simulate_calibrated  # it runs _ProgramRun: import here

        return simulate_calibrated(plan, calibration, transfer_ms=transfer_ms, allreduce_ms=allreduce_ms,
                                   group_ms=group_ms)
    folded = fold(plan) if rows == "replicas" else None
    if folded is None:
        programs = plan.programs or _lower(plan)
        return _ProgramRun(plan, programs, message_price(plan, programs, transfer_ms),
                           group_price(plan, programs, group_ms, allreduce_ms)).run()
    priced = plan.programs or folded.programs
    timeline = _ProgramRun(plan, folded.programs, message_price(plan, priced, transfer_ms),
                           group_price(plan, priced, group_ms, allreduce_ms), folded.members).run()
    if plan.programs:  # every program's times: those of the representative it equals, renumbered
        times = {p.rank: t for p, t in zip(folded.programs, timeline.predicted)}
        timeline.predicted = [times[folded.representative[p.rank]] for p in plan.programs]
    return timeline


def steady_step_ms(plan: Plan, *, transfer_ms: TransferMs | None = None) -> float:
    """Milliseconds per batch of an asynchronous plan (`plan.update` "2bw"/"stash") once the stream is full.

    With no flush between batches (runtime.stream) a step costs the stream's period, not a
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
    run = _ProgramRun(plan, programs, message_price(plan, plan.programs, transfer_ms),
                      group_price(plan, plan.programs, None, None))
    timeline = run.run()
    starts = {op.microbatch: times[0] for program, predicted in zip(programs, timeline.predicted)
              for op, times in zip(program.ops, predicted) if op.kind == "F" and op.stage == 0}
    m, t = plan.micro_batches, stream.t0 + 1
    return (starts[(t + 2) * m] - starts[t * m]) / 2


def _lower(plan: Plan) -> list[Program]:
    """Programs for a plan that has none; a plan without any `reads_from` is read as a chain."""
    if len(plan.stages) > 1 and not any(s.reads_from for s in plan.stages):
        plan = replace(plan, stages=[replace(s, reads_from=[s.index - 1] if s.index else []) for s in plan.stages])
    from partitioner.predict.assemble import lower_plan  # assemble simulates what it lowers: import here, not above

    try:
        return lower_plan(plan, replica_groups(plan))
    except PartitionError as exc:
        raise ScheduleError(f"cannot lower the plan's schedule into programs: {exc}") from None


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


class _ProgramRun:
    """One simulation of programs: rank clocks, finish times, transfers and all-reduces in flight."""

    def __init__(self, plan: Plan, programs: Sequence[Program], message: Callable[[int, int], float],
                 group: Callable[[Group], float], members: Mapping[int, Sequence[int]] | None = None) -> None:
        self.plan, self.programs, self.message, self.group = plan, list(programs), message, group
        self.compute_price: Callable[[int, int, Op], float] | None = None  # (row, op index, op) -> ms
        self.post_ms = 0.0  # the sender's own time to post one SEND (calibrated runs)
        self.recv_ms = 0.0  # the receiver's own time per RECV: posting it and taking the message (calibrated)
        self.wake_ms = 0.0  # a rank blocked on a message resumes this long after it arrives (calibrated)
        self.coupled: dict[tuple[int, int, int], list[tuple[int, int, int]]] = {}  # see couple_batches
        self.receives_posted: dict[tuple[int, int, int], float] = {}  # RECV key -> when its rank posted it
        # Folded replicas (replica_fold): a rank -> the simulated rank standing for it.
        self.stand_for = {m: rep for rep, ms in (members or {}).items() for m in ms}
        self.row = {p.rank: k for k, p in enumerate(self.programs)}
        self.producers = [list(s.reads_from) for s in plan.stages]
        self.consumers: list[list[int]] = [[] for _ in plan.stages]
        for s, ps in enumerate(self.producers):
            for p in ps:
                self.consumers[p].append(s)
        self.clock = [0.0] * len(self.programs)
        self.times: list[list[tuple[float, float] | None]] = [[None] * len(p.ops) for p in self.programs]
        self.finished: dict[tuple[str, int, int], float] = {}
        self.transfers: dict[tuple[int, int, int], tuple[float, float]] = {}
        self.waiting: dict[tuple[int, int, int], tuple[int, int]] = {}  # a RECV seen before its SEND
        self.link_free: dict[tuple[int, int], float] = {}
        self.reduce_free = [0.0] * len(self.programs)
        self.posted: dict[tuple[Group, int], dict[int, tuple[int, float]]] = {}  # (group, k-th) -> row -> (op, time)
        self.seen: list[dict[Group, int]] = [{} for _ in self.programs]
        self.rows = [DeviceTimeline(p.device, sorted({op.stage for op in p.ops if op.is_compute}),
                                    ranks=list((members or {}).get(p.rank, [p.rank])))
                     for p in self.programs]

    def rank_of(self, stage: int, mb: int) -> int:
        ranks = self.plan.stages[stage].ranks or [stage]
        return ranks[mb % len(ranks)]

    def run(self) -> Timeline:
        pointer = [0] * len(self.programs)
        while any(pointer[k] < len(p.ops) for k, p in enumerate(self.programs)):
            moved = False
            for k, program in enumerate(self.programs):
                while pointer[k] < len(program.ops) and self.step(k, pointer[k], program.ops[pointer[k]]):
                    pointer[k] += 1
                    moved = True
            if not moved:
                waits = "; ".join(f"rank {p.rank} at '{p.ops[pointer[k]]}'" for k, p in enumerate(self.programs)
                                  if pointer[k] < len(p.ops))
                raise ScheduleError(f"the programs deadlock: no rank can run its next op ({waits}); "
                                    "lower them again with runtime.program.plan_programs")
        makespan = max([*self.clock, *(t[1] for ts in self.times for t in ts if t is not None)], default=0.0)
        for row in self.rows:
            fill_idle(row, makespan)
        predicted = [[t if t is not None else (makespan, makespan) for t in ts] for ts in self.times]
        return Timeline(self.rows, makespan, in_flight(self.programs, len(self.plan.stages)), predicted)

    def step(self, k: int, i: int, op: Op) -> bool:
        """Run op i of row k if it can start; False when it must wait."""
        if op.is_compute:
            return self._compute(k, i, op)
        if op.kind == "SEND":
            return self._send(k, i, op)
        if op.kind == "RECV":
            key = (op.src, op.dst, op.microbatch)
            if key in self.transfers:
                self.times[k][i] = self.transfers[key]
            else:
                self.waiting[key] = (k, i)
            self.receives_posted[key] = self.clock[k] if key in self.coupled else 0.0  # receive-only: early
            self.clock[k] += self.recv_ms
            return True
        if op.kind == "AR":
            return self._allreduce(k, i, op)
        if any(t is None for t in self.times[k][:i]):  # STEP: after everything this rank started
            return False
        end = max([self.clock[k], *(t[1] for t in self.times[k][:i] if t is not None)])
        self.times[k][i] = (end, end)
        return True

    def couple_batches(self) -> None:
        """Price what runtime/transport_p2p.py does: a take waits for its whole batch (one tick's
        consecutive SEND/RECV ops), so a message whose batch holds sends is taken only once each
        of those sends has landed and its receiver posted the matching receive (a batch with
        sends is posted in program order; a receive-only batch early, at no wait)."""
        for program in self.programs:
            batch: list[Op] = []
            for op in [*program.ops, Op("STEP")]:
                if op.is_p2p and (not batch or batch[-1].tick == op.tick):
                    batch.append(op)
                    continue
                sends = [o.key() for o in batch if o.kind == "SEND"]
                for o in batch:
                    if o.kind == "RECV" and sends:
                        self.coupled[o.key()] = sends
                batch = [op] if op.is_p2p else []

    def _landed(self, key: tuple[int, int, int]) -> float | None:
        """When message `key` can be taken on its receiving row (its batch complete), or None if not known yet."""
        if key not in self.transfers:
            return None
        landed = self.transfers[key][1]
        for send in self.coupled.get(key, []):
            if send not in self.transfers or send not in self.receives_posted:
                return None
            landed = max(landed, self.transfers[send][1], self.receives_posted[send])
        return landed

    def _input(self, k: int, stage: int, kind: str, frm: int, mb: int) -> float | None:
        """When stage `frm`'s output (kind F) or gradient (kind B) for `mb` is on row k, or None."""
        if self.row.get(self.rank_of(frm, mb)) == k:
            return self.finished.get((kind, frm, mb))
        return self._landed((frm, stage, mb))

    def _compute(self, k: int, i: int, op: Op) -> bool:
        s, mb = op.stage, op.microbatch
        if op.kind == "F":
            needs = [self._input(k, s, "F", p, mb) for p in self.producers[s]]
        else:
            needs = [self.finished.get(("F", s, mb))] + [self._input(k, s, "B", c, mb) for c in self.consumers[s]]
            if op.kind == "W":
                needs = [self.finished.get(("B", s, mb))]
        if any(t is None for t in needs):
            return False
        stage = self.plan.stages[s]
        start = max([self.clock[k], *(t for t in needs if t is not None)])
        if self.wake_ms > 0 and op.kind != "W" and self._arrival(k, op) > self.clock[k]:
            start = max(start, self._arrival(k, op) + self.wake_ms)  # blocked: woken after the message lands
        if self.compute_price is not None:
            end = start + self.compute_price(k, i, op)
        else:
            end = start + compute_ms(stage, op.kind, op.split, bool(self.producers[s]))
        self.rows[k].events.append(Event(compute_kind(op.kind), s, mb, start, end))
        self.clock[k] = self.finished[(op.kind, s, mb)] = end
        self.times[k][i] = (start, end)
        return True

    def _arrival(self, k: int, op: Op) -> float:
        """When the last message from another row that compute op `op` on row k reads lands (0: none)."""
        peers = self.producers[op.stage] if op.kind == "F" else self.consumers[op.stage]
        return max([self._landed((f, op.stage, op.microbatch)) or 0.0 for f in peers
                    if self.row.get(self.rank_of(f, op.microbatch)) != k], default=0.0)

    def _send(self, k: int, i: int, op: Op) -> bool:
        ready = self.finished.get(("F" if op.src < op.dst else "B", op.src, op.microbatch))
        peer = self.row.get(op.peer)
        if ready is None or peer is None:
            return False
        duration = self.message(op.src, op.dst)
        if self.post_ms > 0:  # posting occupies the sender's thread before the message leaves
            self.clock[k] = max(self.clock[k], ready) + self.post_ms
        start = max(self.clock[k], ready, self.link_free.get((k, peer), 0.0))
        key = (op.src, op.dst, op.microbatch)
        self.transfers[key] = self.times[k][i] = (start, start + duration)
        self.link_free[(k, peer)] = start + duration
        if key in self.waiting:
            row, index = self.waiting.pop(key)
            self.times[row][index] = self.transfers[key]
        if duration > 0:
            self.rows[k].events.append(Event(SEND, op.src, op.microbatch, start, start + duration, peer))
            self.rows[peer].events.append(Event(RECV, op.dst, op.microbatch, start, start + duration, k))
        return True

    def _allreduce(self, k: int, i: int, op: Op) -> bool:
        nth = self.seen[k].get(op.group, 0)
        self.seen[k][op.group] = nth + 1
        posts = self.posted.setdefault((op.group, nth), {})
        posts[k] = (i, self.clock[k])
        members = {self.row.get(self.stand_for.get(r, r)) for r in op.group}
        if any(m is None or m not in posts for m in members):
            return True  # the others have not reached it yet; it finishes when the last one does
        start = max([t for _, t in posts.values()] + [self.reduce_free[m] for m in posts])
        end = start + self.group(op.group)
        for m, (index, _) in posts.items():
            self.reduce_free[m] = end
            self.times[m][index] = (start, end)
            if end > start:
                stage = min(self.rows[m].stages, default=-1)
                self.rows[m].events.append(Event(ALLREDUCE, stage, -1, start, end))
        return True
