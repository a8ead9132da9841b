"""Explicit schedules: prove an action list complete and deadlock-free, and simulate it on a plan's stage times.

A schedule is per device an ordered list of `Action`s (runtime/schedule.py). A device runs
its list in order, one action at a time; an action starts once the device is free and its
inputs have arrived:

    F(s, i) needs F(s-1, i)'s activations;  B(s, i) needs F(s, i) and B(s+1, i)'s gradients;
    W(s, i), the weight part of a split backward (zero-bubble schedules), needs B(s, i).

Transfers between devices run on the link, overlapping compute; each directed link carries
one transfer at a time, in the sender's order. After a device's last backward of a stage it
all-reduces that stage's gradients. `partitioner.predict.simulator.simulate(plan, schedule)` lands
here; `simulate(plan)` runs the plan's own programs instead (what the runtime runs).

    GPipe, m=2, p=2: forward 1 ms, backward 2 ms, transfer 0.5 ms; one char = 0.5 ms
    (`Timeline.chart(0.5)`: F forward, B backward, ~ only a transfer, . idle):

    device 0 FFFF~......~BBBBBBBB      F0 F1, send F1 at 2.0, recv B1's gradient at 5.5
    device 1 ..~FFFFBBBBBBBB~....      recv F0 at 1.0, F0 F1 B1 B0, send B0's gradient at 7.5
             0   2   4   6   8   10 ms: makespan 10, bubble 1 - 12/20 = 40%

[Note: pricing a split backward]
Where a schedule lists W(s, i), B(s, i) computes only the gradients of the stage's inputs
and W(s, i) its weights' (runtime/split_backward.py); a B without a W of its own runs whole
(DualPipeV splits only some of a stage's backwards). The plan gives one `backward_ms` per
stage; `compute_ms` splits it: half each, as for a matmul (dX = dY W^T and dW = X^T dY
cost the same FLOPs) and so for stages of linear layers; the whole of it in W for a stage
that reads no other stage (the first stage: no input needs a gradient, B is empty). A
split B of a stage without weights is priced half too: coarse, but such stages are cheap.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, Mapping, Sequence

from partitioner.errors import PartitionError
from partitioner.predict.timeline import (
    ALLREDUCE,
    RECV,
    SEND,
    DeviceTimeline,
    Event,
    Timeline,
    compute_kind,
    fill_idle,
)
from rules.actions import peak_in_flight
from runtime.plan import Plan, StagePlan
from runtime.program import action_deps, stage_readers
from runtime.schedule import Action

__all__ = [
    "ScheduleCheck", "ScheduleError", "StageMs", "TransferMs", "check_schedule", "compute_ms", "plan_transfer",
    "simulate_schedule", "stage_ms",
]

TransferMs = Callable[[int, int, int], float]
StageMs = Mapping[int, float] | Callable[[int], float]


class ScheduleError(PartitionError):
    """A schedule misses or repeats actions, or its lists can deadlock; the message lists why."""


@dataclass
class ScheduleCheck:
    """What `check_schedule` proved about a schedule."""

    stage_device: list[int]  # device index (list) running each stage
    peak_in_flight: list[int]  # per stage: max forwards done minus backwards (W where split) done
    ticks: int  # steps when every ready device runs one action per step


Producers = Sequence[Sequence[int]] | None


def _producers(stages: int, producers: Producers) -> list[list[int]]:
    """Stages each stage reads from: the one before it for a chain (the default), else as given."""
    if producers is None:
        return [[s - 1] if s > 0 else [] for s in range(stages)]
    return [list(p) for p in producers]


def _consumers(a: Action, producers: Sequence[Sequence[int]], readers: Sequence[Sequence[int]]) -> list[Action]:
    """Actions on other stages that read `a`'s output (activations forward, gradients backward; W: none)."""
    if a.kind == "W":
        return []
    if a.kind == "F":
        return [Action(c, "F", a.microbatch) for c in readers[a.stage]]
    return [Action(p, "B", a.microbatch) for p in producers[a.stage]]


def check_schedule(
    schedule: Sequence[Sequence[Action]], stages: int, micro_batches: int, producers: Producers = None
) -> ScheduleCheck:
    """Prove that `schedule` runs every F and B once per stage and micro-batch and cannot deadlock.

    A W is optional, per stage and micro-batch: a B with a W of its own is split, one without
    runs whole (as `runtime.program.lower` runs them). The deadlock check proves the order:
    F before B, B before W.

    Args:
        schedule: per device, the ordered actions it runs.
        stages: number of pipeline stages (Action.stage is 0 .. stages-1).
        micro_batches: number of micro-batches (Action.microbatch is 0 .. micro_batches-1).

    Raises:
        ScheduleError: all problems found, one per line; or, for a deadlock, where each
            stuck device waits and on what.
        TypeError: an entry is not an Action.
    """
    if stages < 1 or micro_batches < 1:
        raise ScheduleError(f"need stages >= 1 and micro_batches >= 1, got {stages} and {micro_batches}")
    problems: list[str] = []
    where: dict[Action, tuple[int, int]] = {}
    devices_of: dict[int, set[int]] = {}
    for d, actions in enumerate(schedule):
        for k, a in enumerate(actions):
            if not isinstance(a, Action):
                raise TypeError(f"schedule[{d}][{k}] is {a!r}, not an Action; build lists with runtime.schedule")
            if not (0 <= a.stage < stages and 0 <= a.microbatch < micro_batches and a.kind in ("F", "B", "W")):
                problems.append(
                    f"device {d} position {k}: {a} is outside {stages} stages x {micro_batches} micro-batches"
                )
                continue
            if a in where:
                first = f"device {where[a][0]} position {where[a][1]}"
                problems.append(f"{a} appears twice: {first} and device {d} position {k}")
                continue
            where[a] = (d, k)
            devices_of.setdefault(a.stage, set()).add(d)
    split = _split(schedule)
    kinds: tuple[Literal["F", "B", "W"], ...] = ("F", "B", "W")
    expected = [Action(s, kind, i) for s in range(stages) for kind in kinds for i in range(micro_batches)
                if kind != "W" or (s, i) in split]
    missing = [str(a) for a in expected if a not in where]
    if missing:
        more = " ..." if len(missing) > 20 else ""
        problems.append(f"{len(missing)} actions missing: {' '.join(missing[:20])}{more}")
    for s, devices in sorted(devices_of.items()):
        if len(devices) > 1:
            problems.append(f"stage {s} runs on devices {sorted(devices)}; put all of a stage's actions in one list")
    if problems:
        raise ScheduleError("invalid schedule:\n" + "\n".join(f"- {p}" for p in problems))

    done: set[Action] = set()
    pointer = [0] * len(schedule)
    ticks = 0
    prods = _producers(stages, producers)
    readers = stage_readers(prods)
    while len(done) < len(expected):
        ready = [
            d for d, actions in enumerate(schedule)
            if pointer[d] < len(actions)
            and all(dep in done for dep in action_deps(actions[pointer[d]], prods, readers))
        ]
        if not ready:
            raise ScheduleError(_deadlock_message(schedule, pointer, done, where, prods, readers))
        for d in ready:
            done.add(schedule[d][pointer[d]])
            pointer[d] += 1
        ticks += 1
    return ScheduleCheck(
        stage_device=[next(iter(devices_of[s])) for s in range(stages)],
        peak_in_flight=_peak_in_flight(schedule, stages),
        ticks=ticks,
    )


def _deadlock_message(
    schedule: Sequence[Sequence[Action]],
    pointer: list[int],
    done: set[Action],
    where: Mapping[Action, tuple[int, int]],
    producers: Sequence[Sequence[int]],
    readers: Sequence[Sequence[int]],
) -> str:
    lines = ["schedule deadlocks; every unfinished device waits on an action that cannot run yet:"]
    for d, actions in enumerate(schedule):
        if pointer[d] >= len(actions):
            continue
        a = actions[pointer[d]]
        waits = ", ".join(
            f"{dep} (device {where[dep][0]} position {where[dep][1]})"
            for dep in action_deps(a, producers, readers) if dep not in done
        )
        lines.append(f"- device {d} position {pointer[d]}: {a} needs {waits}")
    lines.append("Fix: order each list so an action's inputs (F of the stage before, B of the stage after, a W's "
                 "own B) run first.")
    return "\n".join(lines)


def _split(schedule: Sequence[Sequence[Action]]) -> set[tuple[int, int]]:
    """(stage, micro-batch) of each backward split into B and W (the schedule lists its W)."""
    return {(a.stage, a.microbatch) for actions in schedule for a in actions if isinstance(a, Action) and a.kind == "W"}


def _peak_in_flight(schedule: Sequence[Sequence[Action]], stages: int) -> list[int]:
    """Per stage, the most micro-batches whose activations it holds: from F to B, or to W where split."""
    split = _split(schedule)
    return peak_in_flight(([(a.stage, a.kind, (a.stage, a.microbatch) in split) for a in actions]
                           for actions in schedule), stages)


def compute_ms(stage: StagePlan, kind: str, split: bool = False, reads: bool = True) -> float:
    """Ms of one F, B or W of `stage`: see [Note: pricing a split backward].

    `split`: the B has a W of its own (W always does); `reads`: the stage reads another
    stage's values, so its B has inputs' gradients to compute.
    """
    if kind == "F":
        return stage.forward_ms
    if kind == "B" and not split:
        return stage.backward_ms
    weight = stage.backward_ms / 2 if reads else stage.backward_ms
    return weight if kind == "W" else stage.backward_ms - weight


def plan_transfer(plan: Plan) -> TransferMs:
    """Transfer times from the plan's stage fields alone (when nothing better is known).

    A message between stages a < b (either direction) takes b's inbound share of its
    `comm_ms` (both directions), split by bytes, and shared evenly among the stages b reads.
    """

    def transfer(src: int, dst: int, nbytes: int) -> float:
        stage = plan.stages[max(src, dst)]
        moved = stage.recv_bytes + stage.send_bytes
        inbound = stage.comm_ms / 2 * stage.recv_bytes / moved if moved > 0 else 0.0
        return inbound / max(1, len(stage.reads_from))

    return transfer


def stage_ms(value: StageMs | None, plan: Plan) -> Callable[[int], float]:
    """A per-stage time as a function: the mapping or callable given, else each stage's `allreduce_ms`."""
    if value is None:
        return lambda s: float(plan.stages[s].allreduce_ms)
    if callable(value):
        return value
    return lambda s: float(value.get(s, 0.0))


def simulate_schedule(
    plan: Plan,
    schedule: Sequence[Sequence[Action]],
    *,
    transfer_ms: TransferMs | None = None,
    allreduce_ms: StageMs | None = None,
    micro_batches: int | None = None,
    producers: Producers = None,
) -> Timeline:
    """Run `schedule` on `plan`'s stage times and return every device's timeline.

    Args:
        plan: stage s computes for `forward_ms` per forward and `backward_ms` per backward.
        schedule: per device, the ordered actions (e.g. `gpipe(m, p)` or `one_f_one_b(m, p)`).
        transfer_ms: (src stage, dst stage, bytes) -> ms for the tensors between adjacent
            stages on different devices; by default each stage's share of `comm_ms`.
        allreduce_ms: stage -> ms of its gradient all-reduce (mapping or callable); by default
            a stage's `allreduce_ms` attribute when it has one, else no all-reduce.
        micro_batches: defaults to `plan.micro_batches`.
        producers: for a DAG of stages (branches side by side), the stages each stage reads
            from; by default a chain, each stage reading the one before.

    Raises:
        ScheduleError: the schedule is incomplete, repeats actions or deadlocks.
    """
    m = plan.micro_batches if micro_batches is None else micro_batches
    checked = check_schedule(schedule, len(plan.stages), m, producers)
    transfer = transfer_ms or plan_transfer(plan)
    run = _Run(plan, schedule, checked.stage_device, transfer, stage_ms(allreduce_ms, plan), m, producers)
    pointer = [0] * len(schedule)
    remaining = sum(len(actions) for actions in schedule)
    while remaining:  # terminates: check_schedule proved some device can always move
        for d, actions in enumerate(schedule):
            while pointer[d] < len(actions) and run.ready(actions[pointer[d]]):
                run.execute(d, actions[pointer[d]])
                pointer[d] += 1
                remaining -= 1
    makespan = max((e.end for t in run.timelines for e in t.events), default=0.0)
    for t in run.timelines:
        fill_idle(t, makespan)
    return Timeline(devices=run.timelines, makespan_ms=makespan, peak_in_flight=checked.peak_in_flight)


class _Run:
    """The state of one simulation: device and link clocks, finish and arrival times."""

    def __init__(
        self,
        plan: Plan,
        schedule: Sequence[Sequence[Action]],
        device_of: list[int],
        transfer: TransferMs,
        reduce_ms: Callable[[int], float],
        micro_batches: int,
        producers: Producers = None,
    ) -> None:
        self.producers = _producers(len(plan.stages), producers)
        self.readers = stage_readers(self.producers)
        self.plan, self.device_of, self.transfer, self.reduce_ms = plan, device_of, transfer, reduce_ms
        self.stages = len(plan.stages)
        self.timelines = [
            DeviceTimeline(
                device=plan.stages[actions[0].stage].device if actions else "",
                stages=sorted({a.stage for a in actions}),
            )
            for actions in schedule
        ]
        self.finished: dict[Action, float] = {}
        self.arrival: dict[tuple[Action, int], float] = {}  # when an action's output is on a device
        self.free = [0.0] * len(schedule)  # compute
        self.reduce_free = [0.0] * len(schedule)
        self.link_free: dict[tuple[int, int], float] = {}
        self.backwards_left = [micro_batches] * self.stages  # the last B (W where split) all-reduces
        self.split = _split(schedule)

    def ready(self, a: Action) -> bool:
        return all(dep in self.finished for dep in action_deps(a, self.producers, self.readers))

    def execute(self, d: int, a: Action) -> None:
        """Run `a` on device d as early as its inputs allow, then send its output on."""
        inputs = [
            self.arrival.get((x, d), self.finished[x]) for x in action_deps(a, self.producers, self.readers)
        ]
        start = max([self.free[d], *inputs])
        stage = self.plan.stages[a.stage]
        split = (a.stage, a.microbatch) in self.split
        end = start + compute_ms(stage, a.kind, split, bool(self.producers[a.stage]))
        kind = compute_kind(a.kind)
        self.timelines[d].events.append(Event(kind, a.stage, a.microbatch, start, end))
        self.free[d] = self.finished[a] = end
        for consumer in _consumers(a, self.producers, self.readers):
            peer = self.device_of[consumer.stage]
            if peer != d and (a, peer) not in self.arrival:
                self._send(d, peer, a, consumer, end)
        if a.kind == ("W" if split else "B"):
            self.backwards_left[a.stage] -= 1
            duration = float(self.reduce_ms(a.stage))
            if self.backwards_left[a.stage] == 0 and duration > 0:
                t0 = max(end, self.reduce_free[d])
                self.reduce_free[d] = t0 + duration
                self.timelines[d].events.append(Event(ALLREDUCE, a.stage, -1, t0, t0 + duration))

    def _send(self, d: int, peer: int, a: Action, consumer: Action, ready: float) -> None:
        """Move `a`'s output over link d -> peer, after the transfers queued before it."""
        nbytes = self.plan.stages[max(a.stage, consumer.stage)].recv_bytes
        duration = float(self.transfer(a.stage, consumer.stage, nbytes))
        if duration <= 0:
            return
        t0 = max(ready, self.link_free.get((d, peer), 0.0))
        self.arrival[(a, peer)] = self.link_free[(d, peer)] = t0 + duration
        self.timelines[d].events.append(Event(SEND, a.stage, a.microbatch, t0, t0 + duration, peer))
        self.timelines[peer].events.append(Event(RECV, consumer.stage, a.microbatch, t0, t0 + duration, d))


