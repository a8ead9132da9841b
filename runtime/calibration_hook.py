"""`pipe.calibrate(steps=N)` on both runtimes, with the work injected by whoever built the pipeline.

Calibration fits the cost model to measured runs and may re-plan: that is the partitioner's
job, and the runtime never imports the partitioner (design.md, one-way data flow). So the
runtime only holds a hook typed by `CalibrationHook`; `partitioner.partition` installs
`partitioner.calibrate.decide.calibrate` there with what it needs to plan again. A pipeline built
by hand has no hook, and `calibrate` says how to get one.

`Calibratable` is the small mixin both `Pipeline` and `DistributedPipeline` take: it records
the last `train_step` call (the default inputs and loss of a calibration), holds the hook and
lets the pipeline adopt another pipeline's whole state (a re-plan in place: same object,
same model and weights, new stages and programs).

A pipeline is calibrated by default from its own first training steps: `partition` also
installs a `StepWatch` (partitioner.calibrate.passive), which `train_step` calls as each step
starts (from `remember_step`, before the step runs) and as a synchronous step's work ends
(`end_step`). It may switch tracing on for a step and refit once; it never runs a step of its
own. `set_step_watch(None)` removes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping, Protocol

import torch

from runtime.errors import PartitionError

__all__ = ["CalibrationHook", "Calibratable", "StepCall", "StepWatch"]


@dataclass
class StepCall:
    """The arguments of one `train_step` call (references, not copies): what a calibration reruns."""

    inputs: Any
    targets: Any
    loss_fn: Callable[[Any, Any], torch.Tensor]
    input_kwargs: Mapping[str, Any] | None = None
    loss_reduction: Literal["mean", "sum"] = "mean"
    extra: dict[str, Any] = field(default_factory=dict)


class CalibrationHook(Protocol):
    """What `pipe.calibrate` calls: measure `steps` traced steps, fit, save, maybe re-plan; returns a report."""

    def __call__(self, pipe: Any, *, steps: int, step: StepCall | None, path: str | None) -> Any: ...


class StepWatch(Protocol):
    """What `train_step` calls as each step starts, with the pipeline (see the module docstring), and as a
    synchronous step's work ends (`step_ended`): the loop's own work between steps is told apart."""

    def __call__(self, pipe: Any) -> None: ...

    def step_ended(self, pipe: Any) -> None: ...


class Calibratable:
    """Mixin of the runtimes: `calibrate`, the hook behind it, the step watch, the last step's call and `adopt`."""

    _calibrator: CalibrationHook | None = None
    _step_watch: StepWatch | None = None
    last_step: StepCall | None = None

    def set_calibrator(self, hook: CalibrationHook | None) -> None:
        """Install the routine `calibrate` runs (partitioner.partition does; None removes it)."""
        self.__dict__["_calibrator"] = hook

    def set_step_watch(self, watch: StepWatch | None) -> None:
        """Install what `train_step` calls as each step starts (partitioner.partition does; None removes it)."""
        self.__dict__["_step_watch"] = watch

    def calibrate(
        self,
        steps: int = 5,
        *,
        inputs: Any = None,
        targets: Any = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        input_kwargs: Mapping[str, Any] | None = None,
        path: str | None = None,
    ) -> Any:
        """Run `steps` traced training steps, fit the cost model to them, save it and re-plan if it pays.

        Inputs: `inputs`/`targets`/`loss_fn` if given, else those of the last `train_step`,
        else the example inputs given to `partition` with the mean of the outputs as the
        loss. The weights, their gradients, BatchNorm statistics and the random state are
        restored afterwards; the optimizer is never stepped. Under torchrun every rank calls
        it with the same arguments. Returns a `partitioner.calibrate.decide.CalibrationReport`.

        Raises:
            PartitionError: the pipeline was not built by `partitioner.partition`, or steps < 1.
        """
        hook = self._calibrator
        if hook is None:
            raise PartitionError("this pipeline has no calibration routine: build it with partitioner.partition(...) "
                                 "(which installs one), or call partitioner.calibrate.decide.calibrate(pipe, ...)")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise PartitionError(f"steps={steps!r}; calibrate needs an integer number of steps >= 1")
        step = None
        if inputs is not None or targets is not None or loss_fn is not None:
            if inputs is None or loss_fn is None:
                raise PartitionError("calibrate: give inputs= and loss_fn= together (targets= as loss_fn takes them)")
            step = StepCall(inputs, targets, loss_fn, input_kwargs)
        return hook(self, steps=steps, step=step, path=path)

    def remember_step(self, call: StepCall) -> None:
        """Record the arguments of a `train_step` (the default of a later `calibrate`), as the step starts;
        then call the step watch, if one is installed."""
        self.__dict__["last_step"] = call
        watch = self.__dict__.get("_step_watch")
        if watch is not None:
            watch(self)

    def end_step(self) -> None:
        """Tell the step watch, if one is installed, that a synchronous training step's work has ended."""
        watch = self.__dict__.get("_step_watch")
        if watch is not None:
            watch.step_ended(self)

    def adopt(self, other: Any) -> None:
        """Take over `other`'s whole state (a pipeline of the same model built from another plan).

        The caller's `pipe` object stays the one it holds; its stages, programs, transport and
        plan become `other`'s. `other` must not be used afterwards.
        """
        if type(other) is not type(self):
            raise TypeError(f"cannot adopt a {type(other).__name__} into a {type(self).__name__}")
        close = getattr(self, "close", None)
        if callable(close):
            close()
        keep = {k: self.__dict__.get(k) for k in ("_calibrator", "_step_watch", "last_step")}
        self.__dict__.update(other.__dict__)
        self.__dict__.update(keep)
        other.__dict__["_pools"] = {}  # its worker threads now serve this object
