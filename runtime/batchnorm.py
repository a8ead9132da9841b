"""Deferred BatchNorm: running statistics over the whole mini-batch, not each micro-batch.

In training each micro-batch is normalized with its own statistics (as in GPipe and
torchgpipe), but the running mean and variance are updated once per mini-batch from the
statistics of all its micro-batches combined, so after a step they equal full-batch
training. With one micro-batch this is exactly plain BatchNorm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["DeferredBatchNorm"]


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
            return bn(x)
        dims = [0, *range(2, x.dim())]
        with torch.no_grad():
            var, mean = torch.var_mean(x.detach(), dim=dims, correction=0)
            self._stats.append((x.numel() // x.shape[1], mean, var))
        return F.batch_norm(x, None, None, bn.weight, bn.bias, True, 0.0, bn.eps)

    def commit(self) -> None:
        """Fold the statistics of this mini-batch's micro-batches into the running buffers."""
        stats, self._stats = self._stats, []
        bn = self.bn
        if not stats or bn.running_mean is None or bn.running_var is None:
            return
        with torch.no_grad():
            total = sum(n for n, _, _ in stats)
            mean = sum(n * m for n, m, _ in stats) / total
            m2 = sum(n * (v + (m - mean) ** 2) for n, m, v in stats)
            unbiased = m2 / max(total - 1, 1)
            factor = bn.momentum
            if bn.num_batches_tracked is not None:
                bn.num_batches_tracked.add_(1)
                if factor is None:
                    factor = 1.0 / float(bn.num_batches_tracked)
            factor = 0.0 if factor is None else factor
            bn.running_mean.mul_(1 - factor).add_(mean.to(bn.running_mean.dtype), alpha=factor)
            bn.running_var.mul_(1 - factor).add_(unbiased.to(bn.running_var.dtype), alpha=factor)
