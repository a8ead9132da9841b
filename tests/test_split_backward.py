"""Split backward (B then W) against one ordinary backward: input and weight gradients, every edge case."""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch
from torch import nn

from runtime.split_backward import backward_input, backward_weight
from tests.zoo import rel

Run = Callable[[nn.Module, torch.Tensor], list[torch.Tensor]]


def compare(model: nn.Module, x: torch.Tensor, run: Run, grads: Callable[[list[torch.Tensor]], list[Any]],
            seed: int = 0) -> nn.Module:
    """B then W on `model`, one backward on a copy: the same input and weight gradients. Returns the model."""
    model.zero_grad(set_to_none=True)
    reference = copy.deepcopy(model)
    xs = [x.detach().requires_grad_(x.is_floating_point()) for _ in range(2)]
    torch.manual_seed(seed)
    roots = run(model, xs[0])
    torch.manual_seed(seed)
    ref_roots = run(reference, xs[1])
    g = grads(roots)
    torch.autograd.backward(ref_roots, g)
    before = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    work = backward_input(roots, g, [xs[0]] if xs[0].requires_grad else [])
    if xs[0].requires_grad:
        assert rel(xs[0].grad, xs[1].grad) < 1e-5  # type: ignore[arg-type]
    for p, b in zip(model.parameters(), before):  # B leaves the weights alone
        assert (p.grad is None and b is None) or (p.grad is not None and b is not None and torch.equal(p.grad, b))
    backward_weight(work)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if q.grad is None:
            assert p.grad is None, name
        else:
            assert p.grad is not None and rel(p.grad, q.grad) < 1e-5, name
    return model


def like_outputs(roots: list[torch.Tensor]) -> list[Any]:
    torch.manual_seed(1)
    return [torch.randn_like(r) for r in roots]


def test_middle_stage_and_last_stage_with_a_loss() -> None:
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4))
    compare(mlp, torch.randn(5, 8), lambda m, x: [m(x)], like_outputs)
    compare(mlp, torch.randn(5, 8), lambda m, x: [m(x).square().mean()], lambda roots: [None])


class TiedUnusedDropout(nn.Module):
    """One Linear used twice (a tied weight), dropout between, and a parameter nothing reads."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.unused = nn.Linear(3, 3)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.drop(torch.tanh(self.lin(x))))


def test_tied_weight_unused_parameter_and_dropout_with_a_fixed_seed() -> None:
    torch.manual_seed(0)
    model = compare(TiedUnusedDropout(), torch.randn(6, 8), lambda m, x: [m(x)], like_outputs, seed=3)
    assert model.unused.weight.grad is None  # never reached: as after an ordinary backward


def test_first_stage_without_input_gradients_runs_everything_in_w() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8))
    compare(model, torch.randint(0, 10, (4, 3)), lambda m, x: [m(x)], like_outputs)


def test_gradients_accumulate_onto_existing_ones() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    reference = copy.deepcopy(model)
    for _ in range(2):  # two micro-batches, as a pipeline step runs them
        x = torch.randn(3, 4)
        backward_weight(backward_input([model(x)], [torch.ones(3, 4)], []))
        reference(x).backward(torch.ones(3, 4))
    assert rel(model.weight.grad, reference.weight.grad) < 1e-6  # type: ignore[arg-type]


class _Count(torch.autograd.Function):
    """Identity whose backward counts its calls; a custom (Python) autograd node."""

    calls = 0

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        _Count.calls += 1
        return g


class _MatMul(torch.autograd.Function):
    """x @ w with a hand-written backward: a custom node where input and weight gradients meet."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        return g @ w.t(), x.t() @ g


class Outputs(nn.Module):
    """Custom autograd nodes, an output that reaches no input, and a parameter returned as is."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))
        self.p = nn.Parameter(torch.randn(8))
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        h = self.lin(_MatMul.apply(_Count.apply(x), self.w))
        return [h + self.p, self.p * 2.0, self.p]


def test_custom_nodes_outputs_that_reach_no_input_and_w_never_reruns_input_only_work() -> None:
    torch.manual_seed(0)
    _Count.calls = 0
    compare(Outputs(), torch.randn(4, 8), lambda m, x: m(x), like_outputs)
    assert _Count.calls == 2  # once in the reference backward, once in B: W never runs it


def test_bad_arguments_are_named() -> None:
    x = torch.randn(2, 2, requires_grad=True)
    y = x * 2
    with pytest.raises(ValueError, match="inputs as leaf tensors"):
        backward_input([y.sum()], [None], [y])
    with pytest.raises(RuntimeError, match=r"a root of shape \(2, 2\) has no gradient"):
        backward_input([y], [None], [x])


def test_an_expanded_input_gradient_is_stored_dense_as_autograd_would() -> None:
    x = torch.randn(3, 4, requires_grad=True)
    w = nn.Parameter(torch.randn(4))
    backward_weight(backward_input([x.sum() * w], [torch.ones(4)], [x]))  # dx: sum(w), expanded with stride 0
    assert x.grad is not None and x.grad.stride() == (4, 1)
    assert torch.allclose(x.grad, w.detach().sum().expand(3, 4))
    assert w.grad is not None and torch.allclose(w.grad, x.detach().sum().expand(4))


def squared_error(out: torch.Tensor, targets: list[torch.Tensor]) -> torch.Tensor:
    """Mean over samples (so micro-batch weighting applies) of a squared error."""
    return ((out - targets[0]) ** 2).flatten(1).sum(1).mean()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("threads", [False, True])
def test_dualpipe_v_mixes_whole_and_split_backwards_and_equals_the_plain_model_and_1f1b(threads: bool) -> None:
    from cost_model.analytic import AnalyticCostModel
    from partitioner import partition
    from tests import zoo

    torch.manual_seed(0)
    model, (x,), _ = zoo.tiny_gpt()  # tied embedding and LM head: stages 0 and 3, both on rank 0
    reference, plain = copy.deepcopy(model), copy.deepcopy(model)
    with torch.no_grad():
        y = [torch.randn_like(reference(x))]
    pipe = partition(model, ["cpu", "cpu"], example_inputs=(x,), micro_batches=4, schedule="dualpipev",
                     threads=threads, cost_model=AnalyticCostModel())
    assert [s.ranks for s in pipe.plan.stages] == [[0], [1], [1], [0]] and pipe.plan.virtual_stages == 2
    backwards = [op for prog in pipe.plan.programs for op in prog.ops if op.kind == "B"]
    assert len(backwards) == 16 and sum(op.split for op in backwards) == 5  # DualPipeV splits 5 of 16 at m=4, p=2
    pipe.tracing = True
    loss = pipe.train_step(x, y, squared_error)
    assert loss is not None
    kinds = [e["kind"] for e in pipe.trace]
    assert (kinds.count("backward"), kinds.count("weight")) == (16, 5)  # every B, and a W per split B
    expected = squared_error(reference(x), y)
    expected.backward()
    assert rel(loss, expected.detach()) < 1e-5
    one_f_one_b = partition(plain, ["cpu", "cpu"], example_inputs=(x,), micro_batches=4, schedule="1f1b",
                            threads=threads, cost_model=AnalyticCostModel())
    one_f_one_b.train_step(x, y, squared_error)
    for (name, p), q, o in zip(model.named_parameters(), reference.parameters(), plain.parameters()):
        assert p.grad is not None and q.grad is not None and o.grad is not None, name
        assert rel(p.grad, q.grad) < 1e-5 and rel(p.grad, o.grad) < 1e-5, name
