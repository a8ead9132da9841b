"""The Plan is plain data: typed fields and programs through JSON, a readable table, clear errors."""

from __future__ import annotations

import json

import pytest

from runtime.plan import Plan, StagePlan
from runtime.program import plan_programs
from runtime.tensor_parallel_spec import ShardedParam, TensorParallelGroup


def make() -> Plan:
    return Plan(
        stages=[
            StagePlan(0, "cuda:0", ["a", "b"], predicted_ms=2.0, param_bytes=3 << 20),
            StagePlan(1, "cuda:1", ["c"], predicted_ms=3.0, activation_bytes=1500),
        ],
        micro_batches=4,
        predicted_step_ms=15.0,
    )


def test_json_round_trip() -> None:
    plan = make()
    assert Plan.from_json(plan.to_json()) == plan
    assert plan.stage_of() == {"a": 0, "b": 0, "c": 1}
    assert plan.devices == ["cuda:0", "cuda:1"] and plan.bottleneck_ms == 3.0


def test_summary_table() -> None:
    lines = make().summary().splitlines()
    assert lines[0].split()[:3] == ["stage", "device", "nodes"]
    assert lines[2].split()[:3] == ["0", "cuda:0", "2"] and "3.0 MiB" in lines[2]
    assert "1.5 KiB" in lines[3]
    assert "2 stages (pipeline), 4 micro-batches" in lines[-1] and "bottleneck 3.000 ms" in lines[-1]


def test_typed_fields_and_programs_round_trip() -> None:
    plan = make()
    plan.placement, plan.schedule, plan.alternatives = "branches", "1f1b", {"pipeline": 20.0, "branches": 15.0}
    plan.stages[0].ranks, plan.stages[1].ranks, plan.stages[1].reads_from = [0, 1], [2], [0]
    plan.stages[0].allreduce_ms, plan.stages[0].memory_bytes, plan.stages[0].capacity_bytes = 1.5, 4096, 1 << 20
    plan.programs = plan_programs(plan, [([0, 1], [0])])
    plan.programs[2].predicted = [(0.5 * k, 0.5 * k + 0.25) for k in range(len(plan.programs[2].ops))]
    text = plan.to_json()
    loaded = Plan.from_json(text)
    assert loaded == plan and loaded.ranks == 3 and loaded.stages[0].replicas == 2
    assert json.loads(text)["programs"][0]["ops"][-2:] == ["AR r0,1 t9", "STEP"]  # readable as text


def test_old_files_load_and_bad_fields_are_named() -> None:
    old = json.dumps({"stages": [{"index": 0, "device": "cpu", "nodes": ["a"]}], "micro_batches": 2,
                      "schedule": "gpipe", "predicted_step_ms": 1.0, "notes": {"placement": "pipeline"}})  # fmt: skip
    assert Plan.from_json(old) == Plan([StagePlan(0, "cpu", ["a"])], micro_batches=2, predicted_step_ms=1.0)
    bad = json.loads(make().to_json())
    bad["schedule"], bad["micro_batches"], bad["stages"][1]["reads_from"] = "zigzag", 0, [1]
    with pytest.raises(ValueError) as error:
        Plan.from_json(json.dumps(bad))
    assert str(error.value).splitlines() == [
        "invalid plan:",
        "- schedule='zigzag'; use one of gpipe, 1f1b, interleaved, zb1, zbv, dualpipev",
        "- micro_batches=0; use an integer >= 1",
        "- stage 1 reads from stages [1]; a stage reads only earlier stages",
    ]


def test_recompute_round_trips_defaults_to_none_and_is_checked() -> None:
    plan = make()
    plan.stages[1].recompute = "selective"
    loaded = Plan.from_json(plan.to_json())
    assert loaded == plan and [s.recompute for s in loaded.stages] == ["none", "selective"]
    assert "recompute none, selective" in plan.summary().splitlines()[-1] and "recompute" not in make().summary()
    old = json.loads(make().to_json())
    for stage in old["stages"]:
        del stage["recompute"]  # a plan written before the field existed
    assert Plan.from_json(json.dumps(old)) == make()
    old["stages"][0]["recompute"] = "some"
    with pytest.raises(ValueError, match=r"stages\[0\].recompute='some'; use one of none, selective, full"):
        Plan.from_json(json.dumps(old))


def test_staleness_round_trips_defaults_to_zero_and_is_checked() -> None:
    plan = make()
    plan.staleness = 2
    loaded = Plan.from_json(plan.to_json())
    assert loaded == plan and loaded.staleness == 2
    assert "staleness 2" in plan.summary().splitlines()[-1] and "staleness" not in make().summary()
    old = json.loads(make().to_json())
    del old["staleness"]  # a plan written before the field existed
    assert Plan.from_json(json.dumps(old)).staleness == 0
    old["staleness"] = -1
    with pytest.raises(ValueError, match=r"staleness=-1; use an integer >= 0"):
        Plan.from_json(json.dumps(old))


def test_a_plan_with_staleness_needs_torchrun() -> None:
    import torch

    from partitioner import PartitionError, partition, plan as make_plan
    from tests import zoo

    model, (x,), _ = zoo.mlp()
    made = make_plan(model, ["cpu", "cpu"], example_inputs=(x,), micro_batches=2)
    made.staleness = 1
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(PartitionError, match="staleness=1 .* torchrun"):
        partition(model, ["cpu", "cpu"], example_inputs=(x,), plan=made)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_split_stages_round_trip_and_are_checked() -> None:
    mlp = TensorParallelGroup("mlp", (ShardedParam("fc1.weight", "colwise", 0),
                                      ShardedParam("fc2.weight", "rowwise", 1)))
    plan = Plan([StagePlan(0, "cpu", ["a"], ranks=[0, 2], tensor=2, tensor_groups=[mlp], sharding="zero3"),
                 StagePlan(1, "cpu", ["b"], ranks=[4, 6], tensor=2, tensor_groups=[mlp], reads_from=[0])],
                data_split="slice", precision={"name": "mixed", "param": "float32"})
    back = Plan.from_json(plan.to_json())
    assert back.stages[0].tensor_groups == [mlp] and back.stages[0].sharding == "zero3"
    assert back.stages[1].rank_groups == [[4, 5], [6, 7]] and back.data_split == "slice"
    assert back.precision == {"name": "mixed", "param": "float32"}
    plain = Plan([StagePlan(0, "cpu", ["a"], ranks=[0])])
    assert "tensor" not in plain.to_json() and "data_split" not in plain.to_json()  # older readers read it
    for bad, words in [
        (Plan([StagePlan(0, "cpu", ["a"], ranks=[0, 1], tensor=2, tensor_groups=[mlp])]), "overlap"),
        (Plan([StagePlan(0, "cpu", ["a"], ranks=[0], tensor=2)]), "names no tensor_groups"),
        (Plan([StagePlan(0, "cpu", ["a"], ranks=[0, 1], sharding="zero2")]), "data_split='slice'"),
        (Plan([StagePlan(0, "cpu", ["a"], ranks=[0, 1]), StagePlan(1, "cpu", ["b"], ranks=[2])], data_split="slice"),
         "as many replicas"),
    ]:
        with pytest.raises(ValueError, match=words):
            bad.check()


def test_every_node_runs_in_exactly_one_stage() -> None:
    twice = Plan([StagePlan(0, "cpu", ["a", "b"]), StagePlan(1, "cpu", ["b", "c"])])
    with pytest.raises(ValueError, match=r"node 'b' is in stages 0, 1; a node runs in exactly one stage"):
        twice.check()
    graph = {"a": [], "b": ["a"], "c": ["b"], "d": ["a", "c"]}  # where the plan meets its graph (runtime.stage)
    make().check()  # alone, a plan cannot know which nodes its graph has
    with pytest.raises(ValueError, match=r"nodes 'd' \(1 in all\) are in no stage"):
        make().check(graph)
    with pytest.raises(ValueError, match=r"the plan names nodes the graph does not have: 'e'"):
        Plan([StagePlan(0, "cpu", ["a", "b", "e"]), StagePlan(1, "cpu", ["c", "d"])]).check(graph)
    with pytest.raises(ValueError, match=r"node 'b' \(stage 0\) reads 'a', which the plan runs after it \(stage 0\)"):
        Plan([StagePlan(0, "cpu", ["b", "a"]), StagePlan(1, "cpu", ["c", "d"])]).check(graph)
    Plan([StagePlan(0, "cpu", ["a", "b"]), StagePlan(1, "cpu", ["c", "d"])]).check(graph)


def test_a_sliced_plan_with_the_programs_the_runtime_lowers_checks() -> None:
    # every replica runs every micro-batch on its slice: programs count micro_batches x replicas (Plan.pieces)
    plan = Plan([StagePlan(0, "cpu", ["a"], ranks=[0, 1], sharding="zero3"),
                 StagePlan(1, "cpu", ["b"], ranks=[2, 3], sharding="zero3")], micro_batches=2, data_split="slice")
    plan.programs = plan_programs(plan)
    assert max(op.microbatch for p in plan.programs for op in p.ops if op.is_compute) == plan.pieces - 1 == 3
    plan.check()
    Plan.from_json(plan.to_json())


def test_expert_and_context_degrees_round_trip_default_and_are_checked() -> None:
    # pp 2 x dp 2: each stage's experts split over its 2 replicas, its sequence over 2 ranks per replica
    plan = Plan([StagePlan(0, "cpu", ["a"], ranks=[0, 2], expert=2, expert_layers=["layers.0.mlp.experts"],
                           context=2, context_attention=["layers.0.attn"]),
                 StagePlan(1, "cpu", ["b"], ranks=[4, 6], expert=2, expert_layers=["layers.1.mlp.experts"],
                           context=2, reads_from=[0])], data_split="slice")
    text = plan.to_json()
    back = Plan.from_json(text)
    assert back == plan and back.stages[0].rank_groups == [[0, 1], [2, 3]] and back.ranks == 8
    assert "context_attention" not in json.loads(text)["stages"][1]  # a field at its default is not written
    old = json.loads(make().to_json())  # a plan written before the fields existed loads with them at 1
    assert all(s.expert == 1 and s.context == 1 and not s.expert_layers for s in Plan.from_json(json.dumps(old)).stages)
    assert "expert" not in make().to_json() and "context" not in make().to_json()
    last = plan.summary().splitlines()[-1]
    assert "experts split 2 ways; sequence split 2 ways;" in last and "split" not in make().summary().splitlines()[-1]
    for bad, words in [
        (Plan([StagePlan(0, "cpu", ["a"], ranks=[0, 1], expert=2)], data_split="slice"), "names no expert_layers"),
        (Plan([StagePlan(0, "cpu", ["a"], ranks=[0, 1, 2], expert=2, expert_layers=["e"])], data_split="slice"),
         "use a divisor of 3"),
        (Plan([StagePlan(0, "cpu", ["a"], ranks=[0, 1], expert=2, expert_layers=["e"])]), "dispatch tokens"),
        (Plan([StagePlan(0, "cpu", ["a"], ranks=[0], context=2)]), "context=2: a replica's context ranks"),
        (Plan([StagePlan(0, "cpu", ["a"], ranks=[0], context_attention=["x"])]), "over context=1 rank"),
        (Plan([StagePlan(0, "cpu", ["a"], ranks=[0, 1], context=2)], data_split="slice"), "overlap"),
        (Plan([StagePlan(0, "cpu", ["a"], ranks=[0], context=2), StagePlan(1, "cpu", ["b"], ranks=[2])],
              data_split="slice"), "give every stage context=2"),
        (Plan([StagePlan(0, "cpu", ["a"], ranks=[0], context=2)], data_split="slice", staleness=1),
         "staleness=1 with experts or a sequence split"),
        (Plan([StagePlan(0, "cpu", ["a"], expert=0)]), r"stages\[0\].expert=0; use an integer >= 1"),
    ]:
        with pytest.raises(ValueError, match=words):
            bad.check()


def test_context_peers_get_their_replicas_program_and_send_gradients_back() -> None:
    # 2 stages, each one replica of 2 context ranks: ranks 1 and 3 run copies of ranks 0 and 2's programs, and
    # every context rank of stage 1 sends its stage input's gradient (whole, the same on both) to its own peer
    plan = Plan([StagePlan(0, "cpu", ["a"], ranks=[0], context=2),
                 StagePlan(1, "cpu", ["b"], ranks=[2], context=2, reads_from=[0])], micro_batches=2,
                data_split="slice")
    programs = [" ".join(map(str, p.ops)) for p in plan_programs(plan)]
    assert programs[1] == programs[0].replace(" r2 ", " r3 ") and programs[3] == programs[2].replace(" r0 ", " r1 ")
    assert "SEND s1->s0 mb0 r1" in programs[3] and "RECV s1->s0 mb0 r3" in programs[1]
