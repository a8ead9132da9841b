"""Saved-activation memory as the planners predict it, against what autograd saves, and the ResNet-50 case.

Issue 17: the hybrid planner counted every node's output as kept for backward, so an fp32
ResNet-50 at 128 images per GPU was predicted to need far more than the 16 GB V100s that
published data-parallel runs train it on. The planners now count what autograd saves
(cost_model.recompute_cost.saved_bytes_per_node). This prints, for small models on CPU, the bytes
autograd saves (torch.autograd.graph.saved_tensors_hooks, each storage once, weights and inputs
left out) beside the prediction and the old bound, as ratios; then the fp32 ResNet-50 at 128 x 224 x 224
traced on `meta` (no memory, no time), old bound and now, what a V100 16 GB leaves for it, and the
hybrid planner's choice for 1,024 images on 8 V100s with each count. 128 images per GPU is PipeDream's
ResNet-50 batch (its profiler runs `main.py -a resnet50 -b 128`: msr-fiddle/pipedream,
profiler/image_classification/README.md), the data-parallel configuration it trains on 16 GB V100s.
Sizes are bytes, not times: the figures do not depend on a quiet machine.

Usage: python benchmarks/saved_memory.py
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cost_model.cluster_shape import Cluster  # noqa: E402
from cost_model.memory import optimizer_states, saved_activation_bytes, usable_bytes  # noqa: E402
from cost_model.ops import classify  # noqa: E402
from cost_model.recompute_cost import graph_nodes  # noqa: E402
from examples.resnet50 import resnet50  # noqa: E402
from partitioner.capture.meta import shapes_only  # noqa: E402
from partitioner.place.devices.search import solve_devices  # noqa: E402
from tests.test_saved_memory import autograd_saved_bytes, cases, resnet50_on_v100s, traced_graph  # noqa: E402

GIB = float(1 << 30)


def old_bound(nodes: list[dict[str, Any]]) -> int:
    """What the hybrid planner counted before: every output but views and sizes."""
    return sum(int(n.get("out_bytes", 0) or 0) for n in nodes if classify(n) not in ("view", "python"))


def main() -> None:
    torch.manual_seed(0)
    print(f"{'model (CPU, small)':<20} {'autograd B':>12} {'predicted B':>12} {'pred/meas':>10} {'old/meas':>10}")
    worst = 0.0
    for name, build in cases().items():
        model, x = build()
        model.train()
        measured = autograd_saved_bytes(model, x)
        graph, order = traced_graph(model, x)
        nodes = graph_nodes(graph, order)
        now, old = saved_activation_bytes(nodes), old_bound(nodes)
        worst = max(worst, abs(now / measured - 1))
        print(f"{name:<20} {measured:>12} {now:>12} {now / measured:>10.3f} {old / measured:>10.3f}")

    with torch.device("meta"):
        model = resnet50()
    x = torch.empty(128, 3, 224, 224, device="meta")
    with shapes_only(model):
        graph, order = traced_graph(model, x)
    nodes = graph_nodes(graph, order)
    now, old = saved_activation_bytes(nodes, "cuda"), old_bound(nodes)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    weights = (2 + optimizer_states("sgd_momentum")) * params  # weights, gradients, momentum
    v100 = usable_bytes(Cluster.parse("1x1xV100").gpu.memory_bytes, "cuda")  # context and allocator headroom off
    print(f"\nfp32 ResNet-50, 128 images of 224 x 224 (traced on meta): saved activations {now / GIB:.2f} GiB "
          f"(old bound {old / GIB:.2f} GiB, {old / now:.2f}x)")
    print(f"with weights, gradients and momentum ({weights / GIB:.2f} GiB): {(now + weights) / GIB:.2f} GiB of the "
          f"{v100 / GIB:.2f} GiB a 16 GB V100 leaves for tensors (old bound: {(old + weights) / GIB:.2f} GiB): "
          f"PipeDream's data-parallel ResNet-50 at its batch of 128 per GPU "
          f"{'fits' if now + weights <= v100 else 'does NOT fit'}")
    plans()
    print(f"saved activations, fp32 ResNet-50 at 128 images: {now / GIB:.2f} GiB (was {old / GIB:.2f} GiB); "
          f"small models within {worst:.1%} of autograd")


def plans() -> None:
    """The hybrid planner on 8 V100 16 GB (2 hosts x 4) for 1,024 images (128 per GPU), SGD with momentum:
    its choice with saved bytes as autograd saves them, and with the old bound (every output)."""
    counts = [8, 16, 32]
    graph, order, problem = resnet50_on_v100s(counts)
    print(f"\nhybrid planner, ResNet-50 fp32, 1,024 images on 2x4 V100 16 GB (usable {problem.capacity[0] / GIB:.1f} "
          "GiB each), SGD momentum:")
    old = np.array([float(old_bound([n])) for n in graph_nodes(graph, order)])
    for label, saved in (("now", problem.saved_bytes.copy()), ("old bound", old)):
        problem.saved_bytes = saved
        sol = solve_devices(problem, counts)
        print(f"  {label:<10} stages x replicas {sol.replicas}, m={sol.micro_batches} "
              f"({1024 // sol.micro_batches} images per pass), {sol.schedule}, predicted step "
              f"{sol.step_s * 1e3:.1f} ms, {max(sol.memory) / GIB:.2f} GiB per GPU")


if __name__ == "__main__":
    main()
