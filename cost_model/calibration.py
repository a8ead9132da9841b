"""A cost model corrected by measured runs: CalibratedCostModel scales a base model's times; fit_calibration fits.

The factors are per device, learned from measured runs and applied to any model (the record that holds
them is cost_model/machine_params.py's Calibration). A run records, for each stage, its device, the
predicted compute time and the measured one (plain data: the runtime's trace or a Plan's stages plus
measured times; nothing here imports the runtime). For each device the factor is the least-squares ratio over every
observation so far,

    f = sum(predicted * measured) / sum(predicted ** 2)

kept as two running sums, so each new run refines it and old runs fade by `decay`.
`CalibratedCostModel` multiplies a base model's node times by its device's factor, and
transfer times by the factor of the device pair.

The rest of a step's time is priced by a few more general parameters, fitted from a traced
run by `fit_calibration` (cost_model/run_fit.py) and read by the simulator: per-kind factors
("cpu/F", "cpu/B" in `sums`), a per-task overhead (`task_ms`: Python dispatch around each F/B/W,
"SEND" and "RECV" the sender's and receiver's own time per message, "WAKE" the delay before a rank
blocked on a message resumes once it has landed), per-backend links (`links`: latency and bandwidth of one message), a
fixed per-step cost (`step_ms`: scatter, gather, loss, optimizer step) and the cores that
ranks of one host share (`cores`: k computing ranks on c < k cores each run c/k as fast).
Saved as JSON with a `version`.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from cost_model.interface import CostModel, forward_time
from cost_model.machine_params import CALIBRATION_VERSION, Calibration, measured_stage_ms, stage_records
from cost_model.op_mix import Shares
from cost_model.run_fit import fit_run

__all__ = ["CALIBRATION_VERSION", "CalibratedCostModel", "Calibration", "fit_calibration", "measured_stage_ms",
           "stage_records"]


def fit_calibration(plan_data: Any, trace: Mapping[str, Any], *, step_ms: float,
                    previous: Calibration | None = None, cores: float | None = None,
                    backend: str = "gloo", priced_with: Calibration | None = None,
                    shares: Sequence[Shares] | None = None) -> Calibration:
    """`previous` refined by one traced run of a plan: see cost_model/run_fit.py (`shares`: each stage's
    compute by operator group, cost_model.op_mix.stage_shares, for factors that carry to other models)."""
    return fit_run(plan_data, trace, step_ms=step_ms, previous=previous, cores=cores, backend=backend,
                   priced_with=priced_with, shares=shares)


class CalibratedCostModel:
    """A base cost model whose times are scaled by learned factors; same interface as the base."""

    def __init__(self, base: CostModel, calibration: Calibration | None = None) -> None:
        self.base = base
        self.calibration = calibration or Calibration()

    def prepare(self, graph_module: Any, flat_inputs: Sequence[Any] = ()) -> None:
        """Pass the traced graph on to the base model if it wants it."""
        method = getattr(self.base, "prepare", None)
        if callable(method):
            method(graph_module, flat_inputs)

    def node_time(self, node: Mapping[str, Any], device: torch.device) -> float:
        return self.base.node_time(node, device) * self.calibration.factor(torch.device(device))

    def forward_time(self, node: Mapping[str, Any], device: torch.device) -> float:
        """Forward part of `node_time`, scaled like it."""
        return forward_time(self.base, node, device) * self.calibration.factor(torch.device(device))

    def transfer_time(self, nbytes: float, src: torch.device, dst: torch.device) -> float:
        key = f"{torch.device(src)}->{torch.device(dst)}"
        return self.base.transfer_time(nbytes, src, dst) * self.calibration.factor(key)

    def allreduce_time(self, nbytes: float, devices: Sequence[torch.device]) -> float:
        """The base model's all-reduce time (collectives are not calibrated)."""
        method = getattr(self.base, "allreduce_time", None)
        return float(method(nbytes, devices)) if callable(method) else 0.0
