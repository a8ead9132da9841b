"""Schedules against literal tables: clock cycles, GPipe, 1F1B, interleaved 1F1B, zero-bubble and the text format."""

from __future__ import annotations

from typing import Any

import pytest

from partitioner.predict.schedule_sim import ScheduleError, check_schedule, simulate_schedule
from runtime.plan import Plan, StagePlan
from runtime.program import lower
from runtime.schedule import (
    Action,
    clock_cycles,
    dualpipe_v,
    format_schedule,
    gpipe,
    interleaved_one_f_one_b,
    one_f_one_b,
    parse_schedule,
    v_stage_ranks,
    zero_bubble_h1,
    zero_bubble_v,
)
from runtime.schedule_ranks import rank_schedule


def rows(schedule: list[list[Action]]) -> list[str]:
    return [" ".join(str(a) for a in actions) for actions in schedule]


def test_clock_cycles_tables() -> None:
    assert list(clock_cycles(3, 2)) == [[(0, 0)], [(1, 0), (0, 1)], [(2, 0), (1, 1)], [(2, 1)]]
    assert list(clock_cycles(2, 3)) == [[(0, 0)], [(1, 0), (0, 1)], [(1, 1), (0, 2)], [(1, 2)]]
    assert list(clock_cycles(1, 1)) == [[(0, 0)]]


def test_gpipe_table() -> None:
    assert rows(gpipe(3, 2)) == ["0F0 0F1 0F2 0B2 0B1 0B0", "1F0 1F1 1F2 1B2 1B1 1B0"]


def test_one_f_one_b_tables() -> None:
    assert rows(one_f_one_b(4, 3)) == [
        "0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3",
        "1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3",
        "2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3",
    ]
    # Fewer micro-batches than stages: warm-up is capped at m.
    assert rows(one_f_one_b(2, 3)) == ["0F0 0F1 0B0 0B1", "1F0 1F1 1B0 1B1", "2F0 2B0 2F1 2B1"]
    assert rows(one_f_one_b(1, 1)) == ["0F0 0B0"]


def test_interleaved_table() -> None:
    assert rows(interleaved_one_f_one_b(4, 2, 2)) == [
        "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3",
        "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3",
    ]
    assert interleaved_one_f_one_b(5, 3, 1) == one_f_one_b(5, 3)


def test_schedule_argument_errors() -> None:
    with pytest.raises(ValueError, match="multiple of 2 such as 4"):
        interleaved_one_f_one_b(3, 2, 2)
    with pytest.raises(ValueError, match="virtual_stages=0"):
        interleaved_one_f_one_b(4, 2, 0)
    with pytest.raises(ValueError, match="micro_batches >= 1"):
        one_f_one_b(0, 2)


def test_action_round_trip() -> None:
    assert str(Action(1, "F", 0)) == "1F0"
    assert Action.parse("12B3") == Action(12, "B", 3)
    assert Action.parse("2W1") == Action(2, "W", 1)
    for text in ("0F0", "3B11", "10F2", "4W0"):
        assert str(Action.parse(text)) == text
    with pytest.raises(ValueError, match="cannot parse action '1X0'"):
        Action.parse("1X0")


def test_format_parse_round_trip() -> None:
    schedule = one_f_one_b(3, 2)
    text = format_schedule(schedule)
    assert text == "0: 0F0 0F1 0B0 0F2 0B1 0B2\n1: 1F0 1B0 1F1 1B1 1F2 1B2"
    assert parse_schedule(text) == schedule
    assert parse_schedule("# two devices\n0F0 0B0\n\n1F0 1B0  # last stage\n") == [
        [Action(0, "F", 0), Action(0, "B", 0)],
        [Action(1, "F", 0), Action(1, "B", 0)],
    ]
    assert parse_schedule(format_schedule([[], [Action(0, "F", 0)]])) == [[], [Action(0, "F", 0)]]
    with pytest.raises(ValueError, match="labelled device '1' but is device 0"):
        parse_schedule("1: 0F0")


def test_zero_bubble_h1_tables() -> None:
    # Stage s puts the W of micro-batch k - s after its k-th B; the W's it held back end its list.
    assert rows(zero_bubble_h1(4, 2)) == [
        "0F0 0F1 0B0 0W0 0F2 0B1 0W1 0F3 0B2 0W2 0B3 0W3",
        "1F0 1B0 1F1 1B1 1W0 1F2 1B2 1W1 1F3 1B3 1W2 1W3",
    ]
    assert rows(zero_bubble_h1(6, 3)) == [
        "0F0 0F1 0F2 0B0 0W0 0F3 0B1 0W1 0F4 0B2 0W2 0F5 0B3 0W3 0B4 0W4 0B5 0W5",
        "1F0 1F1 1B0 1F2 1B1 1W0 1F3 1B2 1W1 1F4 1B3 1W2 1F5 1B4 1W3 1B5 1W4 1W5",
        "2F0 2B0 2F1 2B1 2F2 2B2 2W0 2F3 2B3 2W1 2F4 2B4 2W2 2F5 2B5 2W3 2W4 2W5",
    ]
    # Without the W's, the order is 1F1B's.
    for m, p in ((4, 2), (6, 3), (2, 3)):
        assert [[a for a in actions if a.kind != "W"] for actions in zero_bubble_h1(m, p)] == one_f_one_b(m, p)


def test_zero_bubble_v_table() -> None:
    assert v_stage_ranks(3) == [[0], [1], [2], [2], [1], [0]]
    assert rows(zero_bubble_v(4, 2)) == [
        "0F0 0F1 0F2 3F0 3B0 3W0 3F1 3B1 3W1 0F3 0B0 0W0 3F2 3B2 3W2 0B1 0W1 3F3 3B3 3W3 0B2 0W2 0B3 0W3",
        "1F0 2F0 1F1 2F1 2B0 2W0 1F2 1B0 1W0 2F2 2B1 2W1 1F3 1B1 1W1 2F3 2B2 2W2 1B2 2B3 1B3 1W2 2W3 1W3",
    ]
    # Fewer micro-batches than 2p - 1: the same order without the missing ones.
    assert rows(zero_bubble_v(1, 2)) == ["0F0 3F0 3B0 3W0 0B0 0W0", "1F0 2F0 2B0 2W0 1B0 1W0"]


@pytest.mark.parametrize("p", range(1, 9))
def test_zero_bubble_schedules_are_complete_ordered_and_lower_without_deadlock(p: int) -> None:
    for m in sorted({1, 2, 3, p, 2 * p - 1, 2 * p + 3}):
        for name, stages in (("zb1", p), ("zbv", 2 * p)):
            ranks = [[s] for s in range(p)] if name == "zb1" else v_stage_ranks(p)
            chain = [[s - 1] if s else [] for s in range(stages)]
            lists = rank_schedule(name, m, ranks, chain)
            # every F, B and W exactly once; F before B before W (else the replay deadlocks)
            checked = check_schedule(lists, stages, m)
            assert sum(map(len, lists)) == 3 * stages * m
            programs = lower(lists, chain, ranks, ["cpu"] * p)  # lowering finishes: no deadlock
            assert [program.compute() for program in programs] == lists
            if name == "zb1":  # activations live F to W: p on every stage, 1F1B's peak (stage 0's)
                assert checked.peak_in_flight == [min(p, m)] * p
                assert max(checked.peak_in_flight) <= max(check_schedule(one_f_one_b(m, p), p, m).peak_in_flight)


def test_each_replica_runs_its_own_one_f_one_b() -> None:
    # Every stage on 2 replicas, m = 8: two independent 1F1B pipelines of 4 micro-batches (0, 2, 4, 6 and
    # 1, 3, 5, 7), each warming up p - s forwards, not one 1F1B over 8 dealt in turn (one forward ahead).
    lists = rank_schedule("1f1b", 8, [[0, 1], [2, 3]], [[], [0]])
    assert rows(lists) == [
        "0F0 0F2 0B0 0F4 0B2 0F6 0B4 0B6",
        "0F1 0F3 0B1 0F5 0B3 0F7 0B5 0B7",
        "1F0 1B0 1F2 1B2 1F4 1B4 1F6 1B6",
        "1F1 1B1 1F3 1B3 1F5 1B5 1F7 1B7",
    ]


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb1"])
def test_replicated_layouts_are_complete_and_lower_without_deadlock(name: str) -> None:
    import itertools

    for p in (2, 3, 4):
        chain = [[s - 1] if s else [] for s in range(p)]
        for counts in itertools.product((1, 2, 3), repeat=p):
            starts = [sum(counts[:s]) for s in range(p)]
            ranks = [list(range(a, a + c)) for a, c in zip(starts, counts)]
            for m in (1, 2, 3, 5, 6, 12):
                lists = rank_schedule(name, m, ranks, chain)
                kinds = "FBW" if name == "zb1" else "FB"
                assert sorted((a.stage, a.kind, a.microbatch) for actions in lists for a in actions) == sorted(
                    (s, k, i) for s in range(p) for k in kinds for i in range(m))
                for stage_ranks in ranks:  # micro-batch i on replica i mod r
                    for j, r in enumerate(stage_ranks):
                        assert {a.microbatch for a in lists[r]} == set(range(j, m, len(stage_ranks)))
                programs = lower(lists, chain, ranks, ["cpu"] * sum(counts))  # lowering finishes: no deadlock
                assert [program.compute() for program in programs] == lists


def test_checker_names_a_w_before_its_b_and_a_missing_b() -> None:
    with pytest.raises(ScheduleError, match=r"0W0 needs 0B0"):
        check_schedule(parse_schedule("0F0 0W0 0B0"), 1, 1)
    with pytest.raises(ScheduleError, match="1 actions missing: 0B1"):
        check_schedule(parse_schedule("0F0 0B0 0W0 0F1 0W1"), 1, 2)
    # A W is per micro-batch (DualPipeV splits some backwards of a stage): 0B1 runs whole, as lower runs it.
    mixed = check_schedule(parse_schedule("0F0 0F1 0B0 0B1 0W0"), 1, 2)
    assert mixed.peak_in_flight == [2]
    assert check_schedule(parse_schedule("0F0 0B0 0F1 0B1 0W0"), 1, 2).peak_in_flight == [2]  # 0 lives to its W


def test_zero_bubble_layout_errors() -> None:
    with pytest.raises(ValueError, match=r"zbv runs 2 x 2 stages in a V .*\[\[0\], \[1\], \[1\], \[0\]\]"):
        rank_schedule("zbv", 4, [[0], [1], [0], [1]], [[], [0], [1], [2]])
    with pytest.raises(ValueError, match="rank 0 runs stages 0 and 1 under 'zb1'"):
        rank_schedule("zb1", 4, [[0], [0]], [[], [0]])
    with pytest.raises(ValueError, match="use 'gpipe', '1f1b', 'interleaved', 'zb1', 'zbv' or 'dualpipev'"):
        rank_schedule("zb2", 4, [[0]], [[]])


def test_zero_bubble_h1_shrinks_the_bubble() -> None:
    # F 1 ms, backward 2 ms (B 1 + W 1; stage 0, reading nothing, has all of it in W), no transfers.
    # 1F1B: 3 (m + p - 1) = 15 ms. ZB-H1 (hand-checked): stage 1 runs F0 1-2, B0 2-3, F1 3-4,
    # B1 4-5, W0 5-6, F2 6-7, B2 7-8, W1 8-9, F3 9-10, B3 10-11, W2, W3: 13 ms, bubble (p - 1) ms.
    plan = Plan([StagePlan(s, f"cuda:{s}", [], forward_ms=1.0, backward_ms=2.0) for s in range(2)], micro_batches=4)
    assert simulate_schedule(plan, one_f_one_b(4, 2)).makespan_ms == 15.0
    timeline = simulate_schedule(plan, zero_bubble_h1(4, 2))
    assert timeline.makespan_ms == 13.0
    assert [round(d.busy_ms, 6) for d in timeline.devices] == [12.0, 12.0]
    # ZB-V on the same work cut into 4 half stages: a bubble of p - 1 = 1 half forward, 12.5 ms.
    halves = Plan([StagePlan(s, "cpu", [], forward_ms=0.5, backward_ms=1.0) for s in range(4)], micro_batches=4)
    assert simulate_schedule(halves, zero_bubble_v(4, 2)).makespan_ms == 12.5


# DualPipeV, m=4, p=2 in torch's order (ScheduleDualPipeV: its I is our split B, with a W later);
# the overlapped F&B chunks of its steady state run as their F, then their B.
DUALPIPE_V_4_2 = [
    "0F0 0F1 0F2 3F0 3B0 3W0 3F1 0F3 3B1 3F2 0B0 3B2 3F3 0B1 3B3 0B2 0W2 0B3 0W3",
    "1F0 2F0 1F1 2F1 1F2 2B0 2F2 1B0 1F3 2B1 2F3 1B1 2B2 1B2 2B3 1B3 2W3 1W3",
]


def test_dualpipe_v_table() -> None:
    assert rows(dualpipe_v(4, 2)) == DUALPIPE_V_4_2
    assert rows(dualpipe_v(6, 3)) == [
        "0F0 0F1 0F2 0F3 0F4 5F0 5B0 5W0 5F1 5B1 5W1 5F2 0F5 5B2 5F3 0B0 5B3 5F4 0B1 5B4 5F5 0B2 5B5 0B3 0W3 0B4"
        " 0W4 0B5 0W5",
        "1F0 1F1 1F2 4F0 1F3 4F1 4B0 4W0 4F2 1F4 4B1 4F3 1B0 1F5 4B2 4F4 1B1 4B3 4F5 1B2 4B4 1B3 4B5 1B4 4W5 1B5"
        " 1W4 1W5",
        "2F0 3F0 2F1 3F1 2F2 3F2 2F3 3B0 3F3 2B0 2F4 3B1 3F4 2B1 2F5 3B2 3F5 2B2 3B3 2B3 3B4 2B4 3B5 2B5 2W4 3W5"
        " 2W5",
    ]


def torch_dualpipe_v(micro_batches: int, ranks: int) -> list[str]:
    """torch's ScheduleDualPipeV order (its per-rank generator, run without a process group) in our text."""
    from types import SimpleNamespace

    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    fake = SimpleNamespace(pp_group_size=ranks, _n_microbatches=micro_batches)

    def flat(action: Any) -> list[str]:
        if action.computation_type == schedules._ComputationType.OVERLAP_F_B:
            return [text for sub in action.sub_actions for text in flat(sub)]
        return [str(action).replace("I", "B")]  # torch's I (input gradients only) is our split B

    return [" ".join(text for action in schedules.ScheduleDualPipeV._calculate_single_rank_operations(fake, r)
                     for text in flat(action)) for r in range(ranks)]


@pytest.mark.parametrize("p", range(1, 9))
def test_dualpipe_v_is_torchs_order_complete_and_lowers_without_deadlock(p: int) -> None:
    if p == 2:
        assert torch_dualpipe_v(4, 2) == DUALPIPE_V_4_2
    for m in (2 * p, 2 * p + 1, 4 * p + 3):
        lists = rank_schedule("dualpipev", m, v_stage_ranks(p), [[s - 1] if s else [] for s in range(2 * p)])
        assert rows(lists) == torch_dualpipe_v(m, p)
        checked = check_schedule(lists, 2 * p, m)  # every F and B once, each W once after its B; no deadlock
        splits = sum(a.kind == "W" for actions in lists for a in actions)
        assert sum(map(len, lists)) == 2 * (2 * p) * m + splits and splits == sum(2 * p - 1 - r for r in range(p))
        programs = lower(lists, [[s - 1] if s else [] for s in range(2 * p)], v_stage_ranks(p), ["cpu"] * p)
        assert [program.compute() for program in programs] == lists
        # a split B is lowered as one (input gradients only), a whole B as a whole one
        assert {(op.stage, op.microbatch) for prog in programs for op in prog.ops if op.kind == "B" and op.split} == {
            (a.stage, a.microbatch) for actions in lists for a in actions if a.kind == "W"}
        assert max(checked.peak_in_flight) <= max(check_schedule(zero_bubble_v(m, p), 2 * p, m).peak_in_flight)


def test_dualpipe_v_errors_name_the_fix() -> None:
    with pytest.raises(ValueError, match=r"micro-batch per stage, 2 x 3 = 6, but got 5; pass micro_batches >= 6"):
        dualpipe_v(5, 3)
    with pytest.raises(ValueError, match=r"dualpipev runs 2 x 2 stages in a V .*\[\[0\], \[1\], \[1\], \[0\]\]"):
        rank_schedule("dualpipev", 4, [[0], [1], [0], [1]], [[], [0], [1], [2]])


def test_dualpipe_v_without_compute_overlap_prices_as_zbv_or_better_without_transfers() -> None:
    # With no transfer time, DualPipeV's order is never slower than ZB-V's on uniform stages: equal with
    # F = B = W (p - 1 half forwards of bubble), faster as backwards grow (whole B's fill the drain).
    # With transfers it can be slower: DualPipe hides them behind its F&B overlap, which we do not run.
    for p in (2, 3, 4, 8):
        for m in (2 * p, 4 * p + 1):
            for forward_ms, backward_ms in ((0.5, 1.0), (0.5, 2.0), (1.0, 1.0)):
                plan = Plan([StagePlan(s, "cpu", [], forward_ms=forward_ms, backward_ms=backward_ms)
                             for s in range(2 * p)], micro_batches=m)
                zbv = simulate_schedule(plan, zero_bubble_v(m, p)).makespan_ms
                ours = simulate_schedule(plan, dualpipe_v(m, p)).makespan_ms
                assert ours <= zbv, (p, m, forward_ms, backward_ms)
                if backward_ms == 2 * forward_ms:
                    assert ours == zbv == 2 * m * (forward_ms + backward_ms) + (p - 1) * forward_ms
