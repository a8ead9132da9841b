"""The Plan: plain data saying which graph nodes run on which device, and what that should cost.

The planner writes it, the runtime reads it, the visualizer draws it. It holds names and
numbers only (no tensors, no modules), so it can be saved, edited by hand and loaded back.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, get_args

from rules.schedules import schedule_names
from runtime.ops import Op, Program

__all__ = ["RECOMPUTE_MODES", "UPDATES", "Placement", "Plan", "RecomputeMode", "Schedule", "StagePlan", "Update",
           "human_bytes"]

# A schedule's name: a built-in ("gpipe", "1f1b", "interleaved", "zb1", "zbv", "dualpipev") or one
# registered later (rules.schedules.register), so a string, not a closed Literal; `Plan.check` checks
# it against the registry when a plan is made or loaded.
Schedule = str
Placement = Literal["pipeline", "branches", "hybrid"]
SCHEDULES: tuple[str, ...] = schedule_names()  # the built-ins; schedule_names() also has those registered later
PLACEMENTS: tuple[str, ...] = get_args(Placement)
# What a stage keeps for backward (runtime.recompute): everything autograd saves ("none"), matmul and
# convolution outputs ("selective"), or only its inputs ("full"); the rest runs again in backward.
RecomputeMode = Literal["none", "selective", "full"]
RECOMPUTE_MODES: tuple[str, ...] = get_args(RecomputeMode)
# How weights update (runtime.versions): after each whole step ("sync", the caller steps the optimizer), or
# with no pipeline flush: PipeDream-2BW ("2bw", two weight versions, gradients applied one step late) or
# PipeDream's weight stashing ("stash", an update per micro-batch, each backward on its forward's weights).
Update = Literal["sync", "2bw", "stash"]
UPDATES: tuple[str, ...] = get_args(Update)


@dataclass
class StagePlan:
    """One pipeline stage: a run of graph nodes (topological order) on one device.

    `ranks` are the programs running a replica of the stage each: process ranks under
    torchrun, worker slots in one process (micro-batch i runs on ranks[i % len(ranks)]).
    `reads_from` are the stages whose values it reads (a chain: the one before it).
    """

    index: int
    device: str
    nodes: list[str]
    predicted_ms: float = 0.0  # forward + backward + transfers of one micro-batch, divided by the replicas
    compute_ms: float = 0.0
    forward_ms: float = 0.0  # compute_ms split into its forward and backward parts
    backward_ms: float = 0.0
    comm_ms: float = 0.0
    allreduce_ms: float = 0.0  # the gradient all-reduce over the replicas, once per step
    param_bytes: int = 0
    activation_bytes: int = 0  # activations held for backward across all micro-batches in flight
    memory_bytes: int = 0  # predicted peak on each device of the stage (0: not predicted)
    capacity_bytes: int | None = None  # usable bytes of that device, where the planner knew them
    recv_bytes: int = 0  # per micro-batch, forward direction
    send_bytes: int = 0
    ranks: list[int] = field(default_factory=list)
    reads_from: list[int] = field(default_factory=list)
    cut_from_marker: bool = False  # the cut before this stage is a pipe_split() marker / split_spec point
    recompute: RecomputeMode = "none"  # activation recomputation (runtime.recompute); its cost is in the numbers

    @property
    def replicas(self) -> int:
        return max(1, len(self.ranks))


@dataclass
class Plan:
    """A placement of a traced model onto devices plus the schedule to run it with."""

    stages: list[StagePlan]
    micro_batches: int = 1
    schedule: Schedule = "gpipe"
    predicted_step_ms: float = 0.0
    placement: Placement = "pipeline"
    virtual_stages: int = 1  # stages per rank of a loop or V layout (interleaved: 2 or more; zbv: 2)
    update: Update = "sync"  # asynchronous updates run the 1F1B stream of runtime.stream, not `programs`
    # Bounded staleness (torchrun, runtime.staleness): the update of step t uses the all-reduced
    # gradients of step t - staleness for weights held by several ranks; 0 is synchronous.
    staleness: int = 0
    # GPUs per host of the cluster the plan is for (ranks are host-major: rank r is on host r // it);
    # 0: not planned for a cluster (one machine, or unknown).
    gpus_per_host: int = 0
    # What each rank (worker) runs in one training step, with predicted times: see runtime.program.
    programs: list[Program] = field(default_factory=list)
    # Predicted step ms of the candidates an "auto" choice compared, by name ({} when none).
    alternatives: dict[str, float] = field(default_factory=dict)
    # The model graph for drawing, as plain node-link data (JSON-ready), or None:
    # {"nodes": [{name, op, module, stage, shapes, out_bytes, param_bytes, flops, time}, ...],
    #  "edges": [{src, dst, bytes}, ...], "capacity": {device: bytes or None}};
    # filled by partitioner.show.visualizer.attach_graph.
    graph: dict[str, Any] | None = None

    @property
    def devices(self) -> list[str]:
        return [s.device for s in self.stages]

    @property
    def bottleneck_ms(self) -> float:
        return max((s.predicted_ms for s in self.stages), default=0.0)

    @property
    def recomputes(self) -> bool:
        """Whether any stage recomputes activations in backward (runtime.recompute)."""
        return any(s.recompute != "none" for s in self.stages)

    def stage_of(self) -> dict[str, int]:
        """Node name -> stage index."""
        return {n: s.index for s in self.stages for n in s.nodes}

    @property
    def ranks(self) -> int:
        """How many programs (processes under torchrun, workers in one process) the plan runs on."""
        return len(self.programs) or 1 + max((r for s in self.stages for r in s.ranks), default=len(self.stages) - 1)

    def host_of(self, rank: int) -> int:
        """The host of `rank` on the cluster the plan is for (0 when `gpus_per_host` is not known)."""
        return rank // self.gpus_per_host if self.gpus_per_host > 0 else 0

    def to_json(self) -> str:
        data = asdict(self)
        data["programs"] = [
            {"rank": p.rank, "device": p.device, "ops": [str(op) for op in p.ops], "predicted": p.predicted}
            for p in self.programs
        ]
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Read `to_json` output back (a hand-edited file too); unknown keys are an error."""
        data = json.loads(text)
        data.pop("notes", None)  # written by 0.1; its facts are typed fields now
        stages = [StagePlan(**s) for s in data.pop("stages")]
        programs = [
            Program(p["rank"], p["device"], [Op.parse(o) for o in p["ops"]], [tuple(x) for x in p.get("predicted", [])])
            for p in data.pop("programs", [])
        ]
        plan = cls(stages=stages, programs=programs, **data)
        plan.check()
        return plan

    def check(self) -> None:
        """Raise ValueError naming every field that holds a value the runtime cannot run."""
        problems = []
        if self.schedule not in schedule_names():
            problems.append(f"schedule={self.schedule!r}; use one of {', '.join(schedule_names())}")
        if self.placement not in PLACEMENTS:
            problems.append(f"placement={self.placement!r}; use one of {', '.join(PLACEMENTS)}")
        if self.update not in UPDATES:
            problems.append(f"update={self.update!r}; use one of {', '.join(UPDATES)}")
        elif self.update != "sync" and self.schedule != "1f1b":
            problems.append(f"update={self.update!r} with schedule={self.schedule!r}; asynchronous updates stream "
                            "1F1B: use schedule='1f1b'")
        if isinstance(self.staleness, bool) or not isinstance(self.staleness, int) or self.staleness < 0:
            problems.append(f"staleness={self.staleness!r}; use an integer >= 0 (0: the synchronous all-reduce)")
        if isinstance(self.gpus_per_host, bool) or not isinstance(self.gpus_per_host, int) or self.gpus_per_host < 0:
            problems.append(f"gpus_per_host={self.gpus_per_host!r}; use an integer >= 0 (0: not planned for a cluster)")
        if isinstance(self.micro_batches, bool) or not isinstance(self.micro_batches, int) or self.micro_batches < 1:
            problems.append(f"micro_batches={self.micro_batches!r}; use an integer >= 1")
        for k, s in enumerate(self.stages):
            if s.index != k:
                problems.append(f"stages[{k}].index is {s.index}; number stages 0, 1, 2, ... in order")
            if any(p >= k or p < 0 for p in s.reads_from):
                problems.append(f"stage {k} reads from stages {s.reads_from}; a stage reads only earlier stages")
            if s.recompute not in RECOMPUTE_MODES:
                problems.append(f"stages[{k}].recompute={s.recompute!r}; use one of {', '.join(RECOMPUTE_MODES)}")
        if problems:
            raise ValueError("invalid plan:\n" + "\n".join(f"- {p}" for p in problems))

    def summary(self) -> str:
        """The plan as a fixed-width table, one row per stage."""
        header = (
            "stage", "device", "nodes", "first .. last node", "cut", "pred ms", "comm ms", "params", "activations"
        )
        rows = [
            (
                str(s.index),
                s.device,
                str(len(s.nodes)),
                f"{s.nodes[0]} .. {s.nodes[-1]}" if s.nodes else "-",
                "marker" if s.cut_from_marker else "-" if s.index == 0 else "cost",
                f"{s.predicted_ms:.3f}",
                f"{s.comm_ms:.3f}",
                human_bytes(s.param_bytes),
                human_bytes(s.activation_bytes),
            )
            for s in self.stages
        ]
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
        line = "  ".join(f"{{:<{w}}}" for w in widths)
        out = [line.format(*header), line.format(*("-" * w for w in widths))]
        out += [line.format(*r) for r in rows]
        out.append(
            f"{len(self.stages)} stages ({self.placement}), {self.micro_batches} micro-batches, "
            f"schedule {self.schedule}; "
            + (f"update {self.update}; " if self.update != "sync" else "")
            + (f"staleness {self.staleness}; " if self.staleness else "")
            + (f"recompute {', '.join(s.recompute for s in self.stages)}; " if self.recomputes else "")
            + f"bottleneck {self.bottleneck_ms:.3f} ms per micro-batch, predicted step {self.predicted_step_ms:.3f} ms"
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
