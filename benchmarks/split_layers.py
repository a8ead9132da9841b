"""Layers split across tensor ranks and replicas sharded (issues 26, 27): the targets planned from models on meta.

(a) A 7B-shaped Llama (transformers LlamaConfig: hidden 4096, 32 layers, 32 heads, vocab 32000; bf16),
    global batch 512 sequences of 2048 on 16x8 H100: the plan of before (states at the model's bf16,
    replicas whole: tensor 1, no sharding) against the search over every axis with mixed precision (fp32
    master weights, gradients and Adam moments counted), and at a global batch of 32 (too few samples
    for 128 replicas) the best tensor degree against t = 1.
(b) GPT-3 175B's shape (examples GPT: 96 layers, hidden 12288, 96 heads, vocab 50257, sequence 2048) on
    1,024 A100-SXM4-80GB, global batch 1536, bf16, through the command line
        python -m partitioner plan benchmarks/split_layers.py:gpt3 --cluster 128x8xA100-SXM4-80GB \\
            --global-batch 1536 --dtype bf16 --replicas auto --schedule 1f1b [--sharding none]
    under SC'21's conditions (--sharding none: no sharded optimizer) and free, its tensor degree and
    predicted throughput beside Megatron-LM's published 140 TFLOP/s per GPU for this
    model, batch and GPU count (Narayanan et al., SC'21), counted both as the CLI counts (model FLOPs: 3 x
    forward) and by the paper's eq. 3 (96 B s l h^2 (1 + s / 6h + V / 16 l h): it counts the forward
    recomputed, which Megatron ran; the plan here recomputes only where memory needs it).
(c) The same model on 1,024 H100 (128x8), mixed precision, recomputation where nothing fits without: the
    sharding chosen and memory per GPU by kind (weights, master, gradients, optimizer, activations).
Prices are the analytic model's (GPU table peaks x 0.7 at the 4096-cube GEMM, efficiency by shape,
fabric bandwidths of the DGX systems), nothing measured here.

Usage: python benchmarks/split_layers.py [--skip-cli]
Last line: `split layers: 7B ... ms (before ... ms), 175B on 1024 A100 unsharded as SC'21: t=... X TFLOP/s per GPU
(published 140; free search t=..., Y), ...`
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # examples/ and benchmarks/

from cost_model.analytic import AnalyticCostModel  # noqa: E402
from cost_model.cluster_shape import Cluster  # noqa: E402
from cost_model.precision import MIXED  # noqa: E402
from examples.models import GPT, GPTConfig  # noqa: E402
from partitioner.arguments import cluster_devices  # noqa: E402
from partitioner.capture.graph import build_graph, compute_nodes  # noqa: E402
from partitioner.capture.meta import shapes_only  # noqa: E402
from partitioner.capture.shardable import find_shardable  # noqa: E402
from partitioner.capture.trace import trace  # noqa: E402
from partitioner.meta import empty_weights  # noqa: E402
from partitioner.place.cluster.plan import plan_on_cluster  # noqa: E402
from partitioner.place.search.graph_costs import per_micro_batch  # noqa: E402
from partitioner.place.search.space import SearchSpace  # noqa: E402
from partitioner.predict.memory_kinds import KINDS, memory_kinds  # noqa: E402
from runtime.plan import human_bytes  # noqa: E402

GPT3 = GPTConfig(vocab=50257, width=12288, heads=96, layers=96, seq=2048)
PUBLISHED_TFLOPS = 140.0  # Megatron-LM, SC'21: GPT-3 175B, t = 8, 1,024 A100, batch 1536


def gpt3(batch: int = 1536) -> tuple[torch.nn.Module, tuple[torch.Tensor]]:
    """The GPT-3 175B shape on meta and a batch of token ids (the command line's MODULE:FACTORY)."""
    with torch.device("meta"):
        model = GPT(GPT3)
    return model, (torch.zeros(batch, GPT3.seq, dtype=torch.long, device="meta"),)


def traced(model: torch.nn.Module, tokens: torch.Tensor) -> tuple[Any, list[str], Any, float]:
    start = time.perf_counter()
    with shapes_only(model) as swaps:
        gm = trace(model, (tokens,), {}).graph_module
        swaps.add(model, [gm])
        graph = build_graph(gm, [tokens])
    return graph, [n.name for n in compute_nodes(gm)], find_shardable(gm, graph), time.perf_counter() - start


def plan(shape: str, graph: Any, order: list[str], shardable: Any, **space: Any) -> tuple[Any, Any, float]:
    cluster = Cluster.parse(shape)
    start = time.perf_counter()
    made, found = plan_on_cluster(graph, order, cluster, AnalyticCostModel(cluster_devices(cluster)[2]),
                                  shardable=shardable, space=SearchSpace(**space))
    return made, found, time.perf_counter() - start


def sharding(found: Any) -> str:
    """The solution's sharding mode, or each stage's where they differ (cluster.space.cheapest_modes)."""
    return found.sharding if len(set(found.modes)) == 1 else "/".join(found.modes)


def describe(made: Any, found: Any, seconds: float) -> str:
    memory = max(s.memory_bytes for s in made.stages)
    return (f"{found.stages} stages x {found.replicas} replicas x tensor {found.tensor}, sharding {sharding(found)}, "
            f"{found.micro_batches} micro-batches, {made.schedule}, recompute {made.stages[0].recompute}: step "
            f"{made.predicted_step_ms:.1f} ms, memory/GPU {human_bytes(memory)} (planned in {seconds:.1f} s)")


def llama_7b() -> tuple[float, float, int]:
    from transformers import LlamaConfig, LlamaForCausalLM  # optional dependency: only this section needs it

    config = LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=2048, use_cache=False)
    with empty_weights():
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    graph, order, shardable, took = traced(model, torch.zeros(512, 2048, dtype=torch.long, device="meta"))
    print(f"(a) 7B Llama on meta, traced in {took:.1f} s; 16x8 H100, global batch 512 x 2048 tokens")
    before, found, s = plan("16x8xH100", graph, order, shardable, tensor=[1])
    print(f"    before (states at bf16, replicas whole): {describe(before, found, s)}")
    made, found, s = plan("16x8xH100", graph, order, shardable, precision=MIXED)
    print(f"    mixed precision, every axis:             {describe(made, found, s)}")
    kinds = memory_kinds(made, made.stages[0])
    print("    memory per GPU by kind: " + ", ".join(f"{k} {human_bytes(kinds[k])}" for k in KINDS))
    small = per_micro_batch(graph, 16)  # a global batch of 32
    split, found_split, s = plan("16x8xH100", small, order, shardable, precision=MIXED)
    whole, found_whole, _ = plan("16x8xH100", small, order, shardable, precision=MIXED, tensor=[1])
    print(f"    global batch 32, every axis: {describe(split, found_split, s)}")
    print(f"    global batch 32, tensor 1:   {describe(whole, found_whole, 0.0)}")
    return made.predicted_step_ms, before.predicted_step_ms, found_split.tensor


def cli_a100(*extra: str) -> tuple[int, float]:
    """(b) through the command line, with `extra` options; (tensor degree, eq. 3 TFLOP/s per GPU) it printed."""
    command = [sys.executable, "-m", "partitioner", "plan", f"{Path(__file__).resolve()}:gpt3", "--cluster",
               "128x8xA100-SXM4-80GB", "--global-batch", "1536", "--dtype", "bf16", "--replicas", "auto",
               "--schedule", "1f1b", *extra, "--quiet"]
    start = time.perf_counter()
    out = subprocess.run(command, capture_output=True, text=True, check=True, cwd=Path(__file__).parent.parent).stdout
    took = time.perf_counter() - start
    lines = out.splitlines()
    print(f"(b) python -m partitioner plan benchmarks/split_layers.py:gpt3 --cluster 128x8xA100-SXM4-80GB "
          f"--global-batch 1536 --dtype bf16 --replicas auto --schedule 1f1b {' '.join(extra)} ({took:.1f} s, "
          "tracing included)")
    for line in lines[:12]:
        print("    " + line)
    found = re.search(r"predicted step ([\d.]+) ms.*?([\d.]+) TFLOP/s per GPU", " ".join(out.split()))
    tensor = re.search(r"(\d+) tensor ranks per replica", out)
    if not found:
        raise SystemExit(f"the command line printed no throughput:\n{out}")
    step_s, model_tflops = float(found.group(1)) / 1e3, float(found.group(2))
    s, h, layers, vocab = GPT3.seq, GPT3.width, GPT3.layers, GPT3.vocab
    eq3 = 96 * 1536 * s * layers * h * h * (1 + s / (6 * h) + vocab / (16 * layers * h)) / (step_s * 1024) / 1e12
    t = int(tensor.group(1)) if tensor else 1
    print(f"    tensor {t} inside hosts; predicted {model_tflops:.1f} TFLOP/s per GPU (model FLOPs), {eq3:.1f} by "
          f"SC'21 eq. 3, beside the published {PUBLISHED_TFLOPS:.0f} TFLOP/s per GPU (eq. 3; t = 8, 1,024 A100)")
    return t, eq3


def gpt3_h100(graph: Any, order: list[str], shardable: Any) -> str:
    made, found, s = plan("128x8xH100", graph, order, shardable, precision=MIXED, recompute="auto")
    print(f"(c) GPT-3 175B on 128x8 H100, global batch 1536, mixed precision: {describe(made, found, s)}")
    unsharded = {k: v for k, v in found.tried.items() if "zero" not in k}
    if unsharded:
        best = min(unsharded, key=lambda k: unsharded[k])
        print(f"    the best unsharded candidate compared: {best} at {unsharded[best] * 1e3:.1f} ms")
    print(f"    memory per GPU by kind ({made.stages[0].capacity_bytes / 2**30:.1f} GiB usable):")
    print("      stage " + "".join(f"{k:>13}" for k in (*KINDS, "total")))
    for stage in made.stages:
        kinds = memory_kinds(made, stage)
        print(f"      {stage.index:>5} " + "".join(f"{human_bytes(kinds[k]):>13}" for k in KINDS)
              + f"{human_bytes(stage.memory_bytes):>13}")
    return f"{sharding(found)}, tensor {found.tensor}, {found.stages} stages"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-cli", action="store_true", help="skip (b)'s command line run")
    args = parser.parse_args()
    step, before, small_t = llama_7b()
    # SC'21 ran no sharded optimizer: --sharding none plans under its conditions; the free search may shard
    t, eq3 = cli_a100("--sharding", "none") if not args.skip_cli else (0, float("nan"))
    free_t, free_eq3 = cli_a100() if not args.skip_cli else (0, float("nan"))
    model, (tokens,) = gpt3()
    graph, order, shardable, took = traced(model.to(torch.bfloat16), tokens)
    print(f"    (GPT-3 shape traced in {took:.1f} s)")
    chosen = gpt3_h100(graph, order, shardable)
    print(f"split layers: 7B Llama {step:.1f} ms (before {before:.1f} ms; t={small_t} at batch 32), 175B on 1024 "
          f"A100 unsharded as SC'21: t={t}, {eq3:.1f} TFLOP/s per GPU (published {PUBLISHED_TFLOPS:.0f}; free "
          f"search t={free_t}, {free_eq3:.1f}), 175B on 1024 H100: {chosen}")


if __name__ == "__main__":
    main()
