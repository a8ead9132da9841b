"""Our runtime against torch.distributed.pipelining's `_PipelineScheduleRuntime` on the same plan, 2 gloo ranks.

One plan per schedule (partitioner's cuts and action lists) for a GPT-like model (8 pre-norm
blocks, width 256, 4 heads, sequence 64, vocabulary 8000, untied head), batch 32 in 8
micro-batches, one thread per rank. Both runtimes train the same stage modules: ours through
`partition(..., plan=...)`'s pipeline, torch's through `plan.to_torch_schedule()` loaded by
`_PipelineScheduleRuntime` over `PipelineStage`s of our stage modules (partitioner.export).
Prints each schedule's step time in both (the best of alternating rounds) and the ratio
torch / ours (above 1: ours is faster); the last line is the mean ratio.
Usage: python benchmarks/vs_torch_runtime.py [--steps 3] [--rounds 3] [--schedules 1f1b zb1]   (starts torchrun)
"""

from __future__ import annotations

import argparse
import copy
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import GPT, GPTConfig  # noqa: E402
from rank_timing import timed  # noqa: E402

from partitioner import partition  # noqa: E402
from partitioner.export import pipeline_stages, schedule_runtime  # noqa: E402


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def compare(schedule: str, base: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
            args: argparse.Namespace) -> tuple[float, float]:
    """(our ms, torch's ms) per training step of one plan: the same cuts, actions and stage modules."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ours_model, torch_model = copy.deepcopy(base), copy.deepcopy(base)
    ours = partition(ours_model, ["cpu"] * world, example_inputs=(x,), micro_batches=args.micro_batches,
                     schedule=schedule)
    stages = pipeline_stages(torch_model, ours.plan, (x,))
    theirs = schedule_runtime(stages, loss_fn)
    if rank == 0:
        print(ours.plan.summary(), flush=True)
        print("torch actions, rank 0: " + ",".join(stages.schedule.actions[0]), flush=True)

    def our_step() -> None:
        ours_model.zero_grad(set_to_none=True)
        ours.train_step(x, y, loss_fn)

    def torch_step() -> None:
        torch_model.zero_grad(set_to_none=True)
        theirs.step(x, target=y, losses=[])

    ours_s, torch_s = [], []
    for _ in range(args.rounds):  # alternating rounds, the best of each: load from other processes hits both alike
        ours_s.append(timed(our_step, args.steps, warmup=1))
        torch_s.append(timed(torch_step, args.steps, warmup=1))
    stages.undo()
    return min(ours_s) * 1e3, min(torch_s) * 1e3


def run(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    cfg = GPTConfig(vocab=8000, width=256, heads=4, layers=8, seq=64, tied=False)
    torch.manual_seed(0)
    base = GPT(cfg)
    x = torch.randint(0, cfg.vocab, (args.batch, cfg.seq))
    y = torch.randint(0, cfg.vocab, (args.batch, cfg.seq))
    rows = [(schedule, *compare(schedule, base, x, y, args)) for schedule in args.schedules]
    if dist.get_rank() == 0:
        print(f"{'schedule':<12} {'ours ms':>9} {'torch ms':>9} {'torch/ours':>10}")
        for schedule, ours_ms, torch_ms in rows:
            print(f"{schedule:<12} {ours_ms:>9.1f} {torch_ms:>9.1f} {torch_ms / ours_ms:>10.2f}")
        mean = sum(t / o for _, o, t in rows) / len(rows)
        print(f"vs torch runtime on the same plans ({', '.join(r[0] for r in rows)}; 2 gloo ranks): "
              f"torch step / our step = {mean:.2f} (above 1: ours is faster)", flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of each runtime (best one counts)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--schedules", nargs="+", default=["1f1b", "zb1"])
    args = parser.parse_args()
    if "RANK" not in os.environ:  # start 2 ranks of this script under torchrun
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__,
               *sys.argv[1:]]
        sys.exit(subprocess.call(cmd))
    run(args)


if __name__ == "__main__":
    main()
