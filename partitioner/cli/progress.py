"""What the command line prints while it works: a line or a spinner per step, and the library's phase lines."""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from typing import Iterator

from rich.console import Console

from cost_model.progress import LOGGER

__all__ = ["phase_lines", "step"]


@contextmanager
def step(err: Console, quiet: bool, text: str) -> Iterator[None]:
    """A long step on stderr: a spinner on a terminal, else its name as it starts; its time when it ends."""
    start = time.perf_counter()
    if quiet:
        yield
        return
    if err.is_terminal:
        with err.status(f"{text} ...", spinner="dots"):
            yield
    else:  # a pipe or a log: a spinner draws nothing there, so say what runs now
        err.print(f"{text} ...", markup=False, highlight=False)
        yield
    err.print(f"[dim]{text}: {time.perf_counter() - start:.1f} s[/dim]")


@contextmanager
def phase_lines(err: Console, quiet: bool) -> Iterator[None]:
    """Where stderr is not a terminal, the library's phase lines (tracing, profiling n of N nodes, planning: the
    `cost_model.progress` log) go to it, one line each; on a terminal its spinners and bars show progress instead, and
    with --quiet nothing does: in both the library's own default lines are off ([Note: progress by default])."""
    log = logging.getLogger(LOGGER)
    if quiet or err.is_terminal:
        level = log.level
        log.setLevel(logging.WARNING)
        try:
            yield
        finally:
            log.setLevel(level)
        return
    handler = logging.StreamHandler(err.file)
    handler.setFormatter(logging.Formatter("%(message)s"))
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
