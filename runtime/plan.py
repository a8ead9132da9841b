"""The Plan: plain data saying which graph nodes run on which device, and what that should cost.

The planner writes it, the runtime reads it, the visualizer draws it. It holds names and
numbers only (no tensors, no modules), so it can be saved, edited by hand and loaded back.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Plan", "StagePlan", "human_bytes"]


@dataclass
class StagePlan:
    """One pipeline stage: a contiguous run of graph nodes (topological order) on one device."""

    index: int
    device: str
    nodes: list[str]
    predicted_ms: float = 0.0  # forward + backward + transfers of one micro-batch, divided by the replicas
    compute_ms: float = 0.0
    forward_ms: float = 0.0  # compute_ms split into its forward and backward parts
    backward_ms: float = 0.0
    comm_ms: float = 0.0
    param_bytes: int = 0
    activation_bytes: int = 0  # activations held for backward across all micro-batches in flight
    recv_bytes: int = 0  # per micro-batch, forward direction
    send_bytes: int = 0
    ranks: list[int] = field(default_factory=list)  # processes running a replica each (multi-process runs)


@dataclass
class Plan:
    """A placement of a traced model onto devices plus the schedule to run it with."""

    stages: list[StagePlan]
    micro_batches: int = 1
    schedule: str = "gpipe"
    predicted_step_ms: float = 0.0
    notes: dict[str, Any] = field(default_factory=dict)
    # The model graph for drawing, as plain node-link data (JSON-ready), or None:
    # {"nodes": [{name, op, module, stage, shapes, out_bytes, param_bytes, flops, time}, ...],
    #  "edges": [{src, dst, bytes}, ...], "capacity": {device: bytes or None}};
    # filled by partitioner.visualizer.attach_graph.
    graph: dict[str, Any] | None = None

    @property
    def devices(self) -> list[str]:
        return [s.device for s in self.stages]

    @property
    def bottleneck_ms(self) -> float:
        return max((s.predicted_ms for s in self.stages), default=0.0)

    def stage_of(self) -> dict[str, int]:
        """Node name -> stage index."""
        return {n: s.index for s in self.stages for n in s.nodes}

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        data = json.loads(text)
        stages = [StagePlan(**s) for s in data.pop("stages")]
        return cls(stages=stages, **data)

    def summary(self) -> str:
        """The plan as a fixed-width table, one row per stage."""
        header = ("stage", "device", "nodes", "first .. last node", "pred ms", "comm ms", "params", "activations")
        rows = [
            (
                str(s.index),
                s.device,
                str(len(s.nodes)),
                f"{s.nodes[0]} .. {s.nodes[-1]}" if s.nodes else "-",
                f"{s.predicted_ms:.3f}",
                f"{s.comm_ms:.3f}",
                human_bytes(s.param_bytes),
                human_bytes(s.activation_bytes),
            )
            for s in self.stages
        ]
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
        line = "  ".join("{:<%d}" % w for w in widths)
        out = [line.format(*header), line.format(*("-" * w for w in widths))]
        out += [line.format(*r) for r in rows]
        out.append(
            f"{len(self.stages)} stages, {self.micro_batches} micro-batches, schedule {self.schedule}; "
            f"bottleneck {self.bottleneck_ms:.3f} ms per micro-batch, predicted step {self.predicted_step_ms:.3f} ms"
        )
        return "\n".join(out)

    def __str__(self) -> str:
        return self.summary()


def human_bytes(nbytes: float) -> str:
    """1536 -> '1.5 KiB' (the unit of the plan table and the pictures)."""
    for unit in ("B", "KiB", "MiB"):
        if abs(nbytes) < 1024:
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} GiB"
