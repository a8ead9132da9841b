"""Pipeline schedules as data: which (micro-batch, stage) work runs at each clock tick."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Literal

__all__ = ["Action", "clock_cycles", "gpipe"]


@dataclass(frozen=True, order=True)
class Action:
    """One unit of work: forward ('F') or backward ('B') of `microbatch` on `stage`; prints as '1F0'."""

    stage: int
    kind: Literal["F", "B"]
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> "Action":
        for kind in ("F", "B"):
            stage, sep, mb = text.partition(kind)
            if sep:
                return cls(int(stage), kind, int(mb))  # type: ignore[arg-type]
        raise ValueError(f"cannot parse action {text!r}; expected e.g. '1F0' or '0B3'")


def clock_cycles(micro_batches: int, stages: int) -> Iterator[list[tuple[int, int]]]:
    """GPipe forward staircase: at tick k, every (i, j) with i + j == k runs.

    m=3, n=2:   tick 0: (0,0)
                tick 1: (1,0) (0,1)
                tick 2: (2,0) (1,1)
                tick 3:       (2,1)
    """
    for k in range(micro_batches + stages - 1):
        yield [(k - j, j) for j in range(max(1 + k - micro_batches, 0), min(1 + k, stages))]


def gpipe(micro_batches: int, stages: int) -> list[list[Action]]:
    """Per-stage action lists for GPipe fill-drain: all forwards, then backwards in reverse."""
    return [
        [Action(s, "F", i) for i in range(micro_batches)]
        + [Action(s, "B", i) for i in reversed(range(micro_batches))]
        for s in range(stages)
    ]
