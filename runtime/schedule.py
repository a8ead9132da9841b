"""Pipeline schedules as data, the runtime's names for them: actions and generators live in rules/ (pure rules).

`rules.actions` (what an action list is), `rules.generators` (one generator per built-in
schedule, checked against literal tables) and `rules.schedules` (one `ScheduleSpec` per
schedule: layout, closed forms, the registry) are shared with cost_model/, which may not
import the runtime; these names stay importable from here.
"""

from __future__ import annotations

from rules.actions import Action, Kind, format_schedule, parse_schedule
from rules.generators import (
    clock_cycles,
    dag_gpipe,
    dag_levels,
    dualpipe_v,
    gpipe,
    interleaved_one_f_one_b,
    one_f_one_b,
    stream_one_f_one_b,
    v_stage_ranks,
    zero_bubble_h1,
    zero_bubble_v,
)
from rules.schedules import ScheduleSpec, register, schedule_names, schedule_spec

__all__ = [
    "V_SCHEDULES",
    "Action",
    "Kind",
    "ScheduleSpec",
    "clock_cycles",
    "dag_gpipe",
    "dualpipe_v",
    "dag_levels",
    "format_schedule",
    "gpipe",
    "interleaved_one_f_one_b",
    "one_f_one_b",
    "parse_schedule",
    "register",
    "schedule_names",
    "schedule_spec",
    "stream_one_f_one_b",
    "v_stage_ranks",
    "zero_bubble_h1",
    "zero_bubble_v",
]

# The built-in schedules that run 2 stages per rank in a V, for callers of 0.1 (a schedule registered
# later is not here: ask `schedule_spec(name).layout == "v"`).
V_SCHEDULES: tuple[str, ...] = tuple(n for n in schedule_names() if schedule_spec(n).layout == "v")
