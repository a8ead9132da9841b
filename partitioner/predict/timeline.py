"""A simulated step as data: per-device events (compute, transfers, all-reduce, idle), makespan and bubble.

The simulator (partitioner/predict/simulator.py) fills these; the visualizer and the CLI draw and print them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from partitioner.predict.replica_fold import rank_span

__all__ = [
    "ALLREDUCE", "BACKWARD", "FORWARD", "IDLE", "RECV", "SEND", "WEIGHT", "DeviceTimeline", "Event", "Timeline",
    "compute_kind", "fill_idle",
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
    """A device's (or rank's) events sorted by start; comm events may overlap compute.

    `ranks`: the ranks the row stands for; several when identical data-parallel replicas
    were simulated once (partitioner/predict/replica_fold.py), and then every figure is per rank.
    """

    device: str
    stages: list[int]
    events: list[Event] = field(default_factory=list)
    busy_ms: float = 0.0  # compute
    comm_ms: float = 0.0  # send, recv and allreduce, overlapped or not
    idle_ms: float = 0.0  # nothing at all running
    ranks: list[int] = field(default_factory=list)

    @property
    def replicas(self) -> int:
        """How many ranks run this row's timeline (1 for a row of its own)."""
        return max(1, len(self.ranks))

    def label(self, row: int) -> str:
        """'device 3' for a row of its own, 'ranks 0-8191 (8192 replicas)' for a group."""
        if self.replicas == 1:
            return f"device {row}"
        return f"ranks {rank_span(self.ranks)} ({self.replicas} replicas)"


@dataclass
class Timeline:
    """Per-device timelines of one training step, its makespan and stage occupancy.

    `predicted` holds, when the plan's programs were simulated, each program's (start, end)
    per op: what `Program.predicted` stores (one per program of the plan; where the plan had
    none and replicas were folded, one per row).
    """

    devices: list[DeviceTimeline]
    makespan_ms: float
    peak_in_flight: list[int]  # per stage: most micro-batches forwarded but not yet backwarded
    predicted: list[list[tuple[float, float]]] = field(default_factory=list)

    @property
    def bubble_fraction(self) -> float:
        """Share of device time not computing: 1 - sum(busy) / (devices * makespan), each rank of a row counted."""
        if not self.devices or self.makespan_ms <= 0:
            return 0.0
        ranks = sum(d.replicas for d in self.devices)
        return 1.0 - sum(d.busy_ms * d.replicas for d in self.devices) / (ranks * self.makespan_ms)

    @property
    def ranks(self) -> int:
        """How many ranks the timeline covers (rows of folded replicas count every rank)."""
        return sum(d.replicas for d in self.devices)

    def events(self, kind: str) -> list[list[Event]]:
        """Per device, its events of one kind (e.g. ALLREDUCE), in start order."""
        return [[e for e in d.events if e.kind == kind] for d in self.devices]

    def chart(self, ms_per_char: float | None = None, width: int = 72) -> str:
        """A text Gantt chart: F forward, B backward, ~ only transfers or all-reduce, . idle."""
        scale = ms_per_char or (self.makespan_ms / width if self.makespan_ms > 0 else 1.0)
        columns = max(1, round(self.makespan_ms / scale))
        rows = []
        labels = [timeline.label(d) for d, timeline in enumerate(self.devices)]
        width_label = max(map(len, labels)) if any(d.replicas > 1 for d in self.devices) else 0
        for d, timeline in enumerate(self.devices):
            cells = ["."] * columns
            for e in timeline.events:
                mark = {FORWARD: "F", BACKWARD: "B", WEIGHT: "W", IDLE: None}.get(e.kind, "~")
                for c in range(int(e.start / scale + 0.5), int(e.end / scale + 0.5)):
                    if mark and c < columns and (cells[c] == "." or mark != "~"):
                        cells[c] = mark
            rows.append(f"{labels[d]:<{width_label}} " + "".join(cells))
        return "\n".join(rows)

    def summary(self) -> str:
        """A table: one row per device, then the makespan and bubble."""
        grouped = any(d.replicas > 1 for d in self.devices)
        names = [f"{d.device} {d.label(k)}" if grouped else d.device
                 for k, d in enumerate(self.devices)]
        width = max([12, *map(len, names)]) if grouped else 12
        lines = [f"{'device':<{width}} {'stages':<10} {'busy ms':>10} {'comm ms':>10} {'idle ms':>10}"]
        for name, d in zip(names, self.devices):
            stages = ",".join(map(str, d.stages))
            lines.append(f"{name:<{width}} {stages:<10} {d.busy_ms:>10.3f} {d.comm_ms:>10.3f} {d.idle_ms:>10.3f}")
        lines.append(
            f"makespan {self.makespan_ms:.3f} ms, bubble {self.bubble_fraction:.1%}, "
            f"peak in-flight per stage {self.peak_in_flight}"
            + (f", {self.ranks} ranks in {len(self.devices)} rows (per-rank figures)" if grouped else "")
        )
        return "\n".join(lines)


def compute_kind(action: str) -> str:
    """The event kind of a compute action "F", "B" or "W" (a split backward's weight part)."""
    return {"F": FORWARD, "W": WEIGHT}.get(action, BACKWARD)


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
