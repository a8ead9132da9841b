"""A simulated step as data: per-device events (compute, transfers, all-reduce, idle), makespan and bubble.

The simulator (partitioner/simulator.py) fills these; the visualizer and the CLI draw and print them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = [
    "ALLREDUCE", "BACKWARD", "FORWARD", "IDLE", "RECV", "SEND", "WEIGHT", "DeviceTimeline", "Event", "Timeline",
    "fill_idle",
]

FORWARD, BACKWARD, WEIGHT = "compute-forward", "compute-backward", "compute-weight"  # WEIGHT: a split B's W
SEND, RECV, ALLREDUCE, IDLE = "send", "recv", "allreduce", "idle"


@dataclass
class Event:
    """One interval on a device: compute, a transfer, an all-reduce or idle (times in ms)."""

    kind: str
    stage: int  # -1 for idle
    microbatch: int  # -1 for idle and allreduce
    start: float
    end: float
    peer: int = -1  # the other device (timeline row) of a send or recv

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class DeviceTimeline:
    """A device's (or rank's) events sorted by start; comm events may overlap compute."""

    device: str
    stages: list[int]
    events: list[Event] = field(default_factory=list)
    busy_ms: float = 0.0  # compute
    comm_ms: float = 0.0  # send, recv and allreduce, overlapped or not
    idle_ms: float = 0.0  # nothing at all running


@dataclass
class Timeline:
    """Per-device timelines of one training step, its makespan and stage occupancy.

    `predicted` holds, when the plan's programs were simulated, each program's (start, end)
    per op: what `Program.predicted` stores.
    """

    devices: list[DeviceTimeline]
    makespan_ms: float
    peak_in_flight: list[int]  # per stage: most micro-batches forwarded but not yet backwarded
    predicted: list[list[tuple[float, float]]] = field(default_factory=list)

    @property
    def bubble_fraction(self) -> float:
        """Share of device time not computing: 1 - sum(busy) / (devices * makespan)."""
        if not self.devices or self.makespan_ms <= 0:
            return 0.0
        return 1.0 - sum(d.busy_ms for d in self.devices) / (len(self.devices) * self.makespan_ms)

    def events(self, kind: str) -> list[list[Event]]:
        """Per device, its events of one kind (e.g. ALLREDUCE), in start order."""
        return [[e for e in d.events if e.kind == kind] for d in self.devices]

    def chart(self, ms_per_char: float | None = None, width: int = 72) -> str:
        """A text Gantt chart: F forward, B backward, ~ only transfers or all-reduce, . idle."""
        scale = ms_per_char or (self.makespan_ms / width if self.makespan_ms > 0 else 1.0)
        columns = max(1, round(self.makespan_ms / scale))
        rows = []
        for d, timeline in enumerate(self.devices):
            cells = ["."] * columns
            for e in timeline.events:
                mark = {FORWARD: "F", BACKWARD: "B", WEIGHT: "W", IDLE: None}.get(e.kind, "~")
                for c in range(int(e.start / scale + 0.5), int(e.end / scale + 0.5)):
                    if mark and c < columns and (cells[c] == "." or mark != "~"):
                        cells[c] = mark
            rows.append(f"device {d} " + "".join(cells))
        return "\n".join(rows)

    def summary(self) -> str:
        """A table: one row per device, then the makespan and bubble."""
        lines = [f"{'device':<12} {'stages':<10} {'busy ms':>10} {'comm ms':>10} {'idle ms':>10}"]
        for d in self.devices:
            stages = ",".join(map(str, d.stages))
            lines.append(f"{d.device:<12} {stages:<10} {d.busy_ms:>10.3f} {d.comm_ms:>10.3f} {d.idle_ms:>10.3f}")
        lines.append(
            f"makespan {self.makespan_ms:.3f} ms, bubble {self.bubble_fraction:.1%}, "
            f"peak in-flight per stage {self.peak_in_flight}"
        )
        return "\n".join(lines)


def fill_idle(timeline: DeviceTimeline, makespan: float) -> None:
    """Add idle events for the gaps where nothing runs and total busy, comm and idle time."""
    idle: list[Event] = []
    covered = 0.0
    for e in sorted(timeline.events, key=lambda e: (e.start, e.end)):
        if e.start > covered:
            idle.append(Event(IDLE, -1, -1, covered, e.start))
        covered = max(covered, e.end)
    if makespan > covered:
        idle.append(Event(IDLE, -1, -1, covered, makespan))
    timeline.busy_ms = sum(e.duration for e in timeline.events if e.kind in (FORWARD, BACKWARD, WEIGHT))
    timeline.comm_ms = sum(e.duration for e in timeline.events if e.kind in (SEND, RECV, ALLREDUCE))
    timeline.idle_ms = sum(e.duration for e in idle)
    timeline.events = sorted(timeline.events + idle, key=lambda e: (e.start, e.end))
