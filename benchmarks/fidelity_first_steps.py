"""Calibrated by default: a 2-rank GPT pipeline's prediction after its first 10 steps, against measured (issue 28).

torch.distributed.pipelining's benchmark shape (as benchmarks/vs_torch_runtime.py): a GPT-like LM with
8 pre-norm blocks, width 256, 4 heads, sequence 64, vocabulary 8000, untied head; batch 32 in 8
micro-batches on 2 gloo ranks, one thread each. Each job partitions it with nothing but the defaults
(so no `calibrate` call: the pipeline times its first 10 training steps, traces the last 3, refits the
machine parameters and updates `pipe.plan.predicted_step_ms`; partitioner.calibrate.passive), then
trains on and measures the steps after, as the watch measured its own: the median start-to-start time
of a training loop (zero_grad, train_step, optimizer step), the slowest rank's.

    uncalibrated   the plan's prediction when partition returns (no calibration on this machine: each
                   job saves its refit to a file of its own, which no job reads before)
    calibrated     pipe.plan.predicted_step_ms after the first 10 steps
    measured       the median step of steps 11 .. 10 + --measure

With --machine, jobs use (and update) this machine's saved calibration instead, as a user's would.
Jobs run in turn, schedule by schedule (--jobs rounds), so each schedule samples the same stretch of a
shared machine's load; the figures are medians over jobs. Last line:
    first 10 steps, 2-rank GPT: predicted X ms vs measured Y ms, error E% (uncalibrated U ms, error V%; target <= 10%)
Usage: python benchmarks/fidelity_first_steps.py [--schedules 1f1b gpipe] [--jobs 3] [--measure 30] [--machine]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "benchmarks"))
from models import GPT, GPTConfig  # noqa: E402
from torchrun_job import torchrun_json  # noqa: E402

from partitioner import partition  # noqa: E402

TIMEOUT_S = 300


def worker(schedule: str, out: str, measure: int, machine: bool) -> None:
    """One torchrun rank: partition with the defaults, train, write the figures (rank 0)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=8000, width=256, heads=4, layers=8, seq=64, tied=False)
    model = GPT(cfg)
    x = torch.randint(0, cfg.vocab, (32, cfg.seq))
    y = torch.randint(0, cfg.vocab, (32, cfg.seq))
    own = None if machine else str(Path(out).with_suffix(".calibration.json"))
    pipe = partition(model, ["cpu"] * dist.get_world_size(), example_inputs=(x,), micro_batches=8,
                     schedule=schedule, calibration=own)
    uncalibrated = pipe.plan.predicted_step_ms
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.numel()], lr=1e-4)

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.flatten(0, 1), target.flatten())

    starts = []
    for _ in range(10 + measure + 1):
        starts.append(time.perf_counter())
        optimizer.zero_grad()
        pipe.train_step(x, y, loss_fn)
        optimizer.step()
    calibrated = pipe.plan.predicted_step_ms
    periods = [(b - a) * 1e3 for a, b in zip(starts[10:-1], starts[11:])]
    slowest = torch.tensor([statistics.median(periods)], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        report = getattr(pipe, "calibration_report", None)
        Path(out).write_text(json.dumps({
            "schedule": schedule, "uncalibrated": uncalibrated, "calibrated": calibrated,
            "measured": float(slowest[0]), "first_steps": report.measured_ms if report else None,
            "factors": report.factors if report else {}}))
    dist.destroy_process_group()


def run_job(schedule: str, folder: Path, k: int, measure: int, machine: bool) -> dict[str, Any]:
    out = folder / f"{schedule}-{k}.json"
    args = ["--worker", schedule, str(out), "--measure", str(measure), *(["--machine"] if machine else [])]
    return torchrun_json(__file__, args, 2, out, f"{schedule} job", TIMEOUT_S)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", nargs="+", default=["1f1b", "gpipe"])
    parser.add_argument("--jobs", type=int, default=3, help="jobs per schedule, taken in turn (medians count)")
    parser.add_argument("--measure", type=int, default=30, help="steps measured after the first 10")
    parser.add_argument("--machine", action="store_true", help="use and update this machine's saved calibration")
    parser.add_argument("--worker", nargs=2, metavar=("SCHEDULE", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], args.worker[1], args.measure, args.machine)
        return
    rows: dict[str, list[dict[str, Any]]] = {s: [] for s in args.schedules}
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.jobs):
            for schedule in args.schedules:
                load = os.getloadavg()[0]
                got = run_job(schedule, Path(tmp), k, args.measure, args.machine)
                rows[schedule].append(got)
                print(f"{schedule} job {k + 1}: uncalibrated {got['uncalibrated']:.1f} ms, after 10 steps "
                      f"{got['calibrated']:.1f} ms, measured {got['measured']:.1f} ms (first steps "
                      f"{got['first_steps'] or float('nan'):.1f} ms; load average {load:.2f})", flush=True)
    print(f"\n{'schedule':<10} {'uncalibrated':>12} {'after 10 steps':>14} {'measured':>9} {'error before':>12} "
          f"{'error after':>11}   (medians over {args.jobs} jobs, ms per step)")
    errors: list[tuple[float, float, float, float]] = []
    for schedule, got in rows.items():
        before = statistics.median(g["uncalibrated"] for g in got)
        after = statistics.median(g["calibrated"] for g in got)
        measured = statistics.median(g["measured"] for g in got)
        err_after = statistics.median(abs(g["calibrated"] - g["measured"]) / g["measured"] for g in got)
        err_before = statistics.median(abs(g["uncalibrated"] - g["measured"]) / g["measured"] for g in got)
        errors.append((after, measured, err_after, before))
        print(f"{schedule:<10} {before:>12.1f} {after:>14.1f} {measured:>9.1f} {err_before:>12.1%} {err_after:>11.1%}")
    after, measured, worst, before = max(errors, key=lambda e: e[2])
    print(f"first 10 steps, 2-rank GPT: predicted {after:.1f} ms vs measured {measured:.1f} ms, error {worst:.1%} "
          f"(uncalibrated {before:.1f} ms, error {abs(before - measured) / measured:.1%}; target <= 10%)")


if __name__ == "__main__":
    main()
