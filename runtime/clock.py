"""Start and end marks for runtime traces: host clock on CPU, CUDA events on a GPU (`rules.timing`).

On a GPU the host clock times kernel launches, not kernels. A CUDA clock records an event on
the current stream at each mark, and `resolve()` (one synchronize, after the step) turns
them into wall-clock seconds through one anchor, a host time and an event taken together
when the clock is made:

    host:   anchor_s ---------------------------------------------> seconds(mark)
    stream: anchor_event ... kernels ... mark_event                 = anchor_s + elapsed(anchor_event, mark_event)

So traces from several devices (and processes: time.time() is shared) keep one time base.
A mark may also be a float, a time.time() value taken on the host; it resolves to itself.
"""

from __future__ import annotations

import time
from typing import Union

import torch

from rules.timing import elapsed_s, record_event, sync, uses_events

__all__ = ["Clock", "Mark"]

Mark = Union[float, "torch.cuda.Event"]


class Clock:
    """Marks the start and end of traced ops on one device, as wall-clock seconds.

    `mark()` returns a handle; `seconds(mark)` is valid after `resolve()` (at once on CPU,
    where a mark is the time.time() value itself).
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.cuda = uses_events(self.device)
        self._anchor_s = 0.0
        self._anchor: torch.cuda.Event | None = None
        if self.cuda:
            # The stream is idle after the synchronize, so the anchor event runs at once:
            # its time on the device and the host time agree to within a launch (microseconds).
            sync(self.device)
            self._anchor_s = time.time()
            self._anchor = record_event(self.device)

    def mark(self) -> Mark:
        """Now: time.time() on CPU; on CUDA an event recorded on the current stream (when the
        work queued so far is done)."""
        return record_event(self.device) if self.cuda else time.time()

    def resolve(self) -> None:
        """Wait for the device (CUDA: one synchronize) so every mark made so far can be read."""
        sync(self.device)

    def seconds(self, mark: Mark) -> float:
        """Wall-clock seconds of `mark` (a time.time() value). CUDA marks need `resolve()` first.

        Raises:
            RuntimeError: a CUDA mark that has not completed; call `resolve()` after the step.
        """
        if isinstance(mark, (int, float)):
            return float(mark)
        if self._anchor is None:
            raise RuntimeError(f"a CUDA event mark given to a clock on {self.device}; use the clock that made it")
        if not mark.query():
            raise RuntimeError("this CUDA mark has not completed; call clock.resolve() after the step, then read it")
        return self._anchor_s + elapsed_s(self._anchor, mark)
