"""Progress of the long phases (tracing, profiling, planning): one log line per phase, a bar only on a terminal.

Every phase says what it does in one line on the `cost_model.progress` logger, at INFO, and a phase that
counts (profiling n of N nodes) also draws a bar on stderr when it is a terminal, which clears its line
when the phase ends, so what is printed next starts on a line of its own. It is output, not a price: it
lives in cost_model/ as the lowest layer that says progress (the profiler counts nodes), where
partitioner/ reads it too.

[Note: progress by default] Where nobody configured logging (no handler on this logger or above it), a
call of the front door (`plan`, `partition`: `library_call`) still says its long phases on stderr, one
line each, `partitioner: tracing LlamaForCausalLM ...`: a phase still running after `SLOW_S` seconds,
so quick calls say nothing; on torchrun rank 0 only. The logger's own level is the switch:
`logging.getLogger("cost_model.progress").setLevel(logging.WARNING)` silences it, `logging.INFO` says every
phase as it starts. A program that configured logging gets the records through its own handlers
instead (shown where it shows INFO), and pytest configures logging, so tests print nothing. The
command line draws its own spinners and bars, or logs these lines into a pipe (cli/progress.py).

    phase("profiling 161 nodes on cpu", total=161, unit="node")   # log: "profiling 161 nodes on cpu"
        .advance(161 / 7)   x 7 rounds                           # bar (terminal only): 23/161 ... 161/161
        .close()                                                 # bar gone, line cleared
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from types import TracebackType
from typing import Iterator, TextIO

from tqdm import tqdm

__all__ = ["LOGGER", "SLOW_S", "Progress", "is_terminal", "library_call", "phase", "say"]

LOGGER = "cost_model.progress"
SLOW_S = 3.0  # seconds a phase runs before it is said on stderr by default (see [Note: progress by default])
log = logging.getLogger(LOGGER)


class _Default:
    """The default display of [Note: progress by default]: the phase now running, said on stderr by a timer
    once it has run SLOW_S seconds (at once where the logger's level is INFO or below), inside library calls.

        say("tracing X") ─ starts timer(SLOW_S) ─────────► "partitioner: tracing X ..." on stderr
        the next say(), a bar, or the call's end ─ cancels it first (under `lock`): a quick phase says nothing
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls = 0  # library calls running (nested ones count too)
        self.timer: threading.Timer | None = None

    def said(self, line: str) -> None:
        with self.lock:
            self.cancel()
            if not self.calls or log.hasHandlers() or os.environ.get("RANK", "0") != "0":
                return  # outside a call, logging configured (its handlers show it), or not torchrun's rank 0
            if log.level == logging.NOTSET:
                self.timer = threading.Timer(SLOW_S, self.write, (line + " ...",))
                self.timer.daemon = True
                self.timer.start()
            elif log.level <= logging.INFO:
                self.write(line, locked=True)

    def write(self, line: str, locked: bool = False) -> None:
        with contextlib.nullcontext() if locked else self.lock:
            if not locked and threading.current_thread() is not self.timer:
                return  # cancelled while it waited for the lock
            print(f"partitioner: {line}", file=sys.stderr, flush=True)
            self.timer = None

    def cancel(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


_DEFAULT = _Default()


def say(line: str) -> None:
    """Say in one line which phase runs now ("tracing GPT", "planning 2 stages"): INFO on the `cost_model.progress` log,
    and on stderr where a library call runs long and nobody configured logging (see [Note: progress by default])."""
    log.info(line)
    _DEFAULT.said(line)


@contextlib.contextmanager
def library_call() -> Iterator[None]:
    """One call of the front door (plan, partition): its phases may be said by default, and the last ends with it
    (see [Note: progress by default]). Nests; a function decorated with `@library_call()` runs inside one."""
    with _DEFAULT.lock:
        _DEFAULT.calls += 1
    try:
        yield
    finally:
        with _DEFAULT.lock:
            _DEFAULT.calls -= 1
            if not _DEFAULT.calls:
                _DEFAULT.cancel()


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
            with _DEFAULT.lock:
                _DEFAULT.cancel()  # the bar says this phase: no line of the default display through it

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
