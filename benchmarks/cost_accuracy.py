"""How well the cost model predicts: planned stages timed on the CPU against their predictions.

For four models (an MLP, a residual CNN, a transformer with a large-vocabulary head and a
branchy Inception-style net) split into 2 and 4 stages, each stage's forward plus backward
time per micro-batch is measured and compared with the profiled and the analytic model's
prediction (each on the stages its own plan chose). Then a gloo point-to-point send of 1,
16 and 64 MB between two processes on 127.0.0.1 is timed against the communication model,
whose loopback link was fitted on other sizes. The last line is

    time MAPE: profiled X%, analytic Y%

Run: python benchmarks/cost_accuracy.py [--repeats N] [--no-gloo] [--clock cpu|wall]

Set-up, for steady numbers on a machine shared with other jobs: torch runs on one thread;
stage and node times are the CPU time of that thread (`--clock wall` for wall time), the
median of interleaved rounds; glibc keeps freed memory (`steady_host_allocator`) so layers
do not page-fault at random; profiles go to a temporary cache, so they are taken afresh.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cost_model import AnalyticCostModel, ProfiledCostModel, fit_link, measure_device, measure_gloo_p2p  # noqa: E402
from cost_model.timing import Clock, make_timer, materialize, steady_host_allocator  # noqa: E402
from examples.models import GPT, GPTConfig, InceptionNet  # noqa: E402
from partitioner import partition  # noqa: E402
from partitioner.capture.trace import trace  # noqa: E402
from runtime.microbatch import scatter  # noqa: E402
from tests import zoo  # noqa: E402


@dataclass
class Config:
    """What the benchmark runs; defaults keep the whole run under about three minutes."""

    stage_counts: tuple[int, ...] = (2, 4)
    micro_batches: int = 2
    warmup: int = 2
    repeats: int = 7
    profile_repeats: int = 5
    gloo_sizes_mb: tuple[int, ...] = (1, 16, 64)
    gloo_repeats: int = 15
    threads: int = 1
    clock: Clock = "cpu"  # "cpu": this thread's CPU time, steady on a shared machine; or "wall"


def models() -> dict[str, Callable[[], tuple[nn.Module, torch.Tensor]]]:
    """Name -> factory of (model, one full batch); the batch splits into `micro_batches`."""
    return {
        "mlp": lambda: (zoo.MLP(width=1024, depth=8), torch.randn(64, 1024)),
        "rescnn": lambda: (zoo.ResCNN(channels=48, blocks=4), torch.randn(16, 3, 32, 32)),
        "gpt": lambda: (GPT(GPTConfig(vocab=16384, width=256, heads=4, layers=4, seq=64, tied=False)),
                        torch.randint(0, 16384, (8, 64))),
        "inception": lambda: (InceptionNet(c=64, blocks=3), torch.randn(16, 3, 32, 32)),
    }


# ----------------------------------------------------------------------------- measuring stages
class _StageTimer:
    """One stage on fixed inputs: `run()` times one forward plus backward of one micro-batch."""

    def __init__(self, module: nn.Module, inputs: list[Any], timer: Callable[[], float]) -> None:
        def leaf(x: Any) -> Any:  # gradients flow back into what required them in the model
            if isinstance(x, torch.Tensor):
                return x.detach().requires_grad_(x.requires_grad)
            return x

        self.module = module
        self.timer = timer
        self.args = pytree.tree_map(leaf, inputs)
        self.grads: list[torch.Tensor] | None = None

    def run(self) -> float:
        for a in self.args:
            if isinstance(a, torch.Tensor):
                a.grad = None
        start = self.timer()
        outs = [
            o for o in pytree.tree_leaves(self.module(*self.args)) if isinstance(o, torch.Tensor) and o.requires_grad
        ]
        if self.grads is None:
            self.grads = [torch.randn_like(o) for o in outs]
        torch.autograd.backward(outs, self.grads)
        return self.timer() - start


def _time_stages(timers: list[_StageTimer], warmup: int, repeats: int) -> list[float]:
    """Median seconds per stage, stages interleaved round by round (load bursts hit all alike)."""
    runs: list[list[float]] = [[] for _ in timers]
    for round_ in range(warmup + repeats):
        for i, timer in enumerate(timers):
            t = timer.run()
            if round_ >= warmup:
                runs[i].append(t)
    return [statistics.median(r) for r in runs]


def run_models(cfg: Config, cache_dir: str) -> list[tuple[str, int, int, int, float, float, str]]:
    """Rows (model, stages, stage, nodes, measured ms, predicted ms, which model predicted)."""
    rows = []
    timer = make_timer(torch.device("cpu"), cfg.clock)
    for name, factory in models().items():
        torch.manual_seed(0)
        model, x = factory()
        traced = trace(model, (x,))
        flat = traced.flatten_inputs((x,), {})
        chunk = scatter(flat, cfg.micro_batches)[0]
        analytic = AnalyticCostModel(measure=functools.partial(measure_device, clock=cfg.clock))
        profiled = ProfiledCostModel(
            fallback=analytic, repeats=cfg.profile_repeats, cache_dir=cache_dir, clock=cfg.clock
        )
        profiled.prepare(traced.graph_module, chunk)
        analytic.prepare(traced.graph_module, chunk)  # module classes (Conv2d, MaxPool2d, ...)
        values = materialize(traced.graph_module, chunk)
        plans = []
        timers: dict[tuple[str, ...], _StageTimer] = {}
        for p in cfg.stage_counts:
            for label, cost in (("profiled", profiled), ("analytic", analytic)):
                pipe = partition(
                    model, ["cpu"] * p, example_inputs=(x,), micro_batches=cfg.micro_batches, cost_model=cost
                )
                for stage, plan in zip(pipe.stages, pipe.plan.stages):
                    key = tuple(plan.nodes)
                    if key not in timers:
                        timers[key] = _StageTimer(stage.module, [values[v] for v in stage.inputs], timer)
                    plans.append((p, label, plan, key))
                close = getattr(pipe, "close", None)
                if callable(close):
                    close()
        model.zero_grad(set_to_none=True)
        measured = dict(zip(timers, _time_stages(list(timers.values()), cfg.warmup, cfg.repeats)))
        model.zero_grad(set_to_none=True)
        for p, label, plan, key in plans:
            rows.append((name, p, plan.index, len(plan.nodes), measured[key] * 1e3, plan.predicted_ms, label))
    return rows


def _mape(rows: list[tuple[str, int, int, int, float, float, str]], label: str) -> float:
    errors = [abs(pred - meas) / meas for *_, meas, pred, lab in rows if lab == label]
    return 100.0 * sum(errors) / max(len(errors), 1)


def print_table(rows: list[tuple[str, int, int, int, float, float, str]]) -> None:
    header = (f"{'model':<10} {'stages':>6} {'stage':>5} {'nodes':>5} {'measured ms':>11} {'predicted ms':>12} "
              f"{'error':>7}  cost model")
    print(header)
    print("-" * len(header))
    for name, p, s, n, meas, pred, label in sorted(rows, key=lambda r: (r[6] != "profiled", r[0], r[1], r[2])):
        error = 100 * (pred - meas) / meas
        print(f"{name:<10} {p:>6} {s:>5} {n:>5} {meas:>11.2f} {pred:>12.2f} {error:>+6.1f}%  {label}")


def run_gloo(cfg: Config) -> None:
    fit_sizes = [256 << 10, 2 << 20, 8 << 20, 32 << 20]
    test_sizes = [mb << 20 for mb in cfg.gloo_sizes_mb]
    measured = measure_gloo_p2p(sorted(set(fit_sizes + test_sizes)), repeats=cfg.gloo_repeats)
    link = fit_link({s: measured[s] for s in fit_sizes})
    print(
        f"\ngloo point-to-point, 2 processes on 127.0.0.1 (model: latency {link.latency_s * 1e6:.0f} us + "
        f"bytes / {link.bandwidth / 1e9:.2f} GB/s, fitted on 256 KiB, 2, 8 and 32 MiB sends)"
    )
    print(f"{'size':>6} {'measured ms':>11} {'predicted ms':>12} {'error':>7}")
    for mb, nbytes in zip(cfg.gloo_sizes_mb, test_sizes):
        pred, meas = link.time(nbytes), measured[nbytes]
        print(f"{mb:>3} MB {meas * 1e3:>11.2f} {pred * 1e3:>12.2f} {100 * (pred - meas) / meas:>+6.1f}%")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=Config.repeats, help="timed runs per stage (median kept)")
    parser.add_argument("--no-gloo", action="store_true", help="skip the two-process gloo measurement")
    parser.add_argument("--clock", choices=("cpu", "wall"), default=Config.clock,
                        help="time stages and profiles by this thread's CPU time (steady under load) or wall time")
    args = parser.parse_args(argv)
    cfg = Config(repeats=args.repeats, clock="wall" if args.clock == "wall" else "cpu")
    torch.set_num_threads(cfg.threads)
    steady_host_allocator()
    start = time.perf_counter()
    spec = measure_device(torch.device("cpu"), clock=cfg.clock)
    print(
        f"cpu: matmul {spec.flops_per_s / 1e9:.1f} GFLOP/s, copy {spec.bytes_per_s / 1e9:.1f} GB/s, "
        f"op overhead {spec.op_overhead_s * 1e6:.1f} us (measured once; the analytic model's rates)\n"
    )
    with tempfile.TemporaryDirectory(prefix="cost-accuracy-") as cache_dir:  # profile afresh, not from ~/.cache
        rows = run_models(cfg, cache_dir)
    print_table(rows)
    if not args.no_gloo:
        run_gloo(cfg)
    print(
        f"\n({time.perf_counter() - start:.0f} s; {cfg.threads} torch thread, {cfg.micro_batches} micro-batches, "
        f"{cfg.clock} clock, median of {cfg.repeats} runs per stage)"
    )
    print(f"time MAPE: profiled {_mape(rows, 'profiled'):.1f}%, analytic {_mape(rows, 'analytic'):.1f}%")


if __name__ == "__main__":
    main()
