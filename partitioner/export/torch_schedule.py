"""A plan's compute actions in torch.distributed.pipelining's format: a CSV row per pipeline rank ('0F0,0F1,1I0')."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from partitioner.errors import PartitionError
from partitioner.export.split_points import SplitPoints, split_points
from partitioner.predict.lowering import default_programs
from rules.schedules import Layout, layout_ranks
from runtime.plan import Plan
from runtime.program import Op, lower
from runtime.schedule import Action

__all__ = ["TORCH_CLASSES", "TorchSchedule", "to_torch_schedule", "torch_action"]

# torch's schedule class for each stage layout: torchtitan builds a rank's stages by the class named in
# `pipeline_parallel_schedule` (one stage per rank; stage s on rank s % p; a V), then runs the CSV's actions.
# Any other map ("custom": branches side by side, say) runs on `_PipelineScheduleRuntime`, which reads the map from
# the CSV, but not in torchtitan.
TORCH_CLASSES = {"chain": "PipelineScheduleSingle", "loop": "PipelineScheduleMulti", "v": "ZBVZeroBubble",
                 "custom": "PipelineScheduleMulti"}


@dataclass(frozen=True)
class TorchSchedule:
    """What `_PipelineScheduleRuntime` runs for a plan: compute actions per pipeline rank and where stages live.

    Attributes:
        actions: for each rank of one pipeline (a row of the CSV), its compute actions in
            order: 'F' forward, 'B' whole backward, 'I' the inputs' gradients of a split
            backward and 'W' its weights' gradients, as '<stage><kind><micro-batch>'.
        stage_to_rank: stage index -> rank within the pipeline group.
        micro_batches: micro-batches one pipeline runs per step (torch's `n_microbatches`).
        pipelines: equal pipelines side by side (each stage's replicas in the plan): torchtitan's
            data-parallel replicate degree; pipeline j runs the plan's micro-batches j, j + pipelines, ...
        layout: "chain" (a stage per rank), "loop" (stage s on rank s % ranks), "v", or "custom"
            (any other map: torch's runtime reads it from the CSV, torchtitan cannot place it).
        schedule: the plan's schedule name.
        split_points: the cuts as module names, and those not on a module boundary.
    """

    actions: list[list[str]]
    stage_to_rank: dict[int, int]
    micro_batches: int
    pipelines: int
    layout: str
    schedule: str
    split_points: SplitPoints

    @property
    def ranks(self) -> int:
        """Ranks of one pipeline (torchtitan's `pipeline_parallel_degree`)."""
        return len(self.actions)

    @property
    def stages(self) -> int:
        return len(self.stage_to_rank)

    @property
    def torch_class(self) -> str:
        """The torch schedule class whose stage layout this is (torchtitan's `pipeline_parallel_schedule`)."""
        return TORCH_CLASSES[self.layout]

    def csv(self) -> str:
        """The CSV `_PipelineScheduleRuntime._load_csv` reads: row r is rank r's actions, comma-separated."""
        return "".join(",".join(row) + "\n" for row in self.actions)

    def write_csv(self, path: str | os.PathLike[str]) -> Path:
        """Write `csv()` to `path`; returns the path."""
        out = Path(path)
        out.write_text(self.csv(), encoding="utf-8")
        return out


def torch_action(op: Op) -> str:
    """One compute op as torch writes it: 'F s1 mb3' -> '1F3', a split 'B' -> '1I3', 'W s1 mb3' -> '1W3'."""
    kind = "I" if op.kind == "B" and op.split else op.kind
    return f"{op.stage}{kind}{op.microbatch}"


def to_torch_schedule(plan: Plan) -> TorchSchedule:
    """Each pipeline rank's compute actions of `plan`, in torch.distributed.pipelining's action format.

    The actions are the plan's programs (what our runtime runs), so both runtimes compute in the
    same order. torch passes values from stage s to s + 1 only: a value a later stage reads
    travels through the stages between (partitioner.export.torch_stages), and the lists are
    checked to run under that order.

    Raises:
        PartitionError: what torch's runtime cannot run: asynchronous updates, stages with unequal
            replica counts, micro-batches the replicas do not share equally, or lists that wait
            on each other when values flow stage by stage (each says why).
    """
    if plan.update != "sync":
        raise PartitionError(f"update={plan.update!r} streams micro-batches without a flush; torch's schedules run "
                             "one step at a time: export a plan with update='sync'")
    stage_ranks = [list(s.ranks) or [s.index] for s in plan.stages]
    counts = sorted({len(r) for r in stage_ranks})
    if len(counts) > 1:
        raise PartitionError(f"stages run on {[len(r) for r in stage_ranks]} ranks each; torch.distributed.pipelining "
                             "runs equal pipelines side by side (data parallelism over whole pipelines): plan with the "
                             "same replica count for every stage")
    pipelines = counts[0]
    if plan.micro_batches % pipelines:
        raise PartitionError(f"{plan.micro_batches} micro-batches over {pipelines} replicas of each stage: torch runs "
                             "the same n_microbatches on every pipeline; use a multiple of the replica count")
    programs = {p.rank: p for p in (plan.programs or default_programs(plan))}
    first = [ranks[0] for ranks in stage_ranks]
    local = {rank: k for k, rank in enumerate(sorted(set(first)))}
    stage_to_rank = {s: local[r] for s, r in enumerate(first)}
    lists: list[list[Action]] = []
    rows: list[list[str]] = []
    for j in range(pipelines):
        mine = [[Op(op.kind, stage=op.stage, microbatch=(op.microbatch - j) // pipelines, split=op.split)
                 for op in programs[rank].ops if op.is_compute and stage_ranks[op.stage][j] == rank]
                for rank in sorted({ranks[j] for ranks in stage_ranks})]
        if j == 0:
            lists = [[Action(op.stage, op.kind, op.microbatch) for op in ops] for ops in mine]  # type: ignore[arg-type]
            rows = [[torch_action(op) for op in ops] for ops in mine]
        elif [[torch_action(op) for op in ops] for ops in mine] != rows:
            raise PartitionError(f"replica {j} of the pipeline runs another order than replica 0; torch runs one "
                                 "schedule on every pipeline")
    _check_chain(lists, stage_to_rank, plan.micro_batches // pipelines)
    return TorchSchedule(rows, stage_to_rank, plan.micro_batches // pipelines, pipelines,
                         _layout(stage_to_rank, len(local)), plan.schedule, split_points(plan))


def _check_chain(lists: list[list[Action]], stage_to_rank: dict[int, int], micro_batches: int) -> None:
    """Raise PartitionError unless the lists run when every stage reads the one before it, as torch passes values."""
    stages = len(stage_to_rank)
    chain = [[s - 1] if s else [] for s in range(stages)]
    try:
        lower(lists, chain, [[stage_to_rank[s]] for s in range(stages)], ["cpu"] * len(lists))
    except ValueError as exc:
        raise PartitionError(f"torch.distributed.pipelining sends stage s's values to stage s + 1 only, and in that "
                             f"order the plan's lists cannot run: {exc}") from None
    for s in range(stages):
        done = sorted(a.microbatch for actions in lists for a in actions if a.stage == s and a.kind == "F")
        if done != list(range(micro_batches)):
            raise PartitionError(f"stage {s} runs forwards of micro-batches {done}; each pipeline must run 0.."
                                 f"{micro_batches - 1} once")


def _layout(stage_to_rank: dict[int, int], ranks: int) -> str:
    """The named layout the stage-to-rank map is ('chain', 'loop' or 'v'), else 'custom'."""
    got = [[stage_to_rank[s]] for s in range(len(stage_to_rank))]
    per_rank = max(1, len(got) // max(1, ranks))
    layouts: tuple[Layout, ...] = ("chain", "loop", "v")
    for layout in layouts:
        if got == layout_ranks(layout, ranks, per_rank) and (layout != "loop" or per_rank > 1):
            return layout
    return "custom"
