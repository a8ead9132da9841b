"""Planning time and plan quality: synthetic graphs, and five models against equal-layer and parameter splits.

Tracing and costing are excluded from the synthetic timings' graph building: the graph
arrives annotated, the cost model has fixed rates (deterministic). Prints, in one run:
  - `plan_pipeline` on a 2,000-node graph into 8 stages (median of 5; target < 1 s);
  - graph analysis (fork/join regions, critical path, cheapest cuts) of a graph of about
    10,000 vertices in nested branches (median of 3; target < 5 s);
  - the hybrid planner on a 10,000-node graph into 8 stages, no replicas (target < 2 s),
    and onto 64 devices (8 hosts x 8, NVLink inside, network between) with replication
    (target < 10 s); both include asking the cost model about every node;
  - for 5 models on 2, 4 and 8 equal devices, the predicted step of our plan (stages,
    replicas, micro-batches, schedule) over an equal-layer split (torch.distributed.pipelining
    and DeepSpeed `uniform`: equal numbers of the model's repeated blocks per stage, or
    equal compute-node counts where it has none) and over a parameter-count split (DeepSpeed
    `parameters`: equal parameter bytes per stage). Baselines run one stage per device and
    get their best micro-batch count and schedule under the same cost model.
Usage: python benchmarks/planner.py [--nodes 2000] [--stages 8] [--big 10000] [--devices 64]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, TypeVar

import networkx as nx
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # examples/ and tests/ (the model zoo)

from cost_model.analytic import AnalyticCostModel  # noqa: E402
from cost_model.cluster import DeviceSet  # noqa: E402
from cost_model.devices import DeviceSpec  # noqa: E402
from examples.models import GPT, GPTConfig  # noqa: E402
from partitioner.capture.analysis import critical_path, cut_points  # noqa: E402
from partitioner.capture.graph import build_graph, compute_nodes  # noqa: E402
from partitioner.capture.regions import fork_join_regions, iter_regions  # noqa: E402
from partitioner.capture.trace import trace  # noqa: E402
from partitioner.place.chain import SplitProblem, plan_pipeline, solve  # noqa: E402
from partitioner.place.devices.problem import device_problem  # noqa: E402
from partitioner.place.devices.search import evaluate, solve_devices  # noqa: E402
from partitioner.place.replicated import plan_hybrid  # noqa: E402
from partitioner.place.search.problem import SearchProblem  # noqa: E402
from partitioner.place.search.space import SearchSpace  # noqa: E402
from tests import zoo  # noqa: E402
from tests.graphs import fork_join_graph  # noqa: E402

T = TypeVar("T")


def synthetic_graph(nodes: int, seed: int = 0) -> tuple[nx.DiGraph, list[str]]:
    """A transformer-like chain: every node feeds the next, every 8th also skips 8 ahead."""
    rng = np.random.default_rng(seed)
    g = nx.DiGraph()
    g.add_node("x", name="x", op="placeholder", out_bytes=1 << 20)
    order = [f"n{i}" for i in range(nodes)]
    for i, name in enumerate(order):
        g.add_node(name, name=name, op="call_function", flops=int(rng.integers(1e6, 1e9)),
                   out_bytes=int(rng.integers(1 << 16, 1 << 22)), param_bytes=int(rng.integers(0, 1 << 20)))
        g.add_edge(order[i - 1] if i else "x", name)
        if i >= 8 and i % 8 == 0:
            g.add_edge(order[i - 8], name)
    g.add_node("output", name="output", op="output", out_bytes=0)
    g.add_edge(order[-1], "output")
    return g, order


def time_analysis(vertices: int) -> None:
    """Regions, critical path (unit node times) and the 3 cheapest cuts of a fork_join_graph, together."""
    graph = fork_join_graph(vertices // 9)

    def analyse() -> None:
        list(iter_regions(fork_join_regions(graph)))
        critical_path(graph, lambda name: 1.0)
        cut_points(graph, [n for n, op in graph.nodes(data="op") if op == "call_function"], k=3)

    seconds, _ = timed(analyse, 3)
    print(f"analysis: regions, critical path and cuts of {graph.number_of_nodes()} vertices: median {seconds:.3f} s; "
          "target < 5 s")


def cluster(devices: int, hosts_of: int = 0) -> AnalyticCostModel:
    """`devices` fixed-rate GPUs (16 GiB); with hosts_of, NVLink inside each group of that many, network between."""
    spec = {"flops_per_s": 2e13, "bytes_per_s": 1.5e12, "op_overhead_s": 5e-6, "memory_bytes": "16GiB"}
    links = [{"between": [f"cuda:{i}", f"cuda:{j}"], "kind": "nvlink"}
             for i in range(devices) for j in range(i + 1, devices) if hosts_of and i // hosts_of == j // hosts_of]
    return AnalyticCostModel(DeviceSet.from_dict({
        "devices": {f"cuda:{i}": dict(spec) for i in range(devices)}, "links": links,
        "default_link": "network" if hosts_of else "pcie",
    }))


def timed(fn: Callable[[], T], repeats: int) -> tuple[float, T]:
    """Median seconds of `repeats` calls, and the last call's result."""
    times = []
    for _ in range(max(1, repeats) - 1):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    start = time.perf_counter()
    out = fn()
    times.append(time.perf_counter() - start)
    return statistics.median(times), out


MODELS: dict[str, tuple[Callable[[], tuple[torch.nn.Module, torch.Tensor]], str]] = {
    "mlp (width 1024, 12 layers)": (lambda: (zoo.MLP(1024, 12), torch.randn(64, 1024)), ""),
    "rescnn (64 ch, 8 blocks, 32x32)": (lambda: (zoo.ResCNN(64, 8), torch.randn(32, 3, 32, 32)), "blocks"),
    "gpt (tied, 8 layers, width 256)": (
        lambda: (GPT(GPTConfig(vocab=512, width=256, layers=8, seq=64)), torch.randint(0, 512, (16, 64))), "blocks"),
    "gpt untied, vocab 16000": (
        lambda: (GPT(GPTConfig(vocab=16000, width=256, layers=8, seq=64, tied=False)),
                 torch.randint(0, 16000, (16, 64))),
        "blocks"),
    "inception (32 ch, 32x32)": (lambda: (zoo.Inception(32, 32), torch.randn(32, 32, 32, 32)), ""),
}


def equal_layer_bounds(graph: nx.DiGraph, order: list[str], blocks: str, parts: int) -> list[int]:
    """Equal numbers of `blocks.<i>` per stage (what comes before or after goes to the end stages), else equal
    node counts."""
    index = {}
    for pos, name in enumerate(order):
        path = str(graph.nodes[name].get("module", ""))
        if blocks and path.startswith(blocks + "."):
            index.setdefault(int(path.split(".")[1]), pos)
    if len(index) >= parts:
        firsts = [index[k] for k in sorted(index)]
        return [0] + [firsts[len(firsts) * s // parts] for s in range(1, parts)] + [len(order)]
    return [round(len(order) * s / parts) for s in range(parts + 1)]


def parameter_bounds(problem: SearchProblem, parts: int) -> list[int]:
    """Contiguous stages whose largest parameter bytes is smallest (exact bottleneck split)."""
    none = np.zeros((parts, 2))
    weights = np.tile(problem.param_bytes + 1.0, (parts, 1))
    split = SplitProblem(weights, np.zeros(0, dtype=np.int64), [], np.zeros(0), none, none)
    return solve(split)[0]


def best_baseline(problem: SearchProblem, bounds: list[int], ms: list[int]) -> float:
    """Smallest predicted step of a split with one stage per device, over micro-batch counts and schedules."""
    steps = []
    for m in ms:
        for schedule in ("gpipe", "1f1b"):
            step, _, memory = evaluate(problem, bounds, [1] * (len(bounds) - 1), m, schedule)
            if all(x <= c for x, c in zip(memory, problem.capacity)):
                steps.append(step)
    return min(steps, default=math.inf)


def compare_models() -> None:
    ratios_layer, ratios_param = [], []
    print(f"\n{'model':<32} {'D':>2} {'equal-layer split':<18} {'our plan: replicas, m, schedule':<34} "
          f"{'ours ms':>8} {'layer ms':>9} {'x layer':>8} {'param ms':>9} {'x param':>8}")
    for name, (build, blocks) in MODELS.items():
        torch.manual_seed(0)
        model, x = build()
        traced = trace(model, (x,), {})
        graph = build_graph(traced.graph_module, traced.flatten_inputs((x,), {}))
        order = [n.name for n in compute_nodes(traced.graph_module)]
        for devices in (2, 4, 8):
            names = [f"cuda:{i}" for i in range(devices)]
            problem = device_problem(graph, order, names, cluster(devices))
            ms = [m for m in (1, 2, 4, 8, 16, 32) if m <= (problem.batch or 1)]
            ours = solve_devices(problem, ms)
            layer = best_baseline(problem, equal_layer_bounds(graph, order, blocks, devices), ms)
            param = best_baseline(problem, parameter_bounds(problem, devices), ms)
            ratios_layer.append(layer / ours.step_s)
            ratios_param.append(param / ours.step_s)
            how = f"{ours.replicas}, m={ours.micro_batches}, {ours.schedule}"
            kind = f"{blocks}.* blocks" if blocks else "equal node counts"
            print(f"{name:<32} {devices:>2} {kind:<18} {how:<34} {ours.step_s * 1e3:>8.3f} {layer * 1e3:>9.3f} "
                  f"{ratios_layer[-1]:>7.2f}x {param * 1e3:>9.3f} {ratios_param[-1]:>7.2f}x")
    geo = lambda xs: math.exp(sum(math.log(v) for v in xs) / len(xs))  # noqa: E731
    print(f"geomean predicted speedup vs parameter-count split: {geo(ratios_param):.3f}")
    print(f"geomean predicted speedup vs equal-layer split: {geo(ratios_layer):.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=2000)
    parser.add_argument("--stages", type=int, default=8)
    parser.add_argument("--big", type=int, default=10000)
    parser.add_argument("--devices", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(min(4, torch.get_num_threads()))

    graph, order = synthetic_graph(args.nodes)
    spec = DeviceSpec("fixed", 1e12, 1e11, 5e-6, 16 << 30)
    cost = AnalyticCostModel(measure=lambda d: spec)
    cpus = [torch.device("cpu")] * args.stages
    seconds, plan = timed(lambda: plan_pipeline(graph, order, cpus, cost, micro_batches=8), 5)
    spread = max(s.predicted_ms for s in plan.stages) / min(s.predicted_ms for s in plan.stages)
    print(f"planned {args.nodes} nodes into {args.stages} stages: median {seconds:.3f} s; target < 1 s; "
          f"slowest/fastest stage {spread:.3f}")
    time_analysis(args.big)

    big, big_order = synthetic_graph(args.big)
    names = [f"cuda:{i}" for i in range(args.stages)]
    seconds, plan = timed(
        lambda: plan_hybrid(big, big_order, names, cluster(args.stages), space=SearchSpace(micro_batches=8),
                            replicate=False), 3)
    print(f"hybrid: planned {args.big} nodes into {args.stages} stages (no replicas, m=8): median {seconds:.3f} s; "
          f"target < 2 s; predicted step {plan.predicted_step_ms:.1f} ms")
    names = [f"cuda:{i}" for i in range(args.devices)]
    seconds, plan = timed(lambda: plan_hybrid(big, big_order, names, cluster(args.devices, hosts_of=8)), 3)
    p = plan
    print(f"hybrid: planned {args.big} nodes onto {args.devices} devices with replication (m and schedule chosen too): "
          f"median {seconds:.3f} s; target < 10 s; chose {len(p.stages)} stages x replicas "
          f"{[len(s.ranks) for s in p.stages]}, m={p.micro_batches}, {p.schedule}")
    compare_models()


if __name__ == "__main__":
    main()
