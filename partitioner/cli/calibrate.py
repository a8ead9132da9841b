"""`python -m partitioner calibrate MODULE:FACTORY`: measure a few steps here, fit the cost model, save it.

Runs in one process (the devices listed are its workers), the same routine as
`pipe.calibrate` (partitioner.calibrate.decide); prints the fitted factors, each candidate plan's
predicted step before and after calibration beside the measured one, and where the JSON
went. Under torchrun the same is `partition(..., calibrate=N)` in the training script.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable, ContextManager

from rich.console import Console

from partitioner.api import partition
from partitioner.cli.inputs import UsageError, load_example

__all__ = ["add_calibrate_parser", "run_calibrate"]

TORCHRUN_HINT = ("under torchrun: call partition(model, devices, example_inputs=..., calibrate=N) (or "
                 "pipe.calibrate(N)) on every rank of `torchrun --nproc_per_node=R train.py`; rank 0 saves the "
                 "calibration")


def add_calibrate_parser(commands: Any, common: Callable[[argparse.ArgumentParser], None], placements: tuple[str, ...],
                         schedules: tuple[str, ...], **kw: Any) -> None:
    """The `calibrate` subcommand's arguments."""
    cal = commands.add_parser("calibrate", help="measure a few steps here, fit the cost model to them, save it",
                              description="Partition the model over the devices in this process, run N traced "
                              "training steps (mean of the outputs as the loss), fit per-device factors, save "
                              "them as JSON (reused by later plans on this machine) and re-plan if another plan "
                              "is then faster.", **kw)  # fmt: skip
    common(cal)
    cal.add_argument("--steps", type=int, default=5, metavar="N", help="training steps to measure (default 5)")
    cal.add_argument("--placement", choices=placements, default="pipeline", help="as for `plan` (default pipeline)")
    cal.add_argument("--schedule", choices=schedules, default="gpipe", help="as for `plan` (default gpipe)")
    cal.add_argument("--out", metavar="CALIBRATION.json",
                     help="where to save it (default: this machine's cache, used by later plans automatically)")


def run_calibrate(args: argparse.Namespace, out: Console, err: Console, devices: list[str],
                  step: Callable[[str], ContextManager[None]]) -> int:
    """Calibrate; print factors and predicted vs measured, before and after."""
    if args.steps < 1:
        raise UsageError(f"--steps {args.steps}: use 1 or more")
    micro = args.micro_batches or 1
    with step(f"loading {args.target}"):
        example = load_example(args.target, args.batch, micro)
    with step(f"partitioning on {len(devices)} devices"):
        pipe = partition(example.model, devices, example_inputs=example.args, example_kwargs=example.kwargs,
                         micro_batches=micro, placement=args.placement, schedule=args.schedule,
                         calibration=args.out)
    with step(f"calibrating: {args.steps} steps"):
        report = pipe.calibrate(steps=args.steps, path=args.out)
    out.print(f"calibration of {example.name} on {', '.join(devices)}: {args.steps} steps", markup=False)
    out.print("per-device factors (measured / predicted): " + (", ".join(
        f"{k} {v:.3f}" for k, v in report.factors.items()) or "none"), markup=False)  # fmt: skip
    links = [f"{k} x{v:.3f}" for k, v in report.factors.items() if "->" in k]
    links += [f"{backend}: latency {lat:.3f} ms, {per_ms / 1e6:.3f} GB/s"
              for backend, (lat, per_ms) in report.fitted.get("links", {}).items()]
    out.print("links: " + (", ".join(links) or "no transfer measured apart"), markup=False)
    tasks = report.fitted.get("task_ms", {})
    if tasks or report.fitted.get("step_ms"):
        out.print("per-task overhead: " + ", ".join(f"{k} {v:.3f} ms" for k, v in tasks.items())
                  + f"; per-step {report.fitted.get('step_ms', 0.0):.3f} ms; cores {report.fitted.get('cores', 0.0):g}",
                  markup=False)
    out.print(str(report), markup=False)
    chosen = report.candidates[report.chosen]
    measured = f"{chosen.measured_ms:.2f} ms" if chosen.measured_ms is not None else "-"
    out.print(f"before: predicted {report.predicted_before_ms:.2f} ms, measured {report.measured_ms:.2f} ms "
              f"({report.previous}); after: predicted {chosen.predicted_after_ms:.2f} ms, measured {measured} "
              f"({report.chosen})", markup=False)
    out.print(f"saved {report.path}", markup=False)
    out.print(TORCHRUN_HINT, markup=False)
    close = getattr(pipe, "close", None)
    if callable(close):
        close()
    return 0
