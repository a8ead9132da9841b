"""A schedule torch or torchtitan users already have (a CSV of actions) as a plan's programs, lowered our way."""

from __future__ import annotations

import copy
import csv
import hashlib
import io
import os
from pathlib import Path
from typing import Any, Mapping, Sequence, TypeVar

from torch.distributed.pipelining.schedules import _Action as TorchAction, _ComputationType

from partitioner.errors import PartitionError
from partitioner.predict.assemble import finish
from partitioner.predict.lowering import reduced_groups, replica_groups
from rules.schedules import Layout, ScheduleSpec, layout_ranks, register, schedule_names, schedule_spec
from runtime.plan import Plan
from runtime.program import lower
from runtime.schedule import Action

__all__ = ["ActionsSource", "from_torch_schedule", "read_torch_actions"]

P = TypeVar("P", bound=Plan)
# A CSV path, or the rows themselves: per rank, actions as torch's `_Action`s or their text ('1F0'; None/'' skipped).
ActionsSource = str | os.PathLike[str] | Sequence[Sequence[Any]] | Mapping[int, Sequence[Any]]
_COMPUTE = {"F": "F", "B": "B", "I": "B", "W": "W"}  # torch's kinds -> ours (an I is a B whose W comes later)
_IMPORTED: set[str] = set()  # names registered by this module (only those may be registered again)


def read_torch_actions(source: ActionsSource) -> list[list[Action]]:
    """Each rank's compute actions from a torch schedule CSV (or rows of actions), in our terms.

    'F' and 'W' stay, 'B' (whole backward) and 'I' (inputs' gradients; its 'W' follows) become
    our 'B', an OVERLAP_F_B counts as its sub-actions in order; communication, UNSHARD, RESHARD
    and REDUCE_GRAD are dropped (lowering adds the messages again, our way).

    Raises:
        PartitionError: a cell torch cannot parse, or a file that cannot be read.
    """
    if isinstance(source, (str, os.PathLike)):
        try:
            text = Path(source).read_text(encoding="utf-8")
        except OSError as exc:
            raise PartitionError(f"cannot read the schedule CSV {source}: {exc}") from None
        rows: list[Sequence[Any]] = list(csv.reader(io.StringIO(text)))
    elif isinstance(source, Mapping):
        rows = [source[r] for r in sorted(source)]
    else:
        rows = list(source)
    lists: list[list[Action]] = []
    for rank, row in enumerate(rows):
        actions: list[Action] = []
        for cell in row:
            for a in _leaves(_parse(cell, rank)):
                kind = _COMPUTE.get(a.computation_type.value)
                if kind is not None:
                    actions.append(Action(a.stage_index, kind, int(a.microbatch_index or 0)))  # type: ignore[arg-type]
        lists.append(actions)
    return lists


def from_torch_schedule(source: ActionsSource, plan: P, *, name: str | None = None) -> P:
    """A copy of `plan` that runs the schedule in `source` (torch's CSV format) on its stages.

    The stages keep their nodes, devices and costs; each moves to the rank the schedule runs it
    on, the micro-batch count becomes the schedule's, and the schedule is registered under
    `name` (default 'torch-csv-<hash of the actions>') so the copy checks, runs and simulates
    like any plan: its programs are lowered NCCL-safely (runtime.program.lower) and simulated,
    which sets `predicted_step_ms`. Weights all-reduced together in `plan` still are.

    Raises:
        PartitionError: a schedule that is incomplete, repeats or deadlocks, puts stages where
            our runtime cannot (one stage per rank, round robin, or a V), or has another stage
            count than `plan` (each says why).
    """
    lists = read_torch_actions(source)
    stages, ranks = len(plan.stages), len(lists)
    owner = _owners(lists)
    if sorted(owner) != list(range(stages)):
        raise PartitionError(f"the schedule runs stages {sorted(owner)} but the plan has {stages} (0..{stages - 1}); "
                             "import it onto a plan with as many stages")
    micro_batches = _check_counts(lists, stages)
    layout, per_rank = _layout([owner[s] for s in range(stages)], ranks)
    try:  # deadlock-free when each stage reads the one before (as lowering will run it), before registering
        lower(lists, [[s - 1] if s else [] for s in range(stages)], [[owner[s]] for s in range(stages)],
              ["cpu"] * ranks)
    except ValueError as exc:
        raise PartitionError(f"the imported schedule cannot run: {exc}") from None
    old = _groups_by_stage(plan)
    copied = copy.deepcopy(plan)
    for s in copied.stages:
        s.ranks = [owner[s.index]]
        s.reads_from = [s.index - 1] if s.index else []
    copied.micro_batches, copied.virtual_stages, copied.placement = micro_batches, per_rank, "pipeline"
    copied.update, copied.alternatives = "sync", {}
    copied.schedule = _register(lists, layout, ranks, per_rank, micro_batches, name)
    copied.check()
    groups = [(sorted({owner[s] for s in group}), sorted(group)) for group in old]
    finish(copied, [g for g in groups if len(g[0]) > 1])
    return copied


def _parse(cell: Any, rank: int) -> TorchAction | None:
    if cell is None or isinstance(cell, TorchAction):
        return cell
    try:
        action: TorchAction | None = TorchAction.from_str(str(cell))
        return action
    except RuntimeError as exc:
        raise PartitionError(f"rank {rank}: {exc}") from None


def _leaves(a: TorchAction | None) -> list[TorchAction]:
    if a is None:
        return []
    if a.computation_type == _ComputationType.OVERLAP_F_B:
        return list(a.sub_actions or ())
    return [a]


def _owners(lists: list[list[Action]]) -> dict[int, int]:
    owner: dict[int, int] = {}
    for rank, actions in enumerate(lists):
        for a in actions:
            if owner.setdefault(a.stage, rank) != rank:
                raise PartitionError(f"stage {a.stage} runs on ranks {owner[a.stage]} and {rank}; torch's schedules "
                                     "run each stage on one rank of the pipeline")
    return owner


def _check_counts(lists: list[list[Action]], stages: int) -> int:
    """The micro-batch count; raise unless every stage runs each micro-batch's F once and its backward once."""
    forwards = [sorted(a.microbatch for actions in lists for a in actions if a.stage == s and a.kind == "F")
                for s in range(stages)]
    m = len(forwards[0])
    problems = [f"stage {s} runs forwards of micro-batches {f}; expected 0..{m - 1} once each"
                for s, f in enumerate(forwards) if f != list(range(m))]
    for kind in ("B", "W"):
        for s in range(stages):
            got = sorted(a.microbatch for actions in lists for a in actions if a.stage == s and a.kind == kind)
            if kind == "B" and got != list(range(m)):
                problems.append(f"stage {s} runs backwards (B or I) of micro-batches {got}; expected 0..{m - 1} once")
            if kind == "W" and len(set(got)) != len(got):
                problems.append(f"stage {s} runs W of micro-batches {got}: one W per micro-batch at most")
    if problems:
        raise PartitionError("the schedule is incomplete:\n" + "\n".join(f"- {p}" for p in problems))
    return m


def _layout(owner: list[int], ranks: int) -> tuple[Layout, int]:
    """The named layout of stage -> rank `owner` and its stages per rank."""
    per_rank = max(1, len(owner) // ranks)
    got = [[r] for r in owner]
    layouts: tuple[Layout, ...] = ("chain", "loop", "v")
    for layout in layouts:
        if got == layout_ranks(layout, ranks, per_rank) and (layout == "chain") == (per_rank == 1):
            return layout, per_rank
    raise PartitionError(f"the schedule puts stages on ranks {owner}; our runtime lays stages out one per rank, "
                         "round robin (stage s on rank s % ranks) or in a V (rank r holds r and 2p - 1 - r)")


def _groups_by_stage(plan: Plan) -> list[set[int]]:
    """The stages whose weights `plan` all-reduces together (by stage, so they survive new ranks)."""
    groups = reduced_groups(plan) if plan.programs else replica_groups(plan)
    return [set(stages) for _, stages in groups]


def _register(lists: list[list[Action]], layout: Layout, ranks: int, per_rank: int, micro_batches: int,
              name: str | None) -> str:
    """Register the imported lists as a schedule (only its own counts accepted); returns its name."""
    text = "\n".join(" ".join(map(str, actions)) for actions in lists)
    name = name or f"torch-csv-{hashlib.sha1(text.encode()).hexdigest()[:10]}"
    if name in schedule_names() and name not in _IMPORTED:
        taken = schedule_spec(name).doc or "a registered schedule"
        raise PartitionError(f"schedule name {name!r} is taken by {taken}; pass another name=")
    fixed = [list(actions) for actions in lists]

    def actions(m: int, p: int, v: int) -> list[list[Action]]:
        return [list(a) for a in fixed]

    def accepts(m: int, p: int, v: int) -> str | None:
        if (m, p, v) == (micro_batches, ranks, per_rank):
            return None
        return (f"{name} is a schedule imported for {micro_batches} micro-batches on {ranks} ranks "
                f"({per_rank} stage(s) per rank), not {m} on {p} ({v}); import a schedule made for those")

    register(ScheduleSpec(name, actions, layout, splits_backward=any(a.kind == "W" for row in fixed for a in row),
                          replicas=False, accepts=accepts,
                          doc="imported from a torch.distributed.pipelining schedule CSV"), replace=True)
    _IMPORTED.add(name)
    return name
