"""Worker for tests/test_calibrate_passive.py under torchrun: the refit after the first steps, on every rank.

Each rank partitions a small GPT (calibrated by default; argument "auto": schedule="auto", so the
candidates are planned again, which gathers every weight on rank 0 and drops them again), gives the
step watch a fake clock (rank r's steps (r + 1) x 5 ms apart, each ending 1 ms before the next starts, so
the slowest rank's 9 ms inside train_step counts, and its 1 ms between steps is added to the pipe's prediction),
and trains 12 steps beside the plain model trained alike. Checks, per rank: losses and weights equal
the plain model's, every rank updated its plan to the same prediction, the measured step is the
slowest rank's. Prints 'RESULT ... ok=True|False'.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

from models import GPT, GPTConfig  # noqa: E402

from partitioner import partition  # noqa: E402
from partitioner.calibrate.decide import hook_of  # noqa: E402
from tests.zoo import rel  # noqa: E402

STEPS = 12


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def main() -> int:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=64, width=32, heads=2, layers=2, seq=8))
    reference = copy.deepcopy(model)
    x, y = torch.randint(0, 64, (8, 8)), torch.randint(0, 64, (8, 8))
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    auto = {"schedule": "auto"} if MODE == "auto" else {}
    pipe = partition(model, ["cpu"] * dist.get_world_size(), example_inputs=(x,), micro_batches=2, **auto)
    watch = hook_of(pipe).watch
    assert watch is not None
    # each step's start, then its end 1 ms before the next one starts (the loop's optimizer step)
    ticks = iter([t for k in range(STEPS + 1) for t in (k * (rank + 1) * 5e-3, ((k + 1) * (rank + 1) * 5 - 1) * 1e-3)])
    watch.clock = lambda: next(ticks)
    before = pipe.plan.predicted_step_ms
    opt = torch.optim.SGD([p for p in model.parameters() if p.numel()], lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    loss_err = 0.0
    for _ in range(STEPS):
        opt.zero_grad()
        ref_opt.zero_grad()
        loss = pipe.train_step(x, y, loss_fn)
        ref_loss = loss_fn(reference(x), y)
        ref_loss.backward()
        if loss is not None:
            loss_err = max(loss_err, rel(loss, ref_loss.detach()))
        opt.step()
        ref_opt.step()
    ref = dict(reference.named_parameters())
    held = pipe.held_tensor_ids()
    weight_err = max(rel(p.detach(), ref[n].detach()) for n, p in model.named_parameters() if id(p) in held)
    report = pipe.calibration_report
    seen: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(seen, (pipe.plan.predicted_step_ms, report.measured_ms))
    same = all(s == seen[0] for s in seen)
    saved = Path(report.path).is_file() if rank == 0 else True
    loop = abs(pipe.plan.predicted_step_ms - report.predicted_after_ms - 1.0) < 1e-6
    ok = (same and saved and abs(report.measured_ms - 9.0) < 1e-9 and loop and pipe.plan.predicted_step_ms != before
          and loss_err < 1e-5 and weight_err < 1e-4 and not pipe.tracing and watch.done)
    print(f"RESULT rank={rank} mode={MODE} predicted={pipe.plan.predicted_step_ms:.2f} (was {before:.2f}) "
          f"measured={report.measured_ms} same={same} saved={saved} loss_err={loss_err:.1e} "
          f"weight_err={weight_err:.1e} ok={ok}", flush=True)
    dist.destroy_process_group()
    return 0 if ok else 1


MODE = sys.argv[1] if len(sys.argv) > 1 else "plain"  # or "auto"

if __name__ == "__main__":
    sys.exit(main())
