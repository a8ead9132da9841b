"""Asynchronous training for both runtimes: one stream of calls (runtime.flushless), weight versions, losses.

`Pipeline` (one process) and `DistributedPipeline` (torchrun) both hold an `AsyncTrainer`
when the plan's `update` is "2bw" or "stash". A call of `train_step` adds its batch to the
stream and runs that call's ops; the optimizer steps inside it (runtime.versions).

    call t:   batch t's forwards start; batch t-1's last forwards and backwards end
    returns:  the loss of batch t-1 (its forwards have all run), None on the first call
    flush():  drain every micro-batch in flight, apply the remaining gradients, return the
              last batch's loss; the next call starts a new stream

What may not happen while micro-batches are in flight (`in_flight`): `pipe(x)`, checkpoints,
`load_state_dict`, a `train()`/`eval()` switch; each raises, naming `pipe.flush()`.
The optimizer steps one stage at a time (only that stage's `.grad` set), so per-parameter
optimizers (SGD, momentum, Adam, AdamW, weight decay) behave as in the references of
tests/test_async_updates.py. A learning-rate scheduler stepped between calls sets the lr of
the updates later calls make (2bw: batch t's gradient is applied in call t + 2 or the flush;
stash: in the call that runs the micro-batch's backward). Clipping by the global gradient
norm is not available: gradients never sit in `.grad` between calls, and each stage steps alone.
Restrictions, checked before the first call: schedule "1f1b", one rank per stage (no
replicas), no weight read by two stages, no activation recomputation, no BatchNorm, no input
written in place, every Parameter of the stages in the optimizer with no `.grad` left over.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from runtime.errors import PartitionError
from runtime.flushless import Stream, StreamError
from runtime.interpreter import Interpreter
from runtime.plan import Plan
from runtime.program import Op
from runtime.stage import Stage
from runtime.steps import StepInputs
from runtime.versions import AsyncUpdate, StageVersions, Stepper

__all__ = ["AsyncTrainer", "check_async_plan", "refuse_optimizer"]

RunSegment = Callable[[list[list[Op]], StepInputs | None], None]  # per-rank ops of a call, the call's batch


def refuse_optimizer(optimizer: torch.optim.Optimizer | None) -> None:
    """A synchronous train_step takes no optimizer: the caller steps it (both runtimes say so alike)."""
    if optimizer is not None:
        raise PartitionError("optimizer= is for update='2bw' or 'stash' (the runtime steps it); with "
                             "update='sync' step the optimizer yourself after train_step")


def check_async_plan(plan: Plan) -> list[str]:
    """What keeps `plan` from running with asynchronous updates (empty when it can)."""
    if plan.update == "sync":
        return []
    problems = []
    if plan.schedule != "1f1b":
        problems.append(f"schedule={plan.schedule!r}: update={plan.update!r} streams 1F1B; use schedule='1f1b'")
    if any(len(s.ranks) > 1 for s in plan.stages):
        problems.append(f"replicas {[len(s.ranks) for s in plan.stages]}: update={plan.update!r} runs one rank per "
                        "stage; drop the replicas")
    if plan.recomputes:
        problems.append(f"recompute {[s.recompute for s in plan.stages]}: update={plan.update!r} keeps activations; "
                        "use recompute='none'")
    if plan.placement != "pipeline":
        problems.append(f"placement={plan.placement!r}: update={plan.update!r} runs a pipeline of stages")
    return problems


class AsyncTrainer:
    """The stream of one runtime: which call comes next, the stages' weight versions, the losses.

    Args:
        plan: the plan (its `update`, micro-batches, stages and ranks).
        interpreters: this process's interpreters, by rank (all of them in one process).
        stages: this process's stages (their Parameters get versions).
        devices: each rank's device name.
    """

    def __init__(self, plan: Plan, interpreters: dict[int, Interpreter], stages: Sequence[Stage],
                 devices: Sequence[str]) -> None:
        problems = check_async_plan(plan)
        if problems:
            raise PartitionError("cannot run asynchronous updates:\n" + "\n".join(f"- {p}" for p in problems))
        self.rule: AsyncUpdate = plan.update  # type: ignore[assignment]
        self.m = plan.micro_batches
        try:
            self.stream = Stream(self.m, [s.ranks[0] if s.ranks else s.index for s in plan.stages],
                                 [list(s.reads_from) for s in plan.stages], devices)
        except StreamError as exc:
            raise PartitionError(str(exc)) from None
        self.interpreters = interpreters
        self.stages = list(stages)
        self.calls = 0  # calls of the stream so far (0: none in flight)
        self.training: bool | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.broken: str | None = None
        self._last_loss: torch.Tensor | None = None

    @property
    def in_flight(self) -> bool:
        return self.calls > 0

    def guard(self, what: str) -> None:
        """Raise if `what` cannot happen now (micro-batches in flight, or a failed call)."""
        if self.broken is not None:
            raise PartitionError(f"{what}: an earlier asynchronous train_step failed ({self.broken}); the weights and "
                                 "optimizer are partly updated: build the pipeline again, or load a checkpoint")
        if self.in_flight:
            raise PartitionError(f"{what} while micro-batches of update={self.rule!r} are in flight; call "
                                 "pipe.flush() first (it finishes them and applies their updates)")

    def train_step(self, step: StepInputs, optimizer: torch.optim.Optimizer | None, training: bool,
                   mutated: Sequence[str], run: RunSegment) -> torch.Tensor | None:
        """Run call t of the stream for batch t; returns batch t-1's loss (None on the first call)."""
        if self.broken is not None:
            self.guard("train_step")
        if optimizer is None:
            raise PartitionError(f"update={self.rule!r} steps the optimizer inside train_step: pass "
                                 "pipe.train_step(x, y, loss_fn, optimizer=opt)")
        if len(step.envs) != self.m:
            raise PartitionError(f"the batch splits into {len(step.envs)} micro-batches, not {self.m}: asynchronous "
                                 f"updates need every batch to have at least {self.m} samples")
        if self.in_flight:
            if optimizer is not self.optimizer:
                raise PartitionError("train_step got another optimizer than the micro-batches in flight use; call "
                                     "pipe.flush() before switching optimizers")
            if training != self.training:
                raise PartitionError("the model switched train()/eval() while micro-batches are in flight; call "
                                     "pipe.flush() first")
        else:
            self._start(optimizer, training, mutated)
        t = self.calls
        for interpreter in self.interpreters.values():
            interpreter.add_batch(step, t)
        self._run(run, self.stream.step(t), step)
        self.calls += 1
        return self._complete(t - 1)

    def flush(self, run: RunSegment) -> torch.Tensor | None:
        """Finish every micro-batch in flight and apply every pending update; the last batch's loss."""
        if self.broken is not None:
            self.guard("flush")
        if not self.in_flight:
            return None
        t = self.calls - 1
        self._run(run, self.stream.drain(t), None)
        for interpreter in self.interpreters.values():
            for versions in interpreter.versions.values():
                versions.finish()
            interpreter.versions = {}
        self.calls = 0
        return self._complete(t)

    def _run(self, run: RunSegment, segment: list[list[Op]], step: StepInputs | None) -> None:
        try:
            run(segment, step)
        except BaseException as exc:
            self.broken = f"{type(exc).__name__}: {exc}"
            raise

    def _complete(self, batch: int) -> torch.Tensor | None:
        """Batch `batch`'s loss where this process holds the last stage (its forwards must all have run)."""
        for interpreter in self.interpreters.values():
            found = interpreter.batch_losses.pop(batch, None)
            if found is not None:
                loss, count = found
                if count != self.m:
                    raise RuntimeError(f"internal error: batch {batch} ran {count} of {self.m} forwards")
                return loss
        return None

    def _start(self, optimizer: torch.optim.Optimizer, training: bool, mutated: Sequence[str]) -> None:
        """Check what the stream needs, then give every stage its versions."""
        problems = []
        if mutated:
            problems.append(f"the model writes into its inputs {list(mutated)} in place")
        if any(stage.deferred_bns for stage in self.stages):
            problems.append("the model has BatchNorm (its statistics are committed once per synchronous step)")
        owners: dict[int, int] = {}
        for stage in self.stages:
            for p in stage.module.parameters():
                if owners.setdefault(id(p), stage.index) != stage.index:
                    problems.append(f"a weight of shape {tuple(p.shape)} is read by stages {owners[id(p)]} and "
                                    f"{stage.index} (tied weights); cut so that one stage reads it")
        known = {id(p) for group in optimizer.param_groups for p in group["params"]}
        params = {s.index: [p for p in s.module.parameters() if p.requires_grad] for s in self.stages}
        if any(id(p) not in known for ps in params.values() for p in ps):
            problems.append("the optimizer lacks Parameters of the stages; build it over model.parameters()")
        if any(p.grad is not None for ps in params.values() for p in ps):
            problems.append("Parameters hold gradients from before; call optimizer.zero_grad(set_to_none=True) first "
                            "(asynchronous updates own the gradients)")
        if problems:
            raise PartitionError(f"update={self.rule!r} cannot run:\n" + "\n".join(f"- {p}" for p in problems))
        stepper = Stepper(optimizer)
        local: dict[tuple[int, int, int], list[object]] = {}
        for interpreter in self.interpreters.values():
            interpreter.begin_stream(local)
            interpreter.weighted_backward = self.rule != "stash"
            interpreter.versions = {s: StageVersions(params[s], self.rule, self.m, stepper)
                                    for s in interpreter.stages}
        self.optimizer, self.training = optimizer, training

