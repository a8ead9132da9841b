"""How a search compares schedules: the one it prices candidates with, and the one it keeps at a tie.

Both read the schedule registry (rules.schedules), so the rule is written once for both searches:

    priced with   of the schedules allowed, the first in the registry's `auto` order (1F1B before
                  GPipe: the same step, never more micro-batches in flight)
    kept          the priced one, unless a schedule registered before it predicts the same step and
                  holds the same memory on the chosen configuration (GPipe beside 1F1B where every
                  stage holds all its micro-batches anyway): the earlier registered is kept

The searches plan the schedules with a `fill` (rules.schedules.searched_names): SCHEDULES is that
list at import, the default of every search; a check reads the registry at call time.
"""

from __future__ import annotations

from typing import Callable, Sequence

from rules.schedules import schedule_names, schedule_spec, searched_names

__all__ = ["SCHEDULES", "kept_schedule", "priced_schedule"]

SCHEDULES = searched_names()  # the default: the built-ins with a `fill`; checks read the registry


def priced_schedule(schedules: Sequence[str]) -> str:
    """The schedule a search prices its candidates with (module docstring); `schedules` is not empty."""
    order = {name: k for k, name in enumerate(schedules)}
    return min(schedules, key=lambda name: (_auto(name), order[name]))


def kept_schedule(schedules: Sequence[str], price: Callable[[str], object], priced: str | None = None) -> str:
    """The schedule a search keeps for its chosen configuration (module docstring).

    `price(name)` is what the configuration predicts under a schedule (its step and memory), compared
    for equality; `priced`: the schedule the search priced with (default: `priced_schedule(schedules)`).
    """
    mode = priced if priced is not None else priced_schedule(schedules)
    base: object = None
    for name in schedule_names():
        if name == mode:
            return mode
        if name in schedules:
            base = price(mode) if base is None else base
            if price(name) == base:
                return name
    return mode


def _auto(name: str) -> float:
    auto = schedule_spec(name).auto
    return float("inf") if auto is None else float(auto)
