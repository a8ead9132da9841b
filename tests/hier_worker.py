"""Worker for tests/test_hier_allreduce.py: run under torchrun on 4 gloo ranks ('2 hosts x 2 GPUs').

Modes:
  collective  runtime.hier_allreduce over several groups and host layouts, each result checked
              against the sum of every rank's tensor computed here from the seeds (no collective)
  train       a one-stage plan with 4 replicas and plan.gpus_per_host=2 (the hierarchical all-reduce)
              trains like the plain model on the whole batch: gradients within 1e-5; then with
              staleness 1 the gradients arrive one step late and still equal the plain model's
  batch JOBS  both, in one launch, as the jobs of tests/batch.py
Prints 'RESULT ... ok=True|False' lines; exits non-zero on any mismatch.
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import partitioner  # noqa: E402
from runtime.comm import TorchComm  # noqa: E402
from runtime.hier_allreduce import algorithm, all_reduce, replica_group  # noqa: E402
from tests.batch import serve  # noqa: E402
from tests.dist_worker import data, lm_loss  # noqa: E402
from tests.zoo import rel  # noqa: E402

# (ranks, gpus_per_host, expected algorithm): every rank runs every case, in this order
CASES = [
    ((0, 1, 2, 3), 2, "hierarchical"),  # 2 hosts x 2
    ((0, 1, 2, 3), 3, "flat"),  # uneven: 3 + 1
    ((0, 1, 2, 3), 0, "flat"),  # no host layout
    ((0, 2), 2, "flat"),  # one rank per host
    ((0, 1), 2, "flat"),  # one host
    ((0, 1, 2, 3), 1, "flat"),  # four hosts of one
]
SIZES = [1, 6, 7, 1001]  # 7 and 1001 are not multiples of 2: padded shards


def collective() -> int:
    rank, bad = dist.get_rank(), 0
    comm = TorchComm()
    for ranks, per_host, expected in CASES:
        group = replica_group(ranks, gpus_per_host=per_host, flat=dist.new_group(list(ranks)))
        chosen = algorithm(ranks, gpus_per_host=per_host)
        for size in SIZES:
            tensors = {r: torch.randn(size, generator=torch.Generator().manual_seed(100 * r + size)) for r in ranks}
            if rank not in ranks:
                continue
            mine = tensors[rank].clone()
            all_reduce(comm, mine, group).wait(torch.distributed.default_pg_timeout)
            reference = torch.stack([tensors[r] for r in ranks]).sum(0)
            err = rel(mine, reference)
            ok = err < 1e-6 and chosen == expected == group.algorithm
            bad += not ok
            print(f"RESULT case=collective ranks={list(ranks)} gpus_per_host={per_host} size={size} rank={rank} "
                  f"algorithm={chosen} err={err:.1e} ok={ok}", flush=True)
    return bad


def train() -> int:
    world = int(os.environ["WORLD_SIZE"])
    model, x, y = data("tiny_gpt")
    reference = copy.deepcopy(model)
    plan = partitioner.plan(model, ["cpu"] * world, example_inputs=(x,), micro_batches=4, schedule="1f1b",
                            replicas=[world])
    plan.gpus_per_host = 2
    plan.programs = []  # lowered again by the runtime, with the same groups
    pipe = partitioner.partition(model, ["cpu"] * world, example_inputs=(x,), plan=plan)
    kinds = sorted({g.group.algorithm for g in pipe._groups})
    bad = 0
    for step in range(2):
        model.zero_grad()
        reference.zero_grad()
        pipe.train_step(x, y, lm_loss)
        lm_loss(reference(x), y).backward()
        ref = dict(reference.named_parameters())
        worst = max(rel(p.grad, ref[n].grad) for n, p in model.named_parameters() if p.grad is not None)
        ok = worst < 1e-5 and kinds == ["hierarchical"]
        bad += not ok
        print(f"RESULT case=train step={step} rank={dist.get_rank()} algorithms={kinds} grad_err={worst:.2e} "
              f"ok={ok}", flush=True)
        with torch.no_grad():  # the same update on both, so step 1 starts from new weights
            for (_, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
                p -= 0.1 * p.grad
                q -= 0.1 * q.grad
    # bounded staleness 1 (runtime.staleness): step t's hierarchical all-reduce is waited for at step t + 1;
    # with the weights held still, the second step's gradients are the first's sums: the plain model's
    pipe.staleness = 1
    model.zero_grad()
    reference.zero_grad()
    lm_loss(reference(x), y).backward()
    ref = dict(reference.named_parameters())
    pipe.train_step(x, y, lm_loss)
    warm = [p.grad is None for p in model.parameters()]  # warm-up: nothing reduced yet
    pipe.train_step(x, y, lm_loss)
    late = max(rel(p.grad, ref[n].grad) for n, p in model.named_parameters())
    ok = all(warm) and late < 1e-5
    bad += not ok
    print(f"RESULT case=stale rank={dist.get_rank()} warm_up_without_grad={all(warm)} grad_err={late:.2e} ok={ok}",
          flush=True)
    pipe.wait_gradients()
    return bad


def main() -> int:
    mode = sys.argv[1]
    if mode == "collective":
        dist.init_process_group("gloo")
        code = collective()
    elif mode == "batch":
        dist.init_process_group("gloo")  # train's partition() takes the group started here
        code = serve(sys.argv[2], {"collective": collective, "train": train}, dist.get_rank())
    else:
        code = train()  # partition() starts the process group
    dist.destroy_process_group()
    return 1 if code else 0


if __name__ == "__main__":
    sys.exit(main())
