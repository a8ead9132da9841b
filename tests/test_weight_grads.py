"""Models that compute their own weight gradients after backward (runtime/weight_grads.py; issue 25 item 6).

The model below works as PyTorch's pipelining test model `MultiMLPWithDw` after `toggle()`: its
Function's backward returns the input's gradient only and keeps (output gradient, input) in the
module; `model.compute_dW()` after `loss.backward()` turns them into weight gradients. Partitioned
with several micro-batches, one call after the step used only the first micro-batch's context
(layers.0.w1 1.2 relative off, silently). With `pipe.set_weight_grad_hook` the pipeline calls it
after each micro-batch's backward of each stage (as PyTorch's dw_builder); without, a step refuses.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, cast

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import SplitPoint

from cost_model.analytic import AnalyticCostModel
from partitioner import PartitionError, Plan, StagePlan, partition, plan
from tests.test_distributed import results, torchrun
from tests.zoo import rel


class InputGradOnly(torch.autograd.Function):
    """x @ w.T + b whose backward gives x's gradient and leaves (grad, x) in `owner.context[key]` for w and b."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, owner: nn.Module,
                key: str) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.owner, ctx.key = owner, key
        return x @ w.t() + b

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        x, w = ctx.saved_tensors
        ctx.owner.context[ctx.key].append((grad.clone(), x.clone()))
        return grad @ w, None, None, None, None


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(width, width) / width**0.5)
        self.b1 = nn.Parameter(torch.zeros(width))
        self.w2 = nn.Parameter(torch.randn(width, width) / width**0.5)
        self.b2 = nn.Parameter(torch.zeros(width))
        self.context: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {"fc1": [], "fc2": []}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(InputGradOnly.apply(x, self.w1, self.b1, self, "fc1"))
        out: torch.Tensor = InputGradOnly.apply(h, self.w2, self.b2, self, "fc2")
        return out

    def compute_dW(self) -> None:
        for key, w, b in (("fc1", self.w1, self.b1), ("fc2", self.w2, self.b2)):
            grad, x = self.context[key].pop(0)
            for p, g in ((w, grad.t() @ x), (b, grad.sum(0))):
                p.grad = g if p.grad is None else p.grad + g


class SelfGradNet(nn.Module):
    def __init__(self, width: int = 8, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x

    def compute_dW(self) -> None:
        for layer in reversed(self.layers):
            cast(Block, layer).compute_dW()


def hook(stage_module: nn.Module) -> None:
    """What PyTorch's test runs per stage and micro-batch: the stage's blocks' own weight-gradient code."""
    for m in stage_module.modules():
        if isinstance(m, Block):
            m.compute_dW()


def build(stages: int, schedule: str, threads: bool, m: int = 4) -> tuple[Any, SelfGradNet, SelfGradNet]:
    torch.manual_seed(0)
    model = SelfGradNet()
    reference = copy.deepcopy(model)
    spec = {f"layers.{k}": SplitPoint.BEGINNING for k in range(1, 4)}  # cut between blocks, as PyTorch's stages
    pipe = partition(model, ["cpu"] * stages, example_inputs=(torch.randn(8, 8),), micro_batches=m,
                     schedule=schedule, threads=threads, split_spec=spec, cost_model=AnalyticCostModel())
    return pipe, model, reference


def assert_same_grads(model: nn.Module, reference: nn.Module) -> None:
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert p.grad is not None and q.grad is not None and rel(p.grad, q.grad) < 1e-5, name
    assert all(not ctx for m in model.modules() if isinstance(m, Block) for ctx in m.context.values())


SETTINGS = [(stages, threads) for stages in (2, 3) for threads in (False, True)]


@pytest.mark.parametrize("stages,threads", SETTINGS)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb1"])
def test_the_hook_runs_the_models_weight_gradients_per_micro_batch(stages: int, threads: bool, schedule: str) -> None:
    pipe, model, reference = build(stages, schedule, threads)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    pipe.set_weight_grad_hook(hook)
    loss = pipe.train_step(x, y, F.mse_loss)
    ref_loss = F.mse_loss(reference(x), y)
    ref_loss.backward()
    reference.compute_dW()
    assert loss is not None and rel(loss, ref_loss) < 1e-5
    assert_same_grads(model, reference)
    model.zero_grad()
    reference.zero_grad()
    F.mse_loss(pipe(x), y).backward()  # the caller's backward: the hook runs when it returns
    F.mse_loss(reference(x), y).backward()
    reference.compute_dW()
    assert_same_grads(model, reference)


@pytest.mark.parametrize("stages,threads", SETTINGS)
def test_without_the_hook_several_micro_batches_are_refused_one_is_the_plain_model(stages: int,
                                                                                   threads: bool) -> None:
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    pipe, model, reference = build(stages, "1f1b", threads)
    with pytest.raises(PartitionError, match=r"InputGradOnly in stage 0 is handed module layers.0 and left "
                                             r"layers.0.w1, layers.0.b1 without a gradient.*set_weight_grad_hook"):
        pipe.train_step(x, y, F.mse_loss)
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(PartitionError, match="set_weight_grad_hook"):
        F.mse_loss(pipe(x), y).backward()
    pipe, model, reference = build(stages, "1f1b", threads, m=1)  # one backward per stage: the model's own call
    pipe.train_step(x, y, F.mse_loss)
    model.compute_dW()
    F.mse_loss(reference(x), y).backward()
    reference.compute_dW()
    assert_same_grads(model, reference)


def test_a_module_whose_context_spans_two_stages_is_refused_with_the_hook() -> None:
    torch.manual_seed(0)
    model = SelfGradNet()
    x = torch.randn(8, 8)
    names = [n for s in plan(model, ["cpu"], example_inputs=(x,), cost_model=AnalyticCostModel()).stages
             for n in s.nodes]
    k = names.index([n for n in names if "apply" in n][3])  # between layers.1's two Function calls
    cut = Plan(stages=[StagePlan(0, "cpu", names[:k]), StagePlan(1, "cpu", names[k:])], micro_batches=4)
    pipe = partition(model, ["cpu"] * 2, example_inputs=(x,), plan=cut)
    with pytest.raises(PartitionError, match=r"several stages \(layers\.1 in stages 0, 1\).*split_spec"):
        pipe.set_weight_grad_hook(hook)


def test_under_torchrun_the_hook_and_the_argument_checks_hold_on_every_rank() -> None:
    run = torchrun(2, worker=str(Path(__file__).resolve().parent / "weight_grads_worker.py"))
    lines = results(run.stdout)
    assert run.returncode == 0 and len(lines) == 2 and all("ok=True" in line for line in lines), run.stdout[-4000:]
