"""Calibrated by default: time a pipeline's first training steps, refit the machine parameters, update the plan.

`partition` installs a `StepWatch`; `train_step` calls it as each step starts (runtime.calibration_hook).
It changes nothing the steps compute and runs no step of its own:

    step 1 .. N               its start and end times taken (`clock`); steps N - T + 1 .. N traced (T = `traced`)
    start of step N + 1       tracing off; rank 0 fits the traces (previous calibration blended, group factors),
                              the step time being the median time of steps 2 .. N inside train_step (the
                              slowest rank's under torchrun); saves the JSON; predicts the running plan
                              and, where an argument was "auto", every candidate again with it
                              (partitioner.calibrate.candidates); every rank: pipe.plan.predicted_step_ms
                              and .alternatives updated, pipe.calibration_report set; the watch is removed
    later steps               nothing

What the loop does between steps (the optimizer step, loading data, another pipeline's steps) is this loop's,
not the machine's: the saved calibration is fitted on the time inside train_step, as `pipe.calibrate` measures
it, and the median time between one step's end and the next one's start (`Measurement.loop_ms`) is added to this
pipe's own prediction only, so pipe.plan.predicted_step_ms is what the loop takes per step.

A candidate predicted faster is reported, not switched to: mid-training, a switch would move weights and
optimizer state between ranks or devices, and telling the two apart needs steps of the challenger. The log
names pipe.calibrate(), which measures it and switches when it wins. Plans with asynchronous updates or
stale gradients are not watched (a background all-reduce may be in flight as a step starts), nor steps the
user traces. A failure is logged and ends the watch; it never fails the training step.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from cost_model.calibration_store import calibration_path
from partitioner.calibrate.candidates import MIN_GAIN, Setup, fit_and_rank, option_sets, rebuild, regather
from partitioner.calibrate.measure import CalibrationReport, Candidate, Measurement, step_statistics
from runtime.launch import distributed

__all__ = ["STEPS", "StepWatch"]

logger = logging.getLogger("partitioner.calibrate.decide")
STEPS = 10  # steps timed before the refit
TRACED = 3  # the last of them traced


@dataclass
class StepWatch:
    """The passive refit of one pipeline (see the module docstring); `clock` is a seam for tests."""

    setup: Setup
    steps: int = STEPS
    traced: int = TRACED
    clock: Callable[[], float] = time.perf_counter
    starts: list[float] = field(default_factory=list)
    ends: list[float] = field(default_factory=list)
    traces: list[Any] = field(default_factory=list)
    tracing: bool = False
    done: bool = False

    def __call__(self, pipe: Any) -> None:
        if self.done:
            return
        try:
            self._step_starts(pipe)
        except Exception as exc:  # noqa: BLE001 - calibration must never fail a training step
            self._failed(pipe, exc)

    def step_ended(self, pipe: Any) -> None:
        """The step that started last has done its work (the loop's own work follows)."""
        if not self.done and len(self.ends) < len(self.starts):
            try:
                self.ends.append(self.clock())
            except Exception as exc:  # noqa: BLE001 - calibration must never fail a training step
                self._failed(pipe, exc)

    def _failed(self, pipe: Any, exc: Exception) -> None:
        self.stop(pipe)
        logger.warning("calibration after the first steps failed, the plan keeps its prediction: %s: %s",
                       type(exc).__name__, exc)

    def _step_starts(self, pipe: Any) -> None:
        if pipe.plan.update != "sync" or pipe.plan.staleness:
            self.stop(pipe)
            return
        if self.tracing:  # the step before was traced
            self.traces.append(pipe.gather_trace() if distributed() else pipe.measured_timeline())
            pipe.clear_trace()
        self.starts.append(self.clock())
        step = len(self.starts)  # the step starting now, from 1
        if step == self.steps + 1:
            self.stop(pipe)
            self._refit(pipe)
        elif step == max(2, self.steps - self.traced + 1):
            if pipe.tracing:  # the user traces these steps: leave them to the user
                self.stop(pipe)
                return
            pipe.clear_trace()
            pipe.tracing = self.tracing = True

    def stop(self, pipe: Any) -> None:
        """End the watch (tracing off, removed from the pipe)."""
        if self.tracing:
            pipe.tracing = self.tracing = False
            pipe.clear_trace()
        self.done = True
        if getattr(pipe, "_step_watch", None) is self:
            pipe.set_step_watch(None)

    def _measured(self) -> Measurement:
        """The median time of steps 2 .. N inside train_step and between steps (the slowest rank's; without
        an end for every step, the start-to-start time and no loop time), and the traces gathered."""
        starts = self.starts[1:-1]
        periods = [(b - a) * 1e3 for a, b in zip(starts, self.starts[2:])]
        loop_ms = 0.0
        if len(self.ends) >= len(self.starts) - 1:
            inside = [(e - a) * 1e3 for a, e in zip(starts, self.ends[1:])]
            loop_ms = statistics.median(p - i for p, i in zip(periods, inside))
            periods = inside
        step_ms, noise = step_statistics(periods)
        if distributed():
            slowest = torch.tensor([step_ms, noise, loop_ms], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            step_ms, noise, loop_ms = (float(x) for x in slowest)
        traces = [t for t in self.traces if t is not None]
        return Measurement(step_ms, {"steps": traces} if traces else None, noise, loop_ms=loop_ms)

    def _refit(self, pipe: Any) -> None:
        setup = self.setup
        ran = self._measured()
        given = setup.request.calibration
        where = calibration_path(setup.devices, processes=distributed(),
                                 override=given if isinstance(given, (str, Path)) else None)
        options = option_sets(setup)
        replan = len(options) > 1 or any(options.values())  # an "auto" argument to check again
        many = distributed()
        if replan and many:
            regather(pipe, setup)  # rank 0 plans the candidates with the whole model
        box: list[Any] = [None]
        timeline = None
        if not many or dist.get_rank() == 0:
            try:
                decided = fit_and_rank(pipe, setup, ran, where, replan=replan)
                timeline = decided["timeline"]
                box = [("ok", {k: decided[k] for k in ("cands", "current", "challenger", "error", "factors",
                                                       "fitted", "running_ms")})]
            except Exception as exc:  # noqa: BLE001 - the other ranks must hear of it, not wait
                box = [("error", f"{type(exc).__name__}: {exc}")]
        if many:
            dist.broadcast_object_list(box, src=0)
            if replan:
                pipe.adopt(rebuild(setup, pipe.plan, pipe))  # each rank drops again the weights it does not read
        kind, decided = box[0]
        if kind == "error":
            raise RuntimeError(f"rank 0: {decided}")
        self._update(pipe, ran, str(where), decided, timeline)

    def _update(self, pipe: Any, ran: Measurement, where: str, decided: dict[str, Any], timeline: Any) -> None:
        cands: dict[str, Candidate] = decided["cands"]
        current, challenger = decided["current"], decided["challenger"]
        plan = pipe.plan
        before = plan.predicted_step_ms
        plan.predicted_step_ms = decided["running_ms"] + ran.loop_ms  # this loop's step, its own work included
        plan.alternatives["calibrated"] = plan.predicted_step_ms
        plan.alternatives["measured"] = ran.step_ms + ran.loop_ms
        if len(cands) > 1:
            for c in cands.values():
                plan.alternatives[f"{c.name} calibrated"] = c.predicted_after_ms + ran.loop_ms
        self.setup.current = current
        steps = ran.trace["steps"] if ran.trace else []
        pipe.calibration_report = CalibrationReport(
            steps=self.steps, path=where, measured_ms=ran.step_ms, predicted_before_ms=before,
            predicted_after_ms=decided["running_ms"], previous=current, chosen=current, replanned=False,
            reverted=False, candidates=cands, factors=decided["factors"], fitted=decided["fitted"], plan=plan,
            trace=steps[-1] if steps else None, timeline=timeline)
        logger.info("calibrated from the first %d steps: measured %.2f ms per step (%.2f of them between steps, the "
                    "loop's own work), predicted %.2f ms (was %.2f); saved to %s", self.steps,
                    ran.step_ms + ran.loop_ms, ran.loop_ms, plan.predicted_step_ms, before, where)
        if challenger is None:
            return
        mine, theirs = cands[current].predicted_after_ms, cands[challenger].predicted_after_ms
        if theirs < mine * (1.0 - max(MIN_GAIN, 2 * ran.noise)):
            logger.info("calibrated: %s is predicted %.2f ms per step against %.2f ms for the running %s; "
                        "pipe.calibrate() measures it and switches if it is faster", challenger, theirs, mine,
                        current)
