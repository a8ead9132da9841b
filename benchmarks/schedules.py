"""Every schedule and update rule of ours beside torch.distributed.pipelining's (PiPPy), in one torchrun run.

Configuration (chosen where the pipeline bubble matters, and said so): 2 gloo ranks, one CPU
thread each; a GPT-like language model (8 pre-norm blocks, width 384, 4 heads, sequence 64,
vocabulary 8000, untied LM head: 20.4 M parameters, 15% of them in the head); batch 16 in 4
micro-batches of 4. At width 256 a split backward's extra autograd calls (W runs one per group
of weights) cost a larger share of each op on this CPU, and the zero-bubble gain over 1F1B
measured 1.04-1.14 across runs; at 384 compute dominates, as it does on GPUs.
With m = 4 micro-batches on p = 2 ranks the fill and drain of GPipe and 1F1B idle each rank
for (p - 1) / (m + p - 1) = 20 % of the step: the bubble that zero-bubble schedules fill with
weight gradients (ZB-H1) or halve and fill (ZB-V and DualPipeV, 2 stages per rank). With many
more micro-batches the bubble, and so their gain, shrinks.

Trainers, all in this run, measured in alternating rounds (so a load change on the machine
hits all of them alike); each one's figure is its fastest round (other load on a shared
machine only adds time), its median round printed beside it:
  ours:  gpipe, 1f1b, interleaved (2 stages per rank), zb1, zbv, dualpipev (zbv's V, DualPipeV's
         order), each on the planned split,
         and 1f1b with update="2bw" and update="stash" (no flush between steps; their
         predicted ms is the stream's steady step);
  PiPPy: ScheduleGPipe, Schedule1F1B (1 stage per rank), ScheduleInterleaved1F1B,
         ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble, ScheduleDualPipeV (2 stages per
         rank; V placement for ZBV and DualPipeV), each on PiPPy's equal-layer split (split_spec
         at block boundaries).
Each of ours is printed beside the simulator's prediction for its plan. The last line is
`best ours vs best pippy: X (zero-bubble over 1f1b: Y)`, Y = our best zero-bubble schedule (zb1,
zbv, dualpipev) over our 1F1B.

Usage: torchrun --standalone --nproc_per_node=2 benchmarks/schedules.py [--rounds 6] [--steps 1]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from models import GPT, GPTConfig  # noqa: E402

from partitioner import partition  # noqa: E402

Step = Callable[[], None]
ZERO_BUBBLE = ("ours zb1", "ours zbv", "ours dualpipev")


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def ours(base: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, m: int, schedule: str,
         update: str = "sync") -> tuple[Step, float, Any]:
    """Our trainer: a step function, the simulator's predicted step ms, and the pipeline."""
    model = copy.deepcopy(base)
    world = dist.get_world_size()
    extra = {"update": update} if update != "sync" else {}
    pipe = partition(model, ["cpu"] * world, example_inputs=(x,), micro_batches=m, schedule=schedule,  # type: ignore[arg-type]
                     **extra)
    opt = torch.optim.SGD([p for p in model.parameters() if p.numel()], lr=1e-3)

    def step() -> None:
        if update != "sync":  # the runtime steps the optimizer inside the call
            pipe.train_step(x, y, loss_fn, optimizer=opt)
            return
        opt.zero_grad()
        pipe.train_step(x, y, loss_fn)
        opt.step()

    step.flush = pipe.flush  # type: ignore[attr-defined]  # ends an asynchronous update's stream
    return step, pipe.plan.predicted_step_ms, pipe


def pippy(base: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, m: int, cls: Any, per_rank: int,
          style: str) -> Step:
    """A torch.distributed.pipelining trainer: `per_rank` stages per rank on the equal-layer split."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    model = copy.deepcopy(base)
    rank, world = dist.get_rank(), dist.get_world_size()
    n = world * per_rank
    layers = len(model.blocks)  # type: ignore[arg-type]
    split = {f"blocks.{layers * s // n}": SplitPoint.BEGINNING for s in range(1, n)}
    pipe = pipeline(model, mb_args=(x[: x.shape[0] // m],), split_spec=split)
    if per_rank == 1:
        indices = [rank]
    elif style == "v":
        indices = [rank, 2 * world - 1 - rank]
    else:
        indices = [rank + k * world for k in range(per_rank)]
    if style == "v":  # the tracer's stages warm up as a chain (a send to itself on the V's turn): wrap the
        from torch.distributed.pipelining import PipelineStage  # same modules in PipelineStage, which knows V

        stages = [PipelineStage(pipe.get_stage_module(i), i, n, torch.device("cpu")) for i in indices]
    else:
        stages = [pipe.build_stage(i, torch.device("cpu")) for i in indices]
    schedule = cls(stages[0] if per_rank == 1 else stages, n_microbatches=m, loss_fn=loss_fn)
    opt = torch.optim.SGD([p for s in stages for p in s.submod.parameters()], lr=1e-3)
    first, last = 0 in indices, n - 1 in indices

    def step() -> None:
        opt.zero_grad()
        kwargs: dict[str, Any] = {"target": y, "losses": []} if last else {}
        if first:
            schedule.step(x, **kwargs)
        else:
            schedule.step(**kwargs)
        opt.step()

    return step


def measure(trainers: dict[str, Step], streams: dict[str, Step], rounds: int, steps: int) -> dict[str, list[float]]:
    """Seconds per step of each trainer in each of `rounds` rounds of `steps` steps.

    `trainers` run in alternating rounds. `streams` (asynchronous updates: the runtime keeps
    1F1B running from one call into the next) run their rounds back to back, then flush, so no
    other trainer's messages come between their steps.
    """
    times: dict[str, list[float]] = {k: [] for k in [*trainers, *streams]}

    def timed(name: str, step: Step) -> None:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        dist.barrier()
        times[name].append((time.perf_counter() - start) / steps)

    for step in trainers.values():  # warm-up: two untimed steps each
        step()
        step()
    for _ in range(rounds):
        for name, step in trainers.items():
            timed(name, step)
    for name, step in streams.items():
        step()
        step()
        for _ in range(rounds):
            timed(name, step)
        step.flush()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=1, help="steps per trainer and round")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=384)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    began = time.perf_counter()
    cfg = GPTConfig(vocab=8000, width=args.width, heads=4, layers=args.layers, seq=64, tied=False)
    torch.manual_seed(0)
    base = GPT(cfg)
    x = torch.randint(0, cfg.vocab, (args.batch, cfg.seq))
    y = torch.randint(0, cfg.vocab, (args.batch, cfg.seq))
    m = args.micro_batches
    say = print if rank == 0 else (lambda *a, **k: None)

    trainers: dict[str, Step] = {}
    streams: dict[str, Step] = {}
    predicted: dict[str, float] = {}
    pipes: dict[str, Any] = {}
    for schedule in ("gpipe", "1f1b", "interleaved", "zb1", "zbv", "dualpipev"):
        trainers[f"ours {schedule}"], predicted[f"ours {schedule}"], pipes[schedule] = ours(base, x, y, m, schedule)
    for update in ("2bw", "stash"):
        name = f"ours 1f1b update={update}"
        streams[name], predicted[name], pipes[update] = ours(base, x, y, m, "1f1b", update)

    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleDualPipeV,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
        ScheduleZBVZeroBubble,
    )

    for name, cls, per_rank, style in (
        ("pippy gpipe", ScheduleGPipe, 1, "loop"), ("pippy 1f1b", Schedule1F1B, 1, "loop"),
        ("pippy interleaved-1f1b", ScheduleInterleaved1F1B, 2, "loop"),
        ("pippy interleaved-zb", ScheduleInterleavedZeroBubble, 2, "loop"),
        ("pippy zbv", ScheduleZBVZeroBubble, 2, "v"),
        ("pippy dualpipev", ScheduleDualPipeV, 2, "v"),
    ):
        try:
            trainers[name] = pippy(base, x, y, m, cls, per_rank, style)
        except Exception as exc:  # noqa: BLE001 - report which PiPPy schedule could not run, and why
            say(f"{name}: could not run ({type(exc).__name__}: {exc})")
    say(pipes["1f1b"].plan.summary(), flush=True)

    rounds = measure(trainers, streams, args.rounds, args.steps)
    seconds = {k: min(v) for k, v in rounds.items()}
    say(f"\n{'trainer':<28} {'samples/s':>10} {'step ms':>9} {'median ms':>10} {'predicted ms':>13}")
    for name, s in seconds.items():
        pred = f"{predicted[name]:>13.1f}" if name in predicted else f"{'-':>13}"
        say(f"{name:<28} {args.batch / s:>10.1f} {s * 1e3:>9.1f} {statistics.median(rounds[name]) * 1e3:>10.1f} {pred}")
    ours_best = min(s for k, s in seconds.items() if k.startswith("ours"))
    pippy_times = [s for k, s in seconds.items() if k.startswith("pippy")]
    zero_bubble = min(seconds[k] for k in ZERO_BUBBLE)
    say(f"(m = {m} micro-batches of {args.batch // m}; run took {time.perf_counter() - began:.0f} s)")
    x_ratio = min(pippy_times) / ours_best if pippy_times else float("nan")
    say(f"best ours vs best pippy: {x_ratio:.2f} (zero-bubble over 1f1b: {seconds['ours 1f1b'] / zero_bubble:.2f})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
