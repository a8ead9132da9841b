"""Tracing: fx first with non-tensor arguments fixed, export as fallback, one clear error when both fail."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch import nn

from partitioner.capture.trace import trace
from partitioner.errors import TraceError
from tests import zoo


def test_fx_is_used_where_it_works_and_graph_matches_model() -> None:
    model, (x,), _ = zoo.mlp()
    traced = trace(model, (x,))
    assert traced.method == "fx"
    assert torch.equal(traced.graph_module(*traced.flatten_inputs((x,), {})), model(x))


def test_optional_none_argument_is_fixed_not_traced_as_a_tensor() -> None:
    model, (x,), kwargs = zoo.keyword_dict()
    traced = trace(model, (x,), kwargs)
    assert traced.method == "fx"
    flat = traced.flatten_inputs((x,), kwargs)
    assert flat[2] is None  # scale: left at its default, the `if scale is not None` branch not taken
    out = traced.graph_module(*flat)
    ref = model(x, **kwargs)
    assert torch.equal(out["logits"], ref["logits"])


def test_tied_modules_are_traced_through_so_the_weight_is_a_get_attr() -> None:
    model, (idx,), _ = zoo.tiny_gpt()
    gm = trace(model, (idx,)).graph_module
    modules = {n.target for n in gm.graph.nodes if n.op == "call_module"}
    attrs = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    assert "head" not in modules and "tok" not in modules
    assert "tok.weight" in attrs
    assert "blocks.0.qkv" in modules  # untied leaves stay modules
    assert any(t.endswith("mask") for t in attrs)  # buffers are proxied, not baked constants


def test_module_called_twice_is_traced_through() -> None:
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(torch.relu(self.lin(x)))

    gm = trace(Twice(), (torch.randn(2, 4),)).graph_module
    assert not [n for n in gm.graph.nodes if n.op == "call_module"]


def test_export_fallback_for_transformers_gpt2() -> None:
    pytest.importorskip("transformers")
    model, (idx,), _ = zoo.hf_gpt2()
    traced = trace(model, (idx,))
    assert traced.method == "export"
    assert len(traced.flatten_inputs((idx[:3],), {})) == 1
    result = traced.graph_module(idx[:3])  # another batch size: the batch dimension is dynamic
    expected = model(idx[:3])
    assert type(result) is type(expected)
    assert torch.allclose(result.logits, expected.logits, atol=1e-6)


def test_both_tracers_fail_with_one_error() -> None:
    class Branchy(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.max() > 0:
                return x * 2
            return x

    with pytest.raises(TraceError, match=r"cannot trace Branchy:(.|\n)*test_trace.py:\d+ in forward"):
        trace(Branchy(), (torch.randn(3, 2),))


def test_custom_function_is_one_leaf_node_and_markers_become_cut_marks() -> None:
    model, (x,), _ = zoo.custom_functions()
    gm = trace(model, (x,)).graph_module
    leaves = [n for n in gm.graph.nodes if n.op == "call_function" and n.target.__name__.endswith("_apply")]
    assert [n.target.__name__ for n in leaves] == ["StraightThrough_apply", "CountingFn_apply", "ScaleSplit_apply"]
    assert leaves[2].args[1:] == (0.5, True)  # non-tensor arguments are constants of the node
    assert torch.allclose(gm(x), model(x))
    markers, (y,), _ = zoo.markers()
    gm = trace(markers, (y,)).graph_module
    assert [n.target for n in gm.graph.nodes if n.meta.get("cut_before")] == ["rest.0"]
    assert not any("pipe_split" in str(n.target) for n in gm.graph.nodes)  # the marker itself runs nowhere


def test_export_leaves_the_model_tensors_free_to_swap_and_its_own() -> None:
    pytest.importorskip("transformers")
    model, (idx,), _ = zoo.hf_gpt2()
    traced = trace(model, (idx,))
    assert traced.method == "export"
    ours = {id(t) for t in [*model.parameters(), *model.buffers()]}
    assert {id(t) for t in [*traced.graph_module.parameters(), *traced.graph_module.buffers()]} <= ours
    for t in [*model.parameters(), *model.buffers()]:  # runtime.materialize and capture.meta swap them
        assert not weakref.getweakrefs(t)


def test_export_keeps_the_sequence_length_free() -> None:
    pytest.importorskip("transformers")
    model, (idx,), _ = zoo.hf_gpt2()
    model.eval()
    traced = trace(model, (idx,))
    shorter = idx[:3, :6]
    assert torch.allclose(traced.graph_module(*traced.flatten_inputs((shorter,), {})).logits, model(shorter).logits,
                          atol=1e-6)


def test_a_returned_cache_is_named_with_its_fix() -> None:
    class Cache:
        def __init__(self, t: torch.Tensor) -> None:
            self.t = t

    class ReturnsCache(nn.Module):
        def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, Cache]:
            return inputs[0] * 2, Cache(inputs[0])

    with pytest.raises(TraceError, match=r"forward returns a .*Cache .*use_cache=False") as caught:
        trace(ReturnsCache(), (torch.randn(3, 2),))
    assert "torch.where" not in str(caught.value)


def test_only_real_side_effects_warn() -> None:
    class Counting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.calls = 0
            self.shape = (2,)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            self.shape = (2,)  # an equal value: no side effect anyone sees
            return self.lin(x)

    with pytest.warns(UserWarning, match=r"forward set calls while being traced"):
        trace(Counting(), (torch.randn(3, 2),))
