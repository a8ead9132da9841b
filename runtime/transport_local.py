"""The local transport: values between workers of one process (threads, or one thread in tick order).

A send starts moving the values to the receiving stage's device at once (the producer starts
the copy, on CUDA copy streams: see runtime.cuda_streams) and leaves them in a mailbox; the
receiver's `take` waits for them, and on CUDA for the copy to end on its stream. Within one process
nothing needs NCCL's ordering, but the programs and the interpreter are the same as under
torchrun, so one process runs every schedule the same way.
"""

from __future__ import annotations

import threading
from typing import Any, Mapping, Sequence

import torch

from runtime.cuda_streams import CopyStreams, Handoff
from runtime.microbatch import to_device
from runtime.program import Op

__all__ = ["LocalTransport", "WorkerFailed"]

Key = tuple[int, int, int]


class WorkerFailed(RuntimeError):
    """Another worker of this pipeline raised; its error is the one reported."""


class LocalTransport:
    """Mailboxes shared by the workers of one process; `blocking=False` for one-thread runs."""

    def __init__(self, stage_devices: Sequence[torch.device], blocking: bool = True) -> None:
        self.stage_devices = list(stage_devices)
        self._cpu = all(torch.device(d).type != "cuda" for d in self.stage_devices)  # no copy streams to use
        self.blocking = blocking
        self._box: dict[Key, Handoff] = {}
        self._copies = CopyStreams()
        self._ready = threading.Condition()
        self._failed = False

    @property
    def can_post_early(self) -> bool:
        """Nothing to gain: a local receive is only a wait on the mailbox."""
        return False

    def reset(self, *, mail: bool = True) -> None:
        """Start a step: forget a failure and, unless `mail` is False, every undelivered value.

        A call of an asynchronous stream keeps its mail: a value sent at the last tick of one
        call may be taken by the first op of the next (runtime.flushless).
        """
        if not self._failed and not (mail and self._box):  # between steps no worker runs: nothing to clear
            return
        with self._ready:
            if mail:
                self._box.clear()
            self._failed = False

    def abort(self) -> None:
        """Wake every waiting worker: a worker failed, so the step is over."""
        with self._ready:
            self._failed = True
            self._ready.notify_all()

    def post(self, ops: Sequence[Op], outgoing: Mapping[Key, list[Any]], device: Any) -> None:
        if not outgoing:
            return
        if self._cpu:  # nothing to overlap: values move (if at all) at once
            moved = {key: Handoff(to_device(values, self.stage_devices[key[1]])) for key, values in outgoing.items()}
        else:
            src = device if isinstance(device, torch.device) else torch.device(device)
            moved = {key: self._copies.send(values, src, self.stage_devices[key[1]], to_device)
                     for key, values in outgoing.items()}
        if not self.blocking:  # one thread runs every worker: nobody to wake
            self._box.update(moved)
            return
        with self._ready:
            self._box.update(moved)
            self._ready.notify_all()

    def take(self, key: Key, device: Any) -> list[Any]:
        device = device if isinstance(device, torch.device) else torch.device(device)
        if not self.blocking:
            handoff = self._box.pop(key, None)
            if handoff is None:
                raise RuntimeError(f"internal error: stage {key[1]} needs micro-batch {key[2]} from stage "
                                   f"{key[0]} before it was sent; the programs are out of tick order")
            values: list[Any] = handoff.receive(device)
            return values
        with self._ready:
            while key not in self._box:
                if self._failed:
                    raise WorkerFailed("another worker of the pipeline failed")
                self._ready.wait()
            handoff = self._box.pop(key)
        values = handoff.receive(device)
        return values
