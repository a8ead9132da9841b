"""Synchronous or asynchronous updates? A small GPT trained five ways on a learnable synthetic language.

The data are sentences of a fixed random Markov chain (each token is followed by one of a few
likely tokens), so the loss has a known floor: the chain's entropy rate. Every run starts from
the same weights and sees the same batches, under torchrun on 3 ranks:
  pipeline, 3 stages, 1F1B:  update="sync" (flush every step), "2bw" (PipeDream-2BW: no flush,
                             gradients applied one step late) and "stash" (PipeDream: the
                             stage updates after every micro-batch, each backward on the
                             weights its forward used);
  hybrid, stage 0 on 2 ranks + stage 1 on 1:  staleness 0 (synchronous all-reduce), 1 and 2
                             (the update of step t uses the all-reduced gradients of step t - s).
Prints, per run, the loss after N steps beside synchronous and samples/s; writes the loss
against step and against wall time to a PNG (and the curves to JSON).
Usage: torchrun --standalone --nproc_per_node=3 examples/async_updates.py [--steps 150] [--out docs/async_updates.png]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import GPT, GPTConfig  # noqa: E402

from partitioner import partition  # noqa: E402

RUNS: list[tuple[str, dict[str, Any]]] = [
    ("sync", {"update": "sync"}),
    ("2bw", {"update": "2bw"}),
    ("stash", {"update": "stash"}),
    ("staleness 0", {"replicas": [2, 1], "staleness": 0}),
    ("staleness 1", {"replicas": [2, 1], "staleness": 1}),
    ("staleness 2", {"replicas": [2, 1], "staleness": 2}),
]


class MarkovLanguage:
    """A fixed random Markov chain over `vocab` tokens, `branching` likely successors per token."""

    def __init__(self, vocab: int, branching: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        logits = torch.full((vocab, vocab), -6.0)
        for i in range(vocab):
            nxt = torch.randperm(vocab, generator=g)[:branching]
            logits[i, nxt] = torch.randn(branching, generator=g) + 2.0
        self.p = logits.softmax(-1)
        pi = torch.full((vocab,), 1.0 / vocab)
        for _ in range(500):  # the stationary distribution, by power iteration
            pi = pi @ self.p
        self.entropy_rate = float(-(pi[:, None] * self.p * self.p.log()).sum())

    def batch(self, size: int, seq: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.empty(size, seq + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, self.p.shape[0], (size,), generator=g)
        for t in range(seq):
            tokens[:, t + 1] = torch.multinomial(self.p[tokens[:, t]], 1, generator=g).squeeze(1)
        return tokens[:, :-1], tokens[:, 1:]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def train(name: str, options: dict[str, Any], model: GPT, batches: list[Any],
          args: argparse.Namespace) -> dict[str, Any]:
    """One run; on the last stage's rank: its losses by batch, and the wall time when each was known."""
    model = copy.deepcopy(model)
    update = options.get("update", "sync")
    pipe = partition(model, ["cpu"] * 3, example_inputs=(batches[0][0],), micro_batches=args.micro_batches,
                     schedule="1f1b", **options)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    losses: list[float] = []
    seconds: list[float] = []
    dist.barrier()
    start = time.perf_counter()
    for x, y in batches:
        if update == "sync":
            loss = pipe.train_step(x, y, loss_fn)
            optimizer.step()
            optimizer.zero_grad()
        else:  # the runtime steps the optimizer; the loss returned is the previous batch's
            loss = pipe.train_step(x, y, loss_fn, optimizer=optimizer)
        if loss is not None:
            losses.append(float(loss))
            seconds.append(time.perf_counter() - start)
    if update != "sync":
        loss = pipe.flush()
        if loss is not None:
            losses.append(float(loss))
            seconds.append(time.perf_counter() - start)
    if options.get("staleness"):
        pipe.wait_gradients(drop=True)
    dist.barrier()
    elapsed = time.perf_counter() - start
    return {"name": name, "loss": losses, "seconds": seconds, "samples_per_s": len(batches) * args.batch / elapsed}


def tail(losses: list[float], k: int = 10) -> float:
    return sum(losses[-k:]) / len(losses[-k:])


def reached(run: dict[str, Any], target: float, k: int = 5) -> tuple[int, float] | None:
    """The first (step, seconds) at which the mean of the last k losses is at or below `target`."""
    for i in range(k - 1, len(run["loss"])):
        if sum(run["loss"][i - k + 1 : i + 1]) / k <= target:
            return i + 1, run["seconds"][i]
    return None


def plot(runs: list[dict[str, Any]], floor: float, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for r in runs:
        style = "-" if r["name"] in ("sync", "2bw", "stash") else "--"
        axes[0].plot(range(1, len(r["loss"]) + 1), r["loss"], style, label=r["name"], lw=1.2)
        axes[1].plot(r["seconds"], r["loss"], style, label=r["name"], lw=1.2)
    for ax, xlabel in zip(axes, ("step", "wall time (s)")):
        ax.axhline(floor, color="#888", lw=0.8, ls=":")
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("training loss")
    axes[0].set_title("loss against step", loc="left", fontsize=10)
    axes[1].set_title("loss against wall time (3 CPU ranks)", loc="left", fontsize=10)
    axes[1].legend(fontsize=8, title="solid: 3-stage pipeline; dashed: [2,1] replicas", title_fontsize=7.5)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=96)
    parser.add_argument("--runs", default=",".join(name for name, _ in RUNS), help="comma-separated run names")
    parser.add_argument("--out", default="async_updates.png", help="the plot (.png); the curves go beside it as .json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if int(os.environ.get("WORLD_SIZE", "1")) != 3:
        print("run under torchrun with 3 ranks: torchrun --standalone --nproc_per_node=3 examples/async_updates.py")
        return 2
    dist.init_process_group("gloo")
    wanted = [name.strip() for name in args.runs.split(",")]
    unknown = sorted(set(wanted) - {name for name, _ in RUNS})
    if unknown:
        raise SystemExit(f"--runs names {unknown}; choose from {[name for name, _ in RUNS]}")
    language = MarkovLanguage(vocab=64, branching=3, seed=0)
    cfg = GPTConfig(vocab=64, width=args.width, heads=4, layers=args.layers, seq=32, tied=False)  # 2bw, stash: untied
    torch.manual_seed(0)
    model = GPT(cfg)
    g = torch.Generator().manual_seed(1)
    batches = [language.batch(args.batch, cfg.seq, g) for _ in range(args.steps)]
    runs = [train(name, options, model, batches, args) for name, options in RUNS if name in wanted]
    if dist.get_rank() == 2:  # the last stage's rank in every run: it holds the losses
        floor = language.entropy_rate
        base = {r["name"]: r for r in runs}
        with torch.no_grad():  # batch 0 runs on the initial weights in every run but stash (an update per micro-batch)
            plain = float(loss_fn(model(batches[0][0]), batches[0][1]))
        for r in runs:
            if r["name"] != "stash":
                assert abs(r["loss"][0] - plain) <= 1e-5 * plain, (r["name"], r["loss"][0], plain)
        print(f"first batch's loss {plain:.6f} in one process, the same in every run but stash")
        target = 1.25 * floor
        print(f"{args.steps} steps of {args.batch} sequences, Adam lr {args.lr}; loss floor (entropy rate) {floor:.3f}")
        print(f"{'run':<12} {'loss (last 10)':>14} {'vs sync':>8} {'samples/s':>10} {'vs sync':>8}   "
              f"reaches {target:.3f} (1.25 x floor): step, seconds, seconds vs sync")
        worst = 0.0
        for r in runs:
            sync = base.get("staleness 0" if r["name"].startswith("staleness") else "sync", r)
            worst = max(worst, abs(tail(r["loss"]) / tail(sync["loss"]) - 1))
            loss_ratio = tail(r["loss"]) / tail(sync["loss"])
            speed_ratio = r["samples_per_s"] / sync["samples_per_s"]
            hit, hit_sync = reached(r, target), reached(sync, target)
            when = f"{hit[0]:>4} {hit[1]:>7.1f} s" if hit else f"{'never':>4} {'-':>9}"
            if hit and hit_sync:
                when += f" {hit[1] / hit_sync[1]:>6.2f}x"
            print(f"{r['name']:<12} {tail(r['loss']):>14.4f} {loss_ratio:>7.3f}x {r['samples_per_s']:>10.1f} "
                  f"{speed_ratio:>7.2f}x   {when}")
        out = Path(args.out)
        plot(runs, floor, out)
        out.with_suffix(".json").write_text(json.dumps({"floor": floor, "steps": args.steps, "runs": runs}))
        print(f"wrote {out} and {out.with_suffix('.json')}")
        print(f"worst final loss vs synchronous: {100 * worst:.1f}% (staleness runs against staleness 0)")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
