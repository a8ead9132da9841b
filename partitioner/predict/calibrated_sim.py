"""Simulate a plan's programs priced with a Calibration: what the runtime pays beyond the plan's stage times.

`simulate(plan, calibration=c)` lands here. Each op of the programs is priced from the
calibration's general parameters (cost_model/run_fit.py fits them from a traced run):

    F/B/W     the plan's stage time x the device's factor for that kind + the per-task overhead
              (a + b x that time where a run fitted the "task" line, cost_model/overhead_fit.py),
              x the processor-sharing slowdown max(1, k / cores) while k CPU rows (ranks or
              worker slots) of one host compute at once: they share the host's cores
    SEND      the sender posts it (its thread busy for the "SEND" line's a + b x its compute op before,
              else the flat "SEND" task time), then the message takes latency + bytes / bandwidth of the
              backend's link
    RECV      the receiver's thread is busy for the "RECV" task time (posting, taking the message);
              a compute op whose message lands after its rank is ready starts "WAKE" ms after
              the landing (a blocked thread waits to be woken and get a core back)
    AR        ring all-reduce of the replicated stages' weights over that link (other groups: as
              the programs recorded) x the fitted "allreduce" factor, overlapping later compute
    STEP      + the fixed per-step cost (scatter, gather, loss, optimizer step)

Sharing makes an op's length depend on what overlaps it, which depends on the lengths: the
run is repeated, each op stretched by the average concurrency it saw in the run before
(damped), until the makespan settles (a few passes):

    2 ranks on 1 core, F 2 ms each, both at 0:   pass 1: 0..2 and 0..2, k = 2
                                                 settled: 0..4 and 0..4 (each at half speed)
"""

from __future__ import annotations

from typing import Callable

from cost_model import overhead_fit
from cost_model.calibration import Calibration
from cost_model.run_fit import sharing
from partitioner.predict.lowering import default_programs
from partitioner.predict.prices import GroupMs, group_price, message_price
from partitioner.predict.program_run import ProgramRun
from partitioner.predict.schedule_sim import StageMs, TransferMs, compute_ms
from partitioner.predict.timeline import Timeline
from runtime.plan import Plan
from runtime.program import Op, Program

__all__ = ["simulate_calibrated"]

_PASSES = 30
_TOLERANCE = 1e-4  # relative change of the makespan that ends the passes


def simulate_calibrated(
    plan: Plan,
    calibration: Calibration,
    *,
    transfer_ms: TransferMs | None = None,
    allreduce_ms: StageMs | None = None,
    group_ms: GroupMs | None = None,
    backend: str = "gloo",
) -> Timeline:
    """One step of `plan.programs` (lowered when it has none) priced with `calibration`; one row per rank."""
    programs = plan.programs or default_programs(plan)
    message = _message(plan, programs, calibration, transfer_ms, backend)
    fallback = group_price(plan, programs, group_ms, allreduce_ms)

    def group(ranks: tuple[int, ...]) -> float:
        if group_ms is None:
            nbytes = sum(s.param_bytes for s in plan.stages if tuple(sorted(set(s.ranks))) == ranks)
            priced = calibration.allreduce_ms(nbytes, len(ranks), backend) if nbytes else None
            if priced is not None:
                return priced * calibration.factor("allreduce")
        return fallback(ranks) * calibration.factor("allreduce")

    send_line, flat_send = calibration.line("SEND"), calibration.task_ms.get("SEND", 0.0)
    task_line = calibration.line("task")  # solved once, not per pass
    shared = _shared_rows(plan, programs, calibration.cores)
    stretch: dict[tuple[int, int], float] = {}

    def one_pass() -> tuple[Timeline, list[list[tuple[float, float] | None]]]:
        run = ProgramRun(plan, programs, message, group)
        run.compute_price = _compute_price(plan, programs, calibration, task_line, stretch)
        run.post_price = lambda ms: overhead_fit.price(send_line, ms, flat_send)
        run.recv_ms = calibration.task_ms.get("RECV", 0.0)
        run.wake_ms = calibration.task_ms.get("WAKE", 0.0)
        run.couple_batches()
        return run.run(), run.times

    timeline, times = one_pass()
    for _ in range(_PASSES if shared else 0):
        seen = _concurrency(times, programs, shared)
        stretch = {(r, i): (stretch.get((r, i), 1.0) + sharing(k, shared[r][1])) / 2 for (r, i), k in seen.items()}
        previous = timeline.makespan_ms
        timeline, times = one_pass()
        if abs(timeline.makespan_ms - previous) <= _TOLERANCE * previous:
            break
    timeline.makespan_ms += calibration.step_ms
    return timeline


def _message(plan: Plan, programs: list[Program], calibration: Calibration, transfer_ms: TransferMs | None,
             backend: str) -> Callable[[int, int], float]:
    fallback = message_price(plan, programs, transfer_ms)
    if transfer_ms is not None or backend not in calibration.links:
        return fallback

    def price(src: int, dst: int) -> float:
        priced = calibration.message_ms(plan.stages[max(src, dst)].recv_bytes, backend)
        return fallback(src, dst) if priced is None else priced

    return price


def _compute_price(plan: Plan, programs: list[Program], calibration: Calibration, line: tuple[float, float] | None,
                   stretch: dict[tuple[int, int], float]) -> Callable[[int, int, Op], float]:
    reads = [bool(s.reads_from) for s in plan.stages]  # as ProgramRun reads the stage DAG

    def price(row: int, index: int, op: Op) -> float:
        stage = plan.stages[op.stage]
        base = compute_ms(stage, op.kind, op.split, reads[op.stage]) * calibration.compute_factor(stage.device, op.kind)
        return (base + overhead_fit.price(line, base, calibration.task_ms.get(op.kind, 0.0))) * stretch.get(
            (row, index), 1.0)

    return price


def _shared_rows(plan: Plan, programs: list[Program], cores: float) -> dict[int, tuple[str, float]]:
    """Row -> (what it shares, how many ops that runs at full speed at once), for rows that share one.

    CPU rows share their host's `cores` (ranks under torchrun, workers of one process). GPU rows
    are their own: a plan names a replicated stage's device once for all its ranks, so two rows
    on "cuda:0" may be two GPUs, and nothing here can tell slots of one GPU apart from them.
    """
    keys = {k: (f"host {plan.host_of(p.rank)}", cores) for k, p in enumerate(programs)
            if str(p.device).startswith("cpu")}
    count: dict[str, int] = {}
    for key, _ in keys.values():
        count[key] = count.get(key, 0) + 1
    return {k: (key, capacity) for k, (key, capacity) in keys.items() if count[key] > 1 and capacity > 0}


def _concurrency(times: list[list[tuple[float, float] | None]], programs: list[Program],
                 shared: dict[int, tuple[str, float]]) -> dict[tuple[int, int], float]:
    """(row, op) -> the average number of rows sharing its device computing during it (itself included)."""
    busy: dict[str, list[tuple[float, float]]] = {}
    ops: list[tuple[int, int, float, float]] = []
    for k, (key, _) in shared.items():
        for i, op in enumerate(programs[k].ops):
            t = times[k][i]
            if op.is_compute and t is not None and t[1] > t[0]:
                busy.setdefault(key, []).append(t)
                ops.append((k, i, t[0], t[1]))
    return {(k, i): sum(max(0.0, min(b, e) - max(a, s)) for a, b in busy[shared[k][0]]) / (e - s)
            for k, i, s, e in ops}
