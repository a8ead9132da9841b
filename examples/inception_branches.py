"""Branch placement: an Inception-style net's parallel branches side by side on several devices.

One process. The devices are the GPUs found, else N workers on the CPU. The planner puts
each block's four branches on different devices where that pays, checks the partitioned
output equals the plain model's, trains a few steps on synthetic data (the loss must
fall), and writes the plan picture.
Usage: python examples/inception_branches.py [--devices 2] [--steps 8] [--out inception_plan.html]
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import InceptionNet  # noqa: E402

from partitioner import partition  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2, help="CPU workers when no GPU is present")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--channels", type=int, default=32)
    parser.add_argument("--size", type=int, default=16, help="image side")
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--out", default="inception_plan.html", help=".html, .png or .svg")
    args = parser.parse_args()
    torch.manual_seed(0)
    if torch.cuda.is_available():
        devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    else:
        devices = ["cpu"] * args.devices
    model = InceptionNet(c=args.channels, blocks=2)
    plain = copy.deepcopy(model)
    x = torch.randn(args.batch, 3, args.size, args.size)
    y = torch.randint(0, 10, (args.batch,))
    pipe = partition(model, devices, example_inputs=(x,), micro_batches=args.micro_batches, placement="branches")
    print(pipe.plan.summary())
    print(f"branches on {len({s.ranks[0] for s in pipe.plan.stages})} of {len(devices)} devices")

    with torch.no_grad():
        gap = (pipe(x).cpu() - plain(x)).abs().max().item()
    print(f"max |partitioned - plain| output: {gap:.2e}")
    if gap > 1e-4:
        print("FAILED: the partitioned output differs from the plain model's")
        return 1

    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        optimizer.zero_grad()
        loss = F.cross_entropy(pipe(x), y.to(pipe.output_device))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        print(
            f"step {step:3d}  loss {loss.item():.4f}  {step * args.batch / (time.perf_counter() - start):.0f} samples/s"
        )
    pipe.plan.visualize(args.out)
    print(f"wrote {args.out}")
    if not losses[-1] < losses[0]:
        print("FAILED: the loss did not fall")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
