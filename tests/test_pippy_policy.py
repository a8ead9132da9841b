"""Our planner as a split_policy: torch.distributed.pipelining builds the stages where the planner cuts."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.pipelining import pipeline

from cost_model.analytic import AnalyticCostModel
from cost_model.cluster import DeviceSet
from partitioner.capture.graph import build_graph, compute_nodes
from partitioner.errors import PartitionError
from partitioner.pippy_policy import _example_inputs, split_policy
from partitioner.place.replicated import plan_hybrid
from partitioner.place.search.space import SearchSpace
from tests import zoo

SPLIT = torch.ops.pippy._pipe_split.default


def cluster(speeds: list[float]) -> AnalyticCostModel:
    devices = {
        f"cuda:{i}": {"flops_per_s": s, "bytes_per_s": s * 5, "memory_bytes": "1GiB"} for i, s in enumerate(speeds)
    }
    return AnalyticCostModel(DeviceSet.from_dict({"devices": devices, "default_link": "pcie"}))


def stages_between_markers(gm: torch.fx.GraphModule) -> list[list[str]]:
    stages: list[list[str]] = [[]]
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is SPLIT:
            stages.append([])
        elif node in compute_nodes(gm):
            stages[-1].append(node.name)
    return stages


def params_by_stage(gm: torch.fx.GraphModule, stages: list[list[str]]) -> list[set[str]]:
    stage_of = {name: s for s, names in enumerate(stages) for name in names}
    used: list[set[str]] = [set() for _ in stages]
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            for user in node.users:
                if user.name in stage_of:
                    used[stage_of[user.name]].add(str(node.target))
    return used


@pytest.mark.parametrize("name", ["mlp", "rescnn", "inception"])
@pytest.mark.parametrize("speeds", [[1e10, 1e10], [1e10, 2e10, 5e9]])
def test_pipeline_builds_the_planned_stages(name: str, speeds: list[float]) -> None:
    torch.manual_seed(0)
    model, args, _ = zoo.ZOO[name]()
    model.eval()
    mb = (args[0][:2],)
    devices = [f"cuda:{i}" for i in range(len(speeds))]
    policy = split_policy(devices, cluster(speeds), micro_batches=4)
    seen: list[Any] = []

    def spy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
        out = policy(gm)
        seen.append((stages_between_markers(out), params_by_stage(out, stages_between_markers(out))))
        return out

    pipe = pipeline(model, mb, split_policy=spy)
    marked, params = seen[0]
    assert policy.plan is not None and pipe.num_stages == len(devices) == len(policy.plan.stages)
    assert marked == [s.nodes for s in policy.plan.stages]

    # The same planner on the same exported graph, called directly, cuts at the same nodes.
    gm = torch.export.export(model, mb).module()
    graph = build_graph(gm, _example_inputs(gm))
    for _, attrs in graph.nodes(data=True):
        attrs["flops"], attrs["out_bytes"] = attrs.get("flops", 0) * 4, attrs.get("out_bytes", 0) * 4
    direct = plan_hybrid(graph, [n.name for n in compute_nodes(gm)], devices, cluster(speeds), replicate=False,
                         space=SearchSpace(micro_batches=4, schedules=("1f1b",)))
    assert [s.nodes for s in direct.stages] == marked

    # PiPPy's stage modules hold exactly the weights of the planned stages and compute the model.
    for i in range(pipe.num_stages):
        held = {k for k, _ in pipe.get_stage_module(i).named_parameters()}
        assert held == {p for p in params[i] if p in dict(model.named_parameters())}
    with torch.no_grad():
        out = pipe(*mb)
        torch.testing.assert_close(out[0] if isinstance(out, tuple) else out, model(*mb), rtol=1e-5, atol=1e-6)


def test_slower_device_gets_a_smaller_stage() -> None:
    model, args, _ = zoo.mlp()
    sizes = []
    for speeds in ([1e10, 1e10], [1e9, 1e10]):
        policy = split_policy(["cuda:0", "cuda:1"], cluster(speeds), micro_batches=2)
        pipeline(model, (args[0][:2],), split_policy=policy)
        assert policy.plan is not None
        sizes.append(len(policy.plan.stages[0].nodes))
    assert sizes[1] < sizes[0]


def test_bad_arguments() -> None:
    for kwargs in ({"devices": "cuda:0"}, {"devices": []}, {"devices": ["cpu"], "micro_batches": 0},
                   {"devices": ["cpu"], "schedule": "interleaved"}):
        with pytest.raises(PartitionError):
            split_policy(**kwargs)
    model, args, _ = zoo.mlp()
    with pytest.raises(PartitionError, match="at most"):
        pipeline(model, (args[0][:2],),
                 split_policy=split_policy([f"cuda:{i}" for i in range(20)], cluster([1e10] * 20)))
