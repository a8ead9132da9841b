"""What a search says when nothing fits: InfeasibleError, with the memory each device would need and why."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from partitioner.errors import PartitionError

__all__ = ["Held", "InfeasibleError", "held_text", "size_text"]


@dataclass(frozen=True)
class Held:
    """What one GPU of a stage holds at its peak, split into what a step keeps and what the schedule keeps in flight.

    states: weights, their master copies, gradients, optimizer states and the stage's buffers (messages, the
        backward's working outputs): what fewer ranks sharing the stage, sharding or another optimizer changes.
    activations: the saved activations and boundary values of `in_flight` micro-batches (with `chunks` > 1, each
        a chunk of 1/chunks of the stage, interleaved): what recomputation, smaller micro-batches or more stages
        change.
    """

    stage: int
    states: float
    activations: float
    in_flight: int
    chunks: int = 1

    @property
    def total(self) -> float:
        return self.states + self.activations


class InfeasibleError(PartitionError):
    """No split of the devices keeps every stage within its devices' memory."""

    def __init__(self, message: str, needed_bytes: list[int], note: str = "",
                 held: Sequence[Held] = ()) -> None:
        super().__init__(f"{message} {note}" if note else message)
        self.needed_bytes = needed_bytes  # per device, under the split that needs the least
        self.note = note  # what else would fit (another training precision), or ""
        self.held = list(held)  # per stage of that split, where known: what its GPUs hold (Held)


def held_text(held: Sequence[Held], device: str = "GPU") -> str:
    """The fullest stage's memory by kind, as the errors print it ("" without any); `device`: what a stage runs on."""
    if not held:
        return ""
    h = max(held, key=lambda x: x.total)
    noun = "micro-batch" if h.in_flight == 1 else "micro-batches"
    what = f"chunk {noun} (1/{h.chunks} of the stage each, interleaved)" if h.chunks > 1 else noun
    each = h.activations / h.in_flight if h.in_flight else 0.0
    return (f"Its fullest {device} (stage {h.stage}) holds {size_text(h.states)} of weights, gradients, optimizer "
            f"states and buffers and {size_text(h.activations)} of activations: {h.in_flight} {what} in flight, "
            f"{size_text(each)} each.")


def size_text(x: float) -> str:
    """Bytes as the errors print them: "512 B", "1.50 GiB", "no limit" (inf)."""
    if not np.isfinite(x):
        return "no limit"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if x < 1024 or unit == "GiB":
            return f"{x:.0f} B" if unit == "B" else f"{x:.2f} {unit}"
        x /= 1024
    return ""
