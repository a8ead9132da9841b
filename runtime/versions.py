"""Weight versions for asynchronous pipeline updates: PipeDream-2BW and PipeDream's weight stashing.

In a pipeline without flushes (runtime.flushless) a stage's optimizer steps while micro-batches
whose forwards read the old weights still wait for their backwards. Stepping the Parameters
in place would break what autograd saved (or, swapping `.data`, silently give wrong
gradients). So the forwards never read the Parameters: each version is a set of leaf clones
that the stage module reads through `torch.func.functional_call`; a backward accumulates into
the clones its forward read; a finished version's gradients become the Parameters' `.grad`
for one `optimizer.step()` (which then updates the Parameters, the newest weights), and
the next version is cloned from them.

    2BW   (update="2bw", Narayanan et al. ICML'21): batch t runs on V_t, with
          V_0 = V_1 = W and V_t+1 = V_t - lr * grad f(V_t-1): before the first forward of
          batch t + 1 a stage applies batch t - 1's gradient (its backwards are done by then),
          so at most two versions (batches t and t + 1) are alive per stage.
    stash (update="stash", Narayanan et al. SOSP'19): the stage steps after every
          micro-batch's backward, with that micro-batch's gradient; each forward reads the
          newest weights and its backward the version that forward read, so stage s of p
          holds up to p - s versions.

The optimizer is the caller's, over the model's Parameters; each stage steps only its own
(the others' `.grad` are None then), under one lock when stages run on threads.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Literal, Sequence

import torch
from torch import nn

__all__ = ["AsyncUpdate", "StageVersions", "Stepper"]

AsyncUpdate = Literal["2bw", "stash"]


class Stepper:
    """Steps the caller's optimizer for one stage's Parameters at a time (the others hold no gradient)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self._lock = threading.Lock()

    def step(self, params: Sequence[nn.Parameter], grads: Sequence[torch.Tensor | None]) -> None:
        with self._lock:
            for p, g in zip(params, grads):
                p.grad = g
            try:
                self.optimizer.step()
            finally:
                for p in params:
                    p.grad = None


@dataclass
class _Version:
    tensors: list[torch.Tensor]  # leaf clones of the stage's Parameters, in `StageVersions.params` order
    pending: int = 0  # forwards run minus backwards done


class StageVersions:
    """The live weight versions of one stage: what each forward reads, and when the optimizer steps.

    Args:
        params: the stage's trainable Parameters (not shared with another stage).
        rule: "2bw" or "stash" (see the module docstring).
        micro_batches: per batch (2bw counts a batch's forwards).
        stepper: steps the optimizer for these Parameters.
    """

    def __init__(self, params: Sequence[nn.Parameter], rule: AsyncUpdate, micro_batches: int,
                 stepper: Stepper) -> None:
        self.params = list(params)
        self.rule = rule
        self.m = micro_batches
        self.stepper = stepper
        self._batches: dict[int, _Version] = {}  # 2bw: batch -> its version
        self._current: _Version | None = None  # stash: the version new forwards read
        self._by_mb: dict[int, _Version] = {}  # stash: micro-batch -> the version its forward read
        self._names: dict[int, list[str]] = {}  # per module (by id): its name of each Parameter

    @property
    def live(self) -> int:
        """Versions alive now (held by a micro-batch in flight, or awaiting their update)."""
        if self.rule == "2bw":
            return len(self._batches)
        return len({id(v) for v in self._by_mb.values()})

    @property
    def in_flight(self) -> bool:
        return bool(self._batches) if self.rule == "2bw" else bool(self._by_mb)

    def weights(self, module: nn.Module, microbatch: int) -> dict[str, torch.Tensor]:
        """The tensors micro-batch `microbatch`'s forward reads, by `module`'s parameter names."""
        version = self._for_forward(microbatch)
        names = self._names.get(id(module))
        if names is None:
            by_id = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
            names = self._names[id(module)] = [by_id[id(p)] for p in self.params]
        return dict(zip(names, version.tensors))

    def backward_done(self, microbatch: int) -> None:
        """Micro-batch `microbatch`'s backward has accumulated into its version: stash steps now."""
        if self.rule == "2bw":
            self._batches[microbatch // self.m].pending -= 1
            return
        version = self._by_mb.pop(microbatch)
        grads = [t.grad for t in version.tensors]
        for t in version.tensors:
            t.grad = None
        self.stepper.step(self.params, grads)
        self._current = None  # the next forward reads the updated weights

    def finish(self) -> None:
        """After a drain: apply every gradient not applied yet, oldest first (2bw: the last two batches')."""
        if self.rule == "2bw":
            for b in sorted(self._batches):
                self._apply(self._batches.pop(b), b)
        self._current = None
        self._by_mb.clear()

    def _for_forward(self, microbatch: int) -> _Version:
        if self.rule == "stash":
            if self._current is None:
                self._current = self._clone()
            self._by_mb[microbatch] = self._current
            return self._current
        batch = microbatch // self.m
        version = self._batches.get(batch)
        if version is None:
            old = self._batches.pop(batch - 2, None)
            if old is not None:  # V_t+1 = V_t - lr * grad f(V_t-1), before batch t + 1's first forward
                self._apply(old, batch - 2)
            version = self._batches[batch] = self._clone()
        version.pending += 1
        return version

    def _apply(self, version: _Version, batch: int) -> None:
        if version.pending:
            raise RuntimeError(f"internal error: batch {batch}'s gradient is applied with {version.pending} "
                               "backwards still to run")
        self.stepper.step(self.params, [t.grad for t in version.tensors])

    def _clone(self) -> _Version:
        with torch.no_grad():
            return _Version([p.detach().clone().requires_grad_(p.requires_grad) for p in self.params])
