"""Largest batch that trains under a per-stage memory cap, with and without recomputation; predicted vs measured peaks.

A GPT (examples/models.py; untied head, so each stage owns its weights) is cut into 2 stages
on ["cpu", "cpu"] and trains with 1F1B in one process (the one execution core, one thread),
with Adam: forward, backward and `optimizer.step()`. The batch is split into a fixed number
of micro-batches (`--micro-batches`, default 4), so a larger batch means larger micro-batches
and more activations per stage. For each recomputation mode (none, selective, full) the batch
search starts where the plan predicts the cap is reached, then walks by one row per micro-batch
until the measured peaks say where the cap lies (see `largest_under`). A
stage's peak is measured by runtime.memory_meter.MemoryMeter (live tensor storage per stage)
over one steady-state step (an unmetered first step made Adam's state).

The cut is pinned (`--cut K`: the stages meet before block K, halfway by default, with
PiPPy's `split_spec`), so the running pipeline and the plans that predict its peaks at every
batch compare the same stages. Left to the cost model, the cut moved with the batch (a
larger batch weighs activations more against weights and per-op overheads, priced from rates
measured on the machine), and on some machines batch 132 was cut elsewhere than the running
pipeline.

On CPU the cap is a measured budget, not an allocator limit: nothing stops a step from going
over it; a batch is "under the cap" when every stage's measured peak is. The planner's
prediction (`plan.stages[s].memory_bytes`: parameters, gradients, Adam's two states,
activations of the micro-batches in flight, received values, outputs held, and the worst moment
of one micro-batch's backward: recomputation and gradients, cost_model/memory.py) is
printed beside the measurement, as is what `recompute="auto"` picks when the device set tells
the planner the cap (two stages on one device: the device holds twice the cap).

Last line: `largest batch under cap: X x vs none; peak memory error: Y%`, X = the largest batch
with full recomputation over the largest without, Y = the worst |predicted - measured| /
measured over stages and modes at each mode's largest batch.

Usage: python benchmarks/memory.py [--cap-mib 48] [--micro-batches 4] [--layers 8] [--cut K]
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.distributed.pipelining import SplitPoint

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cost_model.analytic import AnalyticCostModel  # noqa: E402
from cost_model.devices import DeviceSpec  # noqa: E402
from examples.models import GPT, GPTConfig  # noqa: E402
from partitioner import partition, plan  # noqa: E402
from runtime.memory_meter import MemoryMeter  # noqa: E402

MODES = ("none", "selective", "full")
MIB = 1 << 20


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def cost_model(capacity: int | None = None) -> AnalyticCostModel:
    """The analytic cost model; with `capacity`, a CPU device of that many bytes (for recompute="auto")."""
    if capacity is None:
        return AnalyticCostModel()
    spec = DeviceSpec(name="cpu-capped", flops_per_s=1e11, bytes_per_s=2e10, op_overhead_s=5e-6, memory_bytes=capacity)
    return AnalyticCostModel(measure=lambda d: spec)


def pinned(cut: int) -> dict[str, SplitPoint]:
    """The one cut every plan here makes: the second stage starts at block `cut`."""
    return {f"blocks.{cut}": SplitPoint.BEGINNING}


class Trainer:
    """One mode's pipeline over a copy of the model; `peaks(batch)` measures one training step."""

    def __init__(self, base: GPT, cfg: GPTConfig, mode: str, micro_batches: int, cut: int) -> None:
        self.cfg, self.mode, self.m, self.cut = cfg, mode, micro_batches, cut
        self.model = copy.deepcopy(base)
        x = self.batch(4 * micro_batches)[0]
        self.pipe = partition(self.model, ["cpu", "cpu"], example_inputs=(x,), micro_batches=micro_batches,
                              schedule="1f1b", threads=False, cost_model=cost_model(), recompute=mode,  # type: ignore[arg-type]
                              split_spec=pinned(cut))  # fmt: skip
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-4)
        self.measured: dict[int, list[int]] = {}

    def batch(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(size)
        x = torch.randint(0, self.cfg.vocab, (size, self.cfg.seq), generator=g)
        return x, torch.randint(0, self.cfg.vocab, (size, self.cfg.seq), generator=g)

    def peaks(self, size: int) -> list[int]:
        """Each stage's measured peak over one training step of batch `size` (after a first step made Adam's state)."""
        if size not in self.measured:
            x, y = self.batch(size)
            if not self.optimizer.state:  # unmetered: Adam's state exists before any measured step (its size is fixed)
                self.step(x, y)
            with MemoryMeter([s.module for s in self.pipe.stages], optimizer=self.optimizer) as meter:
                self.step(x, y)
            self.measured[size] = meter.peaks
        return self.measured[size]

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.optimizer.zero_grad()
        self.pipe.train_step(x, y, loss_fn)
        self.optimizer.step()

    def predicted(self, size: int) -> list[int]:
        x = self.batch(size)[0]
        made = plan(self.model, ["cpu", "cpu"], example_inputs=(x,), micro_batches=self.m, schedule="1f1b",
                    cost_model=cost_model(), recompute=self.mode, split_spec=pinned(self.cut))  # type: ignore[arg-type]
        if [s.nodes for s in made.stages] != [s.nodes for s in self.pipe.plan.stages]:
            raise RuntimeError(f"batch {size} cuts the model elsewhere than the running pipeline, although the cut "
                               f"is pinned before blocks.{self.cut}; the split_spec was not honored")
        return [s.memory_bytes for s in made.stages]


def largest_under(trainer: Trainer, cap: int, step: int) -> int:
    """The largest multiple of `step` whose measured peak stays under `cap` on every stage (0 if none).

    Measuring is slow (the meter watches every operator), so the search starts where the plan predicts
    the cap is reached (per stage, memory is affine in the batch: two plans give each line) and walks
    from there one `step` at a time: the answer is measured to fit, and `step` more measured not to.
    """
    def fits(size: int) -> bool:
        return max(trainer.peaks(size)) <= cap

    small, large = 4 * step, 8 * step
    at_small, at_large = trainer.predicted(small), trainer.predicted(large)
    guess = min(small + (cap - a) * (large - small) // max(1, b - a) for a, b in zip(at_small, at_large))
    size = max(step, guess // step * step)
    if fits(size):
        while fits(size + step):
            size += step
        return size
    while size > step:
        size -= step
        if fits(size):
            return size
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cap-mib", type=float, default=48.0, help="per-stage memory budget, MiB")
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--cut", type=int, help="the second stage starts at this block (default: layers // 2)")
    args = parser.parse_args()
    cut = args.layers // 2 if args.cut is None else args.cut
    if not 0 < cut < args.layers:
        parser.error(f"--cut {cut}: use a block between 1 and {args.layers - 1} (both stages need a block)")
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=256, width=64, heads=4, layers=args.layers, seq=128, tied=False)
    base = GPT(cfg).train()
    cap, m = int(args.cap_mib * MIB), args.micro_batches
    started = time.time()
    print(f"GPT {cfg.layers} blocks, width {cfg.width}, {cfg.heads} heads, {cfg.seq} tokens, vocab {cfg.vocab}; "
          f"2 stages on cpu (cut before block {cut}), 1F1B, {m} micro-batches per batch, Adam; cap "
          f"{args.cap_mib:.0f} MiB per stage (measured, not enforced by an allocator)")
    largest: dict[str, int] = {}
    worst = 0.0
    rows: list[str] = []
    for mode in MODES:
        trainer = Trainer(base, cfg, mode, m, cut)
        largest[mode] = size = largest_under(trainer, cap, m)
        if size == 0:
            raise SystemExit(f"recompute={mode!r}: not even a batch of {m} fits under {args.cap_mib} MiB; "
                             "raise --cap-mib")
        measured, predicted = trainer.peaks(size), trainer.predicted(size)
        for s, (got, want) in enumerate(zip(measured, predicted)):
            error = abs(want - got) / got
            worst = max(worst, error)
            rows.append(f"{mode:<10} {size:>6} {s:>6} {want / MIB:>15.2f} {got / MIB:>15.2f} {100 * error:>8.1f}%")
        tried = ", ".join(f"{b}: {max(p) / MIB:.1f}" for b, p in sorted(trainer.measured.items()))
        print(f"recompute={mode}: largest batch {size} (batch: max stage peak MiB measured: {tried})")
    print(f"{'mode':<10} {'batch':>6} {'stage':>6} {'predicted MiB':>15} {'measured MiB':>15} {'error':>9}")
    print("\n".join(rows))
    auto: list[str] = []
    for size in sorted(set(largest.values())):
        x = torch.randint(0, cfg.vocab, (size, cfg.seq))
        chosen = plan(base, ["cpu", "cpu"], example_inputs=(x,), micro_batches=m, schedule="1f1b",
                      cost_model=cost_model(2 * cap), recompute="auto", split_spec=pinned(cut))
        auto.append(f"batch {size}: {[s.recompute for s in chosen.stages]} "
                    f"(predicted MiB {[round(s.memory_bytes / MIB, 1) for s in chosen.stages]})")
    print("recompute='auto' under the cap picks: " + "; ".join(auto))
    print(f"baseline (no recomputation): largest batch {largest['none']}; with full: {largest['full']}, "
          f"selective: {largest['selective']}; {time.time() - started:.0f} s")
    print(f"largest batch under cap: {largest['full'] / largest['none']:.2f} x vs none; "
          f"peak memory error: {100 * worst:.1f}%")


if __name__ == "__main__":
    main()
