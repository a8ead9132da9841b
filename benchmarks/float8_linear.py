"""Float8 linear layers priced against torchao's measured float8-over-bf16 speedups on one H100.

Each row is one linear layer, an M x K input and a K x N weight, forward and backward, compiled, as torchao's own
benchmarks ran it: the speedup measured, and the analytic model's (bf16 product time over FP8 product time plus
the recipe's casts, cost_model/float8_casts.py), at gpus.json's H100 rates, nothing fitted to these rows; beside
it the model without the casts (FP8 products alone), what the published-run benchmark priced before them.

    rowwise      pytorch/ao#2185 (2025-05-08): bench_linear_float8.py --compile, fast accumulation, Llama 2 70B's
                 four linear shapes at tensor degree 8 and M = 16,384 (ref_time_sec / pt_fp8_time_sec)
    tensorwise   torchao/float8/README.md at 0cf1281a38bd, "Performance": Example 1 (small shapes, 0.80) and
                 Example 2 (large shapes, 1.39), from its float8_roofline.py benchmarked sweep

Usage: python benchmarks/float8_linear.py
Last line: `float8 linears: median error N% (worst W%) over 6 measured speedups; without the casts median C%`.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cost_model.analytic import AnalyticCostModel  # noqa: E402
from cost_model.cluster_shape import Cluster  # noqa: E402
from partitioner.arguments import cluster_devices  # noqa: E402

# (recipe, layer, (M, K, N), measured speedup)
MEASURED = (
    ("rowwise", "attn.wqkv", (16384, 8192, 1280), 1.111733),
    ("rowwise", "attn.w0", (16384, 1024, 8192), 1.426141),
    ("rowwise", "ffn.w13", (16384, 8192, 7168), 1.729502),
    ("rowwise", "ffn.w2", (16384, 3584, 8192), 1.711090),
    ("tensorwise", "example 1", (1024, 2048, 1024), 0.80),
    ("tensorwise", "example 2", (4096, 8192, 16384), 1.39),
)


def linear(m: int, k: int, n: int) -> dict[str, object]:
    """A bf16 linear layer's node as the graph records it (output shape, forward FLOPs, bytes)."""
    return {"name": "linear", "op": "call_function", "target": "linear", "flops": 2.0 * m * k * n,
            "shapes": [(m, n)], "dtypes": ["bfloat16"], "out_bytes": 2.0 * m * n, "param_bytes": 2.0 * k * n}


def main() -> None:
    specs = cluster_devices(Cluster.parse("1x1xH100"))[2]
    device = torch.device("cuda", 0)
    bf16 = AnalyticCostModel(specs)
    bare = AnalyticCostModel(specs, matmul="float8_e4m3fn")
    errors, bare_errors = [], []
    print(f"{'recipe':<11} {'layer':<10} {'M, K, N':<20} {'measured':>8} {'predicted':>9} {'ratio':>6} "
          f"{'no casts':>8} {'ratio':>6}")
    for recipe, layer, (m, k, n), measured in MEASURED:
        cast = AnalyticCostModel(specs, matmul="float8_e4m3fn", float8=recipe)
        node = linear(m, k, n)
        base = bf16.node_time(node, device)
        predicted, without = base / cast.node_time(node, device), base / bare.node_time(node, device)
        errors.append(abs(predicted / measured - 1))
        bare_errors.append(abs(without / measured - 1))
        print(f"{recipe:<11} {layer:<10} {f'{m}, {k}, {n}':<20} {measured:8.2f} {predicted:9.2f} "
              f"{predicted / measured:6.2f} {without:8.2f} {without / measured:6.2f}")
    print(f"float8 linears: median error {statistics.median(errors):.0%} (worst {max(errors):.0%}) over "
          f"{len(errors)} measured speedups; without the casts median {statistics.median(bare_errors):.0%}")


if __name__ == "__main__":
    main()
