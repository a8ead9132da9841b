"""simulate(plan, calibration=...) on literal programs against hand-computed timelines; the fit on a synthetic trace."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from cost_model.calibration import CALIBRATION_VERSION, Calibration, fit_calibration
from partitioner.predict.simulator import ALLREDUCE, simulate
from runtime.plan import Plan, StagePlan
from runtime.program import Op, Program, plan_programs


def two_independent_cpu_ranks(forward: float = 2.0) -> Plan:
    """Two stages that read nothing from each other, one forward each, on ranks 0 and 1 of one host."""
    plan = Plan([StagePlan(0, "cpu", [], forward_ms=forward, ranks=[0]),
                 StagePlan(1, "cpu", [], forward_ms=forward, ranks=[1])], micro_batches=1)  # fmt: skip
    plan.programs = [Program(r, "cpu", [Op.parse(f"F s{r} mb0 t0"), Op("STEP")]) for r in range(2)]
    return plan


def test_two_ranks_on_one_core_each_run_at_half_speed() -> None:
    plan = two_independent_cpu_ranks()
    assert simulate(plan, calibration=Calibration(cores=2.0)).makespan_ms == pytest.approx(2.0)
    # one core: both forwards overlap all along, so each takes 2 x 2 ms
    assert simulate(plan, calibration=Calibration(cores=1.0)).makespan_ms == pytest.approx(4.0, rel=1e-3)


def test_a_lone_rank_is_not_slowed_by_sharing() -> None:
    plan = two_independent_cpu_ranks()
    plan.programs[1] = Program(1, "cpu", [Op("STEP")])  # rank 1 does nothing
    plan.stages[1].ranks = [1]
    assert simulate(plan, calibration=Calibration(cores=1.0)).makespan_ms == pytest.approx(2.0)


def test_overhead_link_factor_and_fixed_step_cost() -> None:
    # GPipe, 2 stages, 1 micro-batch; F 1 ms, B 2 ms x factor 1.5 (F 1.5, B 3), + 0.5 ms per task;
    # a message: 0.25 ms + 1000 bytes at 1000 bytes/ms = 1.25 ms; + 3 ms per step:
    # F0 0..2, msg 2..3.25, F1 3.25..5.25, B1 5.25..8.75, msg 8.75..10, B0 10..13.5; + 3 = 16.5
    plan = Plan([StagePlan(0, "cuda:0", [], forward_ms=1.0, backward_ms=2.0, ranks=[0]),
                 StagePlan(1, "cuda:1", [], forward_ms=1.0, backward_ms=2.0, ranks=[1], reads_from=[0],
                           recv_bytes=1000)], micro_batches=1)  # fmt: skip
    plan.programs = plan_programs(plan)
    calibration = Calibration(sums={"cuda:0": [1.5, 1.0], "cuda:1": [1.5, 1.0]}, task_ms={"F": 0.5, "B": 0.5},
                              links={"gloo": [0.25, 1000.0]}, step_ms=3.0)
    timeline = simulate(plan, calibration=calibration)
    assert timeline.makespan_ms == pytest.approx(16.5)
    computes = [(e.kind[8], e.start, e.end) for row in timeline.devices for e in row.events
                if e.kind.startswith("compute")]
    assert sorted(computes, key=lambda c: c[1]) == [("f", 0.0, 2.0), ("f", 3.25, 5.25), ("b", 5.25, 8.75),
                                                   ("b", 10.0, 13.5)]


def test_replicas_deal_micro_batches_in_turn_and_the_allreduce_overlaps_backward() -> None:
    # Stage 1 on ranks 1 and 2 (micro-batch 0 on rank 1, 1 on rank 2); its all-reduce is priced from
    # the calibration's link: ring over 2 ranks of 1500 bytes at 1000 bytes/ms = 1.5 ms. Rank 1 posts
    # it at 4, rank 2 at 5: it runs 5 .. 6.5 beside rank 0's backwards (5 .. 9); the step ends at 9.
    plan = Plan([StagePlan(0, "cuda:0", [], forward_ms=1.0, backward_ms=2.0, ranks=[0]),
                 StagePlan(1, "cuda:1", [], forward_ms=1.0, backward_ms=2.0, param_bytes=1500, ranks=[1, 2],
                           reads_from=[0])], micro_batches=2)  # fmt: skip
    plan.programs = plan_programs(plan, [([1, 2], [1])])
    calibration = Calibration(links={"gloo": [0.0, 1000.0]})
    timeline = simulate(plan, calibration=calibration)
    reduces = [[(e.start, e.end) for e in row] for row in timeline.events(ALLREDUCE)]
    assert reduces == [[], [(5.0, 6.5)], [(5.0, 6.5)]]
    assert timeline.makespan_ms == 9.0
    forwards = [[(e.microbatch, e.start) for e in row.events if e.kind == "compute-forward"]
                for row in timeline.devices]
    assert forwards == [[(0, 0.0), (1, 1.0)], [(0, 1.0)], [(1, 2.0)]]
    plan.stages[1].param_bytes = 4500  # 4.5 ms: now it ends the step, 5 + 4.5
    assert simulate(plan, calibration=calibration).makespan_ms == pytest.approx(9.5)


def test_receiver_pays_its_receive_and_a_wake_up_when_it_blocked() -> None:
    # The GPipe step above, + 0.25 ms per RECV on the receiver's thread and a 0.5 ms wake-up after a
    # message it blocked on: rank 1 RECV 0..0.25, F0 0..2, msg 2..3.25, F1 3.75..5.75, B1 5.75..9.25,
    # msg 9.25..10.5; rank 0 RECV 2..2.25 then blocks: B0 11..14.5; + 3 = 17.5
    plan = Plan([StagePlan(0, "cuda:0", [], forward_ms=1.0, backward_ms=2.0, ranks=[0]),
                 StagePlan(1, "cuda:1", [], forward_ms=1.0, backward_ms=2.0, ranks=[1], reads_from=[0],
                           recv_bytes=1000)], micro_batches=1)  # fmt: skip
    plan.programs = plan_programs(plan)
    calibration = Calibration(sums={"cuda:0": [1.5, 1.0], "cuda:1": [1.5, 1.0]},
                              task_ms={"F": 0.5, "B": 0.5, "RECV": 0.25, "WAKE": 0.5},
                              links={"gloo": [0.25, 1000.0]}, step_ms=3.0)
    timeline = simulate(plan, calibration=calibration)
    computes = sorted((e.start, e.end) for row in timeline.devices for e in row.events if e.kind.startswith("compute"))
    assert computes == [(0.0, 2.0), (3.75, 5.75), (5.75, 9.25), (11.0, 14.5)]
    assert timeline.makespan_ms == pytest.approx(17.5)


def test_a_message_that_landed_while_its_receiver_computed_costs_no_wake_up() -> None:
    # rank 0: F0 0..1, message 1..2 (0.5 ms + 500 bytes at 1000 bytes/ms); rank 1 first computes stage 2
    # for `first` ms, posts its RECV (0.25 ms), then F1 (1 ms) reads the message.
    def f1_start(first: float) -> float:
        plan = Plan([StagePlan(0, "cpu", [], forward_ms=1.0, ranks=[0]),
                     StagePlan(1, "cpu", [], forward_ms=1.0, ranks=[1], reads_from=[0], recv_bytes=500),
                     StagePlan(2, "cpu", [], forward_ms=first, ranks=[1])], micro_batches=1)  # fmt: skip
        plan.programs = [Program(0, "cpu", [Op.parse("F s0 mb0 t0"), Op.parse("SEND s0->s1 mb0 r1 t0"), Op("STEP")]),
                         Program(1, "cpu", [Op.parse("F s2 mb0 t0"), Op.parse("RECV s0->s1 mb0 r0 t0"),
                                            Op.parse("F s1 mb0 t1"), Op("STEP")])]  # fmt: skip
        calibration = Calibration(task_ms={"RECV": 0.25, "WAKE": 0.5}, links={"gloo": [0.5, 1000.0]})
        timeline = simulate(plan, calibration=calibration)
        return next(e.start for e in timeline.devices[1].events if e.kind == "compute-forward" and e.stage == 1)

    assert f1_start(4.0) == pytest.approx(4.25)  # landed at 2, long before: no wake-up
    assert f1_start(0.5) == pytest.approx(2.5)  # ready at 0.75, blocked until 2, woken 0.5 ms later


def test_a_take_waits_for_the_sends_of_its_batch() -> None:
    # Free messages. Rank 1 posts [SEND s2->s3, RECV s0->s1] as one batch at 1; the data of s0->s1 is there
    # at 1, but the batch completes only when rank 0 posts its receive of s2->s3, which sits in rank 0's
    # batch with a send after its 5 ms F4: at 6. So F1 runs 6..7 (not 1..2), and F5 7..8.
    plan = Plan([StagePlan(0, "cpu", [], forward_ms=1.0, ranks=[0]),
                 StagePlan(1, "cpu", [], forward_ms=1.0, ranks=[1], reads_from=[0]),
                 StagePlan(2, "cpu", [], forward_ms=1.0, ranks=[1]),
                 StagePlan(3, "cpu", [], forward_ms=1.0, ranks=[0], reads_from=[2]),
                 StagePlan(4, "cpu", [], forward_ms=5.0, ranks=[0]),
                 StagePlan(5, "cpu", [], forward_ms=1.0, ranks=[1], reads_from=[4])], micro_batches=1)  # fmt: skip
    ops = [["F s0 mb0 t0", "SEND s0->s1 mb0 r1 t0", "F s4 mb0 t1", "RECV s2->s3 mb0 r1 t2", "SEND s4->s5 mb0 r1 t2",
            "F s3 mb0 t3"],
           ["F s2 mb0 t0", "SEND s2->s3 mb0 r0 t0", "RECV s0->s1 mb0 r0 t0", "F s1 mb0 t1", "RECV s4->s5 mb0 r0 t2",
            "F s5 mb0 t3"]]  # fmt: skip
    plan.programs = [Program(r, "cpu", [*map(Op.parse, ops[r]), Op("STEP")]) for r in range(2)]
    timeline = simulate(plan, calibration=Calibration(links={"gloo": [0.0, 1000.0]}))
    starts = {e.stage: e.start for row in timeline.devices for e in row.events if e.kind == "compute-forward"}
    assert starts == {0: 0.0, 4: 1.0, 3: 6.0, 2: 0.0, 1: 6.0, 5: 7.0}
    assert timeline.makespan_ms == pytest.approx(8.0)


def synthetic_run() -> tuple[dict[str, Any], dict[str, Any], float]:
    """A 2-stage step traced with known parameters: factor 1.5, 0.2 ms gaps, latency 0.5 ms, 3 ms fixed."""
    plan = {"stages": [{"index": 0, "device": "cpu", "forward_ms": 2.0, "backward_ms": 4.0, "reads_from": [],
                        "recv_bytes": 0},
                       {"index": 1, "device": "cpu", "forward_ms": 2.0, "backward_ms": 4.0, "reads_from": [0],
                        "recv_bytes": 1000}], "programs": []}

    def ev(kind: str, stage: int, start: float, end: float, peer: int = -1) -> dict[str, Any]:
        return {"kind": kind, "stage": stage, "microbatch": 0, "start": start, "end": end, "peer": peer}

    # message: sender ready + 0.5 ms latency + 1000 bytes at 1000 bytes/ms = ready + 1.5
    rank0 = [ev("forward", 0, 0.0, 3.0), ev("recv", 0, 3.2, 15.4, 1), ev("backward", 0, 15.6, 21.6)]
    rank1 = [ev("recv", 1, 0.5, 4.5, 0), ev("forward", 1, 4.7, 7.7), ev("backward", 1, 7.9, 13.9)]
    trace = {"devices": [{"device": "cpu (rank 0)", "events": rank0}, {"device": "cpu (rank 1)", "events": rank1}]}
    return plan, trace, 21.6 + 3.0


def test_fit_recovers_known_parameters_from_a_synthetic_trace() -> None:
    plan, trace, step_ms = synthetic_run()
    previous = Calibration(links={"gloo": [0.1, 1000.0]})
    fitted = fit_calibration(plan, trace, step_ms=step_ms, cores=2.0, previous=None)
    assert fitted.compute_factor("cpu", "F") == pytest.approx(1.5)
    assert fitted.compute_factor("cpu", "B") == pytest.approx(1.5)
    assert fitted.task_ms["F"] == pytest.approx(0.8 / 4)  # two 0.2 ms gaps on each rank, two ops each
    assert fitted.step_ms == pytest.approx(3.0)
    refined = fit_calibration(plan, trace, step_ms=step_ms, cores=2.0, previous=previous)
    assert refined.links["gloo"] == pytest.approx([0.1, 1000.0])  # the link is the loopback measurement's
    # both receivers blocked and resumed 0.5 ms after ready + 1 ms: with a 0.1 ms link latency, 0.4 ms to wake
    assert refined.task_ms["WAKE"] == pytest.approx(0.4)
    assert refined.task_ms["RECV"] == pytest.approx(0.0)  # no take found its message landed, nothing posted
    assert fitted.runs == 1.0


def test_fit_accepts_several_steps_and_a_plan_object() -> None:
    plan, trace, step_ms = synthetic_run()
    stages = [StagePlan(**{**s, "nodes": []}) for s in plan["stages"]]
    fitted = fit_calibration(Plan(stages), {"steps": [trace, trace]}, step_ms=step_ms, cores=2.0)
    assert fitted.compute_factor("cpu", "F") == pytest.approx(1.5) and fitted.step_ms == pytest.approx(3.0)


def test_json_round_trip_and_version(tmp_path: Path) -> None:
    plan, trace, step_ms = synthetic_run()
    fitted = fit_calibration(plan, trace, step_ms=step_ms, cores=2.0)
    path = tmp_path / "calibration.json"
    fitted.save(path)
    assert json.loads(path.read_text())["version"] == CALIBRATION_VERSION
    assert Calibration.load(path) == fitted
    assert Calibration.from_dict({"sums": {"cpu": [2.0, 1.0]}}).factor("cpu") == 2.0  # a version 1 file
    with pytest.raises(ValueError, match="newer"):
        Calibration.from_dict({"version": CALIBRATION_VERSION + 1})


def test_fit_finds_the_cores_three_ranks_shared() -> None:
    # Three ranks compute a 2 ms forward at once and take 3 ms; later rank 0 computes one alone in 2 ms:
    # factor 1 and 2 cores explain both (3 ranks at 2/3 speed), so the fit says 2 cores, factor 1.
    stages = [{"index": s, "device": "cpu", "forward_ms": 2.0, "backward_ms": 0.0, "reads_from": [], "ranks": [s]}
              for s in range(3)]
    rows: list[dict[str, Any]] = [
        {"device": f"cpu (rank {r})",
         "events": [{"kind": "forward", "stage": r, "microbatch": 0, "start": 0.0, "end": 3.0, "peer": -1}]}
        for r in range(3)
    ]
    rows[0]["events"].append({"kind": "forward", "stage": 0, "microbatch": 1, "start": 3.0, "end": 5.0, "peer": -1})
    fitted = fit_calibration({"stages": stages, "programs": []}, {"devices": rows}, step_ms=5.0,
                             previous=Calibration(cores=2.0))
    assert fitted.cores == pytest.approx(2.0)
    assert fitted.compute_factor("cpu", "F") == pytest.approx(1.0)

