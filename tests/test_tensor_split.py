"""A graph as t tensor ranks run it (partitioner.place.search.tensor_split) and a model's blocks, on the example GPT."""

from __future__ import annotations

import networkx as nx
import pytest
import torch

from cost_model.analytic import AnalyticCostModel
from cost_model.cluster_shape import Cluster
from examples.models import make_gpt
from partitioner.arguments import cluster_devices
from partitioner.capture.graph import build_graph, compute_nodes
from partitioner.capture.shardable import Shardable, find_shardable
from partitioner.capture.trace import trace
from partitioner.place.cluster.prepare import cluster_problem
from partitioner.place.search.blocks import block_cuts, block_ids
from partitioner.place.search.degrees import crossing, split_groups
from partitioner.place.search.tensor_split import collective_seconds, split_graph, split_problem


@pytest.fixture(scope="module")
def gpt() -> tuple[nx.DiGraph, list[str], Shardable]:
    torch.manual_seed(0)
    model, (x,) = make_gpt(batch=16)  # width 128, 4 heads, vocab 512, 4 blocks, sequence 64
    traced = trace(model, (x,), {})
    graph = build_graph(traced.graph_module, [x])
    order = [n.name for n in compute_nodes(traced.graph_module)]
    return graph, order, find_shardable(traced.graph_module, graph)


def test_blocks_by_module_path() -> None:
    modules = ["", "tok", "blocks.0.a", "blocks.0.b", "blocks.1.a", "blocks.2", "blocks.3.x", "blocks.3.y", "ln",
               "head"]
    assert block_ids(modules) == [-1, -1, 0, 0, 1, 2, 3, 3, -1, -1]
    assert block_cuts(modules).tolist() == [0, 1, 2, 4, 5, 6, 8, 9, 10]  # type: ignore[union-attr]
    assert block_ids(["a.0", "a.1", "a.2"]) == [-1, -1, -1] and block_cuts(["a.0", "a.1", "a.2"]) is None


def test_groups_a_cut_would_cross_stay_whole(gpt: tuple[nx.DiGraph, list[str], Shardable]) -> None:
    graph, order, shardable = gpt
    cuts = block_cuts([str(graph.nodes[x].get("module", "")) for x in order])
    names = [g.name for g in split_groups(shardable, 2, order, cuts)]
    # the tied embedding and LM head (one vocabulary group) sit at both ends: every block cut crosses it
    assert "tok" not in names and "pos" in names and "blocks.0" in names and "blocks.3.mlp" in names
    assert split_groups(shardable, 8, order, cuts) == [g for g in shardable.groups
                                                        if g.name in ("pos", "blocks.0.mlp", "blocks.1.mlp",
                                                                      "blocks.2.mlp", "blocks.3.mlp")]  # 4 heads
    attention = next(g for g in shardable.groups if g.name == "blocks.0")
    inside = crossing([attention], order).tolist()
    first, last = order.index("blocks_0_qkv"), order.index("blocks_0_proj")
    assert inside == list(range(first + 1, last + 1))


def test_split_layers_by_role(gpt: tuple[nx.DiGraph, list[str], Shardable]) -> None:
    graph, order, shardable = gpt
    attention = next(g for g in shardable.groups if g.name == "blocks.0")
    split = split_graph(graph, [attention], 2)
    qkv, proj, scores = split.nodes["blocks_0_qkv"], split.nodes["blocks_0_proj"], split.nodes["matmul"]
    assert (qkv["flops"], qkv["shapes"], qkv["out_bytes"]) == (50331648, [(16, 64, 192)], 1572864 / 2)  # N / 2
    assert (proj["flops"], proj["shapes"], proj["out_bytes"]) == (16777216, [(16, 64, 128)], 524288)  # rowwise: K / 2
    assert scores["shapes"] == [(16, 2, 64, 64)]  # attention by whole heads
    # weights: 263680 split + 512 replicated (the rowwise bias), a share of (131840 + 512) / 264192 = 0.5
    assert qkv["param_bytes"] == 99264.0 and proj["param_bytes"] == 33088.0
    assert graph.nodes["blocks_0_qkv"]["flops"] == 100663296  # the graph itself is left as it was
    tok = next(g for g in shardable.groups if g.name == "tok")
    holder = next(n for n, a in graph.nodes(data=True) if a["op"] == "get_attr" and a["target"] == "tok.weight")
    assert split_graph(graph, [tok], 4).nodes[holder]["param_bytes"] == 262144 / 4  # vocabulary rows / 4


def test_collectives_of_a_group_per_micro_batch(gpt: tuple[nx.DiGraph, list[str], Shardable]) -> None:
    graph, _, shardable = gpt
    attention = next(g for g in shardable.groups if g.name == "blocks.0")
    # forward: all-reduce the projection's 524288 bytes (whole batch of 16) -> 262144 for 8 samples; backward: ln1's
    forward, backward = collective_seconds(graph, attention, (1e-5, 1e-9), 8)
    assert forward == pytest.approx(1e-5 + 262144e-9) and backward == pytest.approx(1e-5 + 262144e-9)


def test_the_problem_as_each_tensor_rank_runs_it(gpt: tuple[nx.DiGraph, list[str], Shardable]) -> None:
    graph, order, shardable = gpt
    cluster = Cluster.parse("1x8xH100")
    cost = AnalyticCostModel(cluster_devices(cluster)[2])
    plain = cluster_problem(graph, order, torch.device("cuda:0"), cost, [1, 2, 4])
    groups = split_groups(shardable, 2, order, block_cuts([str(graph.nodes[x].get("module", "")) for x in order]))
    half = split_problem(plain, graph, order, torch.device("cuda:0"), cost, 2, groups, (0.0, 0.0))
    mlp = order.index("blocks_0_mlp_0")
    for size in (16, 8, 4):  # a GEMM of half the width takes more than half the time (its efficiency falls)
        whole, split = plain.size_times[size][0, mlp], half.size_times[size][0, mlp]  # type: ignore[index]
        assert whole / 2 < split < whole
    assert half.param_bytes.sum() < 0.6 * plain.param_bytes.sum()
    assert half.saved_bytes.sum() < plain.saved_bytes.sum()
    ringed = split_problem(plain, graph, order, torch.device("cuda:0"), cost, 2, groups, (1e-3, 0.0))
    last = order.index("blocks_0_proj")  # each group's collectives land on its last node: 2 x 1 ms
    assert ringed.size_times[16][0, last] - half.size_times[16][0, last] == pytest.approx(2e-3)  # type: ignore[index]


def test_sequence_parallelism_splits_the_other_nodes_by_the_sequence(
        gpt: tuple[nx.DiGraph, list[str], Shardable]) -> None:
    # Korthikanti et al. 2022: outside the split layers every rank runs 1/t of the sequence, and a summed output
    # is reduce-scattered to that share; the split layers themselves run as without it
    graph, _, shardable = gpt
    attention = next(g for g in shardable.groups if g.name == "blocks.0")
    tensor, sequence = split_graph(graph, [attention], 2), split_graph(graph, [attention], 2, sequence=True)
    norm = graph.nodes["blocks_0_ln1"]
    assert (sequence.nodes["blocks_0_ln1"]["flops"], sequence.nodes["blocks_0_ln1"]["out_bytes"]) == (
        (norm.get("flops", 0) or 0) / 2, norm["out_bytes"] / 2)
    assert sequence.nodes["blocks_0_proj"]["out_bytes"] == tensor.nodes["blocks_0_proj"]["out_bytes"] / 2 == 262144
    assert sequence.nodes["blocks_0_qkv"] == tensor.nodes["blocks_0_qkv"]


class _Head(torch.nn.Module):
    """Embedding, a norm, an untied LM head; `upcast` returns float logits (the head's output read by a cast)."""

    def __init__(self, upcast: bool) -> None:
        super().__init__()
        self.upcast = upcast
        self.tok = torch.nn.Embedding(256, 32)
        self.norm = torch.nn.LayerNorm(32)
        self.head = torch.nn.Linear(32, 256, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.norm(self.tok(x)))
        return logits.float() * 1.0 if self.upcast else logits


@pytest.mark.parametrize("upcast", [False, True])
def test_logits_into_the_loss_stay_split(upcast: bool) -> None:
    # an LM head whose logits are the model's output: the loss reads them split by vocabulary (runtime/loss_split.py),
    # so each of t ranks holds 1/t of them and nothing gathers them; read by another op first, they are gathered
    x = torch.randint(0, 256, (4, 16))
    traced = trace(_Head(upcast), (x,), {})
    graph = build_graph(traced.graph_module, [x])
    head = next(g for g in find_shardable(traced.graph_module, graph).groups if g.name == "head")
    (node,) = head.nodes
    logits = float(graph.nodes[node]["out_bytes"])
    assert logits == 4 * 16 * 256 * 4
    assert head.loss_outputs == (() if upcast else (node,))
    assert [c.kind for c in head.collectives if c.phase == "forward"] == ["all_gather"]  # a forward-only run's
    split = split_graph(graph, [head], 4)
    assert split.nodes[node]["out_bytes"] == (logits if upcast else logits / 4)
    forward, backward = collective_seconds(graph, head, (1e-5, 1e-9), 4)
    assert backward > 0 and (forward > 0) == upcast  # the head's input gradient is all-reduced either way
