"""Schedules against literal tables: clock cycles, GPipe, 1F1B, interleaved 1F1B and the text format."""

from __future__ import annotations

import pytest

from runtime.schedule import (
    Action,
    clock_cycles,
    format_schedule,
    gpipe,
    interleaved_one_f_one_b,
    one_f_one_b,
    parse_schedule,
)


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
    for text in ("0F0", "3B11", "10F2"):
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
