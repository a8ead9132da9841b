"""`python -m partitioner export --plan PLAN.json --csv OUT.csv [--torchtitan OUT.toml]`: a plan for torch's engines."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.console import Console

from partitioner.cli.inputs import UsageError
from partitioner.errors import PartitionError
from partitioner.export.torch_schedule import to_torch_schedule
from partitioner.export.torchtitan import to_torchtitan
from partitioner.show.visualizer import DrawablePlan

__all__ = ["add_export_parser", "run_export"]


def add_export_parser(commands: Any, **kw: Any) -> None:
    """The `export` subcommand's arguments."""
    exp = commands.add_parser(
        "export", help="write a saved plan's schedule for torch.distributed.pipelining / torchtitan",
        description="Write each rank's compute actions of a saved plan as the CSV torch's _PipelineScheduleRuntime "
        "loads (_load_csv; torchtitan's pipeline_parallel_schedule_csv), print the stage-to-rank map and the "
        "split points (module names; cuts not on a module boundary are named), and optionally torchtitan's "
        "[parallelism] config as TOML.", **kw)  # fmt: skip
    exp.add_argument("--plan", required=True, metavar="PLAN.json", help="a plan saved with `plan --save`")
    exp.add_argument("--csv", required=True, metavar="OUT.csv", help="where to write the schedule CSV")
    exp.add_argument("--torchtitan", metavar="OUT.toml", help="also write torchtitan's config, naming the CSV")
    exp.add_argument("--quiet", action="store_true", help="no progress display")
    exp.add_argument("--microbatch-size", type=int, metavar="N",
                     help="samples per micro-batch for torchtitan (default: read from the plan's input shapes)")


def run_export(args: argparse.Namespace, out: Console) -> int:
    """Write the CSV (and TOML); print where stages run and where the cuts fall."""
    try:
        plan = DrawablePlan.from_json(Path(args.plan).read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise UsageError(f"--plan {args.plan}: cannot read a saved plan ({exc}); write one with `plan --save`"
                         ) from None
    if args.microbatch_size is not None and args.microbatch_size < 1:
        raise UsageError(f"--microbatch-size {args.microbatch_size}: use 1 or more")
    try:
        sched = to_torch_schedule(plan)
        toml = to_torchtitan(plan, args.csv, microbatch=args.microbatch_size, schedule=sched) if args.torchtitan else ""
    except PartitionError as exc:
        raise UsageError(f"--plan {args.plan}: {exc}") from None
    sched.write_csv(args.csv)

    def say(text: str) -> None:
        out.print(text, markup=False, soft_wrap=True)

    say(f"wrote {args.csv}: {sched.ranks} ranks, {sched.stages} stages ({sched.layout}), {sched.micro_batches} "
        f"micro-batches per pipeline, schedule {plan.schedule}"
        + (f", {sched.pipelines} pipelines side by side" if sched.pipelines > 1 else ""))
    say("stage -> rank: " + ", ".join(f"{s}:{r}" for s, r in sorted(sched.stage_to_rank.items())))
    split = sched.split_points
    begins = ", ".join(f"stage {s} at {name}" for s, name in enumerate(split.begins, 1) if name is not None)
    say(f"split points: {begins or 'none'}")
    for line in split.off_boundary:
        say(f"not on a module boundary: {line}")
    if args.torchtitan:
        Path(args.torchtitan).write_text(toml, encoding="utf-8")
        say(f"wrote {args.torchtitan}: torchtitan [parallelism] (pipeline_parallel_schedule {sched.torch_class}, "
            f"pipeline_parallel_schedule_csv {args.csv})")
    return 0
