"""Overhead of the one-process pipeline: the plain model vs. the same model partitioned onto one device.

Both run forward + backward on the same batch, alternating step by step so machine noise hits
both alike; the figure is the median of the paired ratios (pipeline step / plain step). The plain
model is the partitioned model itself, run directly: the same parameters in the same memory
(`--copy-baseline` times a deep copy instead, which carries a placement difference of its own). For
micro-batches 1, 4 and 16 it prints the per-sample times, the ratio to the plain model, and the
ratio to the plain model run over the same micro-batches one by one (what micro-batching costs
by itself, apart from what the runtime adds). Rounds repeat the whole measurement; the spread is
the lowest and highest round.

`--compare PATH ...` measures other checkouts of this project in the same run (say, a worktree of
an older commit): each runs this script's measurement in its own process with PYTHONPATH=PATH, and
the rounds take turns, so every figure has its baseline from the same minutes. The last line is

    one-process overhead at micro_batches=1: X% (rounds A% to B%; target <= 3%)

Usage: python benchmarks/overhead.py [--device cpu|cuda:0] [--repeats 50] [--rounds 5] [--compare PATH ...]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from partitioner import partition  # under --serve, the checkout first on PYTHONPATH

HERE = Path(__file__).resolve()


@dataclass
class Row:
    """One round at one micro-batch count: median step seconds, and the median of paired ratios."""

    plain: float
    chunked: float
    pipe: float
    ratio: float
    ratio_chunked: float


def make_model(width: int, depth: int) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU(), nn.LayerNorm(width)]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def _timed(device: torch.device, step: Callable[[], None]) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def setup(args: argparse.Namespace) -> Callable[[], dict[int, Row]]:
    """Build the models and pipelines once; returns a function that measures one round."""
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    x = torch.randn(args.batch, args.width, device=device)
    runs = []
    for m in args.micro_batches:
        model = make_model(args.width, args.depth).to(device)
        # The baseline is the model itself: the pipeline runs its very parameters, so both read the same
        # memory (a deep copy's weights land elsewhere and ran 2-3% slower than the original's here).
        plain = copy.deepcopy(model) if args.copy_baseline else model
        pipe = partition(model, [device] * args.stages, example_inputs=(x,), micro_batches=m)
        runs.append((m, plain, model, pipe))

    def step(net: nn.Module) -> Callable[[], None]:
        return lambda: net(x).square().mean().backward()

    def chunked(net: nn.Module, m: int) -> Callable[[], None]:
        def run() -> None:
            for part in torch.tensor_split(x, m):
                (net(part).square().sum() / x.shape[0] / 10).backward()
        return run

    def one_round() -> dict[int, Row]:
        rows = {}
        for m, plain, model, pipe in runs:
            for _ in range(5):  # warm up both
                _timed(device, step(plain)), _timed(device, step(pipe))
            t_plain, t_pipe, t_chunk = [], [], []
            for r in range(args.repeats):  # alternate the order so drift hits both alike
                first, second = (plain, pipe) if r % 2 else (pipe, plain)
                a, b = _timed(device, step(first)), _timed(device, step(second))
                t_plain.append(a if first is plain else b)
                t_pipe.append(b if first is plain else a)
                t_chunk.append(_timed(device, chunked(plain, m)))
                plain.zero_grad(set_to_none=True)
                model.zero_grad(set_to_none=True)
            rows[m] = Row(statistics.median(t_plain), statistics.median(t_chunk), statistics.median(t_pipe),
                          statistics.median(p / a for p, a in zip(t_pipe, t_plain)),
                          statistics.median(p / c for p, c in zip(t_pipe, t_chunk)))
        return rows

    return one_round


class Remote:
    """This script's measurement in another process, with another checkout first on PYTHONPATH."""

    def __init__(self, path: Path, argv: list[str]) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(path), os.environ.get("PYTHONPATH", "")]))
        self.log = tempfile.TemporaryFile("w+")  # its progress bars and errors, shown if it fails
        self.proc = subprocess.Popen([sys.executable, str(HERE), "--serve", *argv], cwd=path, env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log)

    def __call__(self) -> dict[int, Row]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("round\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            self.log.seek(0)
            raise RuntimeError(f"the measurement {self.proc.args} stopped (exit code {code}):\n"
                               f"{self.log.read()[-3000:]}")
        return {int(m): Row(**row) for m, row in json.loads(line).items()}

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait()


def serve(args: argparse.Namespace) -> None:
    """Measure a round for every line on stdin; print each as one line of JSON."""
    one_round = setup(args)
    for _ in sys.stdin:
        print(json.dumps({m: asdict(row) for m, row in one_round().items()}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=50, help="steps of each model per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--copy-baseline", action="store_true",
                        help="time a deep copy of the model as the baseline (as this benchmark did before)")
    parser.add_argument("--compare", nargs="*", default=[], type=Path, metavar="PATH",
                        help="other checkouts of this project to measure in the same run")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args)
        return
    argv = [f"--{k}={getattr(args, k)}" for k in ("device", "stages", "batch", "width", "depth", "repeats", "threads")]
    argv += ["--micro-batches", *map(str, args.micro_batches)] + (["--copy-baseline"] if args.copy_baseline else [])
    names = ["this checkout"] + [str(p) for p in args.compare]
    measures: list[Callable[[], dict[int, Row]]]
    if args.compare:  # every checkout in its own process, this one too, so all start alike
        measures = [Remote(HERE.parents[1], argv)] + [Remote(p.resolve(), argv) for p in args.compare]
    else:
        measures = [setup(args)]
    print(f"device {args.device}, torch {torch.__version__}, {args.threads or torch.get_num_threads()} threads; "
          f"MLP width {args.width} depth {args.depth}, batch {args.batch}, {args.stages} stages on one device; "
          f"{args.rounds} rounds of {args.repeats} steps each, code bases taking turns", flush=True)
    results: list[list[dict[int, Row]]] = [[] for _ in measures]
    failed: set[int] = set()
    for r in range(args.rounds):
        for k in range(len(measures)):  # rotate who goes first
            j = (k + r) % len(measures)
            if j in failed:
                continue
            try:
                results[j].append(measures[j]())
            except RuntimeError as exc:
                if j == 0:
                    raise
                print(f"{names[j]} left out: {exc}", flush=True)  # an older checkout that cannot run here
                failed.add(j)
        m0 = args.micro_batches[0]
        print(f"round {r + 1}/{args.rounds}, overhead at micro_batches={m0}: " + ", ".join(
            f"{name} {(res[-1][m0].ratio - 1) * 100:.1f}%" for name, res in zip(names, results) if res), flush=True)
    for j, m in enumerate(measures):
        if isinstance(m, Remote) and j not in failed:
            m.close()
    print(f"\n{'code':<24} {'micro_batches':>13} {'plain us/sample':>15} {'plain, same micro-batches':>25} "
          f"{'pipeline us/sample':>18} {'added ms/step':>13} {'pipeline/plain (rounds)':>27} "
          f"{'pipeline/same micro-batches':>27}")
    for name, rounds in zip(names, results):
        for m in args.micro_batches if rounds else ():
            rows = [r[m] for r in rounds]
            med = {f: statistics.median(getattr(r, f) for r in rows) for f in Row.__dataclass_fields__}
            ratios = [r.ratio for r in rows]
            us = {f: med[f] / args.batch * 1e6 for f in ("plain", "chunked", "pipe")}
            print(f"{name:<24} {m:>13} {us['plain']:>15.2f} {us['chunked']:>25.2f} {us['pipe']:>18.2f} "
                  f"{(med['pipe'] - med['plain']) * 1e3:>13.3f} {med['ratio']:>10.3f} "
                  f"({min(ratios):.3f}-{max(ratios):.3f}) {med['ratio_chunked']:>27.3f}")
    if 1 not in args.micro_batches:
        return
    ours = [r[1].ratio for r in results[0]]
    print(f"\none-process overhead at micro_batches=1: {(statistics.median(ours) - 1) * 100:.1f}% "
          f"(rounds {(min(ours) - 1) * 100:.1f}% to {(max(ours) - 1) * 100:.1f}%; target <= 3%)")


if __name__ == "__main__":
    main()
