"""Worker for tests/test_hybrid_plan.py: a plan whose stages the device-list search split, run under torchrun on gloo.

    python -m torch.distributed.run --nproc_per_node=4 tests/hybrid_worker.py equivalence CASE [CASE ...]

A CASE is SCHEDULE:BYTES. Rank 0 plans the small CNN of this file with partitioner.plan(replicas="auto") on 4
ranks whose devices hold BYTES, too little for its fully connected layers whole (a cost model of fixed speed,
so every run plans alike); the
search itself splits them (devices/split.py), nothing is set by hand. Every rank runs that plan; one training step's
loss and every gradient the rank holds are compared with the plain model's. Prints 'RESULT ... ok=...' per
schedule and rank.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cost_model.analytic import AnalyticCostModel  # noqa: E402
from cost_model.devices import DeviceSpec  # noqa: E402
from partitioner import partition, plan  # noqa: E402
from runtime.plan import Plan  # noqa: E402
from tests.zoo import rel  # noqa: E402

BATCH = 8


class SmallCnn(nn.Module):
    """Two convolutions with pooling, then fully connected layers holding almost every weight."""

    def __init__(self, hidden: int = 256, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Linear(16 * 2 * 2, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))


def cost(memory_bytes: int) -> AnalyticCostModel:
    """A device of fixed speed holding `memory_bytes`: the same plan on every run."""
    return AnalyticCostModel(measure=lambda device: DeviceSpec("cpu", flops_per_s=1e10, bytes_per_s=1e10,
                                                               op_overhead_s=1e-6, memory_bytes=memory_bytes))


def planned(model: nn.Module, x: torch.Tensor, schedule: str, memory_bytes: int) -> Plan:
    """What the search chooses for 4 processes on devices of `memory_bytes`."""
    return plan(copy.deepcopy(model), ["cpu"] * 4, processes=True, example_inputs=(x,), micro_batches=4,
                replicas="auto", schedule=schedule, cost_model=cost(memory_bytes))


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def equivalence(case: str) -> bool:
    schedule, memory = case.split(":")
    torch.manual_seed(0)
    model = SmallCnn()
    reference = copy.deepcopy(model)
    x, y = torch.randn(BATCH, 3, 8, 8), torch.randint(0, 10, (BATCH,))
    text: list[Any] = [planned(model, x, schedule, int(memory)).to_json() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(text, src=0)
    made = Plan.from_json(text[0])
    pipe = partition(model, ["cpu"] * 4, example_inputs=(x,), plan=made)
    ids = pipe.held_tensor_ids()
    params = {n: q for n, q in model.named_parameters() if id(q) in ids}
    loss = pipe.train_step(x, y, F.cross_entropy)
    ref_loss = F.cross_entropy(reference(x), y)
    ref_loss.backward()
    ref_params = dict(reference.named_parameters())
    worst = rel(loss, ref_loss.detach()) if loss is not None else 0.0
    for n, q in sorted(params.items()):
        worst = max(worst, rel(full(q.grad), ref_params[n].grad))
    tensors = [s.tensor for s in made.stages]
    split = sum(isinstance(q, DTensor) for q in params.values())
    mine = [s.index for s in pipe.stages]
    ok = worst < 1e-5 and bool(params) and (split > 0) == any(tensors[s] > 1 for s in mine) and max(tensors) > 1
    print(f"RESULT case={case} schedule={made.schedule} rank={dist.get_rank()} stages={mine} tensor={tensors} "
          f"ranks={[s.ranks for s in made.stages]} dtensors={split} err={worst:.1e} ok={ok}", flush=True)
    return ok


def main() -> int:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    mode, *args = sys.argv[1:]
    done = [equivalence(case) for case in args] if mode == "equivalence" else [False]  # every case on every rank
    ok = all(done)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
