"""Worker for tests/test_weight_grads.py under torchrun: a step's argument checks and the weight-gradient hook.

Every rank: targets of another batch are refused (the check is shared with the one-process pipeline),
a model computing its own weight gradients is refused without the hook, and with it this rank's
gradients equal the plain model's. Prints 'RESULT ... ok=...' per rank; exits non-zero on a mismatch.
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import SplitPoint

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cost_model.analytic import AnalyticCostModel  # noqa: E402
from partitioner import PartitionError, partition  # noqa: E402
from runtime.distributed import DistributedPipeline  # noqa: E402
from tests.test_weight_grads import SelfGradNet, hook  # noqa: E402
from tests.zoo import rel  # noqa: E402


def refused(run: object) -> str:
    try:
        run()  # type: ignore[operator]
    except PartitionError as exc:
        return str(exc)
    return ""


def main() -> int:
    world = int(os.environ["WORLD_SIZE"])
    torch.manual_seed(0)
    model = SelfGradNet()
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    spec = {f"layers.{k}": SplitPoint.BEGINNING for k in range(1, 4)}
    pipe = partition(model, ["cpu"] * world, example_inputs=(x,), micro_batches=4, schedule="1f1b", split_spec=spec,
                     cost_model=AnalyticCostModel())
    targets = refused(lambda: pipe.train_step(x, y[:4], F.mse_loss))
    no_hook = refused(lambda: pipe.train_step(x, y, F.mse_loss))
    model.zero_grad()
    pipe.set_weight_grad_hook(hook)
    pipe.train_step(x, y, F.mse_loss)
    F.mse_loss(reference(x), y).backward()
    reference.compute_dW()
    assert isinstance(pipe, DistributedPipeline)
    held = pipe.held_tensor_ids()
    ref = dict(reference.named_parameters())
    mine = [(p.grad, ref[n].grad) for n, p in model.named_parameters() if id(p) in held]
    worst = max(rel(a, b) if a is not None and b is not None else float("inf") for a, b in mine)
    ok = ("targets have a batch of 4" in targets and "inputs have a batch of 8" in targets
          and "set_weight_grad_hook" in no_hook and worst < 1e-5 and bool(mine))
    print(f"RESULT rank={dist.get_rank()} grad_err={worst:.2e} weights={len(mine)} ok={ok}", flush=True)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
