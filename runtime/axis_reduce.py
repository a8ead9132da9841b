"""Gradients the axes inside a replica leave partial, summed at the end of a step: sequence parts and split experts.

A stage whose sequence is split over c ranks (runtime.context_parallel) gives each weight the gradient
of that rank's tokens only; one whose experts are split over e of r replicas (runtime.expert_parallel)
holds each expert on r / e replicas, and the runtime's all-reduce over all replicas (runtime.grad_groups)
must not add different experts together. So, after the step's backwards and the replicas' all-reduces:

    experts   each split stack's local experts: summed over the replicas holding the same experts
    sequence  every weight of the stage the replicas' reductions do not already sum over the context
              ranks: all of them unsharded; sharded by FSDP2 (whose mesh holds the context ranks), only
              the weights it leaves whole (tied to another stage, experts)

in stage order, experts first, on every rank of each group alike (all run the same program): sums
commute, and each group's ranks post its all-reduces in one order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["AxisReductions", "Reduction"]


@dataclass
class Reduction:
    """Sum the gradients of `params` over `group` (a process group holding this rank)."""

    what: str
    group: Any
    params: list[nn.Parameter]

    def run(self) -> None:
        for p in self.params:  # one at a time: few weights, and a DTensor's gradient is its local part
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            dist.all_reduce(local, group=self.group)
            if p.grad is None:
                p.grad = grad


@dataclass
class AxisReductions:
    """This rank's reductions (module docstring), in order; `experts` are the ids of split experts' weights
    (runtime.grad_groups leaves them out)."""

    reductions: list[Reduction] = field(default_factory=list)
    experts: set[int] = field(default_factory=set)

    def run(self) -> None:
        for r in self.reductions:
            r.run()
