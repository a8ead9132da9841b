"""Calibration from measured runs: `pipe.calibrate(steps=N)`, and auto choices that never lose.

    measure N steps of the running plan (the last one traced), weights restored afterwards
      -> fit (cost_model.calibration.fit_calibration) -> save JSON in the per-machine cache
      -> plan every option of the "auto" arguments again, before and after calibration
      -> a challenger: the plan now predicted fastest if it is not the running one, else the
         runner-up when its prediction is within the simulator's proven error of the running one
         (how far the running plan's prediction, made before this run, was from this run)
      -> measure the challenger as long; it replaces the running plan (adopted in place) only when
         measured faster by more than the standard error of the two medians' difference where the
         calibrated simulator predicted it faster, twice that where it did not (MIN_GAIN at least)

Fitting and planning the candidates is partitioner.calibrate.candidates; the refit a pipeline does by
itself after its first training steps (no extra steps, nothing switched) is partitioner.calibrate.passive.
The runtime never imports this module: `partition` installs `calibrate` as the pipe's hook, and the
passive refit's step watch (runtime.calibration_hook; `attach`). Under torchrun every rank runs this
function: rank 0 fits, saves and plans, then broadcasts the challenger's plan; every rank builds and
measures it, and the measured times are the slowest rank's (an all-reduce), so every rank takes the
same decision.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch.distributed as dist

from cost_model.calibration_store import calibration_path
from cost_model.default import default_cost_model
from partitioner.calibrate.candidates import (
    MIN_GAIN,
    Setup,
    fit_and_rank,
    rebuild as rebuild_pipe,
    regather,
    same_plan,
)
from partitioner.calibrate.measure import (
    CalibrationReport,
    Candidate,
    Measurement,
    Snapshot,
    default_step,
    measure_steps,
)
from partitioner.calibrate.passive import StepWatch
from partitioner.errors import PartitionError
from runtime.calibration_hook import Calibratable, StepCall
from runtime.launch import distributed
from runtime.plan import Plan

__all__ = [
    "Candidate", "CalibrationReport", "Hook", "Measurement", "Setup", "attach", "calibrate", "hook_of", "measure_steps",
    "same_plan",
]

logger = logging.getLogger("partitioner.calibrate.decide")
_P = TypeVar("_P", bound=Calibratable)


def calibrate(
    pipe: Any,
    *,
    steps: int,
    setup: Setup,
    step: StepCall | None = None,
    path: str | None = None,
    measure: Callable[[Any, int, StepCall], Measurement] = measure_steps,
    rebuild: Callable[[Setup, Plan, Any], Any] | None = None,
) -> CalibrationReport:
    """Measure, fit, save and re-plan `pipe` (a pipeline from `partition`); see the module's docstring.

    `step`: the inputs and loss to run (default: the last `train_step`'s, else the example
    inputs, see `default_step`). `path`: where the calibration is saved (default: the per-machine
    cache, or the `calibration=` path given to `partition`). `measure` and `rebuild` are seams for
    tests (a fake clock; another builder).

    Raises:
        PartitionError: an asynchronous-update plan (its steps would move the weights), or no inputs.
    """
    if pipe.plan.update != "sync":
        raise PartitionError(f"calibrate runs synchronous steps; this plan has update={pipe.plan.update!r}: "
                             "calibrate a partition(..., update='sync') of the model, then plan with it")
    call = step or pipe.last_step or default_step(setup.example_inputs, setup.example_kwargs)
    given = path if path is not None else setup.request.calibration
    where = calibration_path(setup.devices, processes=distributed(),
                             override=given if isinstance(given, (str, Path)) else None)
    build = rebuild or rebuild_pipe
    rank0 = not distributed() or dist.get_rank() == 0
    before = pipe.plan.predicted_step_ms
    snap = Snapshot(setup.model)
    try:
        ran = measure(pipe, steps, call)
        snap.restore()
        regather(pipe, setup)  # torchrun: rank 0 plans with the whole model, a rebuild may need any weight
        box: list[Any] = [None]
        if rank0:
            try:
                box = [("ok", fit_and_rank(pipe, setup, ran, where))]
            except Exception as exc:  # noqa: BLE001 - the other ranks must hear of it, not wait
                box = [("error", exc if not distributed() else f"{type(exc).__name__}: {exc}")]
        if distributed():
            dist.broadcast_object_list(box, src=0)
        kind, decided = box[0]
        if kind == "error":
            raise decided if isinstance(decided, BaseException) else PartitionError(f"rank 0: {decided}")
        cands: dict[str, Candidate] = decided["cands"]
        current, challenger = decided["current"], decided["challenger"]
        chosen, trace, within_noise = current, ran.trace, False
        if challenger is not None:
            other = build(setup, type(pipe.plan).from_json(decided["plan"]), pipe)  # drawable where the pipe's is
            got = measure(other, steps, call)
            snap.restore()
            cands[challenger].measured_ms = got.step_ms
            # a switch must beat the measurements' noise (the standard error of the two medians' difference):
            # once where the calibrated simulator also says the challenger is faster, twice where it does not
            agrees = cands[challenger].predicted_after_ms < cands[current].predicted_after_ms
            margin = max(MIN_GAIN, (1 if agrees else 2) * math.hypot(ran.noise, got.noise))
            switch = got.step_ms < ran.step_ms * (1.0 - margin)
            within_noise = not switch and got.step_ms < ran.step_ms
            _log(cands[current], cands[challenger], decided["error"], margin, cands[challenger if switch else current])
            if switch:
                pipe.adopt(other)
                chosen, trace = challenger, got.trace
            else:
                regather(other, setup)
                pipe.adopt(build(setup, pipe.plan, other))  # the challenger's build may have moved weights
        elif distributed():
            pipe.adopt(build(setup, pipe.plan, pipe))  # each rank drops the weights its stages do not read
    finally:
        snap.restore()
    final = pipe.plan
    setup.current = chosen
    if chosen != current:  # plans carry base costs; the calibration prices them in the simulator
        setup.planned_with = setup.request.cost_model if setup.request.cost_model is not None else default_cost_model()
    after_ms = {n: c.predicted_after_ms for n, c in cands.items()}
    predicted_switch = challenger is not None and after_ms[challenger] < after_ms[current]
    report = CalibrationReport(
        steps=steps, path=str(where), measured_ms=ran.step_ms, predicted_before_ms=before,
        predicted_after_ms=cands[current].predicted_after_ms, previous=current, chosen=chosen,
        replanned=challenger is not None and chosen != current,
        reverted=challenger is not None and (chosen != current) != predicted_switch and not within_noise,
        within_noise=within_noise,
        candidates=cands, factors=decided["factors"], fitted=decided["fitted"], plan=final,
        trace=trace if rank0 else None, timeline=decided.get("timeline") if chosen == current and rank0 else None)
    for c in cands.values():
        final.alternatives[f"{c.name} calibrated"] = c.predicted_after_ms
        if c.measured_ms is not None:
            final.alternatives[f"{c.name} measured"] = c.measured_ms
    return report


def _log(current: Candidate, challenger: Candidate, error: float, margin: float, winner: Candidate) -> None:
    logger.info(
        "calibrate: %s predicted %.2f ms (calibrated; %.2f before), measured %.2f ms; %s predicted %.2f ms "
        "(calibrated; %.2f before), measured %.2f ms; simulator error %.0f%%, switch margin %.0f%%; keeping %s",
        current.name, current.predicted_after_ms, current.predicted_before_ms, current.measured_ms or 0.0,
        challenger.name, challenger.predicted_after_ms, challenger.predicted_before_ms, challenger.measured_ms or 0.0,
        100 * error, 100 * margin, winner.name)


@dataclass
class Hook:
    """What `partition` installs as `pipe`'s calibration routine: its Setup, the measuring function and the
    passive refit's step watch (partitioner.calibrate.passive), which an explicit calibration replaces."""

    setup: Setup
    measure: Callable[[Any, int, StepCall], Measurement] = measure_steps
    watch: StepWatch | None = None

    def __call__(self, pipe: Any, *, steps: int, step: StepCall | None, path: str | None) -> CalibrationReport:
        if self.watch is not None and not self.watch.done:
            self.watch.stop(pipe)  # measured here instead; its own steps must not count as the watch's
        return calibrate(pipe, steps=steps, setup=self.setup, step=step, path=path, measure=self.measure)


def hook_of(pipe: Any) -> Hook:
    """The calibration hook `partition` installed on `pipe` (to read its Setup, or give it another clock)."""
    hook = getattr(pipe, "_calibrator", None)
    if not isinstance(hook, Hook):
        raise PartitionError("this pipeline was not built by partitioner.partition: it has no calibration hook")
    return hook


def attach(pipe: _P, setup: Setup) -> _P:
    """Install a `Hook` as `pipe`'s calibration routine (runtime.calibration_hook), and by `calibrate=`:
    None (the default): the passive refit after the first training steps (a `StepWatch`); N >= 1: run
    `pipe.calibrate(N)` now; 0: neither."""
    hook = Hook(setup)
    pipe.set_calibrator(hook)
    steps = setup.run.calibrate
    if steps is None:
        hook.watch = StepWatch(setup)
        pipe.set_step_watch(hook.watch)
    elif steps:
        pipe.calibration_report = pipe.calibrate(steps)  # type: ignore[attr-defined]
    return pipe
