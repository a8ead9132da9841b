"""Worker for tests/test_calibrate.py under torchrun: calibrate a job whose auto choice a fake clock contradicts.

Each rank partitions a small Inception-style net with placement="auto" (argument "placement",
2 ranks) or replicas="auto" (argument "replicas", 3 ranks), takes one step
(so gradients exist), then calibrates with a measuring function that reports the running
plan 10x slower than any other. Checks, per rank: every rank switched to the same plan,
weights and gradients are as they were, and a step after the switch gives the gradients and
loss of the plain model. Prints 'RESULT ... ok=True|False'.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

from models import InceptionNet  # noqa: E402

from partitioner import partition  # noqa: E402
from partitioner.calibrate.decide import Measurement, hook_of, measure_steps  # noqa: E402
from runtime.calibration_hook import StepCall  # noqa: E402
from tests.zoo import rel  # noqa: E402


def layout(plan: Any) -> Any:
    return plan.placement if MODE == "placement" else [list(s.ranks) for s in plan.stages]


def main() -> int:
    torch.manual_seed(0)
    model = InceptionNet(c=8, blocks=2)
    reference = copy.deepcopy(model)
    x, y = torch.randn(12, 3, 8, 8), torch.randint(0, 10, (12,))
    dist.init_process_group("gloo")
    devices = ["cpu"] * dist.get_world_size()
    if MODE == "placement":
        pipe = partition(model, devices, example_inputs=(x,), micro_batches=2, placement="auto")
    else:  # the hybrid planner's replicas against one stage per rank
        pipe = partition(model, devices, example_inputs=(x,), micro_batches=6, replicas="auto", schedule="1f1b")
    first = layout(pipe.plan)
    pipe.train_step(x, y, F.cross_entropy)
    held = pipe.held_tensor_ids()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if id(p) in held}

    def fake(p: Any, steps: int, call: StepCall) -> Measurement:
        real = measure_steps(p, steps, call)
        return Measurement(10000.0 if layout(p.plan) == first else 1000.0, real.trace)

    hook_of(pipe).measure = fake
    report = pipe.calibrate(steps=1)
    names: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(names, (report.chosen, layout(pipe.plan), [s.ranks for s in pipe.plan.stages]))
    same = all(n == names[0] for n in names)
    kept = all(rel(p.grad, grads[n]) == 0 for n, p in model.named_parameters() if id(p) in held and n in grads
               and id(p) in pipe.held_tensor_ids())
    model.zero_grad()
    loss = pipe.train_step(x, y, F.cross_entropy)
    ref_loss = F.cross_entropy(reference(x), y)
    ref_loss.backward()
    ref = dict(reference.named_parameters())
    now = pipe.held_tensor_ids()
    worst = max(rel(p.grad, ref[n].grad) for n, p in model.named_parameters() if id(p) in now)
    loss_err = rel(loss, ref_loss.detach()) if loss is not None else 0.0
    # float32 sums over micro-batches in another order than the whole batch: relative errors near 1e-5
    ok = same and kept and worst < 5e-5 and loss_err < 1e-5 and layout(pipe.plan) != first and report.replanned
    print(f"RESULT rank={dist.get_rank()} from={first} to={layout(pipe.plan)} chosen={report.chosen} same={same} "
          f"grads_kept={kept} grad_err={worst:.2e} loss_err={loss_err:.2e} ok={ok}", flush=True)
    dist.destroy_process_group()
    return 0 if ok else 1


MODE = sys.argv[1] if len(sys.argv) > 1 else "placement"  # or "replicas"

if __name__ == "__main__":
    sys.exit(main())
