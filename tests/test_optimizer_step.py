"""The optimizer step's price (cost_model/optimizer_step.py): bytes counted by hand, a rank's shard, the plan."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cost_model.analytic import AnalyticCostModel
from cost_model.cluster_shape import Cluster
from cost_model.optimizer_step import step_bytes_per_param, step_seconds
from cost_model.precision import FP32, MIXED, PURE_BF16, Precision
from examples.models import make_gpt
from partitioner.arguments import cluster_devices
from partitioner.capture.graph import build_graph, compute_nodes
from partitioner.capture.shardable import find_shardable
from partitioner.capture.trace import trace
from partitioner.place.cluster.plan import plan_on_cluster
from partitioner.place.cluster.prepare import memory_bandwidth
from partitioner.place.search.space import SearchSpace

CLUSTER = Cluster.parse("1x8xH100")


def test_adam_moves_forty_bytes_a_mixed_parameter() -> None:
    # step: read master 4 + grad 4 + two moments 8, write master 4 + two moments 8 = 28;
    # clipping: read the gradients for the norm (4), read and write them scaled (8) = 12
    assert step_bytes_per_param(MIXED, clip=False) == 28
    assert step_bytes_per_param(MIXED) == 40
    assert step_bytes_per_param(PURE_BF16) == 20  # every element 2 bytes: 2 x 2 + 4 x 2 + 2 x 2 x 2
    assert step_bytes_per_param(FP32) == 40
    # SGD keeps no state: read w and g, write w (12), clipping 12 more
    assert step_bytes_per_param(Precision("float32", "float32", "float32", "float32", optimizer="sgd")) == 24


def test_a_sharded_rank_steps_one_shard() -> None:
    whole = step_seconds(8e9, MIXED, 2.68e12)
    assert whole == pytest.approx(8e9 * 40 / 2.68e12)  # 119 ms for 8B parameters at 80% of an H100's HBM
    assert step_seconds(8e9, MIXED, 2.68e12, shards=8) == pytest.approx(whole / 8)
    grid = step_seconds(np.array([1e9, 2e9]), MIXED, 1e12, shards=2)  # broadcasts over every cut
    assert grid == pytest.approx([20e-3, 40e-3])
    assert step_seconds(8e9, MIXED, 0.0) == 0.0  # no bandwidth known: not priced (a calibration holds it)
    with pytest.raises(ValueError, match="shards >= 1"):
        step_seconds(1.0, MIXED, 1e12, shards=0)


def test_the_cluster_search_steps_at_the_memory_bound_kernels_rate() -> None:
    cost = AnalyticCostModel(cluster_devices(CLUSTER)[2])
    gpu, _, rate = cost.gpu_rates("cuda:0")
    # gpus.json's measured memory_efficiency of the H100 SXM: FlashMLA's 3000 of 3350 GB/s, 0.9
    assert memory_bandwidth(cost, torch.device("cuda:0")) == rate == pytest.approx(0.9 * gpu.memory_bytes_per_s)


@pytest.mark.parametrize("mode, shards", [("none", 1), ("zero3", 8)])
def test_a_plan_prices_the_step_over_the_shard_each_rank_holds(mode: str, shards: int) -> None:
    torch.manual_seed(0)
    model, (x,) = make_gpt(batch=8)
    gm = trace(model, (x,), {}).graph_module
    graph = build_graph(gm, [x])
    order = [n.name for n in compute_nodes(gm)]
    cost = AnalyticCostModel(cluster_devices(CLUSTER)[2])
    plan, _ = plan_on_cluster(graph, order, CLUSTER, cost, shardable=find_shardable(gm, graph), stages=1,
                              space=SearchSpace(precision=MIXED, sharding=[mode], tensor=[1], micro_batches=[8]))
    (stage,) = plan.stages
    params = sum(float(a.get("param_bytes", 0) or 0) for _, a in graph.nodes(data=True)) / 4  # fp32 weights, as traced
    rate = cost.gpu_rates("cuda:0")[2]
    assert stage.sharding == mode and stage.replicas == 8
    assert stage.optimizer_ms == pytest.approx(1e3 * params / shards * 40 / rate, rel=1e-6)
    assert plan.predicted_step_ms >= stage.optimizer_ms
