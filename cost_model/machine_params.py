"""The machine parameters a calibration learns, as data: the Calibration record (compute factors, overheads, links).

The record a run's measurements update and that is saved as JSON; nothing here prices anything.

See cost_model/calibration.py for what they mean and how the simulator prices them; cost_model/run_fit.py fits them.
Compute factors come twice: pooled per device and kind (`sums`: measured over the plan's base stage time), and
per operator group (`groups`: the fitted runs' normal equations, solved by cost_model.group_fit).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import torch

from cost_model import overhead_fit
from cost_model.group_fit import GroupFit, add_rows, solve

__all__ = ["CALIBRATION_VERSION", "Calibration", "measured_stage_ms",
           "stage_records"]

CALIBRATION_VERSION = 4  # 1: factors only (no "version" key); 2: + task_ms, links, step_ms, cores, runs; 3: + groups;
# 4: + lines


def _get(record: Any, *names: str) -> Any:
    for name in names:
        if isinstance(record, Mapping) and name in record:
            return record[name]
        if hasattr(record, name):
            return getattr(record, name)
    raise ValueError(f"a run record needs one of {names}; got {record!r}")


def measured_stage_ms(trace: Mapping[str, Any]) -> dict[int, float]:
    """Each stage's measured compute per micro-batch (forward + backward, ms) from a runtime trace.

    `trace` is plain data, {"devices": [{"device", "events": [{kind, stage, microbatch,
    start, end}]}]} in ms, as `Pipeline.measured_timeline()` or
    `DistributedPipeline.gather_trace()` give it; replicas' micro-batches average together.
    """
    per: dict[tuple[int, int], float] = {}
    for row in trace.get("devices", []):
        for e in row.get("events", []):
            if e.get("kind") in ("forward", "backward", "weight", "F", "B", "W") and int(e.get("stage", -1)) >= 0:
                key = (int(e["stage"]), int(e.get("microbatch", -1)))
                per[key] = per.get(key, 0.0) + float(e["end"]) - float(e["start"])
    stages: dict[int, list[float]] = {}
    for (stage, _), ms in per.items():
        stages.setdefault(stage, []).append(ms)
    return {s: sum(v) / len(v) for s, v in sorted(stages.items())}


def stage_records(stages: Sequence[Any], measured_ms: Sequence[float]) -> list[dict[str, Any]]:
    """Records from a plan's stages (device, compute_ms) and the measured ms of each, in order.

    Raises:
        ValueError: the two lists differ in length.
    """
    if len(stages) != len(measured_ms):
        raise ValueError(f"{len(stages)} stages but {len(measured_ms)} measured times; give one time per stage")
    return [
        {
            "device": str(_get(s, "device")),
            "predicted_ms": float(_get(s, "compute_ms", "predicted_ms")),
            "measured_ms": float(m),
        }
        for s, m in zip(stages, measured_ms)
    ]


@dataclass
class Calibration:
    """Running least-squares factors (measured / predicted) per device and per device pair."""

    decay: float = 1.0  # weight kept by older observations at each new run (1: never forget)
    sums: dict[str, list[float]] = field(default_factory=dict)  # key -> [sum p*m, sum p*p]
    task_ms: dict[str, float] = field(default_factory=dict)  # "F"/"B"/"W"/"SEND"/"RECV"/"WAKE" -> ms (see above)
    links: dict[str, list[float]] = field(default_factory=dict)  # backend -> [latency ms, bytes per ms]
    step_ms: float = 0.0  # fixed per-step cost outside the traced ops
    cores: float = 0.0  # cores the ranks of one host share (0: unlimited)
    runs: float = 0.0  # weight of the fitted runs behind task_ms, links, step_ms and cores
    # "cpu/F" -> [[ata row]..., [atb]]: the weighted normal equations of F (or B, W) ops on
    # [base ms x share of each group in op_mix.GROUPS..., 1] (run_fit); `group_factors` solves them
    groups: dict[str, list[list[float]]] = field(default_factory=dict)
    # "task" / "SEND" -> normal equations of an overhead that grows with the op before it (cost_model.overhead_fit)
    lines: dict[str, list[float]] = field(default_factory=dict)

    def factor(self, device: Any) -> float:
        """measured / predicted for a device ('cuda:0') or a pair ('cpu->cuda:0'); 1 if unseen."""
        pm, pp = self.sums.get(str(device), (0.0, 0.0))
        return pm / pp if pp > 0 else 1.0

    def compute_factor(self, device: Any, kind: str) -> float:
        """measured / predicted of one F, B or W on `device`: its kind's factor, else the device's."""
        key = f"{device}/{kind}"
        return self.factor(key) if key in self.sums else self.factor(device)

    def group_factors(self, device: Any, kind: str) -> GroupFit | None:
        """The group factors of `device`'s F or B ops (W: B's) from the fitted runs (cost_model.group_fit);
        None when no run with group shares was fitted there."""
        eq = self.groups.get(f"{device}/{'B' if kind == 'W' else kind}")
        return solve(eq) if eq else None

    def stage_ms(self, device: Any, kind: str, base_ms: float, shares: Mapping[str, float],
                 others: float = 0.0) -> float | None:
        """One F or B of a stage on `device` whose base (uncalibrated) time is `base_ms`, its compute shared
        among groups by `shares`, `others` ranks of its host computing beside it; None without a group fit."""
        fit = self.group_factors(device, kind)
        return fit.stage_ms(base_ms, shares, others) if fit is not None and shares else None

    def line(self, key: str) -> tuple[float, float] | None:
        """(a, b) of overhead `key` ("task": per F/B/W op, a + b x its ms; "SEND": per send, a + b x the ms of
        the sender's op before it), or None when no fitted run gave it (then `task_ms` prices it flat)."""
        eq = self.lines.get(key)
        return overhead_fit.solve(eq) if eq else None

    def priced(self, devices: Iterable[Any]) -> Calibration:
        """These parameters for a plan whose stage times on `devices` already carry their compute factors
        (priced by `stage_ms`): a copy whose compute factors there are 1."""
        made = Calibration.from_dict(self.to_dict())
        for device in {str(d) for d in devices}:
            for key in (device, f"{device}/F", f"{device}/B", f"{device}/W"):
                made.sums.pop(key, None)
        return made

    def add_group_rows(self, key: str, rows: Sequence[tuple[Sequence[float], float]]) -> None:
        """Fold ops (cost_model.group_fit.row columns, measured ms) into `key`'s normal equations."""
        self.groups[key] = add_rows(self.groups.get(key, []), rows)

    def message_ms(self, nbytes: float, backend: str = "gloo") -> float | None:
        """One message of `nbytes` over `backend`'s fitted link (ms), or None when it has none."""
        if backend not in self.links or nbytes <= 0:
            return None if backend not in self.links else 0.0
        latency, per_ms = self.links[backend]
        return latency + nbytes / per_ms

    def allreduce_ms(self, nbytes: float, ranks: int, backend: str = "gloo") -> float | None:
        """A ring all-reduce of `nbytes` over `ranks` on `backend`'s link (ms), or None when it has none."""
        if backend not in self.links:
            return None
        if ranks < 2 or nbytes <= 0:
            return 0.0
        latency, per_ms = self.links[backend]
        steps = 2 * (ranks - 1)
        return steps * latency + steps / ranks * nbytes / per_ms

    def observe(self, key: str, predicted_s: float, measured_s: float) -> None:
        """Add one (predicted, measured) pair for `key` (a device or 'src->dst' pair).

        Raises:
            ValueError: a negative time.
        """
        if predicted_s < 0 or measured_s < 0:
            raise ValueError(f"times must be >= 0, got predicted {predicted_s} and measured {measured_s}")
        pm, pp = self.sums.setdefault(str(key), [0.0, 0.0])
        self.sums[str(key)] = [pm + predicted_s * measured_s, pp + predicted_s * predicted_s]

    def update(self, records: Iterable[Any]) -> None:
        """Fold one measured run in: records with device, predicted_ms and measured_ms.

        Older evidence is first multiplied by `decay`, so with decay < 1 the factors follow
        a machine whose speed drifts. A record may also name `src` and `dst` (a transfer).
        """
        parsed = []
        for r in records:  # read every record before changing anything
            predicted = float(_get(r, "predicted_ms", "compute_ms")) / 1e3
            measured = float(_get(r, "measured_ms")) / 1e3
            if isinstance(r, Mapping) and "src" in r and "dst" in r:
                key = f"{torch.device(r['src'])}->{torch.device(r['dst'])}"
            else:
                key = str(torch.device(_get(r, "device")))
            parsed.append((key, predicted, measured))
        for sums in self.sums.values():
            sums[0] *= self.decay
            sums[1] *= self.decay
        for key, predicted, measured in parsed:
            self.observe(key, predicted, measured)

    def to_dict(self) -> dict[str, Any]:
        return {"version": CALIBRATION_VERSION, "decay": self.decay, "sums": {k: list(v) for k, v in self.sums.items()},
                "task_ms": dict(self.task_ms), "links": {k: list(v) for k, v in self.links.items()},
                "step_ms": self.step_ms, "cores": self.cores, "runs": self.runs,
                **({"groups": {k: [list(r) for r in v] for k, v in self.groups.items()}} if self.groups else {}),
                **({"lines": {k: list(v) for k, v in self.lines.items()}} if self.lines else {})}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Calibration:
        """Read `to_dict` output (version 1 files: factors only; 2: no group factors; 3: no lines).

        Raises:
            ValueError: a file from a newer version; re-run the calibration with this version.
        """
        version = int(data.get("version", 1))
        if version > CALIBRATION_VERSION:
            raise ValueError(f"calibration version {version} is newer than this code's {CALIBRATION_VERSION}; "
                             "re-run the calibration (pipe.calibrate()) with this version")
        return cls(
            float(data.get("decay", 1.0)), {str(k): [float(x) for x in v] for k, v in data.get("sums", {}).items()},
            {str(k): float(v) for k, v in data.get("task_ms", {}).items()},
            {str(k): [float(x) for x in v] for k, v in data.get("links", {}).items()},
            float(data.get("step_ms", 0.0)), float(data.get("cores", 0.0)), float(data.get("runs", 0.0)),
            {str(k): [[float(x) for x in r] for r in v] for k, v in data.get("groups", {}).items()},
            {str(k): [float(x) for x in v] for k, v in data.get("lines", {}).items()},
        )

    def save(self, path: str | os.PathLike[str]) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Calibration:
        with open(path) as f:
            return cls.from_dict(json.load(f))



