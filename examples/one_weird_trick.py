"""Krizhevsky's "one weird trick" under torchrun, as the planner chooses it: convolutions data-parallel, fully
connected layers tensor-parallel.

An AlexNet-style CNN (96, 192 and 384 filters, then fully connected layers of 2048) has most of its compute
in the convolutions and almost all of its weights (17 M of 18 M) in the fully connected layers. Data
parallelism all-reduces every weight each step, which is cheap for the convolutions and dear for the
fully connected layers; splitting those layers over ranks moves only their activations. Krizhevsky's
GPUs talked over PCIe, and that is where the planner chooses the trick: rank 0 plans the model for 4
V100-PCIe GPUs with replicas="auto" (partitioner.plan(cluster=...): stages, replicas, a tensor degree
per stage and micro-batches searched by price) and prints the plan, here

    ranks 0, 1   stage 0  the convolutions, one replica each (micro-batches dealt to them)
    ranks 2, 3   stage 1  the classifier, its Linear layers split over both (DTensor)

and, for contrast, what it chooses where an NVLink all-reduce is cheap (4 H100 SXM: every layer
data-parallel). Every rank then runs the chosen plan on CPU (gloo), as it would run on the GPUs. Why GPU
prices and not the CPU's: a profiled CPU cost model prices each node at the time measured for it whole,
so it cannot price a layer split t ways at its share and never finds a split faster (the search would
still split what fits in memory only split: tests/test_hybrid_plan.py).

Every rank trains with the same synthetic batches; the last stage's first rank prints the loss of each step
beside the same model trained in one process (equal to rounding: the pipeline sums its micro-batches' gradients in
another order, which Adam's later steps amplify a little).
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

from partitioner import partition, plan  # noqa: E402
from runtime.plan import Plan  # noqa: E402

GPUS = "1x4xV100-PCIe-16GB"  # where the plan is priced: 4 GPUs joined by PCIe, as Krizhevsky's were
NVLINK = "1x4xH100-SXM"  # the contrast: an all-reduce over NVSwitch


class AlexNetStyle(nn.Module):
    """Convolutions and pooling, then a stack of fully connected layers (no dropout: runs compare exactly)."""

    def __init__(self, width: int = 96, hidden: int = 2048, classes: int = 10) -> None:
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


def is_trick(made: Plan) -> bool:
    """Convolutions on data-parallel replicas, the fully connected layers split over tensor ranks."""
    first, last = made.stages[0], made.stages[-1]
    convolutions = not any(n.startswith("classifier") for n in first.nodes)
    classifier = all(n.startswith("classifier") for n in last.nodes)
    return len(made.stages) > 1 and first.tensor == 1 and len(first.ranks) > 1 and last.tensor > 1 and convolutions \
        and classifier


def chosen_plan(model: nn.Module, x: torch.Tensor, micro_batches: int) -> str:
    """The planner's choice for 4 GPUs on PCIe (printed, with the choice on NVLink beside it); the plan every rank
    runs."""
    def search(cluster: str) -> Plan:
        return plan(copy.deepcopy(model), cluster=cluster, example_inputs=(x,), micro_batches=micro_batches,
                    replicas="auto", schedule="auto")

    contrast = search(NVLINK)
    print(f"On {NVLINK} (NVLink): stages {[(len(s.ranks), s.tensor) for s in contrast.stages]} (replicas, tensor "
          f"degree), predicted step {contrast.predicted_step_ms:.2f} ms", flush=True)
    chosen = search(GPUS)
    print(f"The planner's choice for {GPUS} (stages, replicas, tensor degree and micro-batches searched):\n"
          + chosen.summary(), flush=True)
    print("Convolutions data-parallel, fully connected layers split: "
          + ("yes, the trick" if is_trick(chosen) else "no (run as chosen)"), flush=True)
    return chosen.to_json()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-4)
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
    printer = pipe.plan.stages[-1].ranks[0]  # where the loss is
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
        if loss is not None and dist.get_rank() == printer:
            print(f"step {step:3d}  loss {loss.item():.5f}  plain model {ref_loss.item():.5f}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
