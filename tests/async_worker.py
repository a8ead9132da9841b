"""Worker for tests/test_async_updates.py under torchrun: asynchronous updates over the P2P transport.

For each update rule ("2bw", "stash") every rank (one stage each: 2 or 3 ranks) trains the tiny model K steps with its
stage only, flushes, and compares its weights (and, on the last stage's rank, every returned
loss) with the direct implementation of the rule run in this process (the one-process
pipeline equals it too: tests/test_async_updates.py). Prints 'RESULT ... ok=...' lines.
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from partitioner import partition  # noqa: E402
from tests.test_async_updates import OPTIMIZERS, M, Tiny, data, reference_2bw, reference_stash  # noqa: E402
from tests.zoo import rel  # noqa: E402


def main() -> int:
    bad = 0
    batches = data()
    for update in ("2bw", "stash"):
        torch.manual_seed(0)
        model = Tiny(int(os.environ["WORLD_SIZE"]))
        ref = copy.deepcopy(model)
        pipe = partition(model, ["cpu"] * model.stages, example_inputs=(batches[0][0],), micro_batches=M,
                         schedule="1f1b", update=update)  # type: ignore[arg-type]
        opt = OPTIMIZERS["adam"](list(model.parameters()))
        returned = [pipe.train_step(x, y, F.mse_loss, optimizer=opt) for x, y in batches]
        last = pipe.flush()
        expected = (reference_2bw if update == "2bw" else reference_stash)(
            ref, OPTIMIZERS["adam"](list(ref.parameters())), batches)
        held = pipe.held_tensor_ids()
        weight_err = max(rel(p, q) for p, q in zip(model.parameters(), ref.parameters()) if id(p) in held)
        losses = [*returned[1:], last]
        last_stage = dist.get_rank() == pipe.plan.stages[-1].ranks[0]
        loss_err = max(rel(a, b) for a, b in zip(losses, expected)) if last_stage else 0.0
        ok = weight_err < 1e-5 and loss_err < 1e-5 and returned[0] is None
        ok = ok and (last_stage or all(v is None for v in losses))
        bad += not ok
        print(f"RESULT case={update} rank={dist.get_rank()} weight_err={weight_err:.2e} loss_err={loss_err:.2e} "
              f"ok={ok}", flush=True)
    dist.destroy_process_group()
    return bad


if __name__ == "__main__":
    sys.exit(main())
