"""Gradient modes of sharded stages (rules.sharding): accumulated whole and reduced once a step, or reduce-scattered
after every micro-batch (FSDP's FULL_SHARD), priced in time and memory, chosen by the search and named in the plan.

The runtime's side (the plan's "every" run by FSDP2 under torchrun, equal to the plain model, holding less) is
tests/test_split_layers.py::test_full_shard_reduces_every_micro_batch_equal_to_the_plain_model_and_holds_less.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from cost_model.analytic import AnalyticCostModel
from cost_model.cluster_shape import Cluster
from cost_model.data_parallel import DataParallelCost
from cost_model.precision import MIXED
from examples.models import make_gpt
from partitioner.arguments import cluster_devices
from partitioner.capture.graph import build_graph, compute_nodes
from partitioner.capture.shardable import find_shardable
from partitioner.capture.trace import trace
from partitioner.errors import PartitionError
from partitioner.place.cluster.plan import plan_on_cluster
from partitioner.place.search.space import SearchSpace
from rules.sharding import stage_sync
from runtime.plan import Plan

RING = (0.0, 1e-9)  # no latency, 1 GB/s all-reduce: AG and RS of n bytes take n / 2 ns


def test_full_shard_prices_a_reduce_scatter_every_micro_batch() -> None:
    P, U, F, B = 1e9, 1e8, 0.1, 0.2  # elements; forward and backward seconds of one micro-batch
    last = DataParallelCost("zero3", 4, RING, 2.0, 4.0)
    every = DataParallelCost("zero3", 4, RING, 2.0, 4.0, gradient_sync="every")
    # AG(P c) = 1.0 s, RS(P g) = 2.0 s, AG(U c) = 0.1 s, RS(U g) = 0.2 s
    assert last.gathers(P, U, F, B) == pytest.approx((0.9, 0.8))  # gathered before forward and again before backward
    assert last.per_step(P, U, F, B) == pytest.approx(1.8)  # one reduce-scatter, behind the last backward
    assert every.gathers(P, U, F, B) == pytest.approx((0.9, 2.8))  # + this micro-batch's reduce-scatter, same link
    assert every.per_step(P, U, F, B) == pytest.approx(0.2)  # the last unit's, after the last backward
    m = 8
    assert m * every.per_micro_batch(P, U, F, B) + every.per_step(P, U, F, B) == pytest.approx(8 * 3.7 + 0.2)
    assert m * last.per_micro_batch(P, U, F, B) + last.per_step(P, U, F, B) == pytest.approx(8 * 1.7 + 1.8)
    zero2 = DataParallelCost("zero2", 4, RING, 2.0, 4.0, gradient_sync="every")
    assert zero2.gathers(P, U, F, B) == pytest.approx((0.9, 1.8))  # RS(P g) - B, no gather before backward


def test_what_each_mode_runs_of_a_gradient_sync() -> None:
    assert [stage_sync(m, "every") for m in ("none", "zero1", "zero2", "zero3")] == ["last", "last", "every", "every"]
    assert DataParallelCost("zero1", 4, RING, 2.0, 4.0, gradient_sync="every").gradient_sync == "last"
    with pytest.raises(PartitionError, match="gradient_sync"):
        SearchSpace(precision=MIXED, gradient_sync=("sometimes",))
    assert SearchSpace(precision=MIXED).gradient_syncs() == ("every",)  # FULL_SHARD; zero1 accumulates whole
    assert SearchSpace(precision=MIXED, gradient_sync=("last", "every")).gradient_syncs() == ("last", "every")
    assert SearchSpace(precision=MIXED, sharding=("zero1",)).gradient_syncs() == ("last",)
    assert SearchSpace().gradient_syncs() == ("last",)  # nothing sharded without a precision


@pytest.fixture(scope="module")
def gpt() -> tuple[Any, list[str], Any]:
    model, (x,) = make_gpt(batch=16)
    gm = trace(model, (x,), {}).graph_module
    graph = build_graph(gm, [x])
    return graph, [n.name for n in compute_nodes(gm)], find_shardable(gm, graph)


def _plan(gpt: Any, sharding: str, sync: str) -> Plan:
    graph, order, shardable = gpt
    cluster = Cluster.parse("1x4xH100")
    cost = AnalyticCostModel(cluster_devices(cluster)[2])
    # one schedule: with one stage GPipe and 1F1B predict the same step, and which one a search keeps at that tie
    # (rules of place/search/compare.py on float-equal steps) is not what this file tests
    space = SearchSpace(micro_batches=16, schedules=("1f1b",), precision=MIXED, tensor=(1,), sharding=(sharding,),
                        gradient_sync=(sync,))
    made, _ = plan_on_cluster(graph, order, cluster, cost, space=space, shardable=shardable, stages=1)
    return made


def test_full_shard_is_named_in_the_plan_and_holds_less_than_accumulating(gpt: Any) -> None:
    every, last, zero1 = _plan(gpt, "zero3", "every"), _plan(gpt, "zero3", "last"), _plan(gpt, "zero1", "every")
    assert [s.gradient_sync for s in every.stages] == ["every"] and every.stages[0].replicas == 4
    assert [s.gradient_sync for s in last.stages] == ["last"] and [s.gradient_sync for s in zero1.stages] == ["last"]
    # 4 micro-batches per replica: accumulating keeps every gradient whole (fp32, 4 bytes a weight) between them;
    # FULL_SHARD keeps the fp32 shard (1/4) and the root's and one block's gradients. zero1 also keeps every weight.
    assert every.stages[0].memory_bytes < last.stages[0].memory_bytes < zero1.stages[0].memory_bytes
    weights = every.stages[0].param_bytes // 2  # bf16 compute copy: elements
    assert last.stages[0].memory_bytes - every.stages[0].memory_bytes >= 4 * weights * 3 // 4 - 4 * weights // 2
    # each micro-batch reduce-scatters (hidden behind this small model's backward on NVLink), less once a step
    assert every.stages[0].backward_ms >= last.stages[0].backward_ms
    assert every.stages[0].allreduce_ms <= last.stages[0].allreduce_ms
    stage = json.loads(every.to_json())["stages"][0]
    assert stage["gradient_sync"] == "every" and "gradient_sync" not in json.loads(last.to_json())["stages"][0]
    assert Plan.from_json(every.to_json()).stages[0].gradient_sync == "every"


def test_a_plan_refuses_per_micro_batch_reduction_without_zero2_or_zero3(gpt: Any) -> None:
    made = _plan(gpt, "zero1", "last")
    made.stages[0].gradient_sync = "every"
    with pytest.raises(ValueError, match="gradient_sync='every'.*needs sharding 'zero2' or 'zero3'"):
        made.check()
