"""Graph analysis against hand-built and traced graphs: fork/join regions, critical path, cut points."""

from __future__ import annotations

import networkx as nx
import pytest
import torch
from torch import nn

from partitioner.capture.analysis import CriticalPath, Cut, critical_path, cut_points, describe
from partitioner.capture.graph import build_graph
from partitioner.capture.regions import ForkJoinRegion as R, fork_join_regions, iter_regions
from partitioner.capture.trace import trace
from tests.graphs import dag, fork_join_graph


def traced(model: nn.Module) -> nx.DiGraph:
    x = torch.randn(1, 3, 5, 5)
    result = trace(model, (x,))
    return build_graph(result.graph_module, result.flatten_inputs((x,), {}))


INCEPTION_EDGES = [
    ("x", "stem"), ("stem", "b1"), ("w1", "b1"), ("stem", "b2a"), ("w1", "b2a"), ("b2a", "b2b"),
    ("stem", "b3a"), ("b3a", "b3b"), ("stem", "pool"), ("pool", "b4"),
    ("b1", "cat"), ("b2b", "cat"), ("b3b", "cat"), ("b4", "cat"), ("cat", "head"), ("head", "output"),
]  # fmt: skip


def test_inception_block_hand_built() -> None:
    assert fork_join_regions(dag(INCEPTION_EDGES)) == [
        R("stem", "cat", [["b1"], ["b2a", "b2b"], ["b3a", "b3b"], ["pool", "b4"]]),
    ]


def test_nested_forks_hand_built() -> None:
    graph = dag([
        ("x", "a"), ("a", "b"), ("b", "p"), ("p", "p1"), ("p", "p2"), ("p1", "pj"), ("p2", "pj"),
        ("b", "q"), ("pj", "bj"), ("q", "bj"), ("a", "c"), ("c", "c1"), ("bj", "j"), ("c1", "j"),
        ("j", "r"), ("r", "add"), ("j", "add"), ("add", "output"),
    ])  # fmt: skip
    regions = fork_join_regions(graph)
    assert regions == [
        R("a", "j", [["b", "p", "p1", "p2", "pj", "q", "bj"], ["c", "c1"]], nested=[
            R("b", "bj", [["p", "p1", "p2", "pj"], ["q"]], nested=[R("p", "pj", [["p1"], ["p2"]])]),
        ]),
        R("j", "add", [["r"]], shortcut=True),
    ]  # fmt: skip
    assert [(depth, r.fork) for depth, r in iter_regions(regions)] == [(0, "a"), (1, "b"), (2, "p"), (0, "j")]
    assert [r.parallel for _, r in iter_regions(regions)] == [True, True, True, False]


def test_branches_meeting_before_the_join_nest_under_the_same_fork() -> None:
    # Inception-ResNet: x -> (b1 | b2a b2b | b3) -> cat -> conv -> add(x, .)
    graph = dag([
        ("x", "b1"), ("x", "b2a"), ("b2a", "b2b"), ("x", "b3"), ("b1", "cat"), ("b2b", "cat"), ("b3", "cat"),
        ("cat", "conv"), ("conv", "add"), ("x", "add"), ("add", "output"),
    ])  # fmt: skip
    assert fork_join_regions(graph) == [
        R("x", "add", [["b1", "b2a", "b2b", "b3", "cat", "conv"]], shortcut=True, nested=[
            R("x", "cat", [["b1"], ["b2a", "b2b"], ["b3"]]),
        ]),
    ]  # fmt: skip


def test_chain_has_no_regions() -> None:
    # A weight tied between l1 and l3 is a get_attr: it is not a fork.
    graph = dag([("x", "l1"), ("w", "l1"), ("l1", "l2"), ("l2", "l3"), ("w", "l3"), ("l3", "output")])
    assert fork_join_regions(graph) == []
    # Returning hidden states too: paths meeting only at the output are not a region.
    assert fork_join_regions(dag([("x", "l1"), ("l1", "l2"), ("l2", "output"), ("l1", "output")])) == []


def test_inputs_and_outputs_as_sources_and_sinks() -> None:
    towers = dag([("a_in", "ta1"), ("ta1", "ta2"), ("b_in", "tb1"), ("ta2", "sim"), ("tb1", "sim"), ("sim", "output")])
    assert fork_join_regions(towers) == [R(None, "sim", [["ta1", "ta2"], ["tb1"]])]
    heads = dag([("x", "trunk"), ("trunk", "h1"), ("trunk", "h2"), ("h1", "output"), ("h2", "output")])
    assert fork_join_regions(heads) == [R("trunk", "output", [["h1"], ["h2"]])]
    # Two sinks (no output vertex): the branches never meet.
    assert fork_join_regions(dag([("x", "s"), ("s", "u"), ("s", "v")])) == [R("s", None, [["u"], ["v"]])]


class Inception(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 1)
        self.b1 = nn.Conv2d(4, 2, 1)
        self.b2 = nn.Sequential(nn.Conv2d(4, 2, 1), nn.ReLU(), nn.Conv2d(2, 2, 3, padding=1))
        self.b3 = nn.Sequential(nn.Conv2d(4, 2, 1), nn.Conv2d(2, 2, 5, padding=2))
        self.b4 = nn.Sequential(nn.MaxPool2d(3, 1, 1), nn.Conv2d(4, 2, 1))
        self.head = nn.Conv2d(8, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        return self.head(torch.cat([self.b1(h), self.b2(h), self.b3(h), self.b4(h)], 1))


class NestedResidual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 1)
        self.left = nn.Conv2d(8, 4, 1)
        self.right = nn.Conv2d(8, 4, 1)
        self.right_a = nn.Conv2d(4, 2, 1)
        self.right_b = nn.Conv2d(4, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        r = self.right(h)
        r = torch.cat([self.right_a(r), self.right_b(r)], 1)
        return torch.relu(torch.cat([self.left(h), r], 1) + h)


def test_traced_inception() -> None:
    assert fork_join_regions(traced(Inception())) == [
        R("stem", "cat", [["b1"], ["b2_0", "b2_1", "b2_2"], ["b3_0", "b3_1"], ["b4_0", "b4_1"]]),
    ]


def test_traced_nested_residual() -> None:
    assert fork_join_regions(traced(NestedResidual())) == [
        R("stem", "add", [["right", "right_a", "right_b", "cat", "left", "cat_1"]], shortcut=True, nested=[
            R("stem", "cat_1", [["right", "right_a", "right_b", "cat"], ["left"]], nested=[
                R("right", "cat", [["right_a"], ["right_b"]]),
            ]),
        ]),
    ]  # fmt: skip


def test_traced_chain() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.ReLU(), nn.Conv2d(4, 4, 1), nn.Flatten(), nn.Linear(100, 2))
    assert fork_join_regions(traced(model)) == []


def test_critical_path() -> None:
    graph = dag(INCEPTION_EDGES)
    times = {"stem": 1.0, "b1": 5.0, "b2a": 2.0, "b2b": 2.0, "b3a": 1.0, "b3b": 1.0, "pool": 0.5, "b4": 0.5}
    times |= {"cat": 0.25, "head": 1.0}
    assert critical_path(graph, times) == CriticalPath(["x", "stem", "b1", "cat", "head", "output"], 7.25, 14.25)
    assert critical_path(graph, times).parallelism == pytest.approx(14.25 / 7.25)
    assert critical_path(graph, lambda name: 1.0).nodes == ["x", "stem", "b2a", "b2b", "cat", "head", "output"]
    with pytest.raises(ValueError, match=r"no time for 1 compute vertices, e.g. \['head'\]"):
        critical_path(graph, {k: v for k, v in times.items() if k != "head"})
    with pytest.raises(ValueError, match="node_time\\('b1'\\) is -1.0"):
        critical_path(graph, times | {"b1": -1.0})


def test_cut_points() -> None:
    # a -> b -> c -> d with a skip a -> c; a is also returned by the model.
    sizes = {"a": 10, "b": 20, "c": 30, "d": 40}
    graph = dag([("x", "a"), ("a", "b"), ("b", "c"), ("a", "c"), ("c", "d"), ("d", "output")], sizes)
    cuts = cut_points(graph, ["a", "b", "c", "d"], k=2)
    assert cuts.crossing == [10, 30, 30]
    assert cuts.cheapest == [Cut(0, "a", "b", 10), Cut(1, "b", "c", 30)]
    graph.add_edge("a", "output", bytes=10)
    assert cut_points(graph, ["a", "b", "c", "d"]).crossing == [10, 30, 40]  # a now also crosses cut 2, once
    with pytest.raises(ValueError, match="order is not topological: 'b' \\(position 2\\) feeds 'c' \\(position 1\\)"):
        cut_points(graph, ["a", "c", "b", "d"])
    with pytest.raises(ValueError, match="order\\[1\\]='zz' is not a vertex"):
        cut_points(graph, ["a", "zz"])
    with pytest.raises(ValueError, match="lists 'a' twice"):
        cut_points(graph, ["a", "a"])


def test_describe() -> None:
    text = describe(dag(INCEPTION_EDGES, {"stem": 64, "cat": 8}), k=1)
    assert text.splitlines()[:3] == [
        "graph: 13 vertices (10 call_function, 1 get_attr, 1 output, 1 placeholder), 16 edges",
        "fork/join regions: 1 (1 with parallel branches), nested 1 deep",
        "  stem -> cat: 4 branches (1, 2, 2, 2 vertices)",
    ]
    assert text.splitlines()[-2:] == [
        "cheapest cuts of the 10 compute vertices (bytes crossing):",
        "  after cat (position 8): 8 B",
    ]


def test_ten_thousand_vertices() -> None:
    # How long this takes is measured by benchmarks/planner.py (target < 5 s), not asserted here.
    graph = fork_join_graph(1112)
    assert graph.number_of_nodes() == 10010
    regions = list(iter_regions(fork_join_regions(graph)))
    path = critical_path(graph, lambda name: 1.0)
    order = [n for n, op in graph.nodes(data="op") if op == "call_function"]
    cuts = cut_points(graph, order, k=3)
    assert len(regions) == 3 * 1112
    second_block = [(d, r.fork, r.join) for d, r in regions[3:6]]
    assert second_block == [(0, "add0", "add1"), (1, "add0", "cat1"), (2, "c1", "dj1")]
    assert path.length == 1 + 5 * 1112 + 1  # x, then c d dj cat add per block, then output
    assert cuts.cheapest[0] == Cut(0, "a0", "c0", 4)  # only a0 crosses: x is an input


def test_describe_model_prints_the_branches_of_a_model() -> None:
    from partitioner import describe_model
    from tests import zoo

    model, args, _ = zoo.inception()
    text = describe_model(model, args)
    assert "4 branches" in text and "critical path" in text and "cheapest cuts" in text
