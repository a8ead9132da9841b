"""A small ResNet with BatchNorm as a pipeline over several devices in one process, trained on synthetic data.

On a machine without GPUs the devices are repeated 'cpu' entries: every stage runs on the
CPU, which shows the mechanics (stages, micro-batches, BatchNorm across micro-batches) but
not a speed-up. The script checks that the pipeline's outputs equal the plain model's,
trains a few steps printing loss and samples/s, and writes the plan's picture.
Usage: python examples/resnet_pipeline.py [--devices cpu,cpu,cpu] [--steps 20] [--out resnet_plan.html]
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from dataclasses import dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from partitioner import partition  # noqa: E402
from partitioner.show.visualizer import visualize  # noqa: E402


@dataclass
class Config:
    """Model, data and training settings; every field is also a command-line flag."""

    devices: str = "cpu,cpu,cpu"
    width: int = 16  # channels of the first group; doubled in each later group
    blocks: int = 2  # residual blocks per group (3 groups)
    image: int = 32
    classes: int = 10
    batch: int = 32
    micro_batches: int = 4
    steps: int = 20
    lr: float = 0.05
    seed: int = 0
    out: str = "resnet_plan.html"


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm and a residual; a 1x1 projection when the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.skip = nn.Sequential()
        if stride != 1 or cin != cout:
            self.skip = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(h)) + self.skip(x))


class ResNet(nn.Module):
    """Stem, three groups of BasicBlocks (stride 1, 2, 2), global average pool, linear classifier."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        w = cfg.width
        self.stem = nn.Sequential(nn.Conv2d(3, w, 3, 1, 1, bias=False), nn.BatchNorm2d(w), nn.ReLU())
        groups, cin = [], w
        for i, cout in enumerate((w, 2 * w, 4 * w)):
            groups.append(
                nn.Sequential(
                    *[BasicBlock(cin if b == 0 else cout, cout, 2 if i and b == 0 else 1) for b in range(cfg.blocks)]
                )
            )
            cin = cout
        self.layer1, self.layer2, self.layer3 = groups
        self.fc = nn.Linear(cin, cfg.classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.layer3(self.layer2(self.layer1(self.stem(x))))
        return self.fc(h.mean(dim=(2, 3)))


def synthetic_data(cfg: Config, batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Images whose class is the brightest of `classes` fixed patterns mixed into noise: learnable fast."""
    g = torch.Generator().manual_seed(cfg.seed + 1)
    patterns = torch.randn(cfg.classes, 3, cfg.image, cfg.image, generator=g)
    data = []
    for _ in range(batches):
        y = torch.randint(0, cfg.classes, (cfg.batch,), generator=g)
        x = 0.5 * torch.randn(cfg.batch, 3, cfg.image, cfg.image, generator=g) + patterns[y]
        data.append((x, y))
    return data


def parse(argv: list[str] | None = None) -> Config:
    """Config from the command line: one flag per field, e.g. --micro-batches 4."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for f in fields(Config):
        default = getattr(Config, f.name)
        parser.add_argument(
            "--" + f.name.replace("_", "-"), type=type(default), default=default, help=f"default {default}"
        )
    return Config(**vars(parser.parse_args(argv)))


def main(argv: list[str] | None = None) -> int:
    cfg = parse(argv)
    torch.manual_seed(cfg.seed)
    devices = [d.strip() for d in cfg.devices.split(",")]
    model = ResNet(cfg)
    plain = copy.deepcopy(model)  # the reference: the same weights, never partitioned
    data = synthetic_data(cfg, batches=4)
    pipe = partition(model, devices, example_inputs=(data[0][0],), micro_batches=cfg.micro_batches)
    print(pipe.plan.summary())

    model.eval(), plain.eval()
    with torch.no_grad():
        x = data[1][0]
        diff = (pipe(x).cpu() - plain(x)).abs().max().item()
    print(f"max |pipeline - plain model| on a batch (eval mode): {diff:.2e}")
    if diff > 1e-5:
        print("FAILED: the partitioned model's outputs differ from the plain model's", file=sys.stderr)
        return 1

    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9)
    start = time.perf_counter()
    for step in range(1, cfg.steps + 1):
        x, y = data[step % len(data)]
        logits = pipe(x)
        loss = F.cross_entropy(logits, y.to(logits.device))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step == 1 or step % 5 == 0 or step == cfg.steps:
            rate = step * cfg.batch / (time.perf_counter() - start)
            print(f"step {step:3d}  loss {loss.item():.4f}  {rate:.0f} samples/s")

    plain.load_state_dict(model.state_dict())  # the checkpoint keys are the plain model's own
    model.eval(), plain.eval()
    with torch.no_grad():
        x = data[2][0]
        diff = (pipe(x).cpu() - plain(x)).abs().max().item()
    print(f"max |pipeline - plain model| after training, its state_dict loaded into the plain model: {diff:.2e}")
    if diff > 1e-5:
        print("FAILED: after training the outputs differ from the plain model's", file=sys.stderr)
        return 1
    if cfg.out:
        visualize(pipe.plan, cfg.out)
        print(f"wrote the plan's picture to {cfg.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
