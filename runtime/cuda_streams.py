"""CUDA streams behind small helpers: copy streams, worker compute streams, events; no-ops on CPU.

One process, several GPUs (as torchgpipe does it):

    producer (stage s, cuda:0)          copy streams                 consumer (stage t, cuda:1)
    compute ──► y_i ─── wait_stream ──► copy(0->1): y_i.to(cuda:1) ──► event ─► wait_event ─► compute
    compute ──► y_i+1 (overlaps the copy of y_i)

The producer starts the copy on a copy stream after its compute stream, records the source
tensor on that stream (its memory is not reused until the copy ends) and hands an event to
the consumer, whose compute stream waits for it and records the received tensor (it was
allocated on the copy stream). Workers sharing one GPU (branch slots) get their own
compute streams, which wait for the caller's stream before a step and it for them after.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import torch

from runtime.microbatch import tensors_in

__all__ = ["CopyStreams", "Handoff", "compute_stream", "current", "join_caller", "record_on", "use_stream"]


_IS_CUDA: dict[Any, bool] = {}  # device -> whether it is a GPU: `device.type` builds a string on every read


def _cuda(device: torch.device) -> bool:
    found = _IS_CUDA.get(device)
    if found is None:
        found = _IS_CUDA[device] = torch.device(device).type == "cuda"
    return found


def current(device: torch.device) -> Any:
    """The calling thread's current stream on `device` (None off CUDA)."""
    return torch.cuda.current_stream(device) if _cuda(device) else None


@contextlib.contextmanager
def use_stream(stream: Any) -> Iterator[None]:
    """Make `stream` current on its device for this thread (nothing for None)."""
    if stream is None:
        yield
        return
    with torch.cuda.stream(stream):
        yield


def record_on(value: Any, stream: Any) -> None:
    """Tell the allocator `stream` uses every CUDA tensor of `value` (so it is not reused too early)."""
    if stream is None:
        return
    for t in tensors_in(value):
        if t.is_cuda and t.device == stream.device:
            t.record_stream(stream)


class Handoff:
    """Values moved to their consumer's device, with the event the consumer must wait for (None: ready)."""

    __slots__ = ("event", "values")

    def __init__(self, values: Any, event: Any = None) -> None:
        self.values = values
        self.event = event

    def receive(self, device: torch.device) -> Any:
        """The values, made safe to use on this thread's current stream of `device`."""
        if self.event is None and not _cuda(device):
            return self.values
        stream = current(device)
        if self.event is not None and stream is not None:
            stream.wait_event(self.event)
        record_on(self.values, stream)
        return self.values


class CopyStreams:
    """One copy stream per device, created on first use; `send` moves values the producer's way."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, Any] = {}
        self._lock = threading.Lock()

    def stream(self, device: torch.device) -> Any:
        if not _cuda(device):
            return None
        with self._lock:
            if device not in self._streams:
                self._streams[device] = torch.cuda.Stream(device)
            return self._streams[device]

    def send(self, values: Any, src: torch.device, dst: torch.device, move: Any) -> Handoff:
        """Start moving `values` (made on `src` by this thread) to `dst`; `move(values, dst)` does the copy.

        CPU to CPU moves nothing. Otherwise the copy runs on copy streams after the producer's
        current stream, so the producer goes on computing while it runs.
        """
        if not (_cuda(src) or _cuda(dst)):
            return Handoff(move(values, dst))
        producer = current(src)
        if src == dst:  # no copy: the consumer (maybe on another stream) waits for the producer's work
            event = torch.cuda.Event()
            event.record(producer)
            return Handoff(values, event)
        out_stream, in_stream = self.stream(src), self.stream(dst)
        if out_stream is not None:
            out_stream.wait_stream(producer)
        with use_stream(out_stream), use_stream(in_stream):
            moved = move(values, dst)
            record_on(values, out_stream)
            if in_stream is None:  # to the CPU: `move` copied synchronously, the values are ready
                return Handoff(moved)
            event = torch.cuda.Event()
            event.record(in_stream)
        return Handoff(moved, event)


def compute_stream(device: torch.device, own: bool) -> Any:
    """A worker's compute stream on `device`: its own where it shares the GPU with others, else the current one."""
    if not _cuda(device):
        return None
    return torch.cuda.Stream(device) if own else torch.cuda.current_stream(device)


@contextlib.contextmanager
def join_caller(stream: Any, caller: Any) -> Iterator[None]:
    """Run a worker on `stream`: it starts after the caller's queued work, and the caller's stream
    waits for it at the end (nothing when both are the same stream or off CUDA)."""
    if stream is None or caller is None or stream == caller:
        with use_stream(stream):
            yield
        return
    stream.wait_stream(caller)
    try:
        with use_stream(stream):
            yield
    finally:
        caller.wait_stream(stream)
