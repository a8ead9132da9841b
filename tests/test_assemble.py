"""One way to count a placement: literal stage numbers, the all-reduce in the step, every planner alike."""

from __future__ import annotations

from typing import Any, Mapping

import networkx as nx
import pytest
import torch

from cost_model.analytic import AnalyticCostModel
from cost_model.devices import DeviceSpec
from partitioner.capture.graph import build_graph, compute_nodes
from partitioner.capture.trace import trace
from partitioner.errors import PartitionError
from partitioner.place.branches import plan_branches
from partitioner.place.chain import plan_pipeline
from partitioner.place.replicated import plan_hybrid
from partitioner.place.search.graph_costs import per_micro_batch
from partitioner.place.search.space import SearchSpace
from partitioner.predict.assemble import assemble, finish
from partitioner.predict.counting import stage_edges
from partitioner.predict.simulator import ALLREDUCE, simulate
from runtime.plan import Plan
from tests import zoo

FIXED = DeviceSpec(name="test", flops_per_s=1e9, bytes_per_s=1e10, op_overhead_s=1e-6, memory_bytes=1 << 30)


class Cost:
    """Every compute node: forward 1 ms, backward 2 ms; 80 bytes move in 1 ms; all-reduce 1.5 ms."""

    def __init__(self, ms_per_80_bytes: float = 0.0) -> None:
        self.link = ms_per_80_bytes

    def node_time(self, node: Mapping[str, Any], device: torch.device) -> float:
        return 3e-3 if node["op"] == "call_function" else 0.0

    def forward_time(self, node: Mapping[str, Any], device: torch.device) -> float:
        return 1e-3 if node["op"] == "call_function" else 0.0

    def transfer_time(self, nbytes: float, src: torch.device, dst: torch.device) -> float:
        return self.link * 1e-3 * nbytes / 80

    def allreduce_time(self, nbytes: float, devices: Any) -> float:
        return 1.5e-3 if nbytes > 0 and len(devices) > 1 else 0.0


def graph_of(nodes: list[tuple[str, str, int, int]], edges: list[tuple[str, str]]) -> nx.DiGraph:
    """A hand-made annotated graph: (name, op, out_bytes, param_bytes) per node, producer -> reader edges."""
    g = nx.DiGraph()
    for i, (name, op, out, params) in enumerate(nodes):
        g.add_node(name, name=name, op=op, target=name, module="", position=i, shapes=[[2, 5]], dtypes=["float32"],
                   out_bytes=out, param_bytes=params, flops=100)  # fmt: skip
    for u, v in edges:
        g.add_edge(u, v, bytes=g.nodes[u]["out_bytes"])
    return g


def two_nodes() -> nx.DiGraph:
    """x -> a (1000 B of weights) -> b -> output."""
    return graph_of([("x", "placeholder", 40, 0), ("a", "call_function", 80, 1000), ("b", "call_function", 8, 24),
                     ("output", "output", 0, 0)], [("x", "a"), ("a", "b"), ("b", "output")])  # fmt: skip


def test_replicated_plan_step_includes_its_allreduce() -> None:
    # Stage a on ranks 0 and 1 (micro-batch 0 and 1), stage b on rank 2; GPipe, free transfers:
    #   rank 0: F0 0-1,            B0 7-9, all-reduce 9-10.5
    #   rank 1: F1 0-1,    B1 5-7,         all-reduce 9-10.5 (it waits for rank 0)
    #   rank 2: F0 1-2, F1 2-3, B1 3-5, B0 5-7
    plan = assemble(two_nodes(), [["a"], ["b"]], ["cpu", "cpu"], Cost(), micro_batches=2, stage_ranks=[[0, 1], [2]])
    a, b = plan.stages
    assert (a.allreduce_ms, b.allreduce_ms) == (1.5, 0.0)
    assert plan.predicted_step_ms == 9.0 + a.allreduce_ms == 10.5
    reduces = [[(e.start, e.end) for e in row] for row in simulate(plan).events(ALLREDUCE)]
    assert reduces == [[(9.0, 10.5)], [(9.0, 10.5)], []]
    assert [p.text().splitlines()[-2:] for p in plan.programs[:2]] == [["AR r0,1 t5", "STEP"]] * 2
    assert plan.programs[0].predicted[-2:] == [(9.0, 10.5), (10.5, 10.5)]
    assert (a.predicted_ms, b.predicted_ms) == (1.5, 3.0)  # 3 ms per micro-batch shared by two replicas
    # a replica of a holds one micro-batch: a's output (an unknown op keeps it) and, in backward, its gradient;
    # b holds two: 8 kept for one, 8 + its loss (3 x 8) for the one in backward, and the 80 received of each
    assert (a.activation_bytes, b.activation_bytes) == (80 + 80, 8 + (8 + 3 * 8) + 2 * 80)
    assert a.memory_bytes == 4 * 1000 + 160 + 2 * 80  # adam: weights, grads, 2 states; activations; output + gradient
    loaded = Plan.from_json(plan.to_json())
    assert loaded == plan and simulate(loaded).makespan_ms == 10.5
    assert finish(loaded, groups=[]).makespan_ms == 9.0  # one process: replicas share weights, nothing to reduce


def test_counting_rules_literal() -> None:
    # Stages [a] [b, e] [c]: c reads a (a skip) and b; e is read only by the output, so the last
    # stage receives it; the weight w is read by b and c: counted once (stage 1), all-reduced by ranks 1, 2.
    g = graph_of(
        [("x", "placeholder", 40, 0), ("a", "call_function", 80, 16), ("w", "get_attr", 0, 24),
         ("b", "call_function", 80, 0), ("e", "call_function", 8, 0), ("c", "call_function", 8, 0),
         ("output", "output", 0, 0)],
        [("x", "a"), ("a", "b"), ("w", "b"), ("b", "e"), ("a", "c"), ("b", "c"), ("w", "c"), ("c", "output"),
         ("e", "output")],
    )  # fmt: skip
    stages = [["a"], ["b", "e"], ["c"]]
    assert stage_edges(g, stages) == {(0, 1): 80, (0, 2): 80, (1, 2): 88}
    plan = assemble(g, stages, ["cpu"] * 3, Cost(ms_per_80_bytes=1.0), micro_batches=1)
    assert [s.reads_from for s in plan.stages] == [[], [0], [0, 1]]
    assert [(s.recv_bytes, s.send_bytes) for s in plan.stages] == [(0, 160), (80, 88), (168, 0)]
    assert [s.param_bytes for s in plan.stages] == [16, 24, 0]
    assert [s.comm_ms for s in plan.stages] == pytest.approx([4.0, 4.2, 4.2])  # both directions of every edge
    assert [s.compute_ms for s in plan.stages] == [3.0, 6.0, 3.0]
    assert [s.predicted_ms for s in plan.stages] == pytest.approx([7.0, 10.2, 7.2])
    reduces = [[str(op) for op in p.ops if op.kind == "AR"] for p in plan.programs]
    assert reduces == [[], ["AR r1,2 t4"], ["AR r1,2 t4"]]  # after stage 1's backward, the group's last
    assert [len(row) for row in simulate(plan).events(ALLREDUCE)] == [0, 1, 1]


def test_unused_slot_runs_an_empty_program() -> None:
    plan = assemble(two_nodes(), [["a"], ["b"]], ["cpu", "cuda:2"], Cost(), micro_batches=2, stage_ranks=[[0], [2]],
                    rank_devices=["cpu", "cuda:1", "cuda:2"], placement="branches")  # fmt: skip
    assert [p.rank for p in plan.programs] == [0, 1, 2] and plan.ranks == 3
    assert [str(op) for op in plan.programs[1].ops] == ["STEP"] and plan.programs[1].device == "cuda:1"
    assert {op.peer for op in plan.programs[2].ops if op.is_p2p} == {0}
    assert plan.predicted_step_ms == 9.0


def test_bad_placements_name_the_problem() -> None:
    g = two_nodes()
    with pytest.raises(PartitionError, match=r"nodes in several stages: \['a'\]"):
        assemble(g, [["a"], ["a", "b"]], ["cpu", "cpu"], Cost(), micro_batches=1)
    with pytest.raises(PartitionError, match=r"nodes not in the graph: \['z'\]"):
        assemble(g, [["a", "b", "z"]], ["cpu"], Cost(), micro_batches=1)
    with pytest.raises(PartitionError, match="stage 0 reads 'a' made by the later stage 1"):
        assemble(g, [["b"], ["a"]], ["cpu", "cpu"], Cost(), micro_batches=1)
    with pytest.raises(PartitionError, match="cannot run its schedule 'interleaved'"):
        assemble(g, [["a"], ["b"]], ["cpu", "cpu"], Cost(), micro_batches=2, schedule="interleaved",
                 stage_ranks=[[0, 1], [2]])


def test_side_by_side_stages_of_a_contiguous_split_run_1f1b() -> None:
    # x -> {p, q} -> j: the cut between p and q leaves stages 1 and 2 side by side, still one chain order.
    g = graph_of([("x", "placeholder", 40, 0), ("a", "call_function", 80, 0), ("p", "call_function", 80, 0),
                  ("q", "call_function", 80, 0), ("j", "call_function", 8, 0), ("output", "output", 0, 0)],
                 [("x", "a"), ("a", "p"), ("a", "q"), ("p", "j"), ("q", "j"), ("j", "output")])  # fmt: skip
    plan = assemble(g, [["a"], ["p"], ["q", "j"]], ["cpu"] * 3, Cost(), micro_batches=4, schedule="1f1b")
    assert [s.reads_from for s in plan.stages] == [[], [0], [0, 1]]
    assert simulate(plan).makespan_ms == plan.predicted_step_ms > 0
    side = assemble(g, [["a"], ["p"], ["q"], ["j"]], ["cpu"] * 4, Cost(), micro_batches=4, schedule="1f1b")
    assert [s.reads_from for s in side.stages] == [[], [0], [0], [1, 2]]
    assert all(op.tick >= 0 for p in side.programs for op in p.ops if op.kind != "STEP")


def test_finish_relowers_for_new_micro_batches() -> None:
    plan = assemble(two_nodes(), [["a"], ["b"]], ["cpu", "cpu"], Cost(), micro_batches=2, stage_ranks=[[0, 1], [2]])
    plan.micro_batches = 4
    timeline = finish(plan, graph=two_nodes())
    # in flight: b 2 -> 4 (3 x 8 kept, 8 + 3 x 8 in backward, 4 x 80 received), each replica of a 1 -> 2
    assert plan.stages[1].activation_bytes == 3 * 8 + 32 + 4 * 80 and plan.stages[0].activation_bytes == 80 + 160
    assert plan.stages[1].memory_bytes == 4 * 24 + 376 + 4 * 8  # b's outputs: the loss reads one of each micro-batch
    assert sum(op.kind == "AR" for p in plan.programs for op in p.ops) == 2  # the group the old programs reduced
    assert plan.predicted_step_ms == timeline.makespan_ms == simulate(plan).makespan_ms
    assert [len(p.predicted) for p in plan.programs] == [len(p.ops) for p in plan.programs]


def traced(name: str, whole: bool = False) -> tuple[nx.DiGraph, list[str]]:
    model, args, kwargs = zoo.ZOO[name]()
    t = trace(model, args, kwargs)
    graph = build_graph(t.graph_module, t.flatten_inputs(args, kwargs))
    return graph, [n.name for n in compute_nodes(t.graph_module)]


def rebuilt(plan: Plan, graph: nx.DiGraph, cost: Any, optimizer: str = "adam") -> Plan:
    """The plan of the same placement, assembled directly."""
    return assemble(
        graph, [s.nodes for s in plan.stages], [s.device for s in plan.stages], cost, micro_batches=plan.micro_batches,
        schedule=plan.schedule, stage_ranks=[s.ranks for s in plan.stages],
        rank_devices=[p.device for p in plan.programs],
        placement=plan.placement, optimizer=optimizer, capacity_bytes=[s.capacity_bytes for s in plan.stages],
    )


def test_every_planner_counts_through_assemble() -> None:
    cost = AnalyticCostModel(measure=lambda d: FIXED)
    graph, order = traced("tiny_gpt")
    chain = plan_pipeline(graph, order, [torch.device("cpu")] * 3, cost, 4, replicas=[1, 2, 1], schedule="1f1b")
    assert [s.ranks for s in chain.stages] == [[0], [1, 2], [3]] and chain.placement == "pipeline"
    assert chain == rebuilt(chain, graph, cost)
    graph, order = traced("inception")
    branches = plan_branches(graph, order, [torch.device("cpu")] * 2, cost, 2, min_gain=0.0)
    assert branches.placement == "branches" and branches == rebuilt(branches, graph, cost)
    graph, order = traced("mlp")
    hybrid = plan_hybrid(graph, order, ["cpu"] * 3, cost, space=SearchSpace(micro_batches=[2, 4]))
    assert hybrid.placement == "hybrid"
    assert hybrid == rebuilt(hybrid, per_micro_batch(graph, hybrid.micro_batches), cost)


def test_three_planners_give_the_same_numbers_for_the_same_placement() -> None:
    # One device: every planner puts the whole model in one stage; m = 1, so the whole batch is the micro-batch.
    cost = AnalyticCostModel(measure=lambda d: FIXED)
    graph, order = traced("mlp")
    cpu = torch.device("cpu")
    plans = [
        plan_pipeline(graph, order, [cpu], cost, 1),
        plan_branches(graph, order, [cpu, cpu], cost, 1),  # nothing to place side by side: slot 1 stays idle
        plan_hybrid(graph, order, ["cpu"], cost, space=SearchSpace(micro_batches=1, schedules=("gpipe",))),
    ]
    assert [p.placement for p in plans] == ["pipeline", "branches", "hybrid"]
    assert all(len(p.stages) == 1 and p.stages[0].nodes == order for p in plans)
    fields = ("compute_ms", "forward_ms", "backward_ms", "comm_ms", "allreduce_ms", "predicted_ms", "param_bytes",
              "activation_bytes", "memory_bytes", "recv_bytes", "send_bytes", "ranks", "reads_from")  # fmt: skip
    first = plans[0].stages[0]
    for plan in plans[1:]:
        assert {f: getattr(plan.stages[0], f) for f in fields} == {f: getattr(first, f) for f in fields}
        assert plan.predicted_step_ms == plans[0].predicted_step_ms == first.compute_ms
        assert plan.programs[0].ops == plans[0].programs[0].ops


def test_finish_keeps_each_ranks_device() -> None:
    plan = assemble(two_nodes(), [["a"], ["b"]], ["cpu", "cuda:2"], Cost(), micro_batches=2, stage_ranks=[[0], [2]],
                    rank_devices=["cpu", "cuda:1", "cuda:2"])  # fmt: skip
    plan.micro_batches = 3
    finish(plan)
    assert [p.device for p in plan.programs] == ["cpu", "cuda:1", "cuda:2"]
    assert sum(op.kind == "F" for p in plan.programs for op in p.ops) == 6
