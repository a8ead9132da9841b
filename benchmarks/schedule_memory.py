"""Peak activation memory of one-process 1F1B vs GPipe: what the one execution core buys in one process.

A GPT (examples/models.py) split into p stages on one device trains one step with
`pipe.train_step` under each schedule. Every tensor autograd saves for backward is counted
while it is alive (torch.autograd.graph.saved_tensors_hooks; a storage counted once), per
stage, and the peak is printed beside the plain model's full-batch peak. GPipe keeps every
micro-batch's activations until the backwards start; 1F1B keeps at most p - s on stage s.
Gradients are checked equal between the two schedules. Last line:
`peak activation memory, 1f1b vs gpipe at m=8: X (expected about Y)`.

Usage: python benchmarks/schedule_memory.py [--stages 4] [--micro-batches 8]
"""

from __future__ import annotations

import argparse
import copy
import sys
import threading
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cost_model.analytic import AnalyticCostModel  # noqa: E402
from examples.models import GPT, GPTConfig  # noqa: E402
from partitioner import partition  # noqa: E402


class SavedBytes:
    """Bytes of tensors saved for backward and still alive; the peak since `reset`."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.live: dict[int, int] = {}  # storage pointer -> bytes
        self.refs: dict[int, int] = {}
        self.now = self.peak = 0

    def reset(self) -> None:
        self.live.clear()
        self.refs.clear()
        self.now = self.peak = 0

    def pack(self, t: torch.Tensor) -> Any:
        key = t.untyped_storage().data_ptr()
        with self.lock:
            self.refs[key] = self.refs.get(key, 0) + 1
            if key not in self.live:
                self.live[key] = t.untyped_storage().nbytes()
                self.now += self.live[key]
                self.peak = max(self.peak, self.now)
        return _Held(self, key, t)

    def release(self, key: int) -> None:
        with self.lock:
            self.refs[key] -= 1
            if self.refs[key] == 0:
                self.now -= self.live.pop(key)
                del self.refs[key]


class _Held:
    def __init__(self, counter: SavedBytes, key: int, t: torch.Tensor) -> None:
        self.counter, self.key, self.t = counter, key, t

    def __del__(self) -> None:
        self.counter.release(self.key)


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=256, width=128, heads=4, layers=8, seq=64)
    base = GPT(cfg)
    x = torch.randint(0, cfg.vocab, (args.batch, cfg.seq))
    y = torch.randint(0, cfg.vocab, (args.batch, cfg.seq))
    counter = SavedBytes()
    hooks = torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda held: held.t)

    plain = copy.deepcopy(base)
    with hooks:
        loss_fn(plain(x), y).backward()
    plain_peak = counter.peak
    peaks, grads = {}, {}
    for schedule in ("gpipe", "1f1b"):
        model = copy.deepcopy(base)
        pipe = partition(model, ["cpu"] * args.stages, example_inputs=(x,), micro_batches=args.micro_batches,
                         schedule=schedule,
                         threads=False, cost_model=AnalyticCostModel())
        counter.reset()
        with hooks:  # one thread: the hooks see every stage
            pipe.train_step(x, y, loss_fn)
        peaks[schedule] = counter.peak
        grads[schedule] = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    worst = max(float((a - b).norm() / b.norm().clamp_min(1e-12)) for a, b in zip(grads["1f1b"], grads["gpipe"]))
    p, m = args.stages, args.micro_batches
    expected = sum(min(p - s, m) for s in range(p)) / (p * m)  # micro-batches in flight, over GPipe's m per stage
    print(f"GPT {cfg.layers} blocks, width {cfg.width}, batch {args.batch} x {cfg.seq} tokens, "
          f"{p} stages on cpu, m={m}")
    print(f"{'run':<22} {'peak saved MiB':>15} {'vs plain model':>15}")
    print(f"{'plain model':<22} {plain_peak / 2**20:>15.2f} {1.0:>15.2f}")
    for schedule, peak in peaks.items():
        print(f"{'pipeline ' + schedule:<22} {peak / 2**20:>15.2f} {peak / plain_peak:>15.2f}")
    print(f"gradients 1f1b vs gpipe: max relative difference {worst:.1e}")
    print(f"peak activation memory, 1f1b vs gpipe at m={m}: {peaks['1f1b'] / peaks['gpipe']:.2f} "
          f"(expected about {expected:.2f})")


if __name__ == "__main__":
    main()
