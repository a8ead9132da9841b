"""placement="auto" after calibration against each placement it chooses from, on 2 gloo ranks.

An Inception-style net (blocks of four parallel branches). Each rank holds three copies of the
model: one partitioned with placement="pipeline" (a chain of stages), one with "branches"
(each block's branches side by side on both ranks), and one with placement="auto" and
calibrate=N (measure, fit, re-plan; measure the runner-up where the calibrated simulator
cannot tell them apart, and keep the faster measured). The three are then timed in
interleaved rounds (the machine's load drifts alike for all of them); each time is the median
over rounds of the rank-max step time. The faster alternative is the one with the lower median;
R = t_fastest / t_auto is the median over rounds of that round's ratio (paired, so drift between
rounds cancels). R >= 0.97 means auto is as fast as the faster alternative within noise.

Usage: torchrun --standalone --nproc_per_node=2 benchmarks/auto_placement.py [--rounds 15] [--steps 1]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from models import InceptionNet  # noqa: E402

from partitioner import partition  # noqa: E402
from partitioner.calibrate.decide import same_plan  # noqa: E402


def step_ms(pipe: Any, x: torch.Tensor, y: torch.Tensor, steps: int) -> float:
    """Median step (ms) of `steps` steps, each bracketed by barriers (so it is the slowest rank's)."""
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        pipe.train_step(x, y, F.cross_entropy)
        dist.barrier()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15, help="interleaved timing rounds (default 15)")
    parser.add_argument("--steps", type=int, default=1, help="steps per pipeline per round (default 1)")
    parser.add_argument("--calibrate", type=int, default=5, help="calibration steps (default 5)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--channels", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    base = InceptionNet(c=args.channels)
    x = torch.randn(args.batch, 3, 32, 32)
    y = torch.randint(0, 10, (args.batch,))
    folder = [tempfile.mkdtemp(prefix="auto-placement-") if rank == 0 else None]
    dist.broadcast_object_list(folder, src=0)
    calibration = str(Path(str(folder[0])) / "calibration.json")  # a fresh calibration, not this machine's

    pipes: dict[str, Any] = {}
    for placement in ("pipeline", "branches"):
        pipes[placement] = partition(copy.deepcopy(base), ["cpu", "cpu"], example_inputs=(x,),
                                     micro_batches=args.micro_batches, placement=placement)
    for pipe in pipes.values():
        pipe.train_step(x, y, F.cross_entropy)  # warm-up
    auto = partition(copy.deepcopy(base), ["cpu", "cpu"], example_inputs=(x,), micro_batches=args.micro_batches,
                     placement="auto", calibrate=args.calibrate, calibration=calibration)
    report = auto.calibration_report
    pipes["auto"] = auto
    auto.train_step(x, y, F.cross_entropy)  # warm-up: a rebuilt pipe exchanges message headers on its first step

    rounds: dict[str, list[float]] = {name: [] for name in pipes}
    for r in range(args.rounds):
        order = list(pipes) if r % 2 == 0 else list(reversed(pipes))  # alternate who goes first
        for name in order:
            rounds[name].append(step_ms(pipes[name], x, y, args.steps))
    t = {name: statistics.median(v) for name, v in rounds.items()}
    fastest = min(("pipeline", "branches"), key=lambda n: t[n])
    ratio = statistics.median(a / b for a, b in zip(rounds[fastest], rounds["auto"]))
    if rank == 0:
        print(f"Inception-style net ({args.channels} channels, 3 blocks x 4 branches), batch {args.batch}, "
              f"{args.micro_batches} micro-batches, 2 gloo ranks x 1 thread; {args.rounds} interleaved rounds x "
              f"{args.steps} steps, medians")
        if report is not None:
            print(report)
        print(f"{'plan':<40} {'measured ms/step':>16} {'vs faster alternative':>22}")
        for name in ("pipeline", "branches"):
            paired = statistics.median(a / b for a, b in zip(rounds[fastest], rounds[name]))
            print(f"{name:<40} {t[name]:>16.1f} {paired:>21.2f}x")
        twin = next((n for n in ("pipeline", "branches") if same_plan(auto.plan, pipes[n].plan)), "neither")
        chosen = f"auto ({auto.plan.placement}; same plan as {twin})"
        print(f"{chosen:<40} {t['auto']:>16.1f} {ratio:>21.2f}x")
        print(f"auto after calibration: {ratio:.2f} x the faster alternative")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
