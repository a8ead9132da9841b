"""Simulator and schedule checker against closed forms and hand-computed timelines: schedules and programs."""

from __future__ import annotations

from dataclasses import replace

import pytest

from partitioner.predict.simulator import (
    ALLREDUCE,
    BACKWARD,
    FORWARD,
    IDLE,
    RECV,
    SEND,
    Event,
    ScheduleError,
    Timeline,
    check_schedule,
    simulate,
)
from runtime.plan import Plan, StagePlan
from runtime.program import plan_programs
from runtime.schedule import Action, gpipe, interleaved_one_f_one_b, one_f_one_b, parse_schedule


def equal_plan(stages: int, micro_batches: int, forward: float = 1.0, backward: float = 2.0) -> Plan:
    return Plan(
        stages=[StagePlan(s, f"cuda:{s}", [], forward_ms=forward, backward_ms=backward) for s in range(stages)],
        micro_batches=micro_batches,
    )


# (p, m, makespan (m + p - 1) * 3 ms, bubble (p - 1) / (m + p - 1))
GPIPE_CASES = [
    (1, 3, 9.0, 0.0),
    (2, 1, 6.0, 1 / 2),
    (2, 4, 15.0, 1 / 5),
    (3, 5, 21.0, 2 / 7),
    (4, 4, 21.0, 3 / 7),
    (4, 8, 33.0, 3 / 11),
]


@pytest.mark.parametrize("p, m, makespan, bubble", GPIPE_CASES)
def test_gpipe_bubble_closed_form(p: int, m: int, makespan: float, bubble: float) -> None:
    timeline = simulate(equal_plan(p, m), gpipe(m, p))
    assert timeline.makespan_ms == makespan
    assert timeline.bubble_fraction == pytest.approx(bubble, abs=1e-12)
    assert [d.busy_ms for d in timeline.devices] == [3.0 * m] * p
    assert [d.idle_ms for d in timeline.devices] == [makespan - 3.0 * m] * p
    assert timeline.peak_in_flight == [m] * p


@pytest.mark.parametrize("p, m, makespan, bubble", GPIPE_CASES)
def test_one_f_one_b_same_bubble_as_gpipe(p: int, m: int, makespan: float, bubble: float) -> None:
    timeline = simulate(equal_plan(p, m), one_f_one_b(m, p))
    assert timeline.makespan_ms == makespan
    assert timeline.bubble_fraction == pytest.approx(bubble, abs=1e-12)


@pytest.mark.parametrize(
    "p, m, peak",
    [(4, 8, [4, 3, 2, 1]), (4, 2, [2, 2, 2, 1]), (3, 3, [3, 2, 1]), (1, 5, [1])],
)
def test_one_f_one_b_in_flight_is_p_minus_s(p: int, m: int, peak: list[int]) -> None:
    assert check_schedule(one_f_one_b(m, p), p, m).peak_in_flight == peak
    assert simulate(equal_plan(p, m), one_f_one_b(m, p)).peak_in_flight == peak


def test_interleaved_bubble_shrinks_by_v() -> None:
    # p=2 devices, v=2 stages each of half the work: makespan 3 (m + (p - 1) / v) = 13.5 ms.
    plan = Plan([StagePlan(s, f"cuda:{s % 2}", [], forward_ms=0.5, backward_ms=1.0) for s in range(4)], micro_batches=4)
    timeline = simulate(plan, interleaved_one_f_one_b(4, 2, 2))
    assert timeline.makespan_ms == 13.5
    assert [d.stages for d in timeline.devices] == [[0, 2], [1, 3]]
    assert timeline.bubble_fraction == pytest.approx(1 / 9, abs=1e-12)


def test_transfers_hand_computed() -> None:
    # Stage 1 receives 100 bytes; comm_ms=1.0 covers both directions, so each way takes 0.5 ms.
    plan = equal_plan(2, 2)
    plan.stages[1].comm_ms, plan.stages[1].recv_bytes = 1.0, 100
    timeline = simulate(plan, gpipe(2, 2))
    assert timeline.makespan_ms == 10.0
    assert timeline.devices[1].events == [
        Event(IDLE, -1, -1, 0.0, 1.0),
        Event(RECV, 1, 0, 1.0, 1.5, peer=0),
        Event(FORWARD, 1, 0, 1.5, 2.5),
        Event(RECV, 1, 1, 2.0, 2.5, peer=0),
        Event(FORWARD, 1, 1, 2.5, 3.5),
        Event(BACKWARD, 1, 1, 3.5, 5.5),
        Event(SEND, 1, 1, 5.5, 6.0, peer=0),
        Event(BACKWARD, 1, 0, 5.5, 7.5),
        Event(SEND, 1, 0, 7.5, 8.0, peer=0),
        Event(IDLE, -1, -1, 8.0, 10.0),
    ]
    assert [(e.kind, e.start, e.end) for e in timeline.devices[0].events if e.kind in (FORWARD, BACKWARD)] == [
        (FORWARD, 0.0, 1.0),
        (FORWARD, 1.0, 2.0),
        (BACKWARD, 6.0, 8.0),
        (BACKWARD, 8.0, 10.0),
    ]
    assert timeline.chart(0.5) == "device 0 FFFF~......~BBBBBBBB\ndevice 1 ..~FFFFBBBBBBBB~...."
    assert "bubble 40.0%" in timeline.summary()


def test_link_carries_one_transfer_at_a_time() -> None:
    # 2 ms transfers, 1 ms forwards: activations queue on the link at 1-3, 3-5, 5-7.
    timeline = simulate(equal_plan(2, 3), gpipe(3, 2), transfer_ms=lambda src, dst, nbytes: 2.0)
    sends = [(e.start, e.end) for e in timeline.devices[0].events if e.kind == SEND]
    assert sends == [(1.0, 3.0), (3.0, 5.0), (5.0, 7.0)]
    computes = [(e.kind, e.microbatch, e.start) for e in timeline.devices[1].events if e.kind in (FORWARD, BACKWARD)]
    assert computes == [
        (FORWARD, 0, 3.0), (FORWARD, 1, 5.0), (FORWARD, 2, 7.0),
        (BACKWARD, 2, 8.0), (BACKWARD, 1, 10.0), (BACKWARD, 0, 12.0),
    ]  # fmt: skip
    assert timeline.makespan_ms == 18.0


def test_allreduce_after_last_backward() -> None:
    timeline = simulate(equal_plan(2, 2), gpipe(2, 2), allreduce_ms={0: 1.5, 1: 0.5})
    reduces = [[(e.stage, e.start, e.end) for e in d.events if e.kind == ALLREDUCE] for d in timeline.devices]
    assert reduces == [[(0, 9.0, 10.5)], [(1, 7.0, 7.5)]]
    assert timeline.makespan_ms == 10.5
    assert [d.comm_ms for d in timeline.devices] == [1.5, 0.5]


def test_checker_counts_ticks() -> None:
    assert check_schedule(gpipe(3, 2), 2, 3).ticks == 8  # 2 (m + p - 1)
    result = check_schedule(one_f_one_b(4, 3), 3, 4)
    assert (result.ticks, result.stage_device) == (12, [0, 1, 2])


def test_checker_rejects_deadlock() -> None:
    # Device 1 wants 1F1 first, which needs 0F1, which is behind 0B0, which needs 1B0.
    schedule = parse_schedule("0F0 0B0 0F1 0B1\n1F1 1F0 1B0 1B1")
    with pytest.raises(ScheduleError, match="deadlocks") as error:
        check_schedule(schedule, 2, 2)
    assert "device 0 position 1: 0B0 needs 1B0 (device 1 position 2)" in str(error.value)
    assert "device 1 position 0: 1F1 needs 0F1 (device 0 position 2)" in str(error.value)
    with pytest.raises(ScheduleError, match="0B0 needs 0F0"):
        check_schedule(parse_schedule("0B0 0F0\n1F0 1B0"), 2, 1)


def test_checker_rejects_incomplete_and_repeated() -> None:
    schedule = gpipe(2, 2)
    schedule[1].pop()  # drop 1B0
    schedule[0].append(Action(0, "F", 0))
    schedule[0].append(Action(0, "F", 5))
    with pytest.raises(ScheduleError) as error:
        check_schedule(schedule, 2, 2)
    assert str(error.value) == (
        "invalid schedule:\n"
        "- 0F0 appears twice: device 0 position 0 and device 0 position 4\n"
        "- device 0 position 5: 0F5 is outside 2 stages x 2 micro-batches\n"
        "- 1 actions missing: 1B0"
    )
    with pytest.raises(ScheduleError, match=r"stage 0 runs on devices \[0, 1\]"):
        check_schedule(parse_schedule("0F0\n0B0"), 1, 1)
    with pytest.raises(TypeError, match="schedule\\[0\\]\\[0\\] is '0F0', not an Action"):
        check_schedule([["0F0"]], 1, 1)  # type: ignore[list-item]
    with pytest.raises(ScheduleError, match="outside 2 stages"):
        simulate(equal_plan(2, 1), gpipe(1, 3))


# ---- programs: what the runtime runs (runtime.program), priced ----


def chain(stages: int, micro_batches: int, schedule: str = "gpipe") -> Plan:
    plan = equal_plan(stages, micro_batches)
    plan.schedule = schedule  # type: ignore[assignment]
    for s in plan.stages:
        s.ranks, s.reads_from = [s.index], [s.index - 1] if s.index else []
    return plan


@pytest.mark.parametrize("p, m, makespan, bubble", GPIPE_CASES)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_programs_have_the_closed_form_bubble(p: int, m: int, makespan: float, bubble: float, schedule: str) -> None:
    plan = chain(p, m, schedule)
    plan.programs = plan_programs(plan)
    timeline = simulate(plan)
    assert timeline.makespan_ms == makespan
    assert timeline.bubble_fraction == pytest.approx(bubble, abs=1e-12)
    assert [len(times) for times in timeline.predicted] == [len(prog.ops) for prog in plan.programs]
    assert simulate(chain(p, m, schedule)).makespan_ms == makespan  # no programs yet: lowered on the fly


def test_replicated_last_stage_allreduce_overlaps_compute_and_ends_the_step() -> None:
    # Stage 1 on ranks 1 and 2 (one micro-batch each), all-reduce 1.5 ms: rank 1 posts it at 4,
    # rank 2 at 5, so it runs 5 .. 6.5 beside rank 0's backward (5 .. 7); the step ends at 9.
    plan = Plan([StagePlan(0, "cuda:0", [], forward_ms=1.0, backward_ms=2.0, ranks=[0]),
                 StagePlan(1, "cuda:1", [], forward_ms=1.0, backward_ms=2.0, allreduce_ms=1.5, ranks=[1, 2],
                           reads_from=[0])], micro_batches=2)  # fmt: skip
    plan.programs = plan_programs(plan, [([1, 2], [1])])
    timeline = simulate(plan)
    reduces = [[(e.stage, e.start, e.end) for e in row] for row in timeline.events(ALLREDUCE)]
    assert reduces == [[], [(1, 5.0, 6.5)], [(1, 5.0, 6.5)]]
    assert timeline.makespan_ms == 9.0
    assert timeline.chart(0.5).splitlines() == [
        "device 0 FFFF......BBBBBBBB", "device 1 ..FFBBBB..~~~.....", "device 2 ....FFBBBB~~~.....",
    ]
    ar = [times[k] for prog, times in zip(plan.programs, timeline.predicted)
          for k, op in enumerate(prog.ops) if op.kind == "AR"]
    assert ar == [(5.0, 6.5), (5.0, 6.5)]
    plan.stages[1].allreduce_ms = 4.5  # long enough to end the step: 5 + 4.5
    assert simulate(plan).makespan_ms == 9.5
    assert simulate(plan, group_ms={(1, 2): 0.5}).makespan_ms == 9.0


def test_recorded_prices_reproduce_the_prediction() -> None:
    plan = chain(2, 3)
    plan.programs = plan_programs(plan)
    first = simulate(plan, transfer_ms=lambda src, dst, nbytes: 0.25 if src < dst else 0.75)
    for prog, times in zip(plan.programs, first.predicted):
        prog.predicted = times
    again = simulate(plan)  # no prices given: the durations the programs recorded
    assert again.predicted == first.predicted and again.makespan_ms == first.makespan_ms
    sends = [(e.start, e.end) for e in again.devices[1].events if e.kind == SEND]
    assert [round(b - a, 9) for a, b in sends] == [0.75, 0.75, 0.75]


def test_programs_that_cannot_finish_are_an_error() -> None:
    plan = chain(2, 1)
    plan.programs = plan_programs(plan)
    plan.programs[1].ops = [op for op in plan.programs[1].ops if op.kind != "SEND"]  # a gradient never sent
    with pytest.raises(ScheduleError, match=r"programs deadlock: no rank can run its next op \(rank 0 at 'B s0 mb0 t3"):
        simulate(plan)


def test_weight_gradients_are_their_own_kind_predicted_measured_and_drawn() -> None:
    """A zero-bubble plan's W ops are WEIGHT events in the simulated timeline and "weight" events in what a
    traced step records, and the plan page draws them as W (what is drawn is what runs)."""
    import torch.nn.functional as F

    from partitioner import partition, plan as make_plan
    from partitioner.predict.simulator import WEIGHT, simulate
    from partitioner.show.rows import timeline_data
    from tests import zoo

    model, (x,), _ = zoo.tiny_gpt()
    made = make_plan(model, ["cpu", "cpu"], example_inputs=(x,), micro_batches=2, schedule="zb1")
    timeline = simulate(made)
    weights = [e for row in timeline.events(WEIGHT) for e in row]
    assert len(weights) == 2 * 2 and "W" in timeline.chart(timeline.makespan_ms / 60)
    pipe = partition(model, ["cpu", "cpu"], example_inputs=(x,), micro_batches=2, plan=made)
    pipe.tracing = True
    pipe.train_step(x, x, lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()))
    measured = pipe.measured_timeline()
    kinds = [e["kind"] for d in measured["devices"] for e in d["events"]]
    assert kinds.count("weight") == 4 and kinds.count("backward") == 4
    drawn = timeline_data(measured, "measured")
    assert sum(e["kind"] == "W" for row in drawn["rows"] for e in row["events"]) == 4


# ---- the closed form at every size, and folded replicas at scale ----


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", range(2, 9))
def test_uniform_stages_bubble_is_the_closed_form(schedule: str, p: int) -> None:
    # Equal forward and backward (1.5 ms each), free transfers: every device computes 3 m ms of a
    # (m + p - 1) * 3 ms step, so the bubble (idle share of device time) is (p - 1) / (m + p - 1).
    generate = gpipe if schedule == "gpipe" else one_f_one_b
    for m in range(1, 17):
        plan = chain(p, m, schedule)
        for s in plan.stages:
            s.forward_ms = s.backward_ms = 1.5
        for timeline in (simulate(plan, generate(m, p)), simulate(plan)):  # the schedule, and the programs
            assert timeline.makespan_ms == pytest.approx((m + p - 1) * 3.0, abs=1e-9), (p, m)
            assert timeline.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-12), (p, m)


def replicated(replicas: int, micro_batches: int, schedule: str = "gpipe") -> Plan:
    """2 stages x `replicas` data-parallel replicas; stage 0 on ranks 0..R-1, stage 1 on R..2R-1."""
    plan = Plan([StagePlan(0, "cuda:0", [], forward_ms=1.0, backward_ms=2.0, allreduce_ms=2.5,
                           ranks=list(range(replicas))),
                 StagePlan(1, "cuda:1", [], forward_ms=1.5, backward_ms=2.0, allreduce_ms=0.7, comm_ms=0.4,
                           recv_bytes=100, ranks=list(range(replicas, 2 * replicas)), reads_from=[0])],
                micro_batches=micro_batches)  # fmt: skip
    plan.schedule = schedule  # type: ignore[assignment]
    return plan


def by_rank(timeline: Timeline, events: list[Event]) -> list[Event]:
    """Events with `peer` the first rank of the peer row (a folded timeline's rows are not ranks)."""
    return [replace(e, peer=timeline.devices[e.peer].ranks[0]) if e.peer >= 0 else e for e in events]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb1"])
@pytest.mark.parametrize("replicas, m", [(2, 4), (4, 8), (4, 4), (3, 12)])
def test_folded_replicas_equal_the_rank_by_rank_simulation(schedule: str, replicas: int, m: int) -> None:
    plan = replicated(replicas, m, schedule)
    plan.programs = plan_programs(plan, [(s.ranks, [s.index]) for s in plan.stages])
    every = simulate(plan, rows="ranks")
    folded = simulate(plan)
    assert len(every.devices) == 2 * replicas and len(folded.devices) == 2
    assert folded.makespan_ms == every.makespan_ms
    assert folded.predicted == every.predicted  # every program's times, not only the representatives'
    assert folded.bubble_fraction == pytest.approx(every.bubble_fraction, abs=1e-12)
    assert folded.ranks == every.ranks == 2 * replicas
    for row in folded.devices:  # a row is its first rank's, and it stands for that stage's replicas
        assert by_rank(folded, row.events) == every.devices[row.ranks[0]].events
        assert sorted(row.ranks) == plan.stages[row.stages[0]].ranks
    lowered_here = replicated(replicas, m, schedule)  # no programs: only the representatives are lowered
    alone = simulate(lowered_here)
    assert alone.makespan_ms == every.makespan_ms and [d.events for d in alone.devices] == [
        d.events for d in folded.devices]
    assert alone.predicted == [every.predicted[0], every.predicted[replicas]]


def test_replicas_that_differ_are_simulated_one_by_one() -> None:
    # 6 micro-batches over 4 replicas: replicas 0 and 1 run two, 2 and 3 run one; no fold.
    plan = replicated(4, 6)
    assert len(simulate(plan).devices) == 8
    assert simulate(plan).makespan_ms == simulate(plan, rows="ranks").makespan_ms
    plan = replicated(2, 4)
    plan.programs = plan_programs(plan, [(s.ranks, [s.index]) for s in plan.stages])
    plan.programs[1].ops[0] = replace(plan.programs[1].ops[0], tick=99)  # not replica 0's program renumbered
    assert len(simulate(plan).devices) == 4


@pytest.mark.timeout(120)
def test_16384_ranks_simulate_as_two_rows() -> None:
    # 2 stages x 8192 replicas, 2 micro-batches each, free transfers. One replica by hand: stage 0
    # F 0-1, 1-2, B 5-7, 7-9, all-reduce 9-11.5; stage 1 F 1-2, 2-3, B 3-5, 5-7, all-reduce 7-7.7.
    plan = replicated(8192, 16384)
    plan.stages[1].forward_ms, plan.stages[1].comm_ms = 1.0, 0.0
    timeline = simulate(plan)
    assert timeline.makespan_ms == 11.5
    assert timeline.ranks == 16384 and len(timeline.devices) == 2
    small = replicated(2, 4)
    small.stages[1].forward_ms, small.stages[1].comm_ms = 1.0, 0.0
    assert timeline.makespan_ms == simulate(small, rows="ranks").makespan_ms
    assert timeline.bubble_fraction == pytest.approx(1 - 6 / 11.5, abs=1e-12)
    chart = timeline.chart(0.5).splitlines()
    assert chart == [
        "ranks 0-8191 (8192 replicas)     FFFF......BBBBBBBB~~~~~",
        "ranks 8192-16383 (8192 replicas) ..FFFFBBBBBBBB~........",
    ]
    summary = timeline.summary()
    assert "cuda:0 ranks 0-8191 (8192 replicas)" in summary and "16384 ranks in 2 rows" in summary
