"""Calibration: the machine parameters fitted from measured runs (compute factors, overheads, links), saved as JSON.

See cost_model/calibration.py for what they mean and how the simulator prices them; cost_model/run_fit.py fits them.
Compute factors come twice: pooled per device and kind (`sums`: measured over the plan's base stage time), and
per operator group (`groups`: cost_model.op_mix), solved here from the fitted runs' normal equations:

    minimize  sum over ops  ((sum_g f_g x base x share_g + c - measured) / base)^2
              + RIDGE x sum_g (f_g - pooled)^2

(an op wholly of one group weighs 1: RIDGE is a prior worth that many ops), so a group seen little
stays near the pooled factor, one never seen takes it, and groups that always come together (their
shares in the same proportion) split the difference the pooled way.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import torch

from cost_model.op_mix import GROUPS

__all__ = ["CALIBRATION_VERSION", "Calibration", "measured_stage_ms",
           "stage_records"]

CALIBRATION_VERSION = 3  # 1: factors only (no "version" key); 2: + task_ms, links, step_ms, cores, runs; 3: + groups
RIDGE = 1.0  # how strongly a group's factor is drawn to the pooled one, in ops (see the module docstring)
_SANE = 4.0  # a group factor more than this many times off the pooled one is refitted with a stronger ridge


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

    def factor(self, device: Any) -> float:
        """measured / predicted for a device ('cuda:0') or a pair ('cpu->cuda:0'); 1 if unseen."""
        pm, pp = self.sums.get(str(device), (0.0, 0.0))
        return pm / pp if pp > 0 else 1.0

    def compute_factor(self, device: Any, kind: str) -> float:
        """measured / predicted of one F, B or W on `device`: its kind's factor, else the device's."""
        key = f"{device}/{kind}"
        return self.factor(key) if key in self.sums else self.factor(device)

    def group_factors(self, device: Any, kind: str) -> tuple[dict[str, float], float] | None:
        """(factor of each op_mix group, fixed ms per op) of `device`'s F or B ops (W: B's), from the fitted
        runs; None when no run with group shares was fitted there."""
        rows = self.groups.get(f"{device}/{'B' if kind == 'W' else kind}")
        if not rows:
            return None
        return _solve(rows)

    def stage_ms(self, device: Any, kind: str, base_ms: float, shares: Mapping[str, float]) -> float | None:
        """One F or B of a stage on `device` whose base (uncalibrated) time is `base_ms`, its compute shared
        among groups by `shares`: sum of group factor x share x base_ms, plus the fixed ms; None without a fit."""
        solved = self.group_factors(device, kind)
        if solved is None or not shares:
            return None
        factors, fixed = solved
        return base_ms * sum(factors.get(g, factors["*"]) * share for g, share in shares.items()) + fixed

    def priced(self, devices: Iterable[Any]) -> Calibration:
        """These parameters for a plan whose stage times on `devices` already carry their compute factors
        (priced by `stage_ms`): a copy whose compute factors there are 1."""
        made = Calibration.from_dict(self.to_dict())
        for device in {str(d) for d in devices}:
            for key in (device, f"{device}/F", f"{device}/B", f"{device}/W"):
                made.sums.pop(key, None)
        return made

    def add_group_rows(self, key: str, rows: Iterable[tuple[Sequence[float], float]]) -> None:
        """Fold ops (group columns + [1], measured ms) into `key`'s normal equations, each weighted by 1 / its
        base time (the sum of its group columns): least squares of measured over base, so no op size dominates."""
        for a, measured in rows:
            n = len(a)
            base = sum(a[:-1])
            if base <= 0:
                continue
            eq = self.groups.setdefault(key, [[0.0] * n for _ in range(n)] + [[0.0] * n])
            w2 = 1.0 / (base * base)
            for i in range(n):
                eq[n][i] += w2 * a[i] * measured
                for j in range(n):
                    eq[i][j] += w2 * a[i] * a[j]

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
                **({"groups": {k: [list(r) for r in v] for k, v in self.groups.items()}} if self.groups else {})}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Calibration:
        """Read `to_dict` output (version 1 files: factors only; 2: no group factors).

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
        )

    def save(self, path: str | os.PathLike[str]) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Calibration:
        with open(path) as f:
            return cls.from_dict(json.load(f))




def _solve(rows: Sequence[Sequence[float]]) -> tuple[dict[str, float], float] | None:
    """Group factors and the fixed ms from normal equations [ata rows..., atb] (see the module docstring);
    "*" is the pooled factor, which groups without data take."""
    n = len(rows) - 1
    ata = torch.tensor([list(r) for r in rows[:n]], dtype=torch.float64)
    atb = torch.tensor(list(rows[n]), dtype=torch.float64)
    g = n - 1  # the last column is the fixed cost per op
    whole = float(ata[:g, :g].sum())
    if whole <= 0:
        return None
    pooled = float(atb[:g].sum()) / whole
    seen = ata.diagonal()[:g] > 0
    if g != len(GROUPS):
        raise ValueError(f"a calibration with {g} operator groups; this code knows {len(GROUPS)} "
                         f"({', '.join(GROUPS)}): re-run the calibration (pipe.calibrate()) with this version")
    ridge = RIDGE
    x = _ridge_solve(ata, atb, pooled, ridge)
    for _ in range(4):  # a group factor far off the pooled one: the data cannot tell it apart; lean on the prior
        factors = x[:g]
        if bool(((factors[seen] > pooled / _SANE) & (factors[seen] < pooled * _SANE)).all()):
            break
        ridge *= 4.0
        x = _ridge_solve(ata, atb, pooled, ridge)
    factors = x[:g]
    out = {name: float(f) for name, f in zip(GROUPS, factors)}
    out["*"] = pooled
    return out, float(x[g]) if x.numel() > g else 0.0


def _ridge_solve(ata: torch.Tensor, atb: torch.Tensor, pooled: float, ridge: float) -> torch.Tensor:
    """The group factors and the fixed ms per op under the prior; without the fixed ms where it comes out < 0."""
    g = len(atb) - 1

    def solve(size: int) -> torch.Tensor:
        lhs, rhs = ata[:size, :size].clone(), atb[:size].clone()
        lhs[range(g), range(g)] += ridge
        rhs[:g] += ridge * pooled
        solved: torch.Tensor = torch.linalg.solve(lhs, rhs)
        return solved

    x = solve(g + 1)
    return x if float(x[g]) >= 0 else solve(g)
