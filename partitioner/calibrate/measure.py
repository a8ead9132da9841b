"""One measured calibration run: timing steps, the state they must not change, and the report.

`measure_steps` times N training steps (tracing the last one); `Snapshot` keeps the weights,
gradients and random state a calibration must leave as they were; `CalibrationReport` is
what `pipe.calibrate` returns. partitioner.calibrate.decide decides what to do with them.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn

from partitioner.errors import PartitionError
from runtime.calibration_hook import StepCall
from runtime.launch import distributed
from runtime.plan import Plan

__all__ = ["CalibrationReport", "Candidate", "Measurement", "Snapshot", "default_step", "measure_steps",
           "step_statistics"]


@dataclass
class Measurement:
    """A measured run: the median step (ms; under torchrun the slowest rank's), the last step's trace,
    and the run's noise: the relative standard error of that median (see `step_statistics`)."""

    step_ms: float
    trace: dict[str, Any] | None
    noise: float = 0.0
    loop_ms: float = 0.0  # the loop's own work between steps (optimizer, data; the passive refit's)


def step_statistics(times: Sequence[float]) -> tuple[float, float]:
    """(median ms, its relative standard error) of step times. The error is estimated robustly, from the
    interquartile range (a normal sigma is IQR / 1.349; the median of n draws varies by 1.2533 sigma /
    sqrt(n)), so one step slowed by other work on the host does not set it; 0 with fewer than 4 steps."""
    median = statistics.median(times)
    if len(times) < 4:
        return median, 0.0
    quartiles = statistics.quantiles(times, n=4, method="inclusive")  # within the steps: robust for few
    return median, 1.2533 * (quartiles[2] - quartiles[0]) / 1.349 / math.sqrt(len(times)) / max(median, 1e-9)


@dataclass
class Candidate:
    """One plan an "auto" choice could make: its predictions before and after calibration, and measured."""

    name: str
    options: dict[str, Any]
    predicted_before_ms: float = float("nan")
    predicted_after_ms: float = float("nan")
    measured_ms: float | None = None


@dataclass
class CalibrationReport:
    """What a calibration did: the fit's file, the predictions and measurements, what runs now."""

    steps: int
    path: str
    measured_ms: float  # the plan that ran before, median step
    predicted_before_ms: float
    predicted_after_ms: float
    previous: str
    chosen: str
    replanned: bool  # the pipe now runs another plan
    reverted: bool  # the measurement contradicted the calibrated prediction, and the measurement won
    within_noise: bool = False  # the challenger measured faster, but not by more than the measurements' noise
    candidates: dict[str, Candidate] = field(default_factory=dict)
    factors: dict[str, float] = field(default_factory=dict)
    fitted: dict[str, Any] = field(default_factory=dict)  # the fit's other figures: task_ms, links, step_ms, cores
    plan: Plan | None = None  # the plan running now
    trace: dict[str, Any] | None = None  # its last measured step (rank 0; None on the others)
    timeline: Any = None  # its step as the calibration predicts it (rank 0; None: the plan's own simulation)

    def visualize(self, path: str | Path) -> Path:
        """The plan page with the predicted (calibrated, where the report has it) and the measured timeline of one
        step, one above the other."""
        draw = getattr(self.plan, "visualize", None)  # the pipe's plan is a partitioner.Plan, which draws itself
        if draw is None:
            raise ValueError("this report has no plan to draw; draw one with "
                             "partitioner.Plan.from_plan(plan).visualize(path, measured=report.trace)")
        return Path(draw(path, timeline=self.timeline, measured=self.trace))

    def __str__(self) -> str:
        lines = [f"calibration: {self.steps} steps, saved to {self.path}",
                 "factors: " + ", ".join(f"{k} {v:.3f}" for k, v in self.factors.items())]
        lines.append(f"{'plan':<28} {'predicted before':>17} {'predicted after':>16} {'measured':>10}")
        for c in self.candidates.values():
            measured = f"{c.measured_ms:.2f}" if c.measured_ms is not None else "-"
            lines.append(f"{c.name:<28} {c.predicted_before_ms:>17.2f} {c.predicted_after_ms:>16.2f} {measured:>10}")
        what = "reverted to" if self.reverted and self.replanned else "re-planned to" if self.replanned else "kept"
        why = " (the calibrated prediction was wrong)" if self.reverted else ""
        if self.within_noise:
            other = next((c.name for c in self.candidates.values() if c.name != self.chosen and c.measured_ms), "")
            why = f" ({other} measured faster, within the measurements' noise)"
        lines.append(f"{what} {self.chosen}{why}")
        return "\n".join(lines)


def measure_steps(pipe: Any, steps: int, call: StepCall) -> Measurement:
    """Run `steps` training steps of `pipe`; the median step time and the last step's trace. A pipe that has
    not run a step yet runs one more first, untimed: its first step exchanges message headers and warms
    the allocator, and would count as noise against it."""
    times: list[float] = []
    many = distributed()
    tracing = pipe.tracing
    if getattr(pipe, "last_step", None) is None:
        pipe.train_step(call.inputs, call.targets, call.loss_fn, call.input_kwargs, call.loss_reduction)
    for i in range(steps):
        if i == steps - 1:
            pipe.clear_trace()
            pipe.tracing = True
        if many:
            dist.barrier()
        start = time.perf_counter()
        pipe.train_step(call.inputs, call.targets, call.loss_fn, call.input_kwargs, call.loss_reduction)
        if many:
            dist.barrier()
        times.append((time.perf_counter() - start) * 1e3)
    pipe.tracing = tracing
    trace = pipe.gather_trace() if many else pipe.measured_timeline()
    pipe.clear_trace()
    step_ms, noise = step_statistics(times)
    if many:
        slowest = torch.tensor([step_ms, noise], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        step_ms, noise = float(slowest[0]), float(slowest[1])
    return Measurement(step_ms, trace, noise)


class Snapshot:
    """Weights, buffers, gradients and random state of `model` now; `restore` puts them back (any number of times).

    A tensor whose size changed since (a torchrun rank that dropped or gained it in a re-plan)
    is left as it is: the rank that holds it restores it.
    """

    def __init__(self, model: nn.Module) -> None:
        self.tensors = [(t, t.detach().clone()) for t in [*model.parameters(), *model.buffers()]
                        if t.device.type != "meta"]
        self.grads = [(p, None if p.grad is None else p.grad.detach().clone()) for p in model.parameters()]
        self.cpu_rng, self.py_rng = torch.get_rng_state(), random.getstate()
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        self.cuda_rng = torch.cuda.get_rng_state_all() if cuda else None

    def restore(self) -> None:
        with torch.no_grad():
            for t, saved in self.tensors:
                if t.shape == saved.shape and t.device.type != "meta":
                    t.copy_(saved)
        for p, g in self.grads:
            ok = g is not None and g.shape == p.shape and p.device.type != "meta"
            p.grad = g.to(p.device, copy=True) if ok and g is not None else None  # a copy: steps add into .grad
        torch.set_rng_state(self.cpu_rng)
        random.setstate(self.py_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)


def default_step(example_inputs: tuple[Any, ...], example_kwargs: dict[str, Any]) -> StepCall:
    """The example inputs, with the mean of every floating output as the loss (targets unused)."""
    leaves = [x for x in pytree.tree_leaves((example_inputs, example_kwargs))
              if isinstance(x, torch.Tensor) and x.dim() > 0]
    if not leaves:
        raise PartitionError("calibrate needs inputs with a batch dimension: pass inputs=, targets=, loss_fn=")
    targets = torch.zeros(leaves[0].shape[0], device=leaves[0].device)
    return StepCall(example_inputs, targets, _mean_of_outputs, example_kwargs or None)


def _mean_of_outputs(outputs: Any, targets: Any) -> torch.Tensor:
    floats = [x.float().mean() for x in pytree.tree_leaves(outputs)
              if isinstance(x, torch.Tensor) and x.is_floating_point()]
    if not floats:
        raise PartitionError("calibrate's default loss (the mean of the outputs) found no floating output; "
                             "pass inputs=, targets= and loss_fn=")
    return torch.stack(floats).sum()
