"""Progress of the long phases (tracing, profiling, planning): one log line per phase, a bar only on a terminal.

Every phase says what it does in one line on the `rules.progress` logger, at INFO: silent in a
library unless the caller's logging shows INFO, and shown by the command line when stderr is
not a terminal (a pipe, a CI log), where a bar would only be a stream of carriage returns. On
a terminal a phase that counts (profiling n of N nodes) also draws a bar on stderr that clears
its line when the phase ends, so what is printed next starts on a line of its own.

    phase("profiling 161 nodes on cpu", total=161, unit="node")   # log: "profiling 161 nodes on cpu"
        .advance(161 / 7)   x 7 rounds                           # bar (terminal only): 23/161 ... 161/161
        .close()                                                 # bar gone, line cleared
"""

from __future__ import annotations

import logging
import sys
from types import TracebackType
from typing import TextIO

from tqdm import tqdm

__all__ = ["LOGGER", "Progress", "is_terminal", "phase", "say"]

LOGGER = "rules.progress"
log = logging.getLogger(LOGGER)


def say(line: str) -> None:
    """Say in one line which phase runs now ("tracing GPT", "planning 2 stages"): INFO on the `rules.progress` log."""
    log.info(line)


def is_terminal(stream: TextIO) -> bool:
    """True when `stream` is an interactive terminal (a bar can redraw its line there), False for pipes and files."""
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or replaced stream (pytest's capture, a notebook)
        return False


class Progress:
    """How much of a phase is done, out of `total` (nodes, say): a bar on stderr when it is a terminal.

    `advance` takes fractions (a round over k of N nodes, of r rounds, advances k / r); the bar
    shows whole units, never more than `total`, and reaches `total` exactly when every unit is
    counted. Use as a context manager, or call `close()`: the bar then clears its line.
    """

    def __init__(
        self, what: str, total: int, unit: str = "node", bar: bool = True, stream: TextIO | None = None
    ) -> None:
        self.what, self.total, self.unit = what, max(int(total), 0), unit
        self.done = 0.0
        out = stream if stream is not None else sys.stderr
        self._bar: tqdm[None] | None = None
        if bar and self.total > 0 and is_terminal(out):
            self._bar = tqdm(total=self.total, desc=what, unit=unit, leave=False, file=out, dynamic_ncols=True)

    def advance(self, units: float) -> None:
        """Count `units` more as done (fractions allowed); the bar moves by the whole units they complete."""
        self.done = min(self.done + units, float(self.total))
        if self._bar is not None:
            shown = min(int(self.done + 1e-9), self.total)  # 1e-9: k / r added r times may fall short of k
            if shown > self._bar.n:
                self._bar.update(shown - self._bar.n)

    def reset(self) -> None:
        """Start the count again (the phase is redone another way)."""
        self.done = 0.0
        if self._bar is not None:
            self._bar.reset(total=self.total)

    def close(self) -> None:
        """End the phase: the bar (if any) is removed and its line cleared."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


def phase(what: str, total: int = 0, unit: str = "node", bar: bool = True) -> Progress:
    """Say `what` (one log line) and count the phase's `total` units; `bar=False`: the line only, never a bar."""
    say(what)
    return Progress(what, total, unit, bar)
