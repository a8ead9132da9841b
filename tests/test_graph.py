"""The annotated graph: shapes, bytes, FLOPs and owners per node; the model is left untouched."""

from __future__ import annotations

import torch
from torch import nn

from partitioner.capture.graph import build_graph, compute_nodes
from partitioner.capture.trace import trace
from tests import zoo


def test_linear_node_attributes() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
    x = torch.randn(5, 8)
    traced = trace(model, (x,))
    g = build_graph(traced.graph_module, [x])
    lin = g.nodes["_0"]
    assert lin["op"] == "call_module" and lin["module"] == "0"
    assert lin["shapes"] == [(5, 16)] and lin["dtypes"] == ["float32"]
    assert lin["out_bytes"] == 5 * 16 * 4
    assert lin["param_bytes"] == (8 * 16 + 16) * 4
    assert lin["flops"] == 2 * 5 * 8 * 16
    assert g.nodes["_1"]["flops"] == 0
    assert list(g.successors("input_1")) == ["_0"] and g.edges["_0", "_1"]["bytes"] == 5 * 16 * 4
    assert [n.name for n in compute_nodes(traced.graph_module)] == ["_0", "_1"]


def test_tied_weight_bytes_counted_once() -> None:
    model, (idx,), _ = zoo.tiny_gpt()
    traced = trace(model, (idx,))
    g = build_graph(traced.graph_module, [idx])
    total = sum(d["param_bytes"] for _, d in g.nodes(data=True))
    expected = sum(p.numel() * 4 for p in model.parameters())
    expected += sum(b.numel() * b.element_size() for b in model.buffers())
    assert total == expected


def test_owning_module_paths_from_export() -> None:
    model, (idx,), _ = zoo.hf_gpt2()
    traced = trace(model, (idx,))
    g = build_graph(traced.graph_module, [idx])
    modules = {d["module"] for _, d in g.nodes(data=True)}
    assert "transformer.h.0.attn" in modules or any(m.startswith("transformer.h.0") for m in modules)


def test_building_the_graph_leaves_batchnorm_statistics_and_rng_alone() -> None:
    model, (x,), _ = zoo.rescnn()
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    traced = trace(model, (x,))
    build_graph(traced.graph_module, [x])
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert torch.equal(torch.get_rng_state(), rng)
