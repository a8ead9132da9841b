"""Overheads that grow with the op before them: fitted on plans of long ops, they price a plan of short ones."""

from __future__ import annotations

from typing import Any

import pytest

from cost_model import overhead_fit
from cost_model.calibration import Calibration, fit_calibration
from partitioner.predict.simulator import simulate
from runtime.plan import Plan, StagePlan
from runtime.program import plan_programs

SEND_A, SEND_B = 0.1, 0.05  # the true posting time after an op of L ms: 0.1 + 0.05 L
GAP_A, GAP_B = 0.02, 0.04  # the true untraced time after an op of L ms


def _chain_run(forward: float, micro_batches: int = 6, tail_at: int = 2) -> tuple[dict[str, Any], dict[str, Any]]:
    """Two stages on ranks 0 and 1, forward only: rank 0 computes `forward` ms, posts its message (the true
    posting time; the `tail_at`-th send of every 3 is 3 ms late, a descheduled rank), then pauses the true
    untraced time; rank 1 takes each message (0.05 ms once it has landed), computes `forward` ms and pauses
    the same untraced time."""
    stages = [{"index": s, "device": "cpu", "forward_ms": forward, "backward_ms": 0.0,
               "reads_from": [s - 1] if s else [], "recv_bytes": 1000 * s, "ranks": [s]} for s in range(2)]
    mbs = range(micro_batches)
    programs = [{"rank": 0, "device": "cpu",
                 "ops": [op for mb in mbs for op in (f"F s0 mb{mb} t{mb}", f"SEND s0->s1 mb{mb} r1 t{mb}")]},
                {"rank": 1, "device": "cpu",
                 "ops": [op for mb in mbs for op in (f"RECV s0->s1 mb{mb} r0 t{mb}", f"F s1 mb{mb} t{mb + 1}")]}]
    rows: list[list[dict[str, Any]]] = [[], []]
    clock, free = 0.0, 0.0
    for mb in range(micro_batches):
        post = SEND_A + SEND_B * forward + (3.0 if mb % 3 == tail_at else 0.0)
        rows[0].append({"kind": "forward", "stage": 0, "microbatch": mb, "start": clock, "end": clock + forward})
        rows[0].append({"kind": "send", "stage": 0, "microbatch": mb, "start": clock + forward,
                        "end": clock + forward + post, "peer": 1})
        ready = clock + forward + post
        start = max(ready, free)  # a take that blocks waits inside its event
        rows[1].append({"kind": "recv", "stage": 1, "microbatch": mb, "start": free, "end": start + 0.05, "peer": 0})
        rows[1].append({"kind": "forward", "stage": 1, "microbatch": mb, "start": start + 0.05,
                        "end": start + 0.05 + forward})
        free = start + 0.05 + forward + GAP_A + GAP_B * forward
        clock = ready + GAP_A + GAP_B * forward
    trace = {"devices": [{"device": f"cpu (rank {r})", "events": rows[r]} for r in range(2)]}
    return {"stages": stages, "programs": programs}, trace


def test_lines_fitted_on_long_ops_price_the_overheads_of_short_ones() -> None:
    made = Calibration()
    for forward in (6.0, 3.0):
        plan, trace = _chain_run(forward)
        made = fit_calibration(plan, {"steps": [trace]}, step_ms=100.0, previous=made, cores=2.0)
    a, b = made.line("SEND") or (0.0, 0.0)
    assert (a, b) == (pytest.approx(SEND_A, rel=0.02), pytest.approx(SEND_B, rel=0.02))  # tails left out
    short = overhead_fit.price(made.line("SEND"), 0.5, 0.0)
    assert short == pytest.approx(SEND_A + SEND_B * 0.5, rel=0.02)
    assert made.task_ms["SEND"] > 2 * short  # the flat mean: long ops' posting and the tails
    task = made.line("task")
    assert task is not None
    assert overhead_fit.price(task, 0.5, 0.0) == pytest.approx(GAP_A + GAP_B * 0.5, rel=0.25)
    assert made.task_ms["F"] > 2 * overhead_fit.price(task, 0.5, 0.0)


def test_the_simulator_charges_a_send_after_its_ranks_last_op() -> None:
    # GPipe, 2 stages, 2 micro-batches, F 1 ms (stage 0) and 3 ms (stage 1), B 2 and 4, free link:
    # a send after a 1 ms forward posts 0.1 + 0.05 x 1 = 0.15 ms, after stage 1's 4 ms backward 0.3 ms.
    # Rank 0: F0 0..1, post 1..1.15, F1 1.15..2.15, post ..2.3. Rank 1: F0 1.15..4.15, F1 4.15..7.15,
    # B1 7.15..11.15, post ..11.45, B0 11.45..15.45, post ..15.75; rank 0: B1 11.45..13.45, B0 15.75..17.75
    plan = Plan([StagePlan(0, "cpu", [], forward_ms=1.0, backward_ms=2.0, ranks=[0]),
                 StagePlan(1, "cpu", [], forward_ms=3.0, backward_ms=4.0, ranks=[1], reads_from=[0])],
                micro_batches=2)  # fmt: skip
    plan.programs = plan_programs(plan)
    calibration = Calibration(links={"gloo": [0.0, 1e12]}, task_ms={"SEND": 5.0},
                              lines={"SEND": overhead_fit.add([], [((1.0, 1.0), 0.15), ((1.0, 4.0), 0.3)])})
    assert simulate(plan, calibration=calibration).makespan_ms == pytest.approx(17.75, abs=1e-3)  # ridge
    calibration.lines.clear()  # no line: the flat 5 ms per send
    assert simulate(plan, calibration=calibration).makespan_ms > 30.0


def test_solve_gives_a_flat_line_where_ops_last_alike_and_never_a_falling_one() -> None:
    alike = overhead_fit.add([], [((1.0, 2.0), 0.1), ((1.0, 2.0), 0.3)])
    assert overhead_fit.solve(alike) == (pytest.approx(0.2), 0.0)
    falling = overhead_fit.add([], [((1.0, 1.0), 0.5), ((1.0, 5.0), 0.1)])
    assert overhead_fit.solve(falling) == (pytest.approx(0.3), 0.0)
    assert overhead_fit.solve([]) is None
    assert overhead_fit.price(None, 3.0, 0.25) == 0.25


def test_each_run_weighs_alike_and_older_runs_decay() -> None:
    many = overhead_fit.add([], [((1.0, 1.0), 1.0)] * 10)
    both = overhead_fit.add(many, [((1.0, 3.0), 2.0)])
    assert both[0] == pytest.approx(2.0)  # ten rows of one run and one row of another: 1 each
    decayed = overhead_fit.add(many, [((1.0, 3.0), 2.0)], decay=0.5)
    assert decayed[0] == pytest.approx(1.5)


def test_lines_survive_a_json_round_trip(tmp_path: Any) -> None:
    made = Calibration(lines={"SEND": overhead_fit.add([], [((1.0, 1.0), 0.15), ((1.0, 4.0), 0.3)])})
    path = tmp_path / "calibration.json"
    made.save(path)
    assert Calibration.load(path).line("SEND") == pytest.approx(made.line("SEND"))
    assert Calibration.from_dict({"version": 3}).line("SEND") is None  # an older file: the flat prices
