"""What calibrating by default costs a training loop: the step watch's steps against the same pipe without it.

One process, a small GPT (4 blocks, width 128, batch 16 in 4 micro-batches) on 2 cpu stages. Each
round builds two pipelines of one model's copies, one calibrated by default (its refit saved to a file
of the round's own) and one with partition(calibrate=0), and runs 30 training steps of each, step by
step in turn (so machine noise hits both alike). By phase, the median over rounds of the per-step
ratio watched / plain:

    timed     steps 2 .. 7: the watch takes the start time only
    traced    steps 8 .. 10: those steps are traced
    refit     step 11: the fit, the save and the prediction run as it starts (ms added, once)
    after     steps 12 .. 30: the watch is gone

Last line: 'step watch: timed steps +A%, traced steps +B%, the refit once +C ms, later steps +D%'
Usage: python benchmarks/fidelity_watch_cost.py [--rounds 5] [--schedule 1f1b]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))
from models import GPT, GPTConfig  # noqa: E402

from partitioner import partition  # noqa: E402

STEPS = 30
PHASES = {"timed": range(2, 8), "traced": range(8, 11), "refit": range(11, 12), "after": range(12, STEPS + 1)}


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def one_round(schedule: str, folder: Path, k: int) -> dict[str, list[tuple[float, float]]]:
    """(watched ms, plain ms) of each step, by phase."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=2000, width=128, heads=4, layers=4, seq=32)
    model = GPT(cfg)
    twin = copy.deepcopy(model)
    x, y = torch.randint(0, cfg.vocab, (16, cfg.seq)), torch.randint(0, cfg.vocab, (16, cfg.seq))
    watched = partition(model, ["cpu", "cpu"], example_inputs=(x,), micro_batches=4, schedule=schedule,
                        calibration=str(folder / f"round{k}.json"))
    plain = partition(twin, ["cpu", "cpu"], example_inputs=(x,), micro_batches=4, schedule=schedule, calibrate=0)
    opts = {id(watched): torch.optim.SGD(model.parameters(), lr=1e-3),
            id(plain): torch.optim.SGD(twin.parameters(), lr=1e-3)}

    def step(pipe: object) -> float:
        opt = opts[id(pipe)]
        start = time.perf_counter()
        opt.zero_grad()
        pipe.train_step(x, y, loss_fn)  # type: ignore[attr-defined]
        opt.step()
        return (time.perf_counter() - start) * 1e3

    times = []
    for s in range(1, STEPS + 1):
        if s % 2:
            a = step(watched)
            b = step(plain)
        else:
            b = step(plain)
            a = step(watched)
        times.append((s, a, b))
    return {phase: [(a, b) for s, a, b in times if s in steps] for phase, steps in PHASES.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--schedule", default="1f1b")
    args = parser.parse_args()
    torch.set_num_threads(1)
    ratios: dict[str, list[float]] = {p: [] for p in PHASES}
    added: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.rounds):
            got = one_round(args.schedule, Path(tmp), k)
            for phase, pairs in got.items():
                ratios[phase].append(statistics.median(a / b for a, b in pairs))
            added.append(got["refit"][0][0] - got["refit"][0][1])
            print(f"round {k + 1}: " + ", ".join(f"{p} {ratios[p][-1]:.3f}" for p in PHASES)
                  + f"; refit step +{added[-1]:.1f} ms", flush=True)
    med = {p: statistics.median(v) for p, v in ratios.items()}
    print(f"step watch: timed steps {med['timed'] - 1:+.1%}, traced steps {med['traced'] - 1:+.1%}, "
          f"the refit once {statistics.median(added):+.1f} ms, later steps {med['after'] - 1:+.1%} "
          f"(medians over {args.rounds} rounds of watched / plain per step)")


if __name__ == "__main__":
    main()
