"""What a calibration compares: the Setup partition() was called with, every "auto" candidate planned again and
predicted with a fitted calibration, and the challenger worth a look.

    fit_and_rank(pipe, setup, measurement, path)         (rank 0)
      fit the measured run (previous calibration blended; group factors from each stage's op mix)
      -> save JSON -> plan every option of the "auto" arguments with the base cost model
      -> predict each with the calibration (partitioner.calibrate.predict)
      -> a challenger: the plan now predicted fastest if it is not the running one, else the
         runner-up when its prediction is within the simulator's proven error of the running one

`pipe.calibrate` (partitioner.calibrate.decide) measures the challenger and keeps what wins; the
passive refit after a pipeline's first steps (partitioner.calibrate.passive) only reports it.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from torch import nn

from cost_model.analytic import CostModel
from cost_model.calibration import Calibration, fit_calibration
from cost_model.calibration_store import calibration_path, find_calibration, save_calibration
from cost_model.default import default_cost_model
from partitioner.calibrate.measure import Candidate, Measurement
from partitioner.calibrate.predict import calibrated_plan, calibrated_step_ms, shares_of
from partitioner.errors import PartitionError
from partitioner.make.pipeline import build_pipeline, traced_call
from partitioner.make.plan import plan_model, with_update
from partitioner.place.planning import schedule_layouts
from partitioner.predict.simulator import simulate
from partitioner.request import PlanRequest, RunOptions
from runtime.launch import distributed
from runtime.plan import Plan
from runtime.regather import regather_weights

__all__ = ["MIN_GAIN", "Setup", "fit_and_rank", "option_sets", "priced_with", "rebuild", "regather", "running_name",
           "same_plan"]

logger = logging.getLogger("partitioner.calibrate.decide")
# A challenger counts as faster only by this share at least (or by the measurements' own noise, if larger):
# within it the two are a tie, and the running plan stays.
MIN_GAIN = 0.03


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


def priced_with(setup: Setup) -> Calibration | None:
    """The calibration whose device factors the running plan's stage times carry (None: the base model's)."""
    priced = getattr(setup.planned_with, "calibration", None)
    return priced if isinstance(priced, Calibration) else None


def fit_and_rank(pipe: Any, setup: Setup, ran: Measurement, path: Path, *, replan: bool = True) -> dict[str, Any]:
    """Rank 0's part: fit, save, plan every candidate before and after (with `replan`; else the running plan
    only); the challenger to measure, if any. See the module docstring."""
    if ran.trace is None:
        raise PartitionError("calibrate: no trace was gathered on rank 0")
    # calibration= given (a Calibration, or a path: fresh until written) is the prior, never the machine's file
    given = setup.request.calibration
    if not isinstance(given, Calibration):
        given = None if path == calibration_path(setup.devices, processes=distributed()) else path
    previous = find_calibration(setup.devices, processes=distributed(), given=given)
    shares = shares_of(pipe.plan, setup.model)
    cal = fit_calibration(pipe.plan, ran.trace, step_ms=ran.step_ms, previous=previous,
                          priced_with=priced_with(setup), shares=shares)
    save_calibration(cal, path)
    base = setup.request.cost_model if setup.request.cost_model is not None else default_cost_model()
    names = option_sets(setup) if replan else {"as asked": {}}
    current = running_name(setup, pipe.plan, names) if replan else "as asked"
    cands: dict[str, Candidate] = {}
    after: dict[str, Plan] = {}
    priced, priced_cal = calibrated_plan(pipe.plan, cal, shares, priced_with(setup))
    timeline = simulate(priced, calibration=priced_cal)
    running_ms = float(timeline.makespan_ms)
    for name, options in names.items():
        if not replan:  # the running plan as it is
            after[name] = pipe.plan
            cands[name] = Candidate(name, options, pipe.plan.predicted_step_ms, running_ms)
            continue
        try:
            before_plan = _plan_with(setup, options, base)
            after_ms = calibrated_step_ms(before_plan, cal, shares_of(before_plan, setup.model))
        except PartitionError as exc:  # this combination cannot run here
            logger.info("calibrate: %s cannot be planned (%s)", name, exc)
            continue
        after[name] = before_plan
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
    for device in sorted({str(s.device) for s in pipe.plan.stages}):
        for kind in ("F", "B"):
            solved = cal.group_factors(device, kind)
            if solved is not None:
                factors.update({f"{device}/{kind}/{g}": f for g, f in solved.factors.items() if g != "*"})
                factors.update({f"{device}/{kind}/{g} beside": h for g, h in solved.contention.items() if g != "*"})
    fitted = {name: getattr(cal, name) for name in ("task_ms", "links", "step_ms", "cores") if hasattr(cal, name)}
    return {"cands": cands, "current": current, "challenger": challenger, "error": error, "factors": factors,
            "plan": after[challenger].to_json() if challenger is not None else None, "calibration": cal.to_dict(),
            "fitted": fitted, "running_ms": running_ms, "timeline": timeline}


def regather(running: Any, setup: Setup) -> None:
    """torchrun: every rank gets back the weights `running` made it drop (runtime.regather)."""
    if distributed():
        regather_weights(setup.model, running.held_tensor_ids(), running.device)


def rebuild(setup: Setup, plan: Plan, running: Any) -> Any:
    """A pipeline of the same model (same weights) running `plan`, as partition(model, devices, plan=plan) builds it.

    Under torchrun every rank must hold the whole model first (`regather`): the new plan may give
    it stages the running one (`running`) did not.
    """
    request = setup.request.but(schedule=plan.schedule, virtual_stages=max(plan.virtual_stages, 2))
    run = dataclasses.replace(setup.run, weights=None, init=None, calibrate=0, staleness=plan.staleness)
    request, example = traced_call(setup.model, setup.example_inputs, setup.example_kwargs, request, setup.devices,
                                   run.timeout)
    made = build_pipeline(setup.model, example, dataclasses.replace(plan), request, run, None)
    with_update(made.plan, request, priced=False)
    return made
