"""Worker for tests/test_cluster_search.py: run a saved cluster plan under torchrun (CPU, gloo).

    cluster_worker.py PLAN.json   every rank runs `partition(model, ["cpu"] * world, plan=PLAN.json)` for
                                  tests.zoo's tiny_gpt, trains one step, and compares its loss and gradients
                                  with the plain model; it also checks it runs exactly the stages the plan's
                                  rank map gives its rank. Prints 'RESULT ... ok=True|False'.
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from partitioner import partition  # noqa: E402
from runtime.plan import Plan  # noqa: E402
from tests.dist_worker import data, lm_loss  # noqa: E402
from tests.zoo import rel  # noqa: E402


def main() -> int:
    path = sys.argv[1]
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    expected = Plan.from_json(Path(path).read_text())
    model, x, y = data("tiny_gpt")
    reference = copy.deepcopy(model)
    pipe = partition(model, ["cpu"] * world, example_inputs=(x,), plan=path)
    loss = pipe.train_step(x, y, lm_loss)
    ref_loss = lm_loss(reference(x), y)
    ref_loss.backward()
    held = pipe.held_tensor_ids()
    ref = dict(reference.named_parameters())
    worst = max((rel(p.grad, ref[n].grad) for n, p in model.named_parameters() if id(p) in held), default=0.0)
    loss_err = rel(loss, ref_loss.detach()) if loss is not None else 0.0
    mine = sorted(s.index for s in expected.stages if rank in s.ranks)
    runs = sorted(s.index for s in pipe.plan.stages if rank in s.ranks)
    ok = worst < 1e-5 and loss_err < 1e-5 and mine == runs == sorted(s.index for s in pipe.stages)
    print(f"RESULT rank={rank} stages={runs} grad_err={worst:.2e} loss_err={loss_err:.2e} ok={ok}", flush=True)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
