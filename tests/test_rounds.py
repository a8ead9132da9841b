"""Rounds of node timing: the values one real forward recorded (in-place writes seen, inputs as their nodes read
them), nodes that raise alone reported and timed inside whole forwards, the model's gradients left as they were."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.fx
from torch import nn

from cost_model.progress import Progress
from cost_model.rounds import Recorded, Rounds, record, time_in_forward
from cost_model.timing import NodeRunner, Timer

CPU = torch.device("cpu")


class Later(nn.Module):
    """`first` reads b, `b.add_` writes into it afterwards, `second` reads the result."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = x * 1
        first = b.sum()
        b.add_(100)
        return first + b.sum()


def test_record_sees_writes_and_keeps_what_each_node_read() -> None:
    gm = torch.fx.symbolic_trace(Later())
    x = torch.ones(3)
    recorded = record(gm, [x], CPU)
    assert recorded.writes == {"add_"}
    assert set(recorded.seen) == {"sum_1"}  # read b before add_ changed it (add_ writes it itself: run on copies)
    torch.testing.assert_close(recorded.seen["sum_1"]["mul"], torch.ones(3))
    torch.testing.assert_close(recorded.values["mul"], torch.full((3,), 101.0))  # after the run
    torch.testing.assert_close(x, torch.ones(3))  # the caller's input untouched


def test_record_of_a_graph_without_in_place_writes_runs_once() -> None:
    gm, inputs = net()
    calls = []
    gm.boom.register_forward_hook(lambda *_: calls.append(1))
    recorded = record(gm, inputs, CPU)
    assert recorded.writes == frozenset() and recorded.seen == {} and len(calls) == 1


def test_a_node_runner_runs_a_writing_node_on_copies() -> None:
    """torch.export's `aten.add_.Tensor` does not end in "_": its schema says it writes."""
    graph = torch.fx.Graph()
    b, step = graph.placeholder("b"), graph.placeholder("step")
    graph.output(graph.call_function(torch.ops.aten.add_.Tensor, (b, step)))
    gm = torch.fx.GraphModule(nn.Module(), graph)
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    values = {"b": torch.zeros(4, dtype=torch.long), "step": torch.arange(4)}
    runner = NodeRunner(node, gm, values, CPU)
    assert runner.inplace
    for _ in range(3):
        runner.run_once()
    assert values["b"].tolist() == [0, 0, 0, 0]


class Boom(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.boom, self.out = nn.Linear(4, 4), Boom(), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.boom(self.fc(x))))


class Leaves(torch.fx.Tracer):
    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return isinstance(m, Boom) or super().is_leaf_module(m, qualname)


def net() -> tuple[torch.fx.GraphModule, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = Net()
    return torch.fx.GraphModule(model, Leaves().trace(model)), [torch.randn(8, 4)]


def rounds(warmup: int = 1, repeats: int = 2) -> Rounds:
    return Rounds(CPU, warmup, repeats, Timer(CPU), Progress("test", 0, bar=False))


def raising_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    run_once = NodeRunner.run_once

    def run(self: NodeRunner) -> Any:
        if isinstance(self.fn, Boom):
            raise IndexError("index out of range in self")
        return run_once(self)

    monkeypatch.setattr(NodeRunner, "run_once", run)


def test_rounds_report_a_node_that_raises_alone_and_time_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    gm, inputs = net()
    nodes = [n for n in gm.graph.nodes if n.op in ("call_module", "call_function")]
    raising_alone(monkeypatch)
    timed = rounds()
    failed = timed.time(gm, nodes, record(gm, inputs, CPU))
    assert failed == {"boom": "IndexError: index out of range in self"}
    assert sorted(timed.runs) == ["fc", "out", "tanh"] and all(len(r) == 2 for r in timed.runs.values())
    assert all(p.grad is None for p in gm.parameters())


def test_out_of_memory_alone_is_not_a_node_that_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    gm, inputs = net()

    def full(self: NodeRunner) -> Any:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory.")

    monkeypatch.setattr(NodeRunner, "run_once", full)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        rounds().time(gm, list(gm.graph.nodes)[1:-1], record(gm, inputs, CPU))


def test_time_in_forward_times_forward_and_backward_and_restores_gradients() -> None:
    gm, inputs = net()
    nodes = [n for n in gm.graph.nodes if n.name in ("boom", "fc")]
    gm.fc.weight.grad = torch.ones_like(gm.fc.weight)
    timed = rounds(warmup=1, repeats=3)
    time_in_forward(timed, gm, inputs, nodes)
    assert sorted(timed.runs) == ["boom", "fc"] and timed.in_forward == {"boom", "fc"}
    assert all(len(r) == 3 and all(f > 0 and b > 0 for f, b in r) for r in timed.runs.values())
    assert torch.equal(gm.fc.weight.grad, torch.ones_like(gm.fc.weight)) and gm.out.weight.grad is None
    forward, backward = timed.times(nodes)
    assert set(forward) == set(backward) == {"boom", "fc"}
    assert timed.progress.done == 0.0  # a progress of total 0 counts nothing


def test_a_node_returning_its_input_has_no_backward_of_its_own() -> None:
    class Same(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(x).contiguous()  # contiguous already: the same tensor, tanh's autograd node

    gm = torch.fx.symbolic_trace(Same())
    timed = rounds()
    x = torch.randn(4, requires_grad=True)
    time_in_forward(timed, gm, [x], [n for n in gm.graph.nodes if n.name == "contiguous"])
    assert all(b == 0.0 for _, b in timed.runs["contiguous"]) and x.grad is None


def test_recorded_defaults_are_empty() -> None:
    recorded = Recorded({"x": 1})
    assert recorded.seen == {} and recorded.writes == frozenset()
