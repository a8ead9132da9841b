"""Stage building: boundaries, skips straight to their reader, weights moved in place and back."""

from __future__ import annotations

import pytest
import torch

import runtime.stage
from partitioner.capture.graph import compute_nodes
from partitioner.capture.trace import trace
from runtime.plan import Plan, StagePlan
from runtime.stage import build_stages
from runtime.stage_weights import tensor_stages
from tests import zoo


def split_plan(gm: torch.fx.GraphModule, devices: list[str], bounds: list[int]) -> Plan:
    order = [n.name for n in compute_nodes(gm)]
    return Plan([StagePlan(i, d, order[a:b]) for i, (d, a, b) in enumerate(zip(devices, bounds, bounds[1:]))])


def test_skip_goes_straight_to_the_stage_that_reads_it() -> None:
    model, (x,), _ = zoo.inception()
    gm = trace(model, (x,)).graph_module
    n = len(compute_nodes(gm))
    stages, _ = build_stages(gm, split_plan(gm, ["cpu"] * 3, [0, 2, n - 3, n]))
    # the input x is read by the first branch (stage 0), later branches (stage 1) and the residual add
    assert "x" in stages[0].inputs and "x" in stages[1].inputs
    produced = {name for s in stages for name in s.outputs}
    for s in stages:
        assert all(name == "x" or name in produced for name in s.inputs)


def test_weights_are_owned_by_the_stage_that_reads_them_first() -> None:
    model, (idx,), _ = zoo.tiny_gpt()
    gm = trace(model, (idx,)).graph_module
    plan = split_plan(gm, ["cpu", "meta"], [0, len(compute_nodes(gm)) // 2, len(compute_nodes(gm))])
    readers = tensor_stages(gm, plan.stage_of())
    assert readers[id(model.tok.weight)][1] == [0, 1]  # the tied embedding: read by both, owned by 0
    assert readers[id(model.blocks[-1].mlp[0].weight)][1] == [1]
    assert readers[id(model.blocks[0].qkv.weight)][1] == [0]


def test_tied_weight_read_by_a_later_stage_on_another_device_is_copied_there(monkeypatch: pytest.MonkeyPatch) -> None:
    model, (idx,), _ = zoo.tiny_gpt()
    gm = trace(model, (idx,)).graph_module
    n = len(compute_nodes(gm))
    monkeypatch.setattr(runtime.stage, "_move", lambda t, d: None)  # no second device on a CPU machine
    stages, _ = build_stages(gm, split_plan(gm, ["cpu", "meta"], [0, n // 2, n]))
    copies = [node for node in stages[1].module.graph.nodes if node.op == "call_method" and node.target == "to"]
    assert [c.args[0].target for c in copies] == ["tok.weight"]
    assert not [node for node in stages[0].module.graph.nodes if node.op == "call_method" and node.target == "to"]


def test_undo_restores_the_original_storage(monkeypatch: pytest.MonkeyPatch) -> None:
    model, (idx,), _ = zoo.tiny_gpt()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = {id(p) for p in model.parameters()}
    gm = trace(model, (idx,)).graph_module
    n = len(compute_nodes(gm))

    def fake_move(t: torch.Tensor, device: torch.device) -> None:  # a "move" that changes storage
        t.data = torch.zeros_like(t.data)

    monkeypatch.setattr(runtime.stage, "_move", fake_move)
    monkeypatch.setattr(runtime.stage.torch, "device", _always_different(torch.device))
    _, undo = build_stages(gm, split_plan(gm, ["cpu", "cpu"], [0, n // 2, n]))
    assert float(model.tok.weight.detach().abs().sum()) == 0.0
    undo()
    assert {id(p) for p in model.parameters()} == params
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def _always_different(real: type) -> object:
    """A torch.device stand-in whose instances never equal a tensor's device, forcing moves."""

    class Elsewhere:
        def __init__(self, *args: object) -> None:
            self.real = real(*args)
            self.type = "elsewhere"

        def __eq__(self, other: object) -> bool:
            return isinstance(other, Elsewhere) and other.real == self.real

        def __hash__(self) -> int:
            return hash(self.real)

    return Elsewhere
