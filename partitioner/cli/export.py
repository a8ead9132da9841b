"""`python -m partitioner export --plan PLAN.json --csv OUT.csv [--torchtitan OUT.sh]`: a plan for torch's engines."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.console import Console

from partitioner.cli.inputs import UsageError
from partitioner.errors import PartitionError
from partitioner.export.pipelines import pipeline_schedule
from partitioner.export.torchtitan import TorchtitanJob, torchtitan_job
from partitioner.show.visualizer import DrawablePlan

__all__ = ["add_export_parser", "run_export"]


def add_export_parser(commands: Any, **kw: Any) -> None:
    """The `export` subcommand's arguments."""
    exp = commands.add_parser(
        "export", help="write a saved plan's schedule for torch.distributed.pipelining / a torchtitan job",
        description="Write each rank's compute actions of a saved plan as the CSV torch's _PipelineScheduleRuntime "
        "loads (_load_csv; torchtitan's pipeline_parallel_schedule_csv), print the stage-to-rank map and the "
        "split points (module names; cuts not on a module boundary are named), and optionally a torchtitan 0.3.0 "
        "job: a bash script running torchrun -m torchtitan.train with the plan's degrees, module lists, batch "
        "sizes and activation checkpointing as --section.key overrides.", **kw)  # fmt: skip
    exp.add_argument("--plan", required=True, metavar="PLAN.json", help="a plan saved with `plan --save`")
    exp.add_argument("--csv", required=True, metavar="OUT.csv", help="where to write the schedule CSV")
    exp.add_argument("--torchtitan", metavar="OUT.sh", help="also write torchtitan's job script, naming the CSV")
    exp.add_argument("--torchtitan-module", metavar="M",
                     help="torchtitan's --module for the script (e.g. llama3; default: $MODULE when it runs)")
    exp.add_argument("--torchtitan-config", metavar="C",
                     help="torchtitan's --config for the script (e.g. llama3_8b; default: $CONFIG when it runs)")
    exp.add_argument("--quiet", action="store_true", help="no progress display")
    exp.add_argument("--microbatch-size", type=int, metavar="N",
                     help="samples per micro-batch on one rank, for torchtitan (default: read from the plan's "
                     "input shapes)")


def run_export(args: argparse.Namespace, out: Console) -> int:
    """Write the CSV (and the torchtitan script); print where stages run and where the cuts fall."""
    try:
        plan = DrawablePlan.from_json(Path(args.plan).read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise UsageError(f"--plan {args.plan}: cannot read a saved plan ({exc}); write one with `plan --save`"
                         ) from None
    if args.microbatch_size is not None and args.microbatch_size < 1:
        raise UsageError(f"--microbatch-size {args.microbatch_size}: use 1 or more")
    job: TorchtitanJob | None = None
    try:
        sched = pipeline_schedule(plan)
        if args.torchtitan:
            job = torchtitan_job(plan, args.csv, module=args.torchtitan_module, config=args.torchtitan_config,
                                 microbatch=args.microbatch_size, schedule=sched)
    except PartitionError as exc:
        raise UsageError(f"--plan {args.plan}: {exc}") from None
    sched.write_csv(args.csv)

    def say(text: str) -> None:
        out.print(text, markup=False, soft_wrap=True)

    sliced = plan.data_split == "slice"
    say(f"wrote {args.csv}: {sched.ranks} ranks, {sched.stages} stages ({sched.layout}), {sched.micro_batches} "
        f"micro-batches per pipeline, schedule {plan.schedule}"
        + (f", {sched.pipelines} pipelines side by side" if sched.pipelines > 1 else "")
        + (" (every micro-batch sliced over them)" if sliced and sched.pipelines > 1 else ""))
    say("stage -> rank: " + ", ".join(f"{s}:{r}" for s, r in sorted(sched.stage_to_rank.items())))
    split = sched.split_points
    begins = ", ".join(f"stage {s} at {name}" for s, name in enumerate(split.begins, 1) if name is not None)
    say(f"split points: {begins or 'none'}")
    for line in split.off_boundary:
        say(f"not on a module boundary: {line}")
    if job is not None:
        job.write(args.torchtitan)
        say(f"wrote {args.torchtitan}: torchrun -m torchtitan.train on {job.hosts} x {job.gpus_per_host} GPUs, "
            + " x ".join(f"{name} {degree}" for name, degree in job.degrees.items()) + f", {job.checkpointing}")
        for s, part in enumerate(job.parts.parts):
            say(f"torchtitan stage {s}: {_span(part)}")
        for note in job.notes:
            say(f"note: {note}")
    return 0


def _span(names: list[str]) -> str:
    """'tok_embeddings, layers.0-15' for a stage's module list."""
    layers = [int(n.split(".")[1]) for n in names if n.startswith("layers.")]
    others = [n for n in names if not n.startswith("layers.")]
    head = [n for n in others if n == "tok_embeddings"]
    tail = [n for n in others if n != "tok_embeddings"]
    run = [f"layers.{layers[0]}-{layers[-1]}" if len(layers) > 1 else f"layers.{layers[0]}"] if layers else []
    return ", ".join(head + run + tail) or "nothing"
