"""Planning at any scale: a GPT-3-shaped model (175B, on `meta`) onto 8 .. 16,384 H100s, and a 10,000-node graph.

For each cluster (hosts x 8 H100, bf16, global batch 1536 sequences of 2048 tokens: the
GPT-3 paper's batch, divisible by every power of two up to 512), prints the plan time and the
plan the cluster search (partitioner/place/cluster/search.py) chooses with every axis searched:
tensor degree (the model's split groups, partitioner.capture.shardable), stages, replicas and their
sharding (mixed precision: fp32 master weights, gradients and Adam moments), micro-batches, schedule,
recomputation (searched with none first, then full), rank placement, memory per GPU, predicted step
(simulated), samples/s and MFU. Clusters that cannot hold the weights print the InfeasibleError,
which names the memory per GPU needed.

Plan time = node times at each micro-batch size + each tensor degree's split problem + the search +
building the Plan (assemble and simulate); the model is traced and its split groups found once
(printed apart, not included). The 10,000-node synthetic graph
of benchmarks/planner.py onto 64 and 128 GPUs (8 per host) is planned by today's device-list
search (devices/search.py; 128 GPUs only with --slow: over a minute) and by the count search, each with
its objective. Timings on a busy 2-core machine: medians of --repeat runs, interleaved.

Usage: python benchmarks/scale.py [--sizes 8,64,128,1024,4096,16384] [--repeat 1] [--slow]
Last line: `plan time: X s at 1024 GPUs, Y s at 16384 GPUs`.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # examples/ and benchmarks/

from benchmarks.planner import synthetic_graph  # noqa: E402
from cost_model.analytic import AnalyticCostModel  # noqa: E402
from cost_model.cluster_shape import Cluster  # noqa: E402
from cost_model.precision import MIXED  # noqa: E402
from examples.models import GPT, GPTConfig  # noqa: E402
from partitioner.arguments import cluster_devices  # noqa: E402
from partitioner.capture.graph import build_graph, compute_nodes  # noqa: E402
from partitioner.capture.meta import shapes_only  # noqa: E402
from partitioner.capture.shardable import Shardable, find_shardable  # noqa: E402
from partitioner.capture.trace import trace  # noqa: E402
from partitioner.place.cluster.candidate import fill  # noqa: E402
from partitioner.place.cluster.plan import plan_on_cluster  # noqa: E402
from partitioner.place.cluster.prepare import cluster_problem  # noqa: E402
from partitioner.place.cluster.search import search_cluster  # noqa: E402
from partitioner.place.devices.problem import device_problem  # noqa: E402
from partitioner.place.devices.search import solve_devices  # noqa: E402
from partitioner.place.search.infeasible import InfeasibleError  # noqa: E402
from partitioner.place.search.space import SearchSpace  # noqa: E402
from runtime.plan import human_bytes  # noqa: E402

GPT3 = GPTConfig(vocab=50257, width=12288, heads=96, layers=96, seq=2048)
BATCH = 1536


def gpt3_graph() -> tuple[object, list[str], Shardable, float]:
    """The GPT-3-shaped model on meta in bf16, traced and annotated for the global batch, its split groups;
    seconds taken."""
    start = time.perf_counter()
    with torch.device("meta"):
        model = GPT(GPT3).to(torch.bfloat16)
    tokens = torch.zeros(BATCH, GPT3.seq, dtype=torch.long, device="meta")
    with shapes_only(model) as swaps:
        traced = trace(model, (tokens,), {})
        swaps.add(model, [traced.graph_module])
        graph = build_graph(traced.graph_module, [tokens])
        shardable = find_shardable(traced.graph_module, graph)
    order = [n.name for n in compute_nodes(traced.graph_module)]
    return graph, order, shardable, time.perf_counter() - start


def forward_flops(graph: object) -> float:
    return float(sum(a.get("flops") or 0 for _, a in graph.nodes(data=True)))  # type: ignore[attr-defined]


def plan_gpt3(graph: object, order: list[str], shardable: Shardable, gpus: int) -> tuple[float, str]:
    """Plan time and a one-line description of the plan (or of why none fits)."""
    cluster = Cluster.parse(f"{gpus // 8}x8xH100")
    cost = AnalyticCostModel(cluster_devices(cluster)[2])
    start = time.perf_counter()
    try:
        plan, found = plan_on_cluster(graph, order, cluster, cost, space=SearchSpace(recompute="auto", precision=MIXED),
                                      shardable=shardable)
    except InfeasibleError as exc:
        needs = re.search(r"At least (.*? GiB per GPU) is needed (\(.*?\))", str(exc))
        return time.perf_counter() - start, f"InfeasibleError: needs {needs.group(1)} {needs.group(2)}" if needs \
            else f"InfeasibleError: {exc}"
    seconds = time.perf_counter() - start
    step_s = plan.predicted_step_ms / 1e3
    mfu = 3 * forward_flops(graph) / (step_s * gpus * cluster.gpu.peak("bf16"))
    memory = max(s.memory_bytes for s in plan.stages)
    hosts = {plan.host_of(r) for r in plan.stages[0].all_ranks}
    line = (f"{found.stages} stages x {found.replicas} replicas x tensor {found.tensor}, sharding {found.sharding}, "
            f"{found.micro_batches} micro-batches of {BATCH / found.micro_batches:g}, {plan.schedule}, recompute "
            f"{plan.stages[0].recompute}, {found.order} "
            f"(stage 0 on {len(hosts)} hosts), "
            f"memory/GPU {human_bytes(memory)}, step {plan.predicted_step_ms / 1e3:.2f} s (objective "
            f"{found.step_s:.2f} s), {BATCH / step_s:.1f} samples/s, MFU {mfu:.1%}; "
            f"{found.searched} configurations priced, {found.pruned} pruned")
    return seconds, line


def synthetic(gpus: int, slow: bool) -> None:
    """benchmarks/planner.py's 10,000-node case on gpus (8 per host): today's search and the count search."""
    graph, order = synthetic_graph(10_000)
    cluster = Cluster.parse(f"{gpus // 8}x8xH100")
    cost = AnalyticCostModel(cluster_devices(cluster)[2])
    devices = [torch.device(f"cuda:{r}") for r in range(gpus)]
    start = time.perf_counter()
    problem = cluster_problem(graph, order, devices[0], cost, [1, 2, 4, 8, 16, 32, 64, 128, 256])
    found = search_cluster(problem, cluster, micro_batches=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    new_s = time.perf_counter() - start
    line = f"count search {new_s:.2f} s, objective {found.step_s * 1e3:.3f} ms ({found.stages}x{found.replicas})"
    if gpus <= 64 or slow:
        start = time.perf_counter()
        old = solve_devices(device_problem(graph, order, devices, cost))
        old_s = time.perf_counter() - start
        p, m, d = len(old.replicas), old.micro_batches, max(old.replicas)
        # its (m + p - 1) / m fill as the count search counts it (d pipelines of m / d), so both are one objective
        same = old.step_s / ((m + p - 1) / m) * fill(m, p, d) if len(set(old.replicas)) == 1 else float("nan")
        line = (f"device-list search {old_s:.2f} s, objective {same * 1e3:.3f} ms ({p} stages, replicas "
                f"{sorted(set(old.replicas))}); {line}; time ratio {old_s / new_s:.1f}x, objective ratio "
                f"{found.step_s / same:.4f}")
    else:
        line += "; device-list search skipped (over a minute; --slow runs it)"
    print(f"10,000 nodes on {gpus} GPUs: {line}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="8,64,128,1024,4096,16384")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--slow", action="store_true")
    args = parser.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    graph, order, shardable, traced_s = gpt3_graph()
    print(f"GPT-3 shape (96 layers, hidden 12288, 96 heads, seq 2048, vocab 50257) on meta, bf16: {len(order)} "
          f"compute nodes, {len(shardable.groups)} split groups, traced and annotated once in {traced_s:.1f} s (not in "
          f"the plan times); global batch {BATCH}, mixed precision, every axis searched")
    times: dict[int, list[float]] = {g: [] for g in sizes}
    lines: dict[int, str] = {}
    for _ in range(args.repeat):  # interleaved rounds: a busy moment spreads over every size
        for gpus in sizes:
            seconds, lines[gpus] = plan_gpt3(graph, order, shardable, gpus)
            times[gpus].append(seconds)
    for gpus in sizes:
        print(f"{gpus:>6} GPUs ({gpus // 8} hosts x 8 H100): plan {statistics.median(times[gpus]):.2f} s: "
              f"{lines[gpus]}", flush=True)
    for gpus in (64, 128):
        synthetic(gpus, args.slow)
    at = {g: statistics.median(t) for g, t in times.items()}
    print(f"with the one tracing included: {at.get(1024, float('nan')) + traced_s:.1f} s at 1024 GPUs, "
          f"{at.get(16384, float('nan')) + traced_s:.1f} s at 16384 GPUs; the last line excludes it")
    print(f"plan time: {at.get(1024, float('nan')):.1f} s at 1024 GPUs, {at.get(16384, float('nan')):.1f} s at "
          "16384 GPUs")


if __name__ == "__main__":
    main()
