"""Tensor-parallel groups found in traced graphs: checked against what each model's code says, fx and export paths."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from partitioner.capture.graph import build_graph
from partitioner.capture.shardable import Shardable, find_shardable
from partitioner.capture.shardable_groups import divisors
from partitioner.capture.shardable_rules import view_dim
from partitioner.capture.trace import trace
from runtime.tensor_parallel_spec import ShardedParam, TensorParallelGroup
from tests import tp_worker, zoo

COL, ROW = ("colwise", 0, 1), ("rowwise", 1, 1)  # an nn.Linear's weight: output / input features split
COL_B, ROW_B = ("colwise", 0, 1), ("rowwise", None, 1)  # its bias: split with the outputs / added whole once
CONV_COL, CONV_ROW = ("colwise", 1, 1), ("rowwise", 0, 1)  # Hugging Face Conv1D's weight is [in, out]
VOCAB = ("vocab", 0, 1)
CONVOLUTION = "a convolution: kept data-parallel"


def found_in(case: str) -> Shardable:
    if case in tp_worker.MODELS:
        torch.manual_seed(0)
        model, args = tp_worker.MODELS[case]()
        gm, flat = tp_worker.traced(case, model, args)
    else:
        model, args, kwargs = zoo.ZOO[case]()
        traced = trace(model, args, kwargs)
        gm, flat = traced.graph_module, traced.flatten_inputs(args, kwargs)
    return find_shardable(gm, build_graph(gm, flat))


Row = tuple[str, str, tuple[int, ...], dict[str, Any]]  # name, kind, degrees, {parameter: (style, dim, fused)}


def table(found: Shardable) -> list[Row]:
    return [(g.name, g.kind, g.degrees, {p.name: (p.style, p.dim, p.fused) for p in g.params}) for g in found.groups]


def linear(prefix: str, style: str, bias: bool = True) -> dict[str, Any]:
    weight, b = (COL, COL_B) if style == "colwise" else (ROW, ROW_B)
    return {f"{prefix}.weight": weight, **({f"{prefix}.bias": b} if bias else {})}


def gpt_blocks(layers: int, heads: tuple[int, ...], width: int) -> list[Row]:
    """examples/models.py Block: qkv = Linear(w, 3w) split in three and viewed as heads, proj = Linear(w, w);
    mlp = Linear(w, 4w), GELU, Linear(4w, w)."""
    rows = []
    for i in range(layers):
        b = f"blocks.{i}"
        fused = {f"{b}.qkv.weight": ("colwise", 0, 3), f"{b}.qkv.bias": ("colwise", 0, 3)}
        rows.append((b, "attention", heads, {**fused, **linear(f"{b}.proj", "rowwise")}))
        rows.append((f"{b}.mlp", "mlp", divisors(4 * width),
                     {**linear(f"{b}.mlp.0", "colwise"), **linear(f"{b}.mlp.2", "rowwise")}))
    return rows


@pytest.mark.parametrize("case", ["gpt", "gpt_export"])
def test_example_gpt_on_the_fx_and_the_export_path(case: str) -> None:
    found = found_in(case)
    # GPTConfig(vocab=64, width=32, heads=4, layers=2, seq=8), head tied to tok: the export path names
    # the tied table by the name it kept (head.weight), fx by the first (tok.weight)
    tied = "tok.weight" if case == "gpt" else "head.weight"
    assert table(found) == [
        ("tok", "vocab", divisors(64), {tied: VOCAB}),
        ("pos", "embedding", divisors(8), {"pos.weight": VOCAB}),
        *gpt_blocks(2, (1, 2, 4), 32),
    ]
    assert found.unsplit == []
    attention = found.by_name()["blocks.0"]
    assert attention.sizes == {"features": 32, "heads": 4, "kv_heads": 4}
    assert attention.side_inputs and all(b == 8 * 8 for _, b in attention.side_inputs)  # the causal mask, whole


def test_example_gpt_costs_and_collectives() -> None:
    found = found_in("gpt").by_name()
    mlp, attention, tok = found["blocks.0.mlp"], found["blocks.0"], found["tok"]
    batch, seq, width, f32 = 4, 8, 32, 4
    activation = batch * seq * width * f32
    assert mlp.flops == 2 * 2 * batch * seq * width * 4 * width  # two Linears, 2 FLOPs per multiply-add
    assert mlp.weight_bytes == (width * 4 * width + 4 * width + 4 * width * width) * f32
    assert mlp.replicated_bytes == width * f32  # the rowwise bias, added once after the sum
    assert mlp.flops_per_rank(4) == mlp.flops / 4 and mlp.weight_bytes_per_rank(2) == mlp.weight_bytes / 2 + 128
    with pytest.raises(ValueError, match="cannot be split 3 ways"):
        attention.flops_per_rank(3)
    for group in (mlp, attention):
        assert [(c.kind, c.phase, c.bytes) for c in group.collectives] == [
            ("all_reduce", "forward", activation), ("all_reduce", "backward", activation)]
        assert [(c.kind, c.phase) for c in group.sequence_collectives] == [
            ("all_gather", "forward"), ("reduce_scatter", "forward"), ("reduce_scatter", "backward"),
            ("all_gather", "backward")]
        assert group.inputs[0][1] == activation and group.outputs[0][1] == activation
    assert attention.split_bytes > 0 and mlp.split_bytes == 2 * batch * seq * 4 * width * f32  # up, GELU
    # embedding: the looked-up rows are summed; LM head: the vocabulary-split logits gathered
    assert [(c.kind, c.phase, c.bytes) for c in tok.collectives] == [
        ("all_reduce", "forward", activation), ("all_gather", "forward", batch * seq * 64 * f32),
        ("all_reduce", "backward", activation)]


def test_llama_grouped_query_attention() -> None:
    found = found_in("llama")  # 4 heads, 2 KV heads, hidden 32, MLP 48, vocab 64, not tied
    rows = [("model.embed_tokens", "embedding", divisors(64), {"model.embed_tokens.weight": VOCAB})]
    for i in range(2):
        a, m = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        rows.append((a, "attention", (1, 2), {  # whole KV heads: t divides 2
            **linear(f"{a}.q_proj", "colwise", False), **linear(f"{a}.k_proj", "colwise", False),
            **linear(f"{a}.v_proj", "colwise", False), **linear(f"{a}.o_proj", "rowwise", False)}))
        rows.append((m, "mlp", divisors(48), {
            **linear(f"{m}.gate_proj", "colwise", False), **linear(f"{m}.up_proj", "colwise", False),
            **linear(f"{m}.down_proj", "rowwise", False)}))
    rows.append(("lm_head", "head", divisors(64), {"lm_head.weight": COL}))
    assert table(found) == rows
    assert found.by_name()["model.layers.0.self_attn"].sizes == {"features": 16, "heads": 4, "kv_heads": 2}
    assert found.by_name()["lm_head"].sizes == {"vocab": 64}
    assert found.unsplit == []


def gpt2_rows(layers: int, heads: tuple[int, ...]) -> list[Row]:
    """GPT-2: c_attn = Conv1D(3w) split in q, k, v; c_proj = Conv1D(w); mlp c_fc = Conv1D(4w), c_proj; wte tied."""
    rows: list[Row] = [
        ("transformer.wte", "vocab", divisors(64), {"lm_head.weight": VOCAB}),
        ("transformer.wpe", "embedding", divisors(16), {"transformer.wpe.weight": VOCAB}),
    ]
    for i in range(layers):
        h = f"transformer.h.{i}"
        rows.append((f"{h}.attn", "attention", heads, {
            f"{h}.attn.c_attn.weight": ("colwise", 1, 3), f"{h}.attn.c_attn.bias": ("colwise", 0, 3),
            f"{h}.attn.c_proj.weight": CONV_ROW, f"{h}.attn.c_proj.bias": ROW_B}))
        rows.append((f"{h}.mlp", "mlp", divisors(128), {
            f"{h}.mlp.c_fc.weight": CONV_COL, f"{h}.mlp.c_fc.bias": COL_B,
            f"{h}.mlp.c_proj.weight": CONV_ROW, f"{h}.mlp.c_proj.bias": ROW_B}))
    return rows


def test_gpt2_conv1d_and_fused_qkv() -> None:
    assert table(found_in("gpt2")) == gpt2_rows(2, (1, 2, 4))  # n_head=4
    assert table(found_in("hf_gpt2")) == gpt2_rows(2, (1, 2))  # tests/zoo.py: n_head=2


def test_cnn_fully_connected_stack() -> None:
    found = found_in("cnn")
    # classifier: Dropout, Linear(64, 64), ReLU, Dropout, Linear(64, 64), ReLU, Linear(64, 10)
    assert table(found) == [
        ("classifier", "mlp", divisors(64), {**linear("classifier.1", "colwise"), **linear("classifier.4", "rowwise")}),
        ("classifier.6", "head", divisors(10), linear("classifier.6", "colwise")),
    ]
    assert [(u.nodes, u.reason.startswith(CONVOLUTION)) for u in found.unsplit] == [
        (("features_0",), True), (("features_3",), True)]
    assert [(c.kind, c.phase) for c in found.groups[1].collectives] == [("all_gather", "forward"),
                                                                        ("all_reduce", "backward")]


def test_zoo_models() -> None:
    # MLP: 5 x (Linear(32, 32), GELU), Linear(32, 10): paired from the input side, the last with the head
    assert table(found_in("mlp")) == [
        ("body.0..body.2", "mlp", divisors(32), {**linear("body.0", "colwise"), **linear("body.2", "rowwise")}),
        ("body.4..body.6", "mlp", divisors(32), {**linear("body.4", "colwise"), **linear("body.6", "rowwise")}),
        ("body.8..head", "mlp", divisors(32), {**linear("body.8", "colwise"), **linear("head", "rowwise")}),
    ]
    tiny = found_in("tiny_gpt")  # vocab 50, width 32, 4 heads, 3 layers; pos is a Parameter, not an embedding
    assert table(tiny) == [("tok", "vocab", divisors(50), {"tok.weight": VOCAB}), *gpt_blocks(3, (1, 2, 4), 32)]
    # KeywordDict: tanh(enc(x) + ctx(c)) is returned ('features') and summed: enc and ctx stay whole
    keyword = found_in("keyword_dict")
    assert table(keyword) == [("out", "head", (1, 3), linear("out", "colwise"))]
    assert [(u.nodes, "reduces over the split dimension" in u.reason) for u in keyword.unsplit] == [
        (("enc",), True), (("ctx",), True)]
    # InPlace: layers[0]'s output meets g (from layers[4], learned) whole: its gradient would come back split
    in_place = found_in("in_place")
    assert table(in_place) == [
        ("layers.1..layers.2", "mlp", divisors(8), {**linear("layers.1", "colwise"), **linear("layers.2", "rowwise")}),
        ("layers.3..layers.4", "mlp", divisors(8), {**linear("layers.3", "colwise"), **linear("layers.4", "rowwise")}),
        ("layers.5", "head", divisors(8), linear("layers.5", "colwise")),
    ]
    assert [(u.nodes, "whole across the split dimension" in u.reason) for u in in_place.unsplit] == [
        (("layers_0",), True)]
    assert table(found_in("mode_dependent")) == [
        ("a..b", "mlp", divisors(6), {**linear("a", "colwise"), **linear("b", "rowwise")}),
        ("c", "head", divisors(6), linear("c", "colwise")),
    ]
    rescnn = found_in("rescnn")
    assert table(rescnn) == [("fc", "head", (1, 5), linear("fc", "colwise"))]
    assert len(rescnn.unsplit) == 7 and all(u.reason.startswith(CONVOLUTION) for u in rescnn.unsplit)


class FusedGQA(nn.Module):
    """q, k and v of grouped-query attention in one Linear: parts of unequal sizes (4 heads, 2 KV heads of 8)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(32, (4 + 2 + 2) * 8)
        self.out = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).split([32, 16, 16], dim=-1)
        q = q.view(b, t, 4, 8).transpose(1, 2)
        k, v = (z.view(b, t, 2, 8).transpose(1, 2).repeat_interleave(2, dim=1) for z in (k, v))
        y = torch.softmax(q @ k.transpose(-2, -1), dim=-1) @ v
        return self.out(y.transpose(1, 2).reshape(b, t, 32))


def test_a_group_that_cannot_be_split_says_why() -> None:
    model, x = FusedGQA(), torch.randn(2, 5, 32)
    traced = trace(model, (x,))
    found = find_shardable(traced.graph_module, build_graph(traced.graph_module, [x]))
    assert table(found) == [("out", "head", divisors(32), linear("out", "colwise"))]
    assert [u.nodes for u in found.unsplit] == [("qkv",)]
    assert "unequal parts" in found.unsplit[0].reason


def test_view_dim() -> None:
    assert view_dim((2, 8, 32), (2, 8, 4, 8), 2) == 2  # hidden -> heads
    assert view_dim((2, 8, 4, 8), (2, 8, 32), 2) == 2  # heads -> hidden
    assert view_dim((16, 96), (2, 8, 96), 1) == 2  # Conv1D's 2-D output back to 3-D
    assert view_dim((2, 8, 4, 8), (2, 8, 32), 3) is None  # the head size is not where the hidden starts
    assert view_dim((2, 4, 1, 8, 8), (2, 4, 8, 8), 1) == 1  # an unsqueezed dim dropped


def test_specs_round_trip_as_plain_data() -> None:
    found = found_in("gpt")
    for spec in found.specs():
        assert TensorParallelGroup.from_dict(spec.to_dict()) == spec
    assert [s.name for s in found.specs(degree=8)] == ["tok", "pos", "blocks.0.mlp", "blocks.1.mlp"]
    mlp = found.by_name()["blocks.0.mlp"]
    assert [g.name for g in found.within(mlp.nodes)] == ["blocks.0.mlp"]  # a stage holding just those nodes
    assert found.within(mlp.nodes[1:]) == []  # a cut inside a group: it cannot be split in either stage
    with pytest.raises(ValueError, match="fused"):
        ShardedParam("w", "colwise", None, fused=3)
    with pytest.raises(ValueError, match="style"):
        ShardedParam("w", "diagonal", 0)  # type: ignore[arg-type]
