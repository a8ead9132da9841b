"""Chunks of graph nodes within a memory budget, and their device copies (the meta device stands in for a GPU)."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
from torch import nn

from cost_model.chunks import ChunkModules, default_budget, model_bytes, move_value, node_bytes, plan_chunks, to_device
from cost_model.timing import materialize

CPU = torch.device("cpu")
META = torch.device("meta")


class Tied(nn.Module):
    """Two linears sharing one weight, a ReLU between."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def traced() -> tuple[torch.fx.GraphModule, list[torch.fx.Node], dict[str, Any]]:
    torch.manual_seed(0)
    gm = torch.fx.symbolic_trace(Tied())
    values = materialize(gm, [torch.randn(2, 4)])
    return gm, [n for n in gm.graph.nodes if n.op.startswith("call")], values


def test_node_bytes_counts_weights_with_gradients_and_the_values_read_and_written() -> None:
    gm, nodes, values = traced()
    a, relu, b = nodes
    # weight 64 B and bias 16 B, each twice (gradients), input 2x4 floats (32 B), output 32 B.
    assert node_bytes(gm, a, values) == 2 * (64 + 16) + 32 + 32
    assert node_bytes(gm, relu, values) == 32 + 32
    assert model_bytes(gm) == 2 * (64 + 16 + 16)  # the tied weight once
    assert model_bytes(gm, META) == 0


def test_plan_chunks_is_greedy_in_graph_order() -> None:
    gm, nodes, values = traced()

    def names(budget: int) -> list[tuple[list[str], bool]]:
        return [([n.name for n in c.nodes], c.too_big) for c in plan_chunks(gm, nodes, values, budget)]

    assert names(10**9) == [(["a", "relu", "b"], False)]
    assert names(224 + 64) == [(["a", "relu"], False), (["b"], False)]
    assert names(224) == [(["a"], False), (["relu"], False), (["b"], False)]
    assert names(100) == [(["a"], True), (["relu"], False), (["b"], True)]  # a linear alone is over 100 B


def test_to_device_keeps_what_is_there_and_copies_the_rest() -> None:
    p = nn.Parameter(torch.ones(3))
    assert to_device(p, CPU) is p
    moved = to_device(p, META)
    assert isinstance(moved, nn.Parameter) and moved.requires_grad and moved.device == META
    frozen = to_device(torch.ones(3), META)
    assert not isinstance(frozen, nn.Parameter) and not frozen.requires_grad
    activation = torch.ones(3, requires_grad=True) * 2
    assert to_device(activation, META).requires_grad  # the profiler reads the flag


def test_move_value_reads_the_home_device_as_the_target() -> None:
    value = (torch.ones(2), CPU, torch.device("cuda", 3), 7)
    moved = move_value(value, META, CPU)
    assert moved[0].device == META and moved[1:] == (META, torch.device("cuda", 3), 7)


def test_chunk_modules_copy_once_and_leave_the_model() -> None:
    gm, nodes, _ = traced()
    a, relu, b = nodes
    original = {k: v.clone() for k, v in gm.state_dict().items()}
    on_cpu = ChunkModules(gm, nodes, CPU)
    assert on_cpu.get_submodule("a") is gm.a  # already there: the module itself
    copies = ChunkModules(gm, [a, relu, b], META)
    ca, cb = copies.get_submodule("a"), copies.get_submodule("b")
    assert ca is not gm.a and ca.weight.device == META
    assert ca.weight is cb.weight  # the tied weight copied once
    assert all(t.device == CPU for t in gm.state_dict().values())
    assert all(torch.equal(v, original[k]) for k, v in gm.state_dict().items())


def test_default_budget_has_no_limit_off_gpu() -> None:
    gm, _, _ = traced()
    assert default_budget(gm, CPU) is None
