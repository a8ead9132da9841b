"""Where calibrations live: one JSON per set of devices in the per-machine cache, found and applied to a cost model.

A calibration is saved in the per-machine cache (cost_model.cache), one file per set of devices
and process layout, so that later `plan`/`partition` calls on this machine for the same devices
price with it automatically; an explicit `calibration=` path overrides that.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

from cost_model.cache import cache_dir, cache_key
from cost_model.calibration import CalibratedCostModel, Calibration
from cost_model.default import default_cost_model
from cost_model.interface import CostModel

__all__ = [
    "CalibrationArg", "calibrated_cost", "calibration_path", "find_calibration", "load_calibration",
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
        ValueError: the file is missing or is not a saved calibration (the message names the fix).
    """
    try:
        return Calibration.load(path)
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        raise ValueError(f"calibration={os.fspath(path)!r} cannot be read ({type(exc).__name__}: {exc}); give "
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
    return calibrated_cost(cost_model if cost_model is not None else default_cost_model(), found)
