"""Planning time: split a synthetic 2,000-node graph (skip connections included) into 8 stages.

Tracing and costing are excluded: the graph arrives annotated, the cost model has fixed
rates. Prints the time of `plan_pipeline` (median of 5) against the 1 s target.
Usage: python benchmarks/planner.py [--nodes 2000] [--stages 8]
"""

from __future__ import annotations

import argparse
import statistics
import time

import networkx as nx
import numpy as np
import torch

from cost_model.analytic import AnalyticCostModel
from cost_model.devices import DeviceSpec
from partitioner.planner import plan_pipeline


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=2000)
    parser.add_argument("--stages", type=int, default=8)
    args = parser.parse_args()
    graph, order = synthetic_graph(args.nodes)
    spec = DeviceSpec("fixed", 1e12, 1e11, 5e-6, 16 << 30)
    cost = AnalyticCostModel(measure=lambda d: spec)
    devices = [torch.device("cpu")] * args.stages
    times = []
    for _ in range(5):
        start = time.perf_counter()
        plan = plan_pipeline(graph, order, devices, cost, micro_batches=8)
        times.append(time.perf_counter() - start)
    spread = max(s.predicted_ms for s in plan.stages) / min(s.predicted_ms for s in plan.stages)
    print(f"planned {args.nodes} nodes into {args.stages} stages: median {statistics.median(times):.3f} s "
          f"(min {min(times):.3f}, max {max(times):.3f}); target < 1 s; slowest/fastest stage {spread:.3f}")


if __name__ == "__main__":
    main()
