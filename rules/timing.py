"""CUDA-event timing, written once: the profiler's interval timer and the runtime's trace clock both use it.

On a GPU the host clock times kernel launches, not kernels. An event recorded on a stream
completes when the work queued before it is done; the time between two completed events is
the device's time for the work between them:

    host:    record(begin) ... launch kernels ... record(end) ... sync(device)
    stream:  begin ---------- kernels ----------- end               elapsed_s(begin, end)

Everywhere but CUDA, `sync` does nothing and `record_event` refuses: those devices are timed
by host clocks (`time.perf_counter`, `time.time`) at the call.
"""

from __future__ import annotations

import torch

__all__ = ["elapsed_s", "record_event", "sync", "uses_events"]


def uses_events(device: torch.device) -> bool:
    """True where work is timed by CUDA events (a CUDA device), False where a host clock times it."""
    return device.type == "cuda"


def sync(device: torch.device) -> None:
    """Wait until the work queued on `device` is done (one `torch.cuda.synchronize`; a no-op elsewhere)."""
    if uses_events(device):
        torch.cuda.synchronize(device)


def record_event(device: torch.device) -> torch.cuda.Event:
    """A timing event recorded now on `device`'s current stream (it completes when the work queued so far is done).

    Raises:
        ValueError: `device` is not a CUDA device; time it with a host clock instead.
    """
    if not uses_events(device):
        raise ValueError(f"CUDA events time CUDA devices only, not {device}; time it with a host clock "
                         "(time.perf_counter) instead")  # fmt: skip
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(device))
    return event


def elapsed_s(begin: torch.cuda.Event, end: torch.cuda.Event) -> float:
    """Seconds from event `begin` to event `end`; both must have completed (call `sync` first)."""
    return float(begin.elapsed_time(end)) / 1e3
