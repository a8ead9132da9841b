"""Demo: partition a small GPT over the devices found here, print the plan, train a few steps.

GPUs are found through torch (names through NVML where present); with none, the model is
split into two stages on the CPU. The batches may live on any device (`--input-device`,
default: the first GPU where there is one): the pipeline moves them to its first stage.
The data is synthetic: each sequence counts up modulo the vocabulary, so the loss falls quickly.
Usage: python examples/demo.py [--steps 30] [--micro-batches 4] [--input-device cpu]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import GPT, GPTConfig  # noqa: E402

from partitioner import partition  # noqa: E402


def found_devices() -> list[str]:
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return ["cpu", "cpu"]


def batch(cfg: GPTConfig, size: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    start = torch.randint(0, cfg.vocab, (size, 1))
    seq = (start + torch.arange(cfg.seq + 1)) % cfg.vocab
    return seq[:, :-1].to(device), seq[:, 1:].to(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--input-device", default=None, help="where batches are made (default: the first device)")
    args = parser.parse_args()
    torch.manual_seed(0)
    cfg = GPTConfig()
    devices = found_devices()
    source = args.input_device or devices[0]
    print(f"devices: {devices}; batches made on {source}")
    model = GPT(cfg)  # on the CPU: partition() moves each stage's weights to its device
    x, y = batch(cfg, args.batch, source)
    pipe = partition(model, devices, example_inputs=(x,), micro_batches=args.micro_batches)
    print(pipe.plan.summary())
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        x, y = batch(cfg, args.batch, source)
        logits = pipe(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.to(logits.device).flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step == 1 or step % 10 == 0 or step == args.steps:
            rate = step * args.batch / (time.perf_counter() - start)
            print(f"step {step:3d}  loss {loss.item():.4f}  {rate:.0f} samples/s")


if __name__ == "__main__":
    main()
