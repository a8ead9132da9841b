"""A step's arguments checked where they enter (runtime/steps.py; issue 25 item 5), one process and torchrun alike.

Targets of another batch than the inputs were split by micro-batch unchecked, and the loss came back
(1.75) where the plain model raises; a loss_fn returning a tensor of several elements failed inside
the runtime ("output with shape [] doesn't match the broadcast shape [2, 4]").
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cost_model.analytic import AnalyticCostModel
from partitioner import PartitionError, partition
from tests.zoo import rel


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


@pytest.mark.parametrize("threads", [False, True])
def test_targets_of_another_batch_than_the_inputs_are_refused_naming_both(threads: bool) -> None:
    model = mlp()
    x = torch.randn(8, 8)
    pipe = partition(model, ["cpu", "cpu"], example_inputs=(x,), micro_batches=4, threads=threads,
                     cost_model=AnalyticCostModel())
    with pytest.raises(RuntimeError, match=r"size of tensor a \(8\) must match the size of tensor b \(4\)"):
        with pytest.warns(UserWarning):  # the plain model: broadcasting fails (after a warning)
            F.mse_loss(model(x), torch.randn(4, 4))
    with pytest.raises(PartitionError, match=r"targets have a batch of 4 .* inputs have a batch of 8"):
        pipe.train_step(x, torch.randn(4, 4), F.mse_loss)
    with pytest.raises(PartitionError, match=r"targets' first tensor is a scalar"):
        pipe.train_step(x, torch.tensor(1.0), F.mse_loss)
    assert all(p.grad is None for p in model.parameters())
    y = torch.randn(8, 4)  # targets of the inputs' batch (here in a dict) train as the plain model does
    reference = copy.deepcopy(model)
    loss = pipe.train_step(x, {"y": y}, lambda out, t: F.mse_loss(out, t["y"]))
    assert loss is not None and rel(loss, F.mse_loss(reference(x), y)) < 1e-5


def test_targets_without_a_tensor_reach_every_micro_batch_whole() -> None:
    model = mlp()
    reference = copy.deepcopy(model)
    x = torch.randn(8, 8)
    pipe = partition(model, ["cpu", "cpu"], example_inputs=(x,), micro_batches=4, cost_model=AnalyticCostModel())
    loss = pipe.train_step(x, None, lambda out, _: out.square().mean())
    ref = reference(x).square().mean()
    ref.backward()
    assert loss is not None and rel(loss, ref) < 1e-5
    for p, q in zip(model.parameters(), reference.parameters()):
        assert p.grad is not None and q.grad is not None and rel(p.grad, q.grad) < 1e-5


@pytest.mark.parametrize("micro_batches", [1, 4])
def test_a_loss_that_is_not_a_scalar_is_refused_naming_its_shape_and_the_fix(micro_batches: int) -> None:
    model = mlp()
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    pipe = partition(model, ["cpu", "cpu"], example_inputs=(x,), micro_batches=micro_batches,
                     cost_model=AnalyticCostModel())
    with pytest.raises(RuntimeError, match="grad can be implicitly created only for scalar outputs"):
        ((model(x) - y) ** 2).backward()  # the plain model
    model.zero_grad()
    shape = (8 // micro_batches, 4)
    with pytest.raises(PartitionError, match=re.escape(f"loss_fn returned a tensor of shape {shape}") + ".*reduce it"):
        pipe.train_step(x, y, lambda out, target: (out - target) ** 2)
    with pytest.raises(PartitionError, match=r"loss_fn returned a float, not a scalar tensor"):
        pipe.train_step(x, y, lambda out, target: 1.0)  # type: ignore[arg-type, return-value]
    assert all(p.grad is None for p in model.parameters())  # a failed step changes nothing
    reference = copy.deepcopy(model)  # a one-element loss of shape (1,) is a scalar to backward too
    loss = pipe.train_step(x, y, lambda out, target: F.mse_loss(out, target).reshape(1))
    assert loss is not None and loss.shape == () and rel(loss, F.mse_loss(reference(x), y)) < 1e-5
