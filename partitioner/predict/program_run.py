"""The program simulator: one step of per-rank programs, each rank's timeline of compute, transfers and all-reduce.

`ProgramRun` prices the ops the runtime runs (runtime/program.py), so what is predicted and
drawn is what runs. A rank runs its ops in order:

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
    STEP    ends the rank's step after its compute, transfers and all-reduces, plus the optimizer
            step of the stages it holds (their `optimizer_ms`: 0 where not priced).

    GPipe, m=2, stage 0 on ranks 0 and 1 (one micro-batch each), stage 1 on rank 2; F 1 ms,
    B 2 ms, free transfers, all-reduce 1.5 ms; one char = 0.5 ms (`Timeline.chart(0.5)`):

    rank 0  FF............BBBB~~~   F0, B0 at 7; the all-reduce waits for both replicas,
    rank 1  FF........BBBB....~~~   runs 9 .. 10.5 and ends the step: predicted 10.5 ms,
    rank 2  ..FFFFBBBBBBBB.......   not 9 (tests/test_assemble.py computes it by hand)

Messages and all-reduces are priced by the callables it is given (partitioner/predict/prices.py),
compute by each stage's `forward_ms` and `backward_ms` unless `compute_price` says otherwise
(partitioner/predict/calibrated_sim.py sets it, and the receiver's and sender's own costs).
`simulate(plan)` (partitioner/predict/simulator.py) chooses the programs and the prices.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

from partitioner.predict.prices import Group
from partitioner.predict.schedule_sim import ScheduleError, compute_ms
from partitioner.predict.timeline import ALLREDUCE, RECV, SEND, DeviceTimeline, Event, Timeline, compute_kind, fill_idle
from rules.actions import peak_in_flight
from runtime.plan import Plan
from runtime.program import Op, Program

__all__ = ["ProgramRun", "in_flight"]


def in_flight(programs: Sequence[Program], stages: int) -> list[int]:
    """Per stage, the most micro-batches one rank has forwarded but not yet backwarded (its W, where split):
    `rules.actions.peak_in_flight` of the programs' compute ops."""
    return peak_in_flight(([(op.stage, op.kind, op.split) for op in program.ops if op.kind in ("F", "B", "W")]
                           for program in programs), stages)


class ProgramRun:
    """One simulation of programs: rank clocks, finish times, transfers and all-reduces in flight."""

    def __init__(self, plan: Plan, programs: Sequence[Program], message: Callable[[int, int], float],
                 group: Callable[[Group], float], members: Mapping[int, Sequence[int]] | None = None) -> None:
        self.plan, self.programs, self.message, self.group = plan, list(programs), message, group
        self.compute_price: Callable[[int, int, Op], float] | None = None  # (row, op index, op) -> ms
        # the sender's own time to post one SEND, given the ms of its rank's compute op before it (calibrated runs)
        self.post_price: Callable[[float], float] | None = None
        self.recv_ms = 0.0  # the receiver's own time per RECV: posting it and taking the message (calibrated)
        self.wake_ms = 0.0  # a rank blocked on a message resumes this long after it arrives (calibrated)
        self.coupled: dict[tuple[int, int, int], list[tuple[int, int, int]]] = {}  # see couple_batches
        self.receives_posted: dict[tuple[int, int, int], float] = {}  # RECV key -> when its rank posted it
        # Folded replicas (replica_fold): a rank -> the simulated rank standing for it.
        self.stand_for = {m: rep for rep, ms in (members or {}).items() for m in ms}
        self.row = {p.rank: k for k, p in enumerate(self.programs)}
        held = {p.rank: {op.stage for op in p.ops if op.is_compute} for p in self.programs}
        self.update_ms = [sum(float(plan.stages[s].optimizer_ms) for s in held[p.rank]) for p in self.programs]
        self.producers = [list(s.reads_from) for s in plan.stages]
        self.consumers: list[list[int]] = [[] for _ in plan.stages]
        for s, ps in enumerate(self.producers):
            for p in ps:
                self.consumers[p].append(s)
        self.clock = [0.0] * len(self.programs)
        self.last_ms = [0.0] * len(self.programs)  # each row's latest compute op's length
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
        self.times[k][i] = (end, end + self.update_ms[k])
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
        self.last_ms[k] = end - start
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
        post = self.post_price(self.last_ms[k]) if self.post_price is not None else 0.0
        if post > 0:  # posting occupies the sender's thread before the message leaves
            self.clock[k] = max(self.clock[k], ready) + post
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
