"""Krizhevsky's "one weird trick" under torchrun: convolutions data-parallel, fully connected layers tensor-parallel.

An AlexNet/VGG-style CNN has most of its compute in the convolutions and most of its weights in the fully
connected layers, so the trick runs the convolutions as data-parallel replicas and splits the fully
connected layers across ranks. Here on 4 ranks (gloo, CPU):

    ranks 0, 1   stage 0  the convolutions, one replica each (micro-batches dealt to them)
    ranks 2, 3   stage 1  the classifier, its Linear layers split colwise/rowwise over both (DTensor)

Rank 0 first asks the planner (partitioner.plan on a cluster of 4 GPUs, searching tensor degree and
sharding) and prints the plan it chooses. Where that plan is not the trick (the cluster search gives every
stage one tensor degree), the trick is built from the planner's own parts: its cut before the classifier
and the groups partitioner.capture.shardable finds there. Every rank trains with the same synthetic
batches; rank 2 prints the loss of each step beside the same model trained in one process (equal to rounding:
the pipeline sums its micro-batches' gradients in another order, which Adam's later steps amplify a little).
Usage: torchrun --standalone --nproc_per_node=4 examples/one_weird_trick.py [--steps 40]
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cost_model.analytic import AnalyticCostModel  # noqa: E402
from cost_model.devices import DeviceSpec  # noqa: E402
from partitioner import partition, plan  # noqa: E402
from partitioner.capture.graph import build_graph  # noqa: E402
from partitioner.capture.shardable import find_shardable  # noqa: E402
from partitioner.capture.trace import trace  # noqa: E402
from partitioner.request import SplitPoint  # noqa: E402
from runtime.plan import Plan  # noqa: E402


class AlexNetStyle(nn.Module):
    """Convolutions and pooling, then a stack of fully connected layers (no dropout: runs compare exactly)."""

    def __init__(self, width: int = 16, hidden: int = 256, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(2 * width, 4 * width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Linear(4 * width * 4 * 4, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
            nn.Linear(hidden, classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))


def batches(steps: int, size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Images whose class is the brightest of 10 fixed patterns in them: a task the loss can fall on."""
    g = torch.Generator().manual_seed(1)
    patterns = torch.randn(10, 3, 32, 32, generator=g)
    out = []
    for _ in range(steps):
        y = torch.randint(0, 10, (size,), generator=g)
        out.append((0.5 * torch.randn(size, 3, 32, 32, generator=g) + patterns[y], y))
    return out


def chosen_plan(model: nn.Module, x: torch.Tensor, micro_batches: int) -> str:
    """What the planner's search chooses for 4 GPUs (printed); the plan text every rank runs."""
    searched = plan(copy.deepcopy(model), cluster="1x4xH100", example_inputs=(x,), micro_batches=micro_batches,
                    replicas="auto", schedule="auto", precision="mixed")
    print("The planner's choice for 4 GPUs (tensor degree and sharding searched):\n" + searched.summary(), flush=True)
    tensors = [s.tensor for s in searched.stages]
    if len(searched.stages) > 1 and tensors[0] == 1 and max(tensors) > 1:
        return searched.to_json()  # the trick itself: run what the planner chose
    print(f"\nIt splits no fully connected layer while the convolutions stay data-parallel (tensor degrees {tensors}): "
          "the cluster search gives every stage one tensor degree. Running the trick from the planner's own parts: "
          "its cut before the classifier, the classifier's groups found in the graph.\n", flush=True)
    fixed = AnalyticCostModel(measure=lambda device: DeviceSpec("cpu", flops_per_s=1e10, bytes_per_s=1e10,
                                                                op_overhead_s=1e-6, memory_bytes=1 << 34))
    trick = plan(copy.deepcopy(model), ["cpu", "cpu"], example_inputs=(x,), micro_batches=micro_batches,
                 split_spec={"classifier": SplitPoint.BEGINNING}, processes=False, cost_model=fixed)
    part = x[: x.shape[0] // micro_batches]
    traced = trace(copy.deepcopy(model), (part,))
    found = find_shardable(traced.graph_module, build_graph(traced.graph_module, traced.flatten_inputs((part,), {})))
    convs, fcs = trick.stages
    convs.ranks = [0, 1]  # data-parallel: micro-batch i on rank i mod 2
    fcs.ranks, fcs.tensor = [2], 2  # tensor-parallel: ranks 2 and 3
    fcs.tensor_groups = [g.spec() for g in found.within(fcs.nodes) if 2 in g.degrees]
    trick.programs, trick.graph = [], None
    trick.check()
    return trick.to_json()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    if dist.get_world_size() != 4:
        raise SystemExit("run on 4 ranks: torchrun --standalone --nproc_per_node=4 examples/one_weird_trick.py")
    torch.manual_seed(0)
    model = AlexNetStyle()
    reference = copy.deepcopy(model)
    data = batches(args.steps, args.batch)
    text: list[str | None] = [chosen_plan(model, data[0][0], args.micro_batches) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(text, src=0)
    pipe = partition(model, ["cpu"] * 4, example_inputs=(data[0][0],), plan=Plan.from_json(str(text[0])))
    if dist.get_rank() == 0:
        print("The plan that runs:\n" + pipe.plan.summary(), flush=True)
    held = pipe.held_tensor_ids()
    opt = torch.optim.Adam([p for p in model.parameters() if id(p) in held], lr=args.lr, eps=1e-4)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=args.lr, eps=1e-4)
    for step, (x, y) in enumerate(data):
        opt.zero_grad()
        loss = pipe.train_step(x, y, F.cross_entropy)
        opt.step()
        ref_opt.zero_grad()
        ref_loss = F.cross_entropy(reference(x), y)
        ref_loss.backward()
        ref_opt.step()
        if loss is not None and dist.get_rank() == 2:
            print(f"step {step:3d}  loss {loss.item():.5f}  plain model {ref_loss.item():.5f}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
