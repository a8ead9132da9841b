"""Worker for tests/test_schedule_registry.py, run under torchrun: the toy schedule registered there, on 2 ranks.

    python -m torch.distributed.run --nproc_per_node=2 tests/schedule_registry_worker.py

Registers `FIFO` (defined in the test file), partitions tiny_gpt over the ranks with it, trains two
steps and compares this rank's loss and gradients with the plain model's. Prints one
'RESULT ... ok=...' line per rank.
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from partitioner import partition  # noqa: E402
from rules.schedules import register  # noqa: E402
from tests.dist_worker import data, lm_loss  # noqa: E402
from tests.test_schedule_registry import FIFO  # noqa: E402
from tests.zoo import rel  # noqa: E402


def main() -> int:
    register(FIFO)
    model, x, y = data("tiny_gpt")
    reference = copy.deepcopy(model)
    world = int(os.environ["WORLD_SIZE"])
    pipe = partition(model, ["cpu"] * world, example_inputs=(x,), micro_batches=4, schedule="fifo")
    held = pipe.held_tensor_ids()
    worst = loss_err = 0.0
    for _ in range(2):
        model.zero_grad()
        reference.zero_grad()
        loss = pipe.train_step(x, y, lm_loss)
        ref_loss = lm_loss(reference(x), y)
        ref_loss.backward()
        ref = dict(reference.named_parameters())
        worst = max([worst] + [rel(p.grad, ref[n].grad) for n, p in model.named_parameters()  # type: ignore[arg-type]
                               if id(p) in held])
        loss_err = max(loss_err, rel(loss, ref_loss.detach()) if loss is not None else 0.0)
    ok = pipe.plan.schedule == "fifo" and bool(held) and worst < 1e-5 and loss_err < 1e-5
    print(f"RESULT schedule=fifo rank={dist.get_rank()} grad_err={worst:.2e} loss_err={loss_err:.2e} ok={ok}",
          flush=True)
    dist.destroy_process_group()
    return int(not ok)


if __name__ == "__main__":
    sys.exit(main())
