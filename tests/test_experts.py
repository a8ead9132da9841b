"""partitioner.capture.experts: the MoE layers of a graph that expert parallelism splits, and those left whole."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from partitioner.capture.experts import find_experts
from partitioner.capture.trace import trace
from tests import zoo

pytest.importorskip("transformers")


@pytest.mark.parametrize("family, router", [("mixtral", "mlp.gate"), ("qwen3_moe", "mlp.gate"),
                                            ("gpt_oss", "mlp.router")])
def test_hugging_face_moe_layers_split_with_their_router_whole(family: str, router: str) -> None:
    case = zoo.hf_case(family)
    case.config.use_cache = False
    model = case.build()
    gm = trace(model, (torch.randint(0, 128, (2, 8)),)).graph_module  # torch.export: a stack is one node
    found = find_experts(gm, model)
    assert [layer.path for layer in found.layers] == [f"model.layers.{k}.mlp.experts" for k in range(2)]
    assert all(layer.experts == 4 and layer.top_k == 2 and layer.degrees == (1, 2, 4) for layer in found.layers)
    assert [layer.router for layer in found.layers] == [f"model.layers.{k}.{router}" for k in range(2)]
    assert not found.whole and "splits over 2/4 ranks, the router stays whole" in found.report()
    assert found.within([found.layers[1].node]) == [found.layers[1]] and found.degrees() == (1, 2, 4)


def test_a_plain_pytorch_moe_is_one_node_on_the_fx_path_and_splits() -> None:
    model = zoo.PlainMoEModel()
    traced = trace(model, (torch.randint(0, 64, (2, 8)),))
    gm = traced.graph_module
    calls = [n for n in gm.graph.nodes if n.op == "call_module" and str(n.target).endswith("experts")]
    assert [str(n.target) for n in calls] == ["moes.0.experts", "moes.1.experts"]  # a leaf each, not inlined
    found = find_experts(gm, model)
    assert [(e.path, e.experts, e.top_k, e.router, e.params) for e in found.layers] == [
        (f"moes.{k}.experts", 4, 2, f"moes.{k}.router", ("w_in", "w_out")) for k in range(2)]


class _Unsigned(nn.Module):
    """A stack of experts without `num_experts`: each rank could not run it over its own experts."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 8, 8))
        self.v = nn.Parameter(torch.randn(4, 8, 8))

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return x @ self.w.sum(0) @ self.v.sum(0) * weights.sum(-1, keepdim=True)


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(8, 4)
        self.experts = _Unsigned()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, index = torch.topk(self.router(x), 2, dim=-1)
        return self.experts(x, index, weights)


def test_a_stack_it_cannot_run_per_rank_stays_whole_with_the_reason() -> None:
    model = _Model()
    found = find_experts(trace(model, (torch.randn(4, 8),)).graph_module, model)
    assert not found.layers and len(found.whole) == 1
    assert found.whole[0].path == "experts" and "num_experts (None) is not the 4 experts" in found.whole[0].reason
