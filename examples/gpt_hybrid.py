"""Hybrid parallelism: a GPT trained with pipeline stages x data-parallel replicas under torchrun.

Every rank runs this script with the same synthetic batches (sequences counting up modulo
the vocabulary). Stages and replicas come from --replicas ("2,1,1": stage 0 on two ranks,
stages 1 and 2 on one each; "auto": the hybrid planner chooses). The first step's loss is
checked against the same model trained in one process; the last stage prints loss and
samples/s; rank 0 writes the plan picture with the measured timeline of the last step.
Usage: torchrun --standalone --nproc_per_node=4 examples/gpt_hybrid.py [--replicas 2,1,1] [--steps 20]
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import GPT, GPTConfig  # noqa: E402

from partitioner import partition  # noqa: E402


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def batch(cfg: GPTConfig, size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    start = torch.randint(0, cfg.vocab, (size, 1), generator=generator)
    seq = (start + torch.arange(cfg.seq + 1)) % cfg.vocab
    return seq[:, :-1], seq[:, 1:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", default="auto", help='"auto" or counts per stage such as 2,1,1')
    parser.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--out", default="gpt_hybrid_plan.html", help=".html, .png or .svg")
    args = parser.parse_args()
    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    # rank r takes cuda:LOCAL_RANK: with fewer GPUs than processes on this host, every rank runs on the CPU (gloo)
    device = "cuda" if torch.cuda.device_count() >= local else "cpu"
    cfg = GPTConfig(vocab=256, width=args.width, heads=4, layers=args.layers, seq=32)
    torch.manual_seed(0)
    model = GPT(cfg)
    reference = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(1)
    x, y = batch(cfg, args.batch, generator)
    replicas = "auto" if args.replicas == "auto" else [int(r) for r in args.replicas.split(",")]
    pipe = partition(
        model, [device] * world, example_inputs=(x,), micro_batches=args.micro_batches,
        schedule=args.schedule, replicas=replicas,
    )
    rank = dist.get_rank()  # partition() joined the job
    if rank == 0:
        print(pipe.plan.summary(), flush=True)
    last = rank in pipe.plan.stages[-1].ranks
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.numel()], lr=3e-3)
    losses: list[float] = []
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        if step > 1:
            x, y = batch(cfg, args.batch, generator)
        pipe.tracing = step == args.steps  # record the last step, for the picture
        optimizer.zero_grad()
        loss = pipe.train_step(x, y, loss_fn)
        optimizer.step()
        if step == 1 and last:
            expected = loss_fn(reference(x), y).item()
            print(f"step 1 loss {loss.item():.6f}, one process {expected:.6f}", flush=True)
            if abs(loss.item() - expected) > 1e-5 * abs(expected):
                print("FAILED: the pipelined loss differs from one process's", flush=True)
                return 1
        if last:
            losses.append(loss.item())
            if rank == pipe.plan.stages[-1].ranks[0] and (step % 5 == 0 or step == args.steps):
                rate = step * args.batch / (time.perf_counter() - start)
                print(f"step {step:3d}  loss {loss.item():.4f}  {rate:.0f} samples/s", flush=True)
    trace = pipe.gather_trace()
    if rank == 0:
        pipe.plan.visualize(args.out, measured=trace)
        print(f"wrote {args.out}", flush=True)
    dist.destroy_process_group()
    if last and not losses[-1] < losses[0]:
        print("FAILED: the loss did not fall", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
