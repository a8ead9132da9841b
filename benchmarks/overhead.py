"""Overhead of the pipeline runtime: plain model vs. the same model partitioned onto one device.

Both run forward + backward on the same batch, interleaved so machine noise hits both
alike; prints per-sample time of each for micro-batches 1, 4 and 16 (and of the plain
model run over the same micro-batches one by one, which separates what micro-batching
costs by itself from what the runtime adds), and last the line
`overhead at micro_batches=1: X%`.
Usage: python benchmarks/overhead.py [--device cpu|cuda:0] [--repeats 30]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from torch import nn

from partitioner import partition


def make_model(width: int, depth: int) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU(), nn.LayerNorm(width)]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def step_time(net: nn.Module, x: torch.Tensor, device: torch.device) -> float:
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    sync()
    start = time.perf_counter()
    net(x).square().mean().backward()
    sync()
    return time.perf_counter() - start


def chunked_step_time(net: nn.Module, x: torch.Tensor, chunks: int, device: torch.device) -> float:
    """The plain model over the same micro-batches one after another: what micro-batching costs by itself."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for part in torch.tensor_split(x, chunks):
        (net(part).square().sum() / x.shape[0] / 10).backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    x = torch.randn(args.batch, args.width, device=device)
    print(f"device {device}, torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"MLP width {args.width} depth {args.depth}, batch {args.batch}, {args.stages} stages on one device")
    print(f"{'micro_batches':>13}  {'plain us/sample':>15}  {'plain, same micro-batches':>25}  "
          f"{'partitioned us/sample':>21}  {'ratio':>6}  {'ratio to same micro-batches':>27}")
    overhead_m1 = 0.0
    for m in (1, 4, 16):
        plain = make_model(args.width, args.depth).to(device)
        model = copy.deepcopy(plain)
        pipe = partition(model, [device] * args.stages, example_inputs=(x,), micro_batches=m)
        for _ in range(5):  # warm up both
            step_time(plain, x, device), step_time(pipe, x, device)
        t_plain, t_pipe, t_chunk = [], [], []
        for r in range(args.repeats):  # alternate the order so drift hits both alike
            if r % 2:
                t_pipe.append(step_time(pipe, x, device))
                t_plain.append(step_time(plain, x, device))
            else:
                t_plain.append(step_time(plain, x, device))
                t_pipe.append(step_time(pipe, x, device))
            t_chunk.append(chunked_step_time(plain, x, m, device))
            plain.zero_grad(set_to_none=True)
            model.zero_grad(set_to_none=True)
        a, b, c = statistics.median(t_plain), statistics.median(t_pipe), statistics.median(t_chunk)
        print(f"{m:>13}  {a / args.batch * 1e6:>15.2f}  {c / args.batch * 1e6:>25.2f}  "
              f"{b / args.batch * 1e6:>21.2f}  {b / a:>6.3f}  {b / c:>27.3f}")
        if m == 1:
            overhead_m1 = (b / a - 1) * 100
    print(f"overhead at micro_batches=1: {overhead_m1:.1f}%")


if __name__ == "__main__":
    main()
