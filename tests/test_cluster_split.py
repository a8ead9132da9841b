"""The cluster search over tensor degrees and sharding modes, and the plans it returns, on the example GPT."""

from __future__ import annotations

from typing import Any

import networkx as nx
import numpy as np
import pytest
import torch

from cost_model.analytic import AnalyticCostModel
from cost_model.cluster_shape import Cluster
from cost_model.memory import usable_bytes
from cost_model.precision import MIXED, PURE_BF16
from examples.models import GPT, GPTConfig, make_gpt
from partitioner.api import plan as make_plan
from partitioner.arguments import cluster_devices
from partitioner.capture.graph import build_graph, compute_nodes
from partitioner.capture.shardable import Shardable, find_shardable
from partitioner.capture.trace import trace
from partitioner.place.cluster.plan import plan_on_cluster
from partitioner.place.cluster.space import cheapest_modes
from partitioner.place.search.blocks import block_cuts
from partitioner.place.search.degrees import TensorDegree, split_groups
from partitioner.place.search.infeasible import InfeasibleError
from partitioner.place.search.space import SearchSpace
from partitioner.predict.memory_kinds import KINDS, memory_kinds
from partitioner.show.visualizer import DrawablePlan, page_data

CLUSTER = Cluster.parse("1x8xH100")


def traced(batch: int) -> tuple[nx.DiGraph, list[str], Shardable]:
    torch.manual_seed(0)
    model, (x,) = make_gpt(batch=batch)  # fp32: width 128, 4 heads, 4 blocks
    gm = trace(model, (x,), {}).graph_module
    graph = build_graph(gm, [x])
    return graph, [n.name for n in compute_nodes(gm)], find_shardable(gm, graph)


def planned(graph: nx.DiGraph, order: list[str], shardable: Shardable, stages: int | None = None,
            headroom: float = 0.9, **space: Any) -> Any:
    return plan_on_cluster(graph, order, CLUSTER, AnalyticCostModel(cluster_devices(CLUSTER)[2]),
                           shardable=shardable, stages=stages, headroom=headroom, space=SearchSpace(**space))


@pytest.fixture(scope="module")
def two() -> tuple[nx.DiGraph, list[str], Shardable]:
    return traced(2)  # a batch of 2 on 8 GPUs: at most 2 replicas, the rest pipeline or tensor ranks


def test_the_search_keeps_the_fastest_tensor_degree(two: tuple[nx.DiGraph, list[str], Shardable]) -> None:
    chosen, _ = planned(*two)
    forced = {t: planned(*two, tensor=[t])[0].predicted_step_ms for t in (1, 2, 4)}
    assert chosen.predicted_step_ms == pytest.approx(min(forced.values()))
    with pytest.raises(Exception, match=r"tensor degrees \[3\] cannot split"):
        planned(*two, tensor=[3])


def test_a_split_plan_names_its_groups_and_its_tensor_ranks(two: tuple[nx.DiGraph, list[str], Shardable]) -> None:
    graph, order, shardable = two
    plan, found = planned(graph, order, shardable, tensor=[2])
    assert found.tensor == 2 and plan.programs == []  # lowered where it runs
    cuts = block_cuts([str(graph.nodes[x].get("module", "")) for x in order])
    groups = split_groups(shardable, 2, order, cuts)
    for stage in plan.stages:
        assert stage.tensor == 2 and all(r % 2 == 0 for r in stage.ranks)  # TP innermost: runs of 2 ranks
        assert all(len({r // 8 for r in group}) == 1 for group in stage.rank_groups)  # each inside one host
        inside = set(stage.nodes)
        assert stage.tensor_groups == [g.spec() for g in groups if inside.issuperset(g.nodes)] != []
    plan.check()
    whole, _ = planned(graph, order, shardable, tensor=[1])
    assert sum(s.param_bytes for s in plan.stages) < 0.6 * sum(s.param_bytes for s in whole.stages)


def test_sharded_replicas_slice_every_micro_batch() -> None:
    graph, order, shardable = traced(16)
    plan, found = planned(graph, order, shardable, precision=MIXED, micro_batches=8,
                          tensor=[1], sharding=["zero3"])
    assert found.sharding == "zero3" and found.replicas == 8 and plan.data_split == "slice"
    assert plan.micro_batches == 1 and plan.precision == MIXED.to_dict()  # 8 micro-batches, each over 8 replicas
    stage = plan.stages[0]
    assert stage.sharding == "zero3"
    kinds = memory_kinds(plan, stage)
    assert sum(kinds.values()) == stage.memory_bytes and list(kinds) == list(KINDS)
    params = stage.param_bytes / 2  # the bf16 compute copy's bytes: 2 per element
    assert kinds["optimizer"] == -(-int(2 * params) // 8) * 4 and kinds["master"] == -(-int(params) // 8) * 4
    plan.check()


def test_each_stage_takes_the_fastest_sharding_mode_that_fits_it() -> None:
    """1F1B's first stage holds 2 micro-batches in flight, its last 1: at 41.5 MB a GPU only zero3 fits the first,
    while the last has room for zero1 (one gather a step, not two a micro-batch): the stages differ."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(width=256, layers=8, seq=64))  # 8 blocks: zero3 holds 2 of a stage's 4 gathered
    x = torch.randint(0, 512, (16, 64))
    gm = trace(model, (x,), {}).graph_module
    graph = build_graph(gm, [x])
    order, shardable = [n.name for n in compute_nodes(gm)], find_shardable(gm, graph)
    capacity = 41.5e6
    # gradients accumulated whole (sync "last"); reduce-scattered every micro-batch (FULL_SHARD, the default), zero2
    # fits the first stage as well, and gathers once a micro-batch where zero3 gathers twice: the search takes it
    pin: dict[str, Any] = {"precision": MIXED, "micro_batches": 16, "stages": 2, "schedules": ("1f1b",),
                           "gradient_sync": ("last",)}
    headroom = capacity / CLUSTER.gpu.memory_bytes
    full_shard, _ = planned(graph, order, shardable, headroom=headroom, **{**pin, "gradient_sync": None})
    assert [(s.sharding, s.gradient_sync) for s in full_shard.stages] == [("zero2", "every"), ("zero1", "last")]
    plan, found = planned(graph, order, shardable, headroom=headroom, **pin)
    modes = [s.sharding for s in plan.stages]
    assert modes == found.modes == ["zero3", "zero1"] and found.sharding == "zero3" and plan.data_split == "slice"
    plan.check()
    lines = DrawablePlan.from_plan(plan).summary().splitlines()
    at = next(i for i, line in enumerate(lines) if line.split()[:5] == ["stage", "ranks", "replicas", "tensor",
                                                                        "sharding"])
    assert [line.split()[4] for line in lines[at + 2:at + 4]] == modes  # the summary's sharding column
    # each mode alone on every stage, room for all: the plan's own memory and the search's W of each stage
    alone = {mode: planned(graph, order, shardable, tensor=[1], sharding=[mode], **pin)
             for mode in ("none", "zero1", "zero2", "zero3")}
    for s, mode in enumerate(modes):
        assert all(f.bounds == found.bounds for _, f in alone.values())  # same cuts: stage s is the same nodes
        assert alone[mode][0].stages[s].memory_bytes <= capacity
        faster = [x for x, (_, f) in alone.items() if f.work_s[s] < alone[mode][1].work_s[s]]
        assert all(alone[x][0].stages[s].memory_bytes > capacity for x in faster), (s, mode, faster)
    uniform, one = planned(graph, order, shardable, headroom=capacity / CLUSTER.gpu.memory_bytes,
                           tensor=[1], sharding=["zero3"], **pin)  # the only one mode that fits
    # the last stage's own work drops under zero1; the step (the slowest stage's) never grows for it
    assert found.work_s[1] < one.work_s[1] and found.step_s <= one.step_s
    assert plan.predicted_step_ms <= uniform.predicted_step_ms
    # a stage leaves the configuration's mode only for a strictly faster one that fits
    assert cheapest_modes({"zero3": ([2.0, 2.0], [5.0, 5.0]), "zero1": ([1.0, 2.0], [9.0, 4.0])}, "zero3",
                          6.0) == ["zero3", "zero3"]


def test_each_state_is_counted_at_its_dtype() -> None:
    graph, order, shardable = traced(16)
    pin: dict[str, Any] = {"micro_batches": 8, "stages": 1, "tensor": [1], "sharding": ["none"]}
    before, _ = planned(graph, order, shardable, **pin)  # every state fp32, as the model: 16 bytes per parameter
    mixed, _ = planned(graph, order, shardable, precision=MIXED, **pin)  # bf16 copy 2 + master 4 + grads 4 + Adam 8
    params = before.stages[0].param_bytes // 4
    assert mixed.stages[0].param_bytes == 2 * params  # the weights forward reads: bf16
    assert mixed.stages[0].memory_bytes - before.stages[0].memory_bytes == 2 * params
    assert memory_kinds(mixed, mixed.stages[0])["optimizer"] == 8 * params


def test_a_model_that_fits_under_another_precision_says_so() -> None:
    graph, order, shardable = traced(16)
    pin: dict[str, Any] = {"micro_batches": 8, "stages": 1, "tensor": [1], "sharding": ["none"]}
    bf16, _ = planned(graph, order, shardable, precision=PURE_BF16, **pin)
    mixed, _ = planned(graph, order, shardable, precision=MIXED, **pin)
    between = (bf16.stages[0].memory_bytes + mixed.stages[0].memory_bytes) / 2
    headroom = between / CLUSTER.gpu.memory_bytes  # capacity between what the two need
    with pytest.raises(InfeasibleError, match=r"Under mixed nothing fits; under pure bf16 \(1 stages x 8 replicas\)"):
        planned(graph, order, shardable, precision=MIXED, headroom=headroom, **pin)
    assert usable_bytes(CLUSTER.gpu.memory_bytes, "cuda") > between


def test_a_cluster_plan_shows_its_split_and_memory_by_kind() -> None:
    graph, order, shardable = traced(16)
    plan, _ = planned(graph, order, shardable, precision=MIXED, micro_batches=8,
                      tensor=[2], sharding=["zero2"])
    drawable = DrawablePlan.from_plan(plan)
    lines = drawable.summary().splitlines()
    header = next(line for line in lines if line.startswith("stage") and "tensor" in line).split()
    assert header == ["stage", "ranks", "replicas", "tensor", "sharding", *KINDS, "memory"]
    assert any(line.split()[3:5] == ["2", "zero2"] for line in lines) and "precision mixed" in lines[-1]
    data = page_data(drawable)
    assert data["title"].startswith(f"{len(plan.stages)}-stage plan on 8 GPUs (1 hosts x 8), 2 tensor ranks")
    for row, stage in zip(data["devices"], plan.stages):  # a row per stage: one rank's memory by kind
        assert row["name"].startswith(f"stage {stage.index}: ranks ")
        assert sum(row["kinds"].values()) == stage.memory_bytes
    pipeline, _ = planned(graph, order, shardable, stages=8, micro_batches=8)  # nothing replicated, split or sharded
    assert "tensor" not in DrawablePlan.from_plan(pipeline).summary()


def test_plan_keeps_the_split_stages_numbers_when_recomputation_is_chosen_per_stage() -> None:
    torch.manual_seed(0)
    model, (x,) = make_gpt(batch=2)
    made = {rec: make_plan(model, cluster="1x8xH100", example_inputs=(x,), micro_batches=2, replicas="auto",
                                  schedule="1f1b", precision="mixed", recompute=rec) for rec in ("none", "auto")}
    assert made["none"].precision == MIXED.to_dict()
    assert [s.memory_bytes for s in made["auto"].stages] == [s.memory_bytes for s in made["none"].stages]
    assert made["auto"].predicted_step_ms == made["none"].predicted_step_ms


def test_every_stage_of_a_split_plan_splits_a_group() -> None:
    split = TensorDegree(2, (traced_problem_stub(),), spans=np.array([[3, 5], [8, 9]]))
    holds = split.holds_a_group(np.array([0, 3, 6, 8, 10]))
    assert holds is not None and holds.astype(int).tolist() == [[0, 0, 1, 1, 1], [0, 0, 1, 1, 1], [0, 0, 0, 0, 1],
                                                                [0, 0, 0, 0, 1], [0, 0, 0, 0, 0]]
    assert TensorDegree(1, (traced_problem_stub(),)).holds_a_group(np.array([0, 3])) is None


def traced_problem_stub() -> Any:
    return None  # the problem is not read by holds_a_group
