"""Worker for tests/test_staleness.py, run under torchrun: bounded staleness against a direct implementation.

    python -m torch.distributed.run --nproc_per_node=3 tests/staleness_worker.py STALENESS [STALENESS ...]

For each staleness s it partitions tiny_gpt over 3 ranks with replicas [2, 1], trains a few steps on
changing batches with SGD (momentum) and checks this rank's weights against the un-partitioned model
trained by the rule itself: a weight held by several ranks is updated at step t with the full-batch
gradient of step t - s (none in the first s steps), every other weight with that of step t.
Prints one 'RESULT ... ok=...' line per staleness and rank.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from partitioner import partition  # noqa: E402
from tests import zoo  # noqa: E402
from tests.dist_worker import lm_loss  # noqa: E402
from tests.zoo import rel  # noqa: E402

STEPS = 5


def batches(vocab: int, like: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, vocab, like.shape, generator=g), torch.randint(0, vocab, like.shape, generator=g))
            for _ in range(STEPS)]


def reference_run(model: torch.nn.Module, data: list[tuple[torch.Tensor, torch.Tensor]], stale: set[str],
                  s: int) -> None:
    """The rule, directly: the un-partitioned model, the same optimizer, gradients of step t - s for `stale`."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    history: list[dict[str, torch.Tensor]] = []
    for t, (x, y) in enumerate(data):
        opt.zero_grad()
        lm_loss(model(x), y).backward()
        history.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        for n, p in model.named_parameters():
            if n in stale:
                p.grad = history[t - s][n].clone() if t >= s else None
        opt.step()


def run(s: int) -> bool:
    torch.manual_seed(0)
    model, (x,), _ = zoo.tiny_gpt()
    x = torch.cat([x, x[:1]])
    reference = copy.deepcopy(model)
    vocab = int(model(x).shape[-1])
    data = batches(vocab, x)
    pipe = partition(model, ["cpu"] * 3, example_inputs=(x,), micro_batches=4, schedule="1f1b", replicas=[2, 1],
                     staleness=s, timeout=120)
    names = {id(p): n for n, p in model.named_parameters()}
    mine = {names[id(p)] for g in pipe._groups for p in g.params}
    everyone: list[set[str]] = [set()] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    stale = set().union(*everyone)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for bx, by in data:
        opt.zero_grad()
        pipe.train_step(bx, by, lm_loss)
        opt.step()
    pipe.wait_gradients()  # nothing in flight before the job ends
    reference_run(reference, data, stale, s)
    held = pipe.held_tensor_ids()
    ref = dict(reference.named_parameters())
    worst = max(rel(p.detach(), ref[n].detach()) for n, p in model.named_parameters() if id(p) in held)
    start = zoo.tiny_gpt()[0].parameters()  # the weights before training (seed 0)
    moved = max(rel(p.detach(), q.detach()) for p, q in zip(model.parameters(), start) if id(p) in held)
    ok = worst < 1e-5 and pipe.staleness == s and bool(stale) and moved > 1e-3
    print(f"RESULT staleness={s} rank={dist.get_rank()} stale_weights={len(stale)} err={worst:.2e} ok={ok}",
          flush=True)
    return ok


def main() -> int:
    bad = sum(not run(int(s)) for s in sys.argv[1:])
    dist.destroy_process_group()
    return int(bad > 0)


if __name__ == "__main__":
    sys.exit(main())
