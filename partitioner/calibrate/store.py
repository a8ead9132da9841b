"""Where calibrations live and how one is fitted and applied: the one seam to the cost model's fit.

A calibration is saved as JSON in the per-machine cache (cost_model.cache), one file per
set of devices and process layout, so that later `plan`/`partition` calls on this machine for
the same devices price with it automatically; an explicit `calibration=` path overrides that.

`fit` is the only place that turns a measured run into a Calibration; `calibrated_step_ms`
prices a plan with one (the simulator), and `calibrated_cost` scales a cost model by its factors
for later plans on this machine.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Sequence

from cost_model.analytic import CostModel
from cost_model.cache import cache_dir, cache_key
from cost_model.calibration import CalibratedCostModel, Calibration, fit_calibration
from partitioner.errors import PartitionError
from runtime.plan import Plan

__all__ = [
    "calibrated_cost", "calibrated_step_ms", "calibration_path", "find_calibration", "fit", "load_calibration",
    "save_calibration", "with_calibration",
]

CalibrationArg = Calibration | str | os.PathLike[str] | None


def calibration_path(devices: Sequence[Any], *, processes: bool, override: CalibrationArg = None) -> Path:
    """The JSON file of the calibration of `devices` (one process, or one process per rank)."""
    if isinstance(override, (str, os.PathLike)):
        return Path(override)
    key = cache_key("calibration", [str(d) for d in devices], bool(processes))
    return cache_dir() / "calibration" / f"{key}.json"


def load_calibration(path: str | os.PathLike[str]) -> Calibration:
    """A saved calibration.

    Raises:
        PartitionError: the file is missing or is not a saved calibration.
    """
    try:
        return Calibration.load(path)
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        raise PartitionError(f"calibration={os.fspath(path)!r} cannot be read ({type(exc).__name__}: {exc}); give "
                             "a file written by pipe.calibrate() or `python -m partitioner calibrate --out`") from None


def find_calibration(devices: Sequence[Any], *, processes: bool, given: CalibrationArg = None) -> Calibration | None:
    """`given` (a Calibration or a path), else the one saved on this machine for these devices, else None.

    A `given` path that does not exist yet is where a calibration will be saved: None, no error.
    """
    if isinstance(given, Calibration):
        return given
    if given is not None:
        return load_calibration(given) if Path(given).exists() else None
    path = calibration_path(devices, processes=processes)
    if not path.is_file():
        return None
    try:
        return Calibration.load(path)
    except (OSError, ValueError, TypeError, AttributeError):
        return None  # a damaged cache entry is a miss


def save_calibration(calibration: Calibration, path: Path) -> Path:
    """Write it (creating the folder); the path written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    calibration.save(tmp)
    os.replace(tmp, path)
    return path


def fit(plan: Plan, trace: Mapping[str, Any], *, step_ms: float, previous: Calibration | None,
        priced_with: Calibration | None = None) -> Calibration:
    """The calibration after one measured step of `plan` (`trace`: that step's gathered runtime trace), by
    cost_model.calibration.fit_calibration. `priced_with`: the calibration the plan's numbers already carry
    (divided out first, so factors always scale the base cost model)."""
    return fit_calibration(plan, trace, step_ms=step_ms, previous=previous, priced_with=priced_with)


def calibrated_step_ms(plan: Plan, calibration: Calibration) -> float:
    """What one option of an "auto" choice takes per step under `calibration`: its plan (made with base
    costs) simulated with the calibration's prices (partitioner.predict.calibrated_sim)."""
    from partitioner.predict.simulator import simulate

    return float(simulate(plan, calibration=calibration).makespan_ms)


def calibrated_cost(base: CostModel, calibration: Calibration | None) -> CostModel:
    """`base` priced with `calibration` (as it is where there is none)."""
    if calibration is None:
        return base
    return CalibratedCostModel(base, calibration)


def with_calibration(cost_model: CostModel | None, devices: Sequence[Any], *, processes: bool,
                     given: CalibrationArg = None) -> CostModel | None:
    """The cost model `plan`/`partition` price with: calibrated by `given` or by this machine's saved
    calibration for `devices`; a cost model the user passed is kept as it is unless `given` is set."""
    if cost_model is not None and given is None:
        return cost_model
    found = find_calibration(devices, processes=processes, given=given)
    if found is None:
        return cost_model
    if cost_model is None:
        from cost_model import default_cost_model

        cost_model = default_cost_model()
    return calibrated_cost(cost_model, found)
