"""Bounded staleness: the update of step t uses the all-reduced gradients of step t - s, exchanged in the background.

[Note: bounded staleness] A weight held by several ranks (replicas of a stage, or a weight
tied across stages) has its gradient summed over exactly those ranks (runtime.distributed).
With staleness s, each rank starts the all-reduce of its step-t gradients as soon as they are
ready and does not wait for it: the gradients it leaves for the optimizer at the end of step t
are the all-reduced sum of step t - s, so every copy of a weight takes the same update and the
copies stay identical, while a rank waits for its peers' step-t exchange only s steps later.
Warm-up: in the first s steps nothing has been reduced yet, so those weights get no gradient
(`grad` None: torch optimizers leave the weight and its optimizer state alone). Every step's
gradient is applied exactly once, s steps late; s = 0 is the synchronous all-reduce.

    step       t-2        t-1          t
    start      AR(t-2) ─┐ AR(t-1) ─┐   AR(t) ─┐      (background, one global order per group)
    apply (s=2)         │          │   G(t-2) ◄┘... waited here, at step t
                        └──────────┴─► in flight: at most s reductions per group

NCCL: every rank of a group starts the same reductions in the same order (one per step, in
the program's AR order) and waits for them in that order; `drain` waits for whatever is still
in flight, before a checkpoint or the end of the job, so nothing is left unwaited.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, NamedTuple, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["Reduction", "StaleReductions", "check_staleness"]


def check_staleness(staleness: object) -> int:
    """`staleness` as an int >= 0, else ValueError naming the fix."""
    if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 0:
        raise ValueError(f"staleness={staleness!r}; use an integer >= 0 (0: the synchronous all-reduce; s: the "
                         "update of step t uses the gradients of step t - s)")
    return staleness


class Reduction(NamedTuple):
    """One started all-reduce: its work handle, the flat buffer it sums in place, the weights it holds."""

    work: Any
    flat: torch.Tensor
    params: list[nn.Parameter]


class StaleReductions:
    """The last `staleness` steps' reductions of one weight group, oldest first ([Note: bounded staleness])."""

    def __init__(self, staleness: int = 0) -> None:
        self.staleness = check_staleness(staleness)
        self._steps: deque[list[Reduction]] = deque()
        self._waited: set[int] = set()  # ids of works already waited for (by drain)

    @property
    def in_flight(self) -> int:
        """How many steps' reductions are started and not applied yet."""
        return len(self._steps)

    def step(self, started: Sequence[Reduction], params: Sequence[nn.Parameter],
             wait: Callable[[Any], None]) -> None:
        """End a step: queue its reductions, then give `params` the gradients of step t - s (None in warm-up)."""
        self._steps.append(list(started))
        if len(self._steps) <= self.staleness:  # warm-up: nothing of step t - s exists
            for p in params:
                p.grad = None
            return
        for work, flat, bucket in self._steps.popleft():
            if id(work) not in self._waited:
                wait(work)
            self._waited.discard(id(work))
            offset = 0
            for q in bucket:  # what was reduced: the local part of each gradient (a DTensor's: its shard)
                grad = q.grad if q.grad is not None else q
                mine = grad.to_local() if isinstance(grad, DTensor) else grad
                part = flat[offset : offset + mine.numel()].view_as(mine).to(q.device)
                offset += mine.numel()
                if q.grad is None:
                    q.grad = part.clone() if not isinstance(q, DTensor) else DTensor.from_local(
                        part.clone(), q.device_mesh, q.placements, shape=q.shape, stride=q.stride())
                else:
                    mine.copy_(part)

    def drain(self, wait: Callable[[Any], None]) -> None:
        """Wait for every reduction still in flight (they stay queued and are applied at their step)."""
        for reductions in self._steps:
            for r in reductions:
                if id(r.work) not in self._waited:
                    wait(r.work)
                    self._waited.add(id(r.work))

    def reset(self, wait: Callable[[Any], None]) -> None:
        """Wait for and drop everything in flight (weights loaded from a checkpoint: warm-up starts again)."""
        self.drain(wait)
        self._steps.clear()
        self._waited.clear()
