"""What a predicted step on a cluster means: samples and tokens per second, model FLOPs and MFU.

    samples/s = global batch / predicted step             tokens/s = samples/s x sequence (token-id inputs)
    MFU       = 3 x forward FLOPs of the global batch / (step s x GPUs x the table's dense peak at the
                precision products run in: the plan's precision (bf16 under "mixed", whatever the
                model's dtype; FP8 where it says so), else --dtype)

Forward FLOPs are the plan graph's (torch's FlopCounterMode per node, one micro-batch) times the
micro-batches; forward + backward counts as 3 x forward, without recomputation (model FLOPs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cost_model.cluster_shape import Cluster
from cost_model.gpu_table import precision_of
from cost_model.precision import Precision
from partitioner.cli.inputs import Example
from runtime.plan import Plan

__all__ = ["Throughput", "product_precision", "throughput"]


@dataclass(frozen=True)
class Throughput:
    """What one predicted step means: samples and tokens per second, model FLOPs and MFU."""

    step_ms: float
    samples_per_s: float
    tokens_per_s: float | None  # None: the input is not token ids
    flops_per_step: float  # 3 x forward FLOPs of the global batch
    peak_flops: float  # per GPU, dense, at `peak_precision`
    mfu: float
    peak_precision: str  # the precision products run in (`product_precision`)


def product_precision(plan: Plan, dtype: str) -> str:
    """The precision the plan's products run in, whose peak MFU divides by: its precision's product dtype (a mixed
    plan of an fp32 model runs them in bf16), else `dtype` (--dtype, or the model's)."""
    if not plan.precision:
        return dtype
    key = precision_of((given := Precision.from_dict(plan.precision)).matmul or given.compute)
    return dtype if key == "fp32" and precision_of(dtype) == "tf32" else key  # fp32 products on the TF32 peak


def throughput(plan: Plan, example: Example, cluster: Cluster, dtype: str) -> Throughput:
    """The plan's step as samples/s, tokens/s and MFU (module docstring)."""
    nodes = (plan.graph or {}).get("nodes", [])
    forward = float(sum(n.get("flops") or 0 for n in nodes)) * plan.pieces  # the graph is one micro-batch's
    step_s = plan.predicted_step_ms / 1e3
    first = example.args[0] if example.args else None
    tokens = None
    if isinstance(first, torch.Tensor) and first.dim() == 2 and not first.is_floating_point():
        tokens = example.batch * int(first.shape[1]) / step_s
    products = product_precision(plan, dtype)
    peak = cluster.gpu.peak(products)
    return Throughput(plan.predicted_step_ms, example.batch / step_s, tokens, 3 * forward, peak,
                      3 * forward / (step_s * cluster.size * peak), products)
