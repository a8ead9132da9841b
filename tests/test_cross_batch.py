"""Never silently wrong: an operation that mixes samples across the batch is refused with micro_batches > 1.

Each refused case is one the plain model computes over the whole batch and a micro-batch would compute
over its own samples only (checked below against the plain model); each accepted case equals the plain model.
"""

from __future__ import annotations

import copy
import re
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cost_model.analytic import AnalyticCostModel
from partitioner import PartitionError, partition, plan as make_plan
from tests.zoo import rel

Fn = Callable[[torch.Tensor, torch.Tensor], Any]


class Centered(nn.Module):
    """The issue's model: `h - h.mean(0)` subtracts the batch's mean."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        h = h - h.mean(0, keepdim=True)
        out: torch.Tensor = self.b(h)
        return out


class Wrapped(nn.Module):
    """Linear, then `fn(h, x)`; `export=True` makes torch.fx fail so torch.export traces it."""

    def __init__(self, fn: Fn, export: bool = False) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.fn = fn
        self.export = export

    def forward(self, x: torch.Tensor) -> Any:
        if self.export and x.shape[1] == 8:  # control flow on a shape: torch.fx cannot trace it
            pass
        return self.fn(self.b(torch.tanh(self.a(x))), x)


def build(model: nn.Module, x: torch.Tensor, micro_batches: int, **options: Any) -> Any:
    return partition(model, ["cpu"] * 2, example_inputs=(x,), micro_batches=micro_batches,
                     cost_model=AnalyticCostModel(), **options)


def test_the_batch_mean_is_refused_naming_the_op_its_line_and_the_flag() -> None:
    torch.manual_seed(0)
    model, x = Centered(), torch.randn(8, 8)
    reference = copy.deepcopy(model)
    with pytest.raises(PartitionError) as error:
        build(model, x, 4)
    message = str(error.value)
    assert "micro_batches=4" in message and "node 'mean': mean over dim 0" in message
    assert re.search(r"`h = h - h.mean\(0, keepdim=True\)` \(.*test_cross_batch.py:\d+ in forward\)", message)
    assert "cross_batch='allow'" in message
    assert all(p.device.type == "cpu" and p.grad is None for p in model.parameters())
    # why: per micro-batch the mean is another one (what cross_batch='allow' runs, and what was silent before)
    pipe = build(model, x, 4, cross_batch="allow")
    out = pipe(x)
    assert rel(out, reference(x)) > 0.05
    assert rel(out, torch.cat([reference(chunk) for chunk in x.chunk(4)])) < 1e-5
    whole = build(copy.deepcopy(reference), x, 1)  # one micro-batch: the whole batch, exact
    assert rel(whole(x), reference(x)) < 1e-5
    with pytest.raises(PartitionError, match="node 'mean'"):
        make_plan(Centered(), ["cpu"] * 2, example_inputs=(x,), micro_batches=2, cost_model=AnalyticCostModel())
    with pytest.raises(PartitionError, match="cross_batch='never'; use 'refuse'.* or 'allow'"):
        build(Centered(), x, 2, cross_batch="never")


MIXING: dict[str, tuple[Fn, str]] = {
    "sum over the batch": (lambda h, x: h + h.sum(0), "sum over dim 0"),
    "variance over the batch": (lambda h, x: h / h.var(0), "var over dim 0"),
    "max of everything": (lambda h, x: h / h.abs().max(), "max over every dim"),
    "softmax over the batch": (lambda h, x: F.softmax(h, 0), "softmax over dim 0"),
    "cumsum over the batch": (lambda h, x: h.cumsum(0), "cumsum over dim 0"),
    "sort over the batch": (lambda h, x: h.sort(0).values, "sort over dim 0"),
    "topk over the batch": (lambda h, x: h + h.topk(2, dim=0).values.sum(), "topk over dim 0"),
    "one sample": (lambda h, x: h + h[0], "dim 0"),
    "flip": (lambda h, x: h.flip(0), "flip over dim 0"),
    "roll": (lambda h, x: h.roll(1, 0), "roll over dim 0"),
    "gram matrix": (lambda h, x: h * torch.einsum("bi,bj->ij", h, h).sum(0), "einsum 'bi,bj->ij' summing"),
    "pairs of samples": (lambda h, x: (h[:, None, :] - h[None, :, :]).pow(2).sum(-1), "pairs samples"),
    "batch regrouped": (lambda h, x: h.reshape(8, -1).t().reshape(x.shape[0], 8), "regroups samples"),
    "normalize over the batch": (lambda h, x: F.normalize(h, dim=0), "over dim 0"),
    "functional batch_norm": (lambda h, x: F.batch_norm(h, None, None, training=True), "batch_norm in training"),
    "a loss used per sample": (lambda h, x: h * F.mse_loss(h, x), "mse_loss (reduction="),
    "index not from the batch": (lambda h, x: h + h.index_select(0, torch.tensor([0])), "index_select"),
}


@pytest.mark.parametrize("export", [False, True], ids=["fx", "export"])
@pytest.mark.parametrize("name", MIXING)
def test_operations_mixing_samples_are_refused(name: str, export: bool) -> None:
    torch.manual_seed(0)
    fn, what = MIXING[name]
    model, x = Wrapped(fn, export), torch.randn(6, 8)
    reference = copy.deepcopy(model)
    with pytest.raises(PartitionError, match="mix samples across the batch") as error:
        build(model, x, 3)
    assert what in str(error.value) and "cross_batch='allow'" in str(error.value)
    pipe = build(model, x, 3, cross_batch="allow")  # what it would have run: not the plain model's result
    out, ref = pipe(x), reference(x)
    assert out.shape != ref.shape or rel(out, ref) > 1e-3


PER_SAMPLE: dict[str, Fn] = {
    "softmax over features": lambda h, x: F.softmax(h, -1),
    "layer norm": lambda h, x: F.layer_norm(h, (8,)),
    "mean over features": lambda h, x: h - h.mean(-1, keepdim=True),
    "slice of features": lambda h, x: h[:, 1:] * 2,
    "pooling by index from the batch": lambda h, x: h[torch.arange(x.shape[0]), h.argmax(-1)],
    "heads and back": lambda h, x: h.view(x.shape[0], 2, 4).transpose(0, 1).reshape(2, -1).view(2, -1, 4)
    .transpose(0, 1).reshape(x.shape[0], 8),
    "attention": lambda h, x: F.scaled_dot_product_attention(*[h.view(x.shape[0], 2, 1, 4)] * 3, is_causal=True),
    "loss per sample": lambda h, x: F.mse_loss(h, x, reduction="none"),
    "a scalar output merged by rule": lambda h, x: (h, h.pow(2).sum()),
}


@pytest.mark.parametrize("export", [False, True], ids=["fx", "export"])
@pytest.mark.parametrize("name", PER_SAMPLE)
def test_per_sample_operations_are_kept_and_equal_the_plain_model(name: str, export: bool) -> None:
    torch.manual_seed(0)
    model, x = Wrapped(PER_SAMPLE[name], export), torch.randn(6, 8)
    reference = copy.deepcopy(model)
    pipe = build(model, x, 3, output_merge_spec={"[1]": "sum"} if "scalar" in name else None)
    out, ref = pipe(x), reference(x)
    for got, want in zip(out if isinstance(out, tuple) else [out], ref if isinstance(ref, tuple) else [ref]):
        assert got.shape == want.shape and rel(got, want) < 1e-5


class WithBatchNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.bn = nn.BatchNorm1d(6)
        self.b = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.b(torch.relu(self.bn(self.a(x))))
        return out


def test_batchnorm_modules_are_the_runtimes_not_refused() -> None:
    torch.manual_seed(0)
    model, x = WithBatchNorm(), torch.randn(8, 6)
    reference = copy.deepcopy(model)
    pipe = build(model, x, 2)
    out = pipe(x)  # deferred BatchNorm: each micro-batch normalized alone, statistics folded once (README)
    assert rel(out, torch.cat([reference(chunk) for chunk in x.chunk(2)])) < 1e-5
