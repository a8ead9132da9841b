"""Calibration from measured runs: `pipe.calibrate(steps=N)`, and auto choices that never lose.

    measure N steps of the running plan (the last one traced), weights restored afterwards
      -> fit (cost_model.calibration.fit_calibration) -> save JSON in the per-machine cache
      -> plan every option of the "auto" arguments again, before and after calibration
      -> a challenger: the plan now predicted fastest if it is not the running one, else the
         runner-up when its prediction is within the simulator's proven error of the running one
         (how far the running plan's prediction, made before this run, was from this run)
      -> measure the challenger as long; it replaces the running plan (adopted in place) only when
         measured faster by more than the noise of the two measurements (MIN_GAIN at least)

The runtime never imports this module: `partition` installs `calibrate` as the pipe's hook
(runtime.calibration_hook). Under torchrun every rank runs this function: rank 0 fits, saves
and plans, then broadcasts the challenger's plan; every rank builds and measures it, and the
measured times are the slowest rank's (an all-reduce), so every rank takes the same decision.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, TypeVar

import torch.distributed as dist
from torch import nn

from cost_model.analytic import CostModel
from cost_model.calibration import Calibration, fit_calibration
from cost_model.calibration_store import calibration_path, find_calibration, save_calibration
from cost_model.default import default_cost_model
from partitioner.calibrate.measure import (
    CalibrationReport,
    Candidate,
    Measurement,
    Snapshot,
    default_step,
    measure_steps,
)
from partitioner.errors import PartitionError
from partitioner.make.pipeline import build_pipeline, traced_call
from partitioner.make.plan import plan_model, with_update
from partitioner.place.planning import schedule_layouts
from partitioner.predict.simulator import simulate
from partitioner.request import PlanRequest, RunOptions
from runtime.calibration_hook import Calibratable, StepCall
from runtime.launch import distributed
from runtime.plan import Plan
from runtime.regather import regather_weights

__all__ = [
    "Candidate", "CalibrationReport", "Hook", "Measurement", "Setup", "attach", "calibrate", "hook_of", "measure_steps",
]

logger = logging.getLogger("partitioner.calibrate.decide")
# A measured challenger replaces the running plan only when faster by this share at least (or by the
# measurements' own noise, if larger): within it the two are a tie, and the running plan stays.
MIN_GAIN = 0.03
_P = TypeVar("_P", bound=Calibratable)


@dataclass
class Setup:
    """What `partition` was called with: enough to plan again and to rebuild the pipe from a plan."""

    model: nn.Module
    devices: list[Any]  # as given (under torchrun, each rank resolves its own entry)
    example_inputs: tuple[Any, ...]
    example_kwargs: dict[str, Any]
    request: PlanRequest
    run: RunOptions
    current: str = ""  # the candidate now running ("" until the first calibration names it)
    planned_with: CostModel | None = None  # the cost model the running plan was priced with


def option_sets(setup: Setup) -> dict[str, dict[str, Any]]:
    """Every concrete choice of the "auto" arguments (their product), by name; the user's if none is auto."""
    axes: list[list[tuple[str, dict[str, Any]]]] = []
    request = setup.request
    if request.placement == "auto":
        axes.append([("pipeline", {"placement": "pipeline"}), ("branches", {"placement": "branches"})])
    if request.schedule == "auto":
        names = schedule_layouts([[r] for r in range(request.world)], request.micro_batches,
                                 hybrid=request.replicas == "auto")
        axes.append([(n, {"schedule": n}) for n in names])
    if request.replicas == "auto":
        axes.append([("replicas=auto", {"replicas": "auto"}), ("replicas=1", {"replicas": None})])
    if not axes:
        return {"as asked": {}}
    return {"+".join(n for n, _ in combo): {k: v for _, o in combo for k, v in o.items()}
            for combo in itertools.product(*axes)}


def running_name(setup: Setup, plan: Plan, names: Mapping[str, dict[str, Any]]) -> str:
    """The candidate the running plan is (first calibration: by its placement, schedule and replicas)."""
    if setup.current in names:
        return setup.current
    replicated = any(len(s.ranks) > 1 for s in plan.stages)
    for name, o in names.items():
        if "placement" in o and o["placement"] != plan.placement:
            continue
        if "schedule" in o and o["schedule"] != plan.schedule:
            continue
        if "replicas" in o and (o["replicas"] == "auto") != (replicated or setup.request.replicas == "auto"):
            continue
        return name
    return next(iter(names))


def same_plan(a: Plan, b: Plan) -> bool:
    """Whether two plans run the same stages on the same ranks with the same schedule."""
    return (a.schedule == b.schedule and a.placement == b.placement and a.micro_batches == b.micro_batches
            and [(s.nodes, s.ranks, s.device) for s in a.stages] == [(s.nodes, s.ranks, s.device) for s in b.stages])


def _plan_with(setup: Setup, options: dict[str, Any], cost: CostModel) -> Plan:
    """The plan of one candidate: the running request with `options` changed, priced by `cost`."""
    request = setup.request.but(**options, cost_model=cost, processes=distributed())
    if request.placement != "pipeline" and request.schedule == "auto":
        request = request.but(schedule="gpipe")
    return plan_model(setup.model, setup.example_inputs, setup.example_kwargs, request)


def _decide(pipe: Any, setup: Setup, ran: Measurement, path: Path) -> dict[str, Any]:
    """Rank 0's part: fit, save, plan every candidate before and after; the challenger to measure, if any."""
    if ran.trace is None:
        raise PartitionError("calibrate: no trace was gathered on rank 0")
    previous = find_calibration(setup.devices, processes=distributed(), given=path if path.is_file() else None)
    priced = getattr(setup.planned_with, "calibration", None)
    cal = fit_calibration(pipe.plan, ran.trace, step_ms=ran.step_ms, previous=previous,
              priced_with=priced if isinstance(priced, Calibration) else None)
    save_calibration(cal, path)
    base = setup.request.cost_model if setup.request.cost_model is not None else default_cost_model()
    names = option_sets(setup)
    current = running_name(setup, pipe.plan, names)
    cands: dict[str, Candidate] = {}
    after: dict[str, Plan] = {}
    for name, options in names.items():
        try:
            before_plan = _plan_with(setup, options, base)
            after[name], after_ms = before_plan, float(simulate(before_plan, calibration=cal).makespan_ms)
        except PartitionError as exc:  # this combination cannot run here
            logger.info("calibrate: %s cannot be planned (%s)", name, exc)
            continue
        cands[name] = Candidate(name, options, before_plan.predicted_step_ms, after_ms)
    if current not in cands:
        raise PartitionError(f"calibrate: the running plan ({current}) cannot be planned again with the calibration")
    cands[current].measured_ms = ran.step_ms
    ranked = sorted(cands, key=lambda n: cands[n].predicted_after_ms)
    # The simulator's proven error: how far the running plan's own prediction (made before this run,
    # so out of sample) was from what this run measured. The fit has seen the run: its error is no proof.
    error = abs(pipe.plan.predicted_step_ms - ran.step_ms) / max(ran.step_ms, 1e-9)
    challenger: str | None = None
    if not same_plan(after[ranked[0]], pipe.plan):
        challenger = ranked[0]  # the calibrated simulator contradicts the running choice (or re-cuts it)
    else:
        runner = next((n for n in ranked if n != ranked[0] and not same_plan(after[n], pipe.plan)), None)
        if runner is not None:
            mine = cands[current].predicted_after_ms
            gap = (cands[runner].predicted_after_ms - mine) / max(mine, 1e-9)
            if gap <= error:  # closer than the simulator has proven it can tell apart
                challenger = runner
    factors = {k: cal.factor(k) for k in sorted(getattr(cal, "sums", {}))}
    fitted = {name: getattr(cal, name) for name in ("task_ms", "links", "step_ms", "cores") if hasattr(cal, name)}
    return {"cands": cands, "current": current, "challenger": challenger, "error": error, "factors": factors,
            "plan": after[challenger].to_json() if challenger is not None else None, "calibration": cal.to_dict(),
            "fitted": fitted}


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
    build = rebuild or _rebuild
    rank0 = not distributed() or dist.get_rank() == 0
    before = pipe.plan.predicted_step_ms
    snap = Snapshot(setup.model)
    try:
        ran = measure(pipe, steps, call)
        snap.restore()
        _regather(pipe, setup)  # torchrun: rank 0 plans with the whole model, a rebuild may need any weight
        box: list[Any] = [None]
        if rank0:
            try:
                box = [("ok", _decide(pipe, setup, ran, where))]
            except Exception as exc:  # noqa: BLE001 - the other ranks must hear of it, not wait
                box = [("error", exc if not distributed() else f"{type(exc).__name__}: {exc}")]
        if distributed():
            dist.broadcast_object_list(box, src=0)
        kind, decided = box[0]
        if kind == "error":
            raise decided if isinstance(decided, BaseException) else PartitionError(f"rank 0: {decided}")
        cands: dict[str, Candidate] = decided["cands"]
        current, challenger = decided["current"], decided["challenger"]
        chosen, trace = current, ran.trace
        if challenger is not None:
            other = build(setup, type(pipe.plan).from_json(decided["plan"]), pipe)  # drawable where the pipe's is
            got = measure(other, steps, call)
            snap.restore()
            cands[challenger].measured_ms = got.step_ms
            margin = max(MIN_GAIN, ran.spread, got.spread)  # a switch must beat the measurements' noise
            switch = got.step_ms < ran.step_ms * (1.0 - margin)
            _log(cands[current], cands[challenger], decided["error"], margin, cands[challenger if switch else current])
            if switch:
                pipe.adopt(other)
                chosen, trace = challenger, got.trace
            else:
                _regather(other, setup)
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
        reverted=challenger is not None and (chosen != current) != predicted_switch,
        candidates=cands, factors=decided["factors"], fitted=decided["fitted"], plan=final,
        trace=trace if rank0 else None)
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


def _regather(running: Any, setup: Setup) -> None:
    """torchrun: every rank gets back the weights `running` made it drop (runtime.regather)."""
    if distributed():
        regather_weights(setup.model, running.held_tensor_ids(), running.device)


def _rebuild(setup: Setup, plan: Plan, running: Any) -> Any:
    """A pipeline of the same model (same weights) running `plan`, as partition(model, devices, plan=plan) builds it.

    Under torchrun every rank must hold the whole model first (`_regather`): the new plan may give
    it stages the running one (`running`) did not.
    """
    request = setup.request.but(schedule=plan.schedule, virtual_stages=max(plan.virtual_stages, 2))
    run = dataclasses.replace(setup.run, weights=None, init=None, calibrate=0, staleness=plan.staleness)
    request, example = traced_call(setup.model, setup.example_inputs, setup.example_kwargs, request, setup.devices,
                                   run.timeout)
    made = build_pipeline(setup.model, example, dataclasses.replace(plan), request, run, None)
    with_update(made.plan, request, priced=False)
    return made


@dataclass
class Hook:
    """What `partition` installs as `pipe`'s calibration routine: its Setup and the measuring function."""

    setup: Setup
    measure: Callable[[Any, int, StepCall], Measurement] = measure_steps

    def __call__(self, pipe: Any, *, steps: int, step: StepCall | None, path: str | None) -> CalibrationReport:
        return calibrate(pipe, steps=steps, setup=self.setup, step=step, path=path, measure=self.measure)


def hook_of(pipe: Any) -> Hook:
    """The calibration hook `partition` installed on `pipe` (to read its Setup, or give it another clock)."""
    hook = getattr(pipe, "_calibrator", None)
    if not isinstance(hook, Hook):
        raise PartitionError("this pipeline was not built by partitioner.partition: it has no calibration hook")
    return hook


def attach(pipe: _P, setup: Setup) -> _P:
    """Install a `Hook` as `pipe`'s calibration routine (runtime.calibration_hook); with `calibrate=N`, run it now."""
    pipe.set_calibrator(Hook(setup))
    if setup.run.calibrate:
        pipe.calibration_report = pipe.calibrate(setup.run.calibrate)  # type: ignore[attr-defined]
    return pipe
