"""A plan's step as the calibration prices it, each stage's compute by operator group where the fit has them.

    shares   each stage's compute by group (cost_model.op_mix), from the plan's stored graph and
             the model's module classes
    step     simulate(plan, calibration=c) after pricing each stage's F and B with the group
             factors (Calibration.stage_ms); stages on devices without them keep the pooled factor

An op's group price depends on how many other ranks of its host compute beside it (cost_model.group_fit),
which depends on the prices: the plan is priced alone first, simulated, each stage's F and B priced
again with the overlap the simulation gave them, a few times (PASSES) until the step settles.
So a calibration fitted on one model predicts another from that model's own mix of operators.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Sequence

from cost_model.machine_params import Calibration
from cost_model.op_mix import Shares, module_kinds, stage_shares
from partitioner.predict.simulator import simulate
from partitioner.predict.timeline import BACKWARD, FORWARD, WEIGHT, Timeline
from runtime.plan import Plan

__all__ = ["PASSES", "calibrated_plan", "calibrated_step_ms", "shares_of"]

PASSES = 3
_KIND = {FORWARD: "F", BACKWARD: "B", WEIGHT: "B"}


def shares_of(plan: Plan, model: Any = None) -> list[Shares] | None:
    """Each stage's compute by operator group (None: the plan stores no node times); `model`: the nn.Module
    the plan cuts, whose module classes name what its call_module nodes do."""
    return stage_shares(json.loads(plan.to_json()), module_kinds(model) if model is not None else None)


def calibrated_plan(plan: Plan, calibration: Calibration, shares: Sequence[Shares] | None,
                    priced_with: Calibration | None = None) -> tuple[Plan, Calibration]:
    """(the plan with its stages' F and B priced by `calibration`'s group factors, the calibration to simulate
    it with). `priced_with`: the calibration whose device factors the plan's stage times carry (divided out)."""
    if not shares or len(shares) != len(plan.stages):
        return plan, calibration
    devices = {str(s.device) for s in plan.stages
               if all(calibration.group_factors(s.device, kind) is not None for kind in ("F", "B"))}
    if not devices:
        return plan, calibration
    cal = calibration.priced(devices)
    others: dict[tuple[int, str], float] = {}
    priced = plan
    for _ in range(PASSES):
        priced = _priced(plan, calibration, shares, priced_with, devices, others)
        others = _overlaps(simulate(priced, calibration=cal), calibration.cores)
    return priced, cal


def _priced(plan: Plan, calibration: Calibration, shares: Sequence[Shares], priced_with: Calibration | None,
            devices: set[str], others: dict[tuple[int, str], float]) -> Plan:
    stages = []
    for stage, share in zip(plan.stages, shares):
        if str(stage.device) not in devices:
            stages.append(stage)
            continue
        scale = priced_with.factor(stage.device) if priced_with is not None else 1.0
        times = {}
        for kind, base in (("F", stage.forward_ms / scale), ("B", stage.backward_ms / scale)):
            ms = calibration.stage_ms(stage.device, kind, base, share, others.get((stage.index, kind), 0.0))
            times[kind] = ms if ms is not None else base * calibration.compute_factor(stage.device, kind)
        stages.append(dataclasses.replace(stage, forward_ms=times["F"], backward_ms=times["B"]))
    return dataclasses.replace(plan, stages=stages)


def _overlaps(timeline: Timeline, cores: float) -> dict[tuple[int, str], float]:
    """(stage, "F" or "B") -> the mean number of other cpu rows computing during its ops, up to `cores` - 1."""
    busy = [[(e.start, e.end) for e in row.events if e.kind in _KIND] for row in timeline.devices]
    cpu = [k for k, row in enumerate(timeline.devices) if str(row.device).startswith("cpu")]
    cap = max(0.0, cores - 1.0) if cores > 0 else float("inf")
    sums: dict[tuple[int, str], list[float]] = {}
    for k in cpu:
        for e in timeline.devices[k].events:
            if e.kind not in _KIND or e.end <= e.start:
                continue
            beside = sum(max(0.0, min(e.end, b) - max(e.start, a)) for j in cpu if j != k for a, b in busy[j])
            sums.setdefault((e.stage, _KIND[e.kind]), []).append(min(cap, beside / (e.end - e.start)))
    return {key: sum(v) / len(v) for key, v in sums.items()}


def calibrated_step_ms(plan: Plan, calibration: Calibration, shares: Sequence[Shares] | None,
                       priced_with: Calibration | None = None) -> float:
    """The simulated step (ms) of `plan` priced by `calibration` (see `calibrated_plan`)."""
    priced, cal = calibrated_plan(plan, calibration, shares, priced_with)
    return float(simulate(priced, calibration=cal).makespan_ms)
