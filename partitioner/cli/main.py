"""Command line: `python -m partitioner plan|profile|simulate|calibrate MODULE:FACTORY ...`.

Exit codes: 0 success, 1 the work itself failed (a model that cannot be traced, say),
2 bad arguments (the message says which and how to fix it).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

import torch
from rich import box
from rich.console import Console
from rich.table import Table

from cost_model.analytic import AnalyticCostModel
from cost_model.devices import resolve_devices
from cost_model.profiler import ProfiledCostModel
from partitioner.api import plan as make_plan
from partitioner.cli.calibrate import add_calibrate_parser, run_calibrate
from partitioner.cli.cluster import add_cluster_arguments, cast_example, cluster_report, plan_cluster, plan_keywords
from partitioner.cli.export import add_export_parser, run_export
from partitioner.cli.inputs import Example, UsageError, load_example
from partitioner.cli.profile import run_profile
from partitioner.cli.progress import phase_lines, step
from partitioner.errors import PartitionError, TraceError
from partitioner.predict.assemble import finish
from partitioner.predict.simulator import simulate
from partitioner.request import PLACEMENTS, RECOMPUTE_CHOICES
from partitioner.show.hosts import text_rows
from partitioner.show.visualizer import DrawablePlan, simulated_timeline, visualize
from rules.schedules import schedule_names, schedule_spec
from runtime.plan import UPDATES, Plan, human_bytes, micro_batch_words

__all__ = ["main"]

EPILOG = """\
MODULE:FACTORY names a function that returns (model, example_inputs) or
(model, example_inputs, example_kwargs); example_inputs is a tensor or a tuple of them.
MODULE is a dotted module imported from the current directory or PYTHONPATH
(e.g. mypkg.models:make_gpt), or a file path (models.py:make_gpt).

Batch size: with --batch N, a FACTORY that takes a `batch` argument is called with
batch=N; otherwise its inputs may be a full batch (dim 0 is N) or one micro-batch (dim 0 is
N / --micro-batches; it is repeated to make the full batch). Without --batch the inputs are
the full batch.

examples:
  python -m partitioner plan mymodels:make_gpt --devices cuda:0,cuda:1 --batch 32 --micro-batches 8 --out plan.html
  python -m partitioner plan mymodels:make_gpt --cluster 16x8xH100 --global-batch 1536 --dtype bf16 \
      --replicas auto --schedule auto --out plan.html --save plan.json
  (a cluster that is not here: stages, replicas, hosts, memory per GPU, step time, samples/s and MFU;
   run the saved plan under torchrun with partition(model, devices, plan="plan.json"))
  python -m partitioner export --plan plan.json --csv schedule.csv --torchtitan parallelism.toml
  (the plan's actions for torch.distributed.pipelining's runtime, and torchtitan's config naming them)

exit codes: 0 success, 1 the work failed (the model cannot be traced), 2 bad arguments.
"""


def schedule_choices() -> tuple[str, ...]:
    """--schedule's choices: every registered schedule (rules.schedules), read when the parser is built."""
    return (*schedule_names(), "auto")


def schedule_help() -> str:
    """--schedule's help, from each registered schedule's own description."""
    named = [f"{n} ({schedule_spec(n).doc})" if schedule_spec(n).doc else n for n in schedule_names()]
    return ", ".join(named) + " or auto (the fastest predicted that fits memory)"


RECOMPUTE_HELP = ("activation recomputation of every stage: none, selective (recompute element-wise ops in backward), "
                  "full (keep only stage inputs) or auto (per stage, the cheapest that fits; default none)")
PLACEMENT_HELP = ("pipeline: contiguous stages, one per device; branches: parallel branches side by side; "
                  "auto: whichever is predicted faster (default pipeline)")


class _Parser(argparse.ArgumentParser):
    """argparse that says how to get help after a usage error (it already exits with 2)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n(see {self.prog} --help)\n")


def _common(p: argparse.ArgumentParser, devices: bool = True) -> None:
    p.add_argument("target", metavar="MODULE:FACTORY", help="function returning (model, example_inputs); see below")
    if devices:
        p.add_argument("--devices", metavar="LIST",
                       help="comma-separated devices, one per stage, e.g. cuda:0,cuda:1 or "
                       "cpu,cpu (a device may repeat); default: every visible GPU, else cpu,cpu")  # fmt: skip
    p.add_argument("--batch", type=int, metavar="N", help="full batch size (default: dim 0 of the example inputs)")
    p.add_argument("--micro-batches", type=int, metavar="M",
                   help="micro-batches per step (default 1; with --cluster and --global-batch: chosen)")
    p.add_argument("--quiet", action="store_true", help="no progress display")


def build_parser() -> argparse.ArgumentParser:
    """The `python -m partitioner` argument parser."""
    parser = _Parser(
        prog="python -m partitioner",
        description="Plan, profile and simulate pipeline-parallel placements of a PyTorch model.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    commands.required = True
    kw: dict[str, Any] = {"epilog": EPILOG, "formatter_class": argparse.RawDescriptionHelpFormatter}

    plan = commands.add_parser("plan", help="split the model over devices; print the plan, write its picture",
                               description="Split the model into one pipeline stage per device, print the plan as a "
                               "table and write its picture.", **kw)  # fmt: skip
    _common(plan)
    plan.add_argument("--schedule", choices=schedule_choices(),
                      help=schedule_help() + " (default gpipe; auto with --cluster)")
    plan.add_argument("--recompute", choices=RECOMPUTE_CHOICES, default="none", help=RECOMPUTE_HELP)
    plan.add_argument("--update", choices=UPDATES, default="sync",
                      help="how weights update: sync (after each step), 2bw or stash (no flush; --schedule 1f1b)")
    plan.add_argument("--placement", choices=PLACEMENTS, default="pipeline", help=PLACEMENT_HELP)
    add_cluster_arguments(plan)
    plan.add_argument("--out", metavar="PATH", help="write the picture: .html (interactive), .png, .svg or .dot")
    plan.add_argument("--save", metavar="PLAN.json", help="also save the plan as JSON (reload with `simulate --plan`)")
    plan.add_argument("--profile", action="store_true", help="measure every node on the devices instead of estimating")
    plan.add_argument("--depth", type=int, metavar="D", help="module depth of the drawn graph (99: every node)")

    prof = commands.add_parser("profile", help="show each node's shapes, FLOPs, bytes and time",
                               description="Trace the model and show per-node costs for one micro-batch.",
                               **kw)  # fmt: skip
    _common(prof, devices=False)
    prof.add_argument("--device", default="cpu", help="device to measure on (default cpu)")
    prof.add_argument("--analytic", action="store_true", help="estimate from FLOPs and bytes instead of measuring")
    prof.add_argument("--sort", choices=("order", "time"), default="order", help="row order (default: graph order)")
    prof.add_argument("--top", type=int, default=40, metavar="K", help="show K rows, 0 for all (default 40)")
    prof.add_argument("--no-cache", action="store_true", help="measure again even if a cached profile exists")

    sim = commands.add_parser("simulate", help="print the schedule timeline and bubble fraction",
                              description="Simulate a schedule on a plan (from the model, or a saved plan) and print "
                              "each device's timeline, busy/transfer/idle time and the bubble fraction.",
                              **kw)  # fmt: skip
    sim.add_argument("target", metavar="MODULE:FACTORY", nargs="?", help="function returning (model, example_inputs)")
    sim.add_argument("--plan", metavar="PLAN.json", help="a plan saved with `plan --save` (instead of MODULE:FACTORY)")
    sim.add_argument("--devices", metavar="LIST", help="as for `plan`")
    sim.add_argument("--batch", type=int, metavar="N", help="as for `plan`")
    sim.add_argument("--micro-batches", type=int, metavar="M", help="micro-batches (default: the plan's, else 1)")
    sim.add_argument("--schedule", choices=schedule_choices(),
                     help=schedule_help() + " (default: the plan's, else gpipe)")
    sim.add_argument("--recompute", choices=RECOMPUTE_CHOICES, help=RECOMPUTE_HELP + "; not with --plan")
    sim.add_argument("--placement", choices=PLACEMENTS, default="pipeline", help=PLACEMENT_HELP)
    sim.add_argument("--width", type=int, default=72, metavar="COLS", help="characters per timeline row (default 72)")
    sim.add_argument("--out", metavar="PATH", help="also write the plan's picture with this timeline")
    sim.add_argument("--quiet", action="store_true", help="no progress display")
    add_calibrate_parser(commands, _common, PLACEMENTS, schedule_choices(), **kw)
    add_export_parser(commands, **kw)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    args = build_parser().parse_args(argv)
    if args.command == "plan" and args.schedule is None:  # a cluster's schedule is searched with its stages
        args.schedule = "auto" if getattr(args, "cluster", None) else "gpipe"
    out = Console(width=max(80, shutil.get_terminal_size((120, 40)).columns), highlight=False)
    err = Console(stderr=True, highlight=False)
    try:
        _check(args)
        with phase_lines(err, args.quiet):
            if args.command == "calibrate":
                return run_calibrate(args, out, err, _devices(args.devices), lambda text: step(err, args.quiet, text))
            if args.command == "profile":
                return run_profile(args, out, lambda text: step(err, args.quiet, text))
            if args.command == "export":
                return run_export(args, out)
            return {"plan": _plan, "simulate": _simulate}[args.command](args, out, err)
    except UsageError as exc:
        err.print(f"error: {exc}", markup=False, soft_wrap=True)
        return 2
    except TraceError as exc:
        err.print(f"error: {exc}", markup=False, soft_wrap=True)
        return 1
    except PartitionError as exc:  # bad devices, micro-batches or inputs
        err.print(f"error: {exc}", markup=False, soft_wrap=True)
        return 2


def _check(args: argparse.Namespace) -> None:
    if getattr(args, "global_batch", None) is not None:
        if args.batch is not None and args.batch != args.global_batch:
            raise UsageError(f"--batch {args.batch} and --global-batch {args.global_batch} differ; give one of them")
        args.batch = args.global_batch
    if getattr(args, "batch", None) is not None and args.batch < 1:
        raise UsageError(f"--batch {args.batch} (--global-batch): use a batch size of 1 or more")
    if getattr(args, "micro_batches", None) is not None and args.micro_batches < 1:
        raise UsageError(f"--micro-batches {args.micro_batches}: use 1 or more")
    if getattr(args, "top", 0) < 0:
        raise UsageError(f"--top {args.top}: use 0 (all rows) or more")
    if getattr(args, "depth", None) is not None and args.depth < 1:
        raise UsageError(f"--depth {args.depth}: use 1 or more (99 draws every node)")
    for name in ("out",) if args.command != "calibrate" else ():  # calibrate --out is the JSON
        path = getattr(args, name, None)
        if path and Path(path).suffix.lower() not in (".html", ".htm", ".png", ".svg", ".pdf", ".dot", ".gv"):
            raise UsageError(f"--out {path}: the suffix picks the picture; use .html, .png, .svg, .pdf or .dot")
    if args.command == "simulate" and bool(args.target) == bool(args.plan):
        raise UsageError("simulate needs either MODULE:FACTORY or --plan PLAN.json (one of them)")
    if args.command == "simulate" and args.plan and args.recompute:
        raise UsageError(f"--recompute {args.recompute} with --plan: a saved plan carries each stage's recomputation; "
                         "simulate MODULE:FACTORY --recompute ... plans again")
    if args.command == "simulate" and args.plan and args.schedule == "auto":
        raise UsageError("--schedule auto with --plan: choosing a schedule re-plans the stages; simulate "
                         "MODULE:FACTORY --schedule auto instead")


def _devices(text: str | None) -> list[str]:
    if not text:
        return [f"cuda:{i}" for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else ["cpu", "cpu"]
    devices = [d.strip() for d in text.split(",")]
    if any(not d for d in devices):
        raise UsageError(f"--devices {text!r} has an empty entry; write e.g. cuda:0,cuda:1")
    return devices


def _make_plan(args: argparse.Namespace, err: Console, schedule: str, micro_batches: int) -> tuple[Any, Example]:
    """The plan `partition` would run, made by its planning step alone (nothing moves), drawable."""
    devices = _devices(args.devices)
    try:
        resolve_devices(devices)
    except ValueError as exc:
        raise UsageError(f"--devices: {exc}") from None
    with step(err, args.quiet, f"loading {args.target}"):
        example = load_example(args.target, args.batch, micro_batches)
    example = cast_example(example, getattr(args, "dtype", None))
    options = plan_keywords(args)  # replicas (processes with them) and precision
    doing = f"planning on {len(devices)} devices ({example.batch} samples, {micro_batches} micro-batches)"
    with step(err, args.quiet, doing):
        plan = make_plan(example.model, devices, example_inputs=example.args, example_kwargs=example.kwargs,
                         micro_batches=micro_batches, schedule=schedule, placement=args.placement,
                         cost_model=_cost_model(args), recompute=args.recompute or "none",
                         update=getattr(args, "update", "sync"), **options)
    return DrawablePlan.from_plan(plan), example


def _cost_model(args: argparse.Namespace) -> Any:
    """Measured nodes with --profile (the planner shows it the graph), else the analytic estimate."""
    if getattr(args, "profile", False):
        return ProfiledCostModel(progress=not args.quiet)
    return AnalyticCostModel(tf32={"fp32": False, "tf32": True}.get(getattr(args, "dtype", ""), None))


def plan_table(plan: Any, title: str = "", width: int = 120) -> Table:
    """The plan as a rich table `width` characters wide at most: one row per stage, the bottleneck in red."""
    reduce = any(s.allreduce_ms > 0 for s in plan.stages)  # replicated stages: their all-reduce, once per step
    header = ("stage", "device", "nodes", "first .. last node", "compute ms", "comm ms", "total ms", "params",
              "activations", "sends") + (("all-reduce ms",) if reduce else ())  # fmt: skip
    rows = [
        (
            str(s.index), s.device, str(len(s.nodes)), f"{s.nodes[0]} .. {s.nodes[-1]}" if s.nodes else "-",
            f"{s.compute_ms:.3f}", f"{s.comm_ms:.3f}", f"{s.predicted_ms:.3f}",
            human_bytes(s.param_bytes), human_bytes(s.activation_bytes), human_bytes(s.send_bytes),
        ) + ((f"{s.allreduce_ms:.3f}",) if reduce else ())
        for s in plan.stages
    ]
    table = Table(title=title or None, title_justify="left", header_style="bold", box=box.SIMPLE_HEAD, show_edge=False,
                  padding=(0, 1), collapse_padding=True)  # fmt: skip
    widths = [max(len(name), *(len(r[i]) for r in rows)) if rows else len(name) for i, name in enumerate(header)]
    names = width - sum(widths) + widths[3] - 2 * len(header)  # node names give way when narrow
    keep = [i for i in range(len(header)) if i != 3 or names >= 16]
    for i in keep:
        if i == 3:
            table.add_column(header[i], overflow="ellipsis", no_wrap=True, max_width=names)
        else:
            table.add_column(header[i], justify="left" if i == 1 else "right")
    for s, r in zip(plan.stages, rows):
        row = [r[i] for i in keep]
        table.add_row(*row, style="bold red" if s.predicted_ms == plan.bottleneck_ms and len(plan.stages) > 1 else None)
    return table


def _plan(args: argparse.Namespace, out: Console, err: Console) -> int:
    if args.cluster:
        made = plan_cluster(args, err, lambda text: step(err, args.quiet, text))
        cluster_report(out, made)
        return _write(args, out, err, DrawablePlan.from_plan(made.plan), None)
    plan, example = _make_plan(args, err, args.schedule, args.micro_batches or 1)
    timeline, note = simulated_timeline(plan)
    out.print(plan_table(plan, f"{example.name}: {len(plan.stages)} stages", out.width))
    bubble = ""
    if timeline:
        bubble = f", simulated step {timeline.makespan_ms:.3f} ms, bubble {timeline.bubble_fraction:.1%}"
    if plan.update != "sync":  # no flush: the steady step of the stream, not one step's fill and drain
        bubble = f", update {plan.update}: steady step {plan.predicted_step_ms:.3f} ms (no flush between steps)"
    replicated = any(s.replicas > 1 for s in plan.stages)
    out.print(
        f"batch {example.batch} in {micro_batch_words(plan, example.batch)}, schedule {plan.schedule}, "
        + (f"recompute {', '.join(s.recompute for s in plan.stages)}, " if plan.recomputes else "") +
        f"{plan.placement}; bottleneck {plan.bottleneck_ms:.3f} ms per micro-batch (red){bubble}. Times are forward + "
        "backward of one micro-batch" + ("; total ms: (compute + comm) over the stage's replicas" if replicated else
                                         "") + "; sends: bytes to later stages per micro-batch", markup=False,
    )  # fmt: skip
    if plan.alternatives:
        what = "schedule" if args.schedule == "auto" else "placement"
        out.print(f"predicted step of each {what} compared: " + ", ".join(
            f"{name} {ms:.3f} ms" for name, ms in plan.alternatives.items()), markup=False)  # fmt: skip
    if note:
        out.print(note, markup=False)
    return _write(args, out, err, plan, timeline)


def _write(args: argparse.Namespace, out: Console, err: Console, plan: Any, timeline: Any) -> int:
    """--save PLAN.json and --out PICTURE (a timeline of None: simulated for the picture)."""
    if args.save:
        Path(args.save).write_text(plan.to_json(), encoding="utf-8")
        out.print(f"saved the plan to {args.save}", markup=False)
    if args.out:
        with step(err, args.quiet, f"writing {args.out}"):
            visualize(plan, args.out, timeline=timeline or simulated_timeline(plan)[0], depth=args.depth)
        out.print(f"wrote {args.out}", markup=False)
    return 0


def _simulate(args: argparse.Namespace, out: Console, err: Console) -> int:
    batch: int | None = None
    if args.plan:
        try:
            plan = DrawablePlan.from_json(Path(args.plan).read_text(encoding="utf-8"))
        except (OSError, ValueError, TypeError, KeyError) as exc:
            raise UsageError(
                f"--plan {args.plan}: cannot read a saved plan ({exc}); write one with `plan --save`"
            ) from None
        name = args.plan
    else:
        plan, example = _make_plan(args, err, args.schedule or "gpipe", args.micro_batches or 1)
        name, batch = example.name, example.batch
    chosen = args.schedule if args.schedule != "auto" else plan.schedule  # auto: the planner chose it
    changed = _reschedule(plan, args.micro_batches or plan.pieces, chosen or plan.schedule)
    try:  # see [Note: simulate as the plan was predicted]
        timeline = finish(plan) if changed and plan.programs else simulate(plan)
    except PartitionError as exc:
        raise UsageError(f"--schedule {plan.schedule} --micro-batches {args.micro_batches or plan.pieces}: "
                         f"{exc}") from None
    words = micro_batch_words(plan if batch or not changed else replace(plan, graph=None), batch)  # graph: old count
    out.print(f"{name}: {len(plan.stages)} stages, {words}, schedule {plan.schedule}"
              + (f", recompute {', '.join(s.recompute for s in plan.stages)}" if plan.recomputes else ""),
              markup=False)
    if plan.alternatives:
        out.print("predicted step of each candidate compared: " + ", ".join(
            f"{n} {ms:.3f} ms" for n, ms in plan.alternatives.items()), markup=False)  # fmt: skip
    out.print(text_rows(timeline, gpus_per_host=plan.gpus_per_host, width=args.width, footer=False), markup=False,
              soft_wrap=True)
    out.print("F forward, B backward, W weight gradients, ~ only transfers or all-reduce, . idle", markup=False)
    rows = len(timeline.devices)
    predicted = (f"; the plan's predicted step {plan.predicted_step_ms:.3f} ms" if not changed and plan.update == "sync"
                 and plan.predicted_step_ms else "")
    out.print(f"makespan {timeline.makespan_ms:.3f} ms, bubble fraction {timeline.bubble_fraction:.1%}, "
              f"{timeline.ranks} ranks simulated as {rows} row{'s' if rows != 1 else ''} (identical ranks folded; "
              f"figures per rank){predicted}", markup=False)
    if args.out:
        with step(err, args.quiet, f"writing {args.out}"):
            visualize(plan, args.out, timeline=timeline)
        out.print(f"wrote {args.out}", markup=False)
    return 0


def _reschedule(plan: Plan, pieces: int, schedule: str) -> bool:
    """Give `plan` `pieces` micro-batches in the step (`Plan.pieces`: --micro-batches counts them so) and
    `schedule`; whether either changed.

    [Note: simulate as the plan was predicted] A plan simulated with its own micro-batches and schedule
    goes through `simulate(plan)`, the function that made its `predicted_step_ms`, so the two agree. Only
    a plan whose programs no longer fit is lowered again (`finish`); a plan saved without programs (a
    cluster plan) is lowered by `simulate` itself, as the planner lowered it. `finish` would lower it
    with the runtime's lowering, which leaves a sharded stage's reduction to FSDP2 and so out of the step.
    """
    if (pieces, schedule) == (plan.pieces, plan.schedule):
        return False
    replicas = max(s.replicas for s in plan.stages)
    if plan.data_split == "slice" and pieces % replicas:
        raise UsageError(f"--micro-batches {pieces}: the plan slices every micro-batch over {replicas} replicas, "
                         f"so a step runs a multiple of {replicas} micro-batches; use e.g. "
                         f"{replicas * max(1, pieces // replicas)}")
    plan.micro_batches = pieces // replicas if plan.data_split == "slice" else pieces
    plan.schedule = schedule
    return True
