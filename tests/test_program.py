"""Per-rank programs against literal tables: GPipe on two ranks, 1F1B with a replicated stage, ZB-H1, text, errors."""

from __future__ import annotations

import pytest

from runtime.plan import Plan, StagePlan
from runtime.program import Op, format_program, lower, parse_program, plan_programs
from runtime.schedule import Action
from runtime.tensor_parallel_spec import ShardedParam, TensorParallelGroup


def texts(plan: Plan, groups: list[tuple[list[int], list[int]]] | None = None) -> list[str]:
    return [p.text() for p in plan_programs(plan, groups or [])]


def test_gpipe_two_ranks_literal() -> None:
    plan = Plan([StagePlan(0, "cuda:0", ["a"], ranks=[0]), StagePlan(1, "cuda:1", ["b"], ranks=[1], reads_from=[0])],
                micro_batches=2)
    assert texts(plan) == [
        "F s0 mb0 t0\nSEND s0->s1 mb0 r1 t0\nF s0 mb1 t1\nSEND s0->s1 mb1 r1 t1\n"
        "RECV s1->s0 mb1 r1 t3\nB s0 mb1 t4\nRECV s1->s0 mb0 r1 t4\nB s0 mb0 t5\nSTEP",
        "RECV s0->s1 mb0 r0 t0\nF s1 mb0 t1\nRECV s0->s1 mb1 r0 t1\nF s1 mb1 t2\n"
        "B s1 mb1 t3\nSEND s1->s0 mb1 r0 t3\nB s1 mb0 t4\nSEND s1->s0 mb0 r0 t4\nSTEP",
    ]
    assert [p.device for p in plan_programs(plan)] == ["cuda:0", "cuda:1"]


def replicated_1f1b() -> Plan:
    """Stage 0 on ranks 0 and 1 (micro-batches in turn), stage 1 on rank 2; 1F1B, m = 4."""
    return Plan(
        [StagePlan(0, "cuda:0", ["a"], ranks=[0, 1]), StagePlan(1, "cuda:1", ["b"], ranks=[2], reads_from=[0])],
        micro_batches=4, schedule="1f1b",
    )


def test_one_f_one_b_with_a_replicated_stage_literal() -> None:
    assert texts(replicated_1f1b(), [([0, 1], [0])]) == [
        "F s0 mb0 t0\nSEND s0->s1 mb0 r2 t0\nRECV s1->s0 mb0 r2 t2\nB s0 mb0 t3\n"
        "F s0 mb2 t4\nSEND s0->s1 mb2 r2 t4\nRECV s1->s0 mb2 r2 t6\nB s0 mb2 t7\nAR r0,1 t9\nSTEP",
        "F s0 mb1 t0\nSEND s0->s1 mb1 r2 t0\nRECV s1->s0 mb1 r2 t4\nB s0 mb1 t5\n"
        "F s0 mb3 t6\nSEND s0->s1 mb3 r2 t6\nRECV s1->s0 mb3 r2 t8\nB s0 mb3 t9\nAR r0,1 t9\nSTEP",
        "RECV s0->s1 mb0 r0 t0\nRECV s0->s1 mb1 r1 t0\nF s1 mb0 t1\nB s1 mb0 t2\nSEND s1->s0 mb0 r0 t2\n"
        "F s1 mb1 t3\nB s1 mb1 t4\nRECV s0->s1 mb2 r0 t4\nSEND s1->s0 mb1 r1 t4\nF s1 mb2 t5\nB s1 mb2 t6\n"
        "RECV s0->s1 mb3 r1 t6\nSEND s1->s0 mb2 r0 t6\nF s1 mb3 t7\nB s1 mb3 t8\nSEND s1->s0 mb3 r1 t8\nSTEP",
    ]


def test_allreduce_follows_the_groups_last_backward_on_every_member() -> None:
    programs = plan_programs(replicated_1f1b(), [([0, 1], [0])])
    last = max(op.tick for p in programs for op in p.ops if op.kind == "B" and op.stage == 0)
    for p in programs[:2]:
        (k,) = [i for i, op in enumerate(p.ops) if op.kind == "AR"]
        assert p.ops[k].group == (0, 1) and p.ops[k].tick == last
        assert all(op.tick <= last for op in p.ops[:k] if op.kind != "STEP")  # nothing of a later tick before it
        assert [op.kind for op in p.ops[k + 1:]] == ["STEP"]
    assert not any(op.kind == "AR" for op in programs[2].ops)  # rank 2 holds no weight of the group
    assert not any(op.kind == "AR" for p in plan_programs(replicated_1f1b()) for op in p.ops)  # no group, no AR


def test_forward_only_drops_backwards_and_reduces() -> None:
    programs = plan_programs(replicated_1f1b(), [([0, 1], [0])], forward_only=True)
    kinds = {op.kind for p in programs for op in p.ops}
    assert kinds == {"F", "SEND", "RECV", "STEP"}
    assert not any(op.gradient for p in programs for op in p.ops if op.is_p2p)


def test_text_round_trip() -> None:
    ops = [Op("F", stage=1, microbatch=3, tick=4), Op("B", stage=0, microbatch=12, tick=30),
           Op("SEND", microbatch=3, src=1, dst=2, peer=2, tick=4),
           Op("RECV", microbatch=0, src=2, dst=1, peer=5, tick=9),
           Op("AR", group=(0, 1, 3), tick=9), Op("STEP")]  # fmt: skip
    text = format_program(ops)
    assert text.splitlines() == ["F s1 mb3 t4", "B s0 mb12 t30", "SEND s1->s2 mb3 r2 t4", "RECV s2->s1 mb0 r5 t9",
                                 "AR r0,1,3 t9", "STEP"]  # fmt: skip
    assert parse_program(text) == ops
    commented = "# rank 0\nF s0 mb0 t0   # first\n\nSTEP\n"
    assert parse_program(commented) == [Op("F", stage=0, microbatch=0, tick=0), Op("STEP")]
    for program in plan_programs(replicated_1f1b(), [([0, 1], [0])]):
        assert parse_program(program.text()) == program.ops
    with pytest.raises(ValueError, match="cannot parse op 'F s1 t4'"):
        Op.parse("F s1 t4")


def test_plan_json_keeps_programs_as_text() -> None:
    plan = replicated_1f1b()
    plan.programs = plan_programs(plan, [([0, 1], [0])])
    plan.programs[0].predicted = [(float(i), float(i) + 0.5) for i in range(len(plan.programs[0].ops))]
    loaded = Plan.from_json(plan.to_json())
    assert loaded == plan and loaded.ranks == 3
    assert '"AR r0,1 t9"' in plan.to_json()


def test_deadlock_is_named() -> None:
    # Rank 1 wants 1B0 first, which needs 1F0, which comes after it in the same list.
    schedule = [[Action(0, "F", 0), Action(0, "B", 0)], [Action(1, "B", 0), Action(1, "F", 0)]]
    waits = r"\(rank 0 at 0B0; rank 1 at 1B0\)"
    with pytest.raises(ValueError, match=r"the schedule deadlocks: no rank can run its next action " + waits):
        lower(schedule, [[], [0]], [[0], [1]], ["cpu", "cpu"])


def test_actions_on_the_wrong_rank_are_errors_and_idle_ranks_only_step() -> None:
    with pytest.raises(ValueError, match="rank 0's schedule runs 0F1, but stage 0 runs micro-batch 1 on rank 1"):
        lower([[Action(0, "F", 0), Action(0, "F", 1)], []], [[]], [[0, 1]], ["cpu", "cpu"])
    plan = Plan([StagePlan(0, "cpu", ["a"], ranks=[0]), StagePlan(1, "cpu", ["b"], ranks=[2], reads_from=[0])])
    idle = plan_programs(plan, devices={1: "cuda:1"})[1]  # a rank with no stage only ends the step
    assert (idle.device, [str(op) for op in idle.ops]) == ("cuda:1", ["STEP"])


def zb1_two_ranks() -> Plan:
    return Plan([StagePlan(0, "cpu", ["a"], ranks=[0]), StagePlan(1, "cpu", ["b"], ranks=[1], reads_from=[0])],
                micro_batches=2, schedule="zb1")


def test_zero_bubble_literal_split_backwards_and_w_moves_nothing() -> None:
    # rank 0: 0F0 0F1 0B0 0W0 0B1 0W1; rank 1: 1F0 1B0 1F1 1B1 1W0 1W1 (runtime.schedule.zero_bubble_h1)
    assert texts(zb1_two_ranks()) == [
        "F s0 mb0 t0\nSEND s0->s1 mb0 r1 t0\nF s0 mb1 t1\nSEND s0->s1 mb1 r1 t1\nRECV s1->s0 mb0 r1 t2\n"
        "B s0 mb0 t3 split\nW s0 mb0 t4\nRECV s1->s0 mb1 r1 t4\nB s0 mb1 t5 split\nW s0 mb1 t6\nSTEP",
        "RECV s0->s1 mb0 r0 t0\nF s1 mb0 t1\nRECV s0->s1 mb1 r0 t1\nB s1 mb0 t2 split\nSEND s1->s0 mb0 r0 t2\n"
        "F s1 mb1 t3\nB s1 mb1 t4 split\nSEND s1->s0 mb1 r0 t4\nW s1 mb0 t5\nW s1 mb1 t6\nSTEP",
    ]
    for program in plan_programs(zb1_two_ranks()):
        assert parse_program(program.text()) == program.ops  # 'split' survives the text
    assert Op.parse("B s2 mb0 t1 split") == Op("B", stage=2, microbatch=0, tick=1, split=True)
    with pytest.raises(ValueError, match="cannot parse op 'W s1 mb0 t3 split'"):
        Op.parse("W s1 mb0 t3 split")


def test_zero_bubble_allreduce_follows_the_last_w_and_forward_only_drops_w() -> None:
    programs = plan_programs(zb1_two_ranks(), [([0, 1], [0, 1])])  # a weight both stages read
    for p in programs:
        assert [str(op) for op in p.ops[-2:]] == ["AR r0,1 t6", "STEP"]  # after W s0 mb1 t6 and W s1 mb1 t6
    forward = plan_programs(zb1_two_ranks(), forward_only=True)
    assert {op.kind for p in forward for op in p.ops} == {"F", "SEND", "RECV", "STEP"}


def test_a_w_without_its_b_or_an_action_twice_is_named() -> None:
    with pytest.raises(ValueError, match=r"deadlocks: no rank can run its next action \(rank 0 at 0W1\)"):
        lower([[Action(0, "F", 0), Action(0, "B", 0), Action(0, "W", 1)]], [[]], [[0]], ["cpu"])
    with pytest.raises(ValueError, match="0F0 is listed twice"):
        lower([[Action(0, "F", 0), Action(0, "F", 0)]], [[]], [[0]], ["cpu"])


def test_a_stage_that_recomputes_selectively_runs_its_backward_whole() -> None:
    plan = zb1_two_ranks()
    plan.stages[1].recompute = "selective"  # torch's selective checkpoint allows one backward per region
    rank0, rank1 = plan_programs(plan)
    assert any(op.kind == "W" for op in rank0.ops) and all(op.split for op in rank0.ops if op.kind == "B")
    assert not any(op.kind == "W" or op.split for op in rank1.ops)


SPLIT = [TensorParallelGroup("g", (ShardedParam("w", "colwise", 0),))]


def test_split_layers_copy_each_program_to_the_tensor_peers_literal() -> None:
    # stage 0 split over ranks 0 and 1, stage 1 whole on rank 2: each peer of stage 0 receives the gradients from
    # rank 2 (index k mod 1), and stage 0's activations go to rank 2 from index 0 only (k_b mod 2 == 0)
    plan = Plan([StagePlan(0, "cpu", ["a"], ranks=[0], tensor=2, tensor_groups=SPLIT),
                 StagePlan(1, "cpu", ["b"], ranks=[2], reads_from=[0])], micro_batches=2)
    assert texts(plan) == [
        "F s0 mb0 t0\nSEND s0->s1 mb0 r2 t0\nF s0 mb1 t1\nSEND s0->s1 mb1 r2 t1\n"
        "RECV s1->s0 mb1 r2 t3\nB s0 mb1 t4\nRECV s1->s0 mb0 r2 t4\nB s0 mb0 t5\nSTEP",
        "F s0 mb0 t0\nF s0 mb1 t1\nRECV s1->s0 mb1 r2 t3\nB s0 mb1 t4\nRECV s1->s0 mb0 r2 t4\nB s0 mb0 t5\nSTEP",
        "RECV s0->s1 mb0 r0 t0\nF s1 mb0 t1\nRECV s0->s1 mb1 r0 t1\nF s1 mb1 t2\nB s1 mb1 t3\n"
        "SEND s1->s0 mb1 r0 t3\nSEND s1->s0 mb1 r1 t3\nB s1 mb0 t4\nSEND s1->s0 mb0 r0 t4\nSEND s1->s0 mb0 r1 t4\nSTEP",
    ]


def test_one_weird_trick_data_parallel_then_split_literal() -> None:
    # convolutions on 2 replicas dealt micro-batches (ranks 0, 1), fully connected layers split over ranks 2, 3: a
    # replica sends its activations to both tensor ranks; gradients come back from index 0; the replicas all-reduce
    plan = Plan([StagePlan(0, "cpu", ["a"], ranks=[0, 1]),
                 StagePlan(1, "cpu", ["b"], ranks=[2], tensor=2, tensor_groups=SPLIT, reads_from=[0])],
                micro_batches=2)
    assert texts(plan, [([0, 1], [0])]) == [
        "F s0 mb0 t0\nSEND s0->s1 mb0 r2 t0\nSEND s0->s1 mb0 r3 t0\nRECV s1->s0 mb0 r2 t4\nB s0 mb0 t5\n"
        "AR r0,1 t5\nSTEP",
        "F s0 mb1 t0\nSEND s0->s1 mb1 r2 t0\nSEND s0->s1 mb1 r3 t0\nRECV s1->s0 mb1 r2 t3\nB s0 mb1 t4\n"
        "AR r0,1 t5\nSTEP",
        "RECV s0->s1 mb0 r0 t0\nRECV s0->s1 mb1 r1 t0\nF s1 mb0 t1\nF s1 mb1 t2\nB s1 mb1 t3\n"
        "SEND s1->s0 mb1 r1 t3\nB s1 mb0 t4\nSEND s1->s0 mb0 r0 t4\nSTEP",
        "RECV s0->s1 mb0 r0 t0\nRECV s0->s1 mb1 r1 t0\nF s1 mb0 t1\nF s1 mb1 t2\nB s1 mb1 t3\nB s1 mb0 t4\nSTEP",
    ]


def test_sliced_sharded_replicas_run_the_dealt_plan_and_reduce_per_tensor_index_literal() -> None:
    # 2 stages x 2 replicas x tensor 2 (8 ranks), one micro-batch sliced over the replicas: as 2 micro-batches
    # dealt; stage 0 is sharded (FSDP2 reduces its weights: no AR), stage 1 is not: AR per tensor index
    plan = Plan([StagePlan(0, "cpu", ["a"], ranks=[0, 2], tensor=2, tensor_groups=SPLIT, sharding="zero3"),
                 StagePlan(1, "cpu", ["b"], ranks=[4, 6], tensor=2, tensor_groups=SPLIT, reads_from=[0])],
                micro_batches=1, schedule="1f1b", data_split="slice")
    assert texts(plan, [([0, 2], [0]), ([4, 6], [1])]) == [
        "F s0 mb0 t0\nSEND s0->s1 mb0 r4 t0\nRECV s1->s0 mb0 r4 t2\nB s0 mb0 t3\nSTEP",
        "F s0 mb0 t0\nSEND s0->s1 mb0 r5 t0\nRECV s1->s0 mb0 r5 t2\nB s0 mb0 t3\nSTEP",
        "F s0 mb1 t0\nSEND s0->s1 mb1 r6 t0\nRECV s1->s0 mb1 r6 t2\nB s0 mb1 t3\nSTEP",
        "F s0 mb1 t0\nSEND s0->s1 mb1 r7 t0\nRECV s1->s0 mb1 r7 t2\nB s0 mb1 t3\nSTEP",
        "RECV s0->s1 mb0 r0 t0\nF s1 mb0 t1\nB s1 mb0 t2\nSEND s1->s0 mb0 r0 t2\nAR r4,6 t2\nSTEP",
        "RECV s0->s1 mb0 r1 t0\nF s1 mb0 t1\nB s1 mb0 t2\nSEND s1->s0 mb0 r1 t2\nAR r5,7 t2\nSTEP",
        "RECV s0->s1 mb1 r2 t0\nF s1 mb1 t1\nB s1 mb1 t2\nSEND s1->s0 mb1 r2 t2\nAR r4,6 t2\nSTEP",
        "RECV s0->s1 mb1 r3 t0\nF s1 mb1 t1\nB s1 mb1 t2\nSEND s1->s0 mb1 r3 t2\nAR r5,7 t2\nSTEP",
    ]


def test_split_interleaved_lowers_over_the_first_ranks_and_pairs_agree() -> None:
    plan = Plan([StagePlan(s, "cpu", [str(s)], ranks=[2 * (s % 2)], tensor=2, tensor_groups=SPLIT,
                           reads_from=[s - 1] if s else []) for s in range(4)],
                micro_batches=2, schedule="interleaved", virtual_stages=2)
    programs = plan_programs(plan)
    assert [p.compute() for p in programs[:2]] == [programs[0].compute()] * 2  # peers run their first rank's compute
    for a in programs:  # every pair posts the same messages in the same order, each side seen from the other
        for b in programs:
            sent = [(op.key(), op.tick) for op in a.ops if op.kind == "SEND" and op.peer == b.rank]
            got = [(op.key(), op.tick) for op in b.ops if op.kind == "RECV" and op.peer == a.rank]
            assert sent == got


def test_a_weight_shared_by_stages_of_other_tensor_degrees_is_named() -> None:
    plan = Plan([StagePlan(0, "cpu", ["a"], ranks=[0], tensor=2, tensor_groups=SPLIT),
                 StagePlan(1, "cpu", ["b"], ranks=[2], reads_from=[0])], micro_batches=2)
    with pytest.raises(ValueError, match=r"hold \[2, 1\] ranks per replica; stages sharing a weight need one "
                                         r"tensor and context degree"):
        plan_programs(plan, [([0, 2], [0, 1])])
