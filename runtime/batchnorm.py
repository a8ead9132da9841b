"""Deferred BatchNorm: running statistics over the whole mini-batch, not each micro-batch.

In training each micro-batch is normalized with its own statistics (as in GPipe and
torchgpipe), but the running mean and variance are updated once per mini-batch from the
statistics of all its micro-batches combined, so after a step they equal full-batch
training. With one micro-batch this is exactly plain BatchNorm. The update happens when the
step succeeds (`commit`); a step that raises leaves the buffers untouched (`discard`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["DeferredBatchNorm", "DeferredBatchNormOp", "fold"]


class DeferredBatchNorm(nn.Module):
    """Wraps one of the model's BatchNorm modules (its parameters and buffers stay the model's)."""

    def __init__(self, bn: _BatchNorm) -> None:
        super().__init__()
        self.bn = bn
        self.deferring = False
        self._stats: list[tuple[int, torch.Tensor, torch.Tensor]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bn = self.bn
        if not (self.deferring and bn.training and bn.track_running_stats):
            out: torch.Tensor = bn(x)
            return out
        dims = [0, *range(2, x.dim())]
        with torch.no_grad():
            var, mean = torch.var_mean(x.detach(), dim=dims, correction=0)
            self._stats.append((x.numel() // x.shape[1], mean, var))
        return F.batch_norm(x, None, None, bn.weight, bn.bias, True, 0.0, bn.eps)

    def discard(self) -> None:
        """Forget the statistics of a step that failed: the running buffers stay as they were."""
        self._stats = []

    def commit(self) -> None:
        """Fold the statistics of this mini-batch's micro-batches into the running buffers."""
        stats, self._stats = self._stats, []
        bn = self.bn
        fold(stats, bn.running_mean, bn.running_var, bn.num_batches_tracked, bn.momentum)


class DeferredBatchNormOp(nn.Module):
    """The same deferral for `aten.batch_norm` in a torch.export graph, whose buffers are the model's."""

    def __init__(self, running_mean: torch.Tensor, running_var: torch.Tensor, num_batches_tracked: torch.Tensor | None,
                 momentum: float | None) -> None:
        super().__init__()
        self.stats = (running_mean, running_var, num_batches_tracked)
        self.momentum = momentum
        self.deferring = False
        self._stats: list[tuple[int, torch.Tensor, torch.Tensor]] = []

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                running_mean: torch.Tensor | None, running_var: torch.Tensor | None, training: bool,
                momentum: float, eps: float, cudnn_enabled: bool) -> torch.Tensor:
        if not (self.deferring and training):
            out: torch.Tensor = torch.ops.aten.batch_norm.default(
                x, weight, bias, running_mean, running_var, training, momentum, eps, cudnn_enabled
            )
            return out
        with torch.no_grad():
            var, mean = torch.var_mean(x.detach(), dim=[0, *range(2, x.dim())], correction=0)
            self._stats.append((x.numel() // x.shape[1], mean, var))
        return F.batch_norm(x, None, None, weight, bias, True, 0.0, eps)

    def discard(self) -> None:
        self._stats = []

    def commit(self) -> None:
        stats, self._stats = self._stats, []
        fold(stats, *self.stats, self.momentum)


def fold(
    stats: list[tuple[int, torch.Tensor, torch.Tensor]],
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    num_batches_tracked: torch.Tensor | None,
    momentum: float | None,
) -> None:
    """One running-statistics update from the (count, mean, biased var) of each micro-batch, as BatchNorm
    makes from the whole batch: the combined mean, the unbiased combined variance, `momentum`
    (None: a cumulative average over `num_batches_tracked`)."""
    if not stats or running_mean is None or running_var is None:
        return
    with torch.no_grad():
        total = sum(n for n, _, _ in stats)
        mean = torch.stack([n * m for n, m, _ in stats]).sum(0) / total
        m2 = torch.stack([n * (v + (m - mean) ** 2) for n, m, v in stats]).sum(0)
        unbiased = m2 / max(total - 1, 1)
        factor = momentum
        if num_batches_tracked is not None:
            num_batches_tracked.add_(1)
            if factor is None:
                factor = 1.0 / float(num_batches_tracked)
        factor = 0.0 if factor is None else factor
        running_mean.mul_(1 - factor).add_(mean.to(running_mean.device, running_mean.dtype), alpha=factor)
        running_var.mul_(1 - factor).add_(unbiased.to(running_var.device, running_var.dtype), alpha=factor)
