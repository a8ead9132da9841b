"""DeferredBatchNorm: running statistics from all micro-batches equal one full-batch update."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from runtime.batchnorm import DeferredBatchNorm


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("shape", [(9, 4), (9, 4, 5, 5)])
def test_running_stats_equal_full_batch(momentum: float | None, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    bn = (nn.BatchNorm1d if len(shape) == 2 else nn.BatchNorm2d)(4, momentum=momentum)
    full = copy.deepcopy(bn)
    deferred = DeferredBatchNorm(bn)
    deferred.deferring = True
    for step in range(3):
        x = torch.randn(*shape) * (step + 1) + step
        outs = [deferred(c) for c in torch.tensor_split(x, 4)]
        deferred.commit()
        full(x)
        for c, o in zip(torch.tensor_split(x, 4), outs):
            expected = nn.functional.batch_norm(c, None, None, bn.weight, bn.bias, True, 0.0, bn.eps)
            assert torch.allclose(o, expected, atol=1e-6)
    assert torch.allclose(bn.running_mean, full.running_mean, atol=1e-6)
    assert torch.allclose(bn.running_var, full.running_var, atol=1e-5)
    assert int(bn.num_batches_tracked) == 3


def test_not_deferring_or_eval_is_plain_batchnorm() -> None:
    bn = nn.BatchNorm1d(3)
    ref = copy.deepcopy(bn)
    wrapped = DeferredBatchNorm(bn)
    x = torch.randn(6, 3)
    assert torch.equal(wrapped(x), ref(x))
    assert torch.equal(bn.running_mean, ref.running_mean)
    bn.eval(), ref.eval()
    wrapped.deferring = True
    assert torch.equal(wrapped(x), ref(x))
    wrapped.commit()
    assert torch.equal(bn.running_var, ref.running_var)
