"""Training throughput against torch.distributed.pipelining (PiPPy) on 2 gloo ranks, one thread each.

A GPT-like language model (8 pre-norm blocks, width 256, 4 heads, sequence 64, vocabulary
8000, untied head), batch 32 in 8 micro-batches, trained by
  (a) one process (rank 0 alone),
  (b) torch.distributed.pipelining, equal-layer split (4 blocks per stage), GPipe and 1F1B,
  (c) partitioner, the planned split, GPipe and 1F1B,
all in this one run. Prints samples/s of each and last
`speedup vs pippy: X (ours Y over one process, ideal Z)` with Z = p*m / (m + p - 1).
Usage: torchrun --standalone --nproc_per_node=2 benchmarks/vs_pippy.py [--steps 6]
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from models import GPT, GPTConfig  # noqa: E402
from rank_timing import timed  # noqa: E402

from partitioner import Pipeline, partition  # noqa: E402


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--micro-batches", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(vocab=8000, width=256, heads=4, layers=8, seq=64, tied=False)
    torch.manual_seed(0)
    base = GPT(cfg)
    x = torch.randint(0, cfg.vocab, (args.batch, cfg.seq))
    y = torch.randint(0, cfg.vocab, (args.batch, cfg.seq))
    m = args.micro_batches
    results: dict[str, float] = {}

    # (a) one process
    single = copy.deepcopy(base)
    opt = torch.optim.SGD(single.parameters(), lr=1e-3)

    def single_step() -> None:
        if rank == 0:
            opt.zero_grad()
            loss_fn(single(x), y).backward()
            opt.step()

    results["one process"] = args.batch / timed(single_step, args.steps)

    # (b) torch.distributed.pipelining, equal-layer split
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, SplitPoint, pipeline

    for name, schedule_cls in (("gpipe", ScheduleGPipe), ("1f1b", Schedule1F1B)):
        model = copy.deepcopy(base)
        split = {f"blocks.{cfg.layers * s // world}": SplitPoint.BEGINNING for s in range(1, world)}
        pipe = pipeline(model, mb_args=(x[: args.batch // m],), split_spec=split)
        stage = pipe.build_stage(rank, torch.device("cpu"))
        schedule = schedule_cls(stage, n_microbatches=m, loss_fn=loss_fn)
        popt = torch.optim.SGD(stage.submod.parameters(), lr=1e-3)

        # the loop's values are bound as defaults, not looked up when the step runs
        def pippy_step(popt: torch.optim.Optimizer = popt, schedule: ScheduleGPipe | Schedule1F1B = schedule) -> None:
            popt.zero_grad()
            if rank == 0:
                schedule.step(x)
            else:
                schedule.step(target=y, losses=[])
            popt.step()

        results[f"pippy {name} equal-layer"] = args.batch / timed(pippy_step, args.steps)

    # (c) ours, planned split
    for name in ("gpipe", "1f1b"):
        model = copy.deepcopy(base)
        ours = partition(model, ["cpu"] * world, example_inputs=(x,), micro_batches=m, schedule=name)
        oopt = torch.optim.SGD([p for p in model.parameters() if p.numel()], lr=1e-3)
        if rank == 0 and name == "gpipe":
            print(ours.plan.summary(), flush=True)

        def our_step(ours: Pipeline = ours, oopt: torch.optim.Optimizer = oopt) -> None:
            oopt.zero_grad()
            ours.train_step(x, y, loss_fn)
            oopt.step()

        results[f"ours {name} planned"] = args.batch / timed(our_step, args.steps)

    if rank == 0:
        print(f"{'trainer':<28} {'samples/s':>10}")
        for key, value in results.items():
            print(f"{key:<28} {value:>10.1f}")
        best_pippy = max(v for k, v in results.items() if k.startswith("pippy"))
        best_ours = max(v for k, v in results.items() if k.startswith("ours"))
        ideal = world * m / (m + world - 1)
        print(f"speedup vs pippy: {best_ours / best_pippy:.2f} "
              f"(ours {best_ours / results['one process']:.2f} over one process, ideal {ideal:.2f})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
