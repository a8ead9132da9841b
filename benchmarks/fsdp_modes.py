"""Sharding modes and kernel sets on the measured runs issue 37 names: what each holds per GPU, and what it predicts.

For each row (benchmarks/measured_runs.py, planned as benchmarks/measured_plan.py says), the measured configuration
(tensor, stages, micro-batch size, recomputation) is priced by the cluster search (partitioner/place/cluster/
fixed.py) under three sharding modes of its replicas and both kernel sets (rules/kernels.py):

    zero1              weights gathered for the step, gradients accumulated whole, reduce-scattered once
    zero3-accumulate   gathered per micro-batch (twice), gradients accumulated whole, reduce-scattered once
    zero3-full-shard   gathered per micro-batch (twice), gradients reduce-scattered after each micro-batch
                       (FSDP's FULL_SHARD as trainers run it: gradient_sync "every")

(and, for Llama 3 405B, `zero2-every`: the paper's "we shard optimizer states and gradients, but for model shards
we do not reshard after forward computation" read literally, FSDP's SHARD_GRAD_OP: gathered per micro-batch and kept
to its backward, gradients reduce-scattered after each; the rows' `zero1` reads the FP32 gradients as accumulated
whole and reduced once, which is what their measured step time allows) and prints, per configuration, memory per
GPU by kind (the states of one rank by cost_model.training_memory at the row's parameters / (t p), one layer an
FSDP unit; "activations" is the rest of the search's peak: saved activations, messages, buffers), the predicted MFU
(the source's FLOP count over the predicted step) and its ratio to the measured MFU, or "does not fit" with the
memory per GPU it needs and its fullest GPU's states and activations (micro-batches, or interleaved chunks, in
flight). Rows: llm-foundry's 7B at sequence 8192 on 8 A100-40GB, its 30B with activation checkpointing on 32
A100-40GB (the smallest 30B run of the table), SC'21's 1.7B on 32 A100, and Llama 3 405B at 8K and 16K GPUs. The
measured configuration (its sharding mode, its kernel set) is marked "*". Last line: `measured FSDP configurations
that fit: k of n` (the rows that ran sharded: each as-run mode and kernel set, with the forced FULL_SHARD
configuration where the run used FULL_SHARD).

Usage: python benchmarks/fsdp_modes.py [--rows KEY,KEY] [--fast]   (--fast: the 405B rows as run and read literally)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.measured_plan import plan_arguments  # noqa: E402
from benchmarks.measured_runs import RUNS  # noqa: E402
from benchmarks.measured_types import Run, flops_per_token, implied_tokens_per_s  # noqa: E402
from benchmarks.published import traced  # noqa: E402
from benchmarks.published_runs import over_text  # noqa: E402
from cost_model.analytic import AnalyticCostModel  # noqa: E402
from cost_model.precision import Precision  # noqa: E402
from cost_model.training_memory import state_bytes  # noqa: E402
from partitioner.arguments import cluster_devices  # noqa: E402
from partitioner.place.cluster.fixed import Fixed, price_fixed  # noqa: E402
from partitioner.place.search.infeasible import InfeasibleError  # noqa: E402

ROWS = ["foundry-a100-40gb-7b-8192-8", "foundry-a100-40gb-30b-2048-32", "sc21-1.7B", "llama3-405B-8k",
        "llama3-405B-16k"]
MODES = {"zero1": ("zero1", "last"), "zero3-accumulate": ("zero3", "last"), "zero3-full-shard": ("zero3", "every")}
GIB = float(1 << 30)
HEADROOM = 0.9  # the share of a GPU's memory a plan may fill (price_fixed's default, passed to it)


def measured_mfu(run: Run) -> float:
    """The run's MFU under its source's FLOP count: the middle of what its printed figures allow."""
    implied = implied_tokens_per_s(run)
    low, high = max(lo for lo, _ in implied.values()), min(hi for _, hi in implied.values())
    tokens = (low + high) / 2 if low <= high else (sum(lo + hi for lo, hi in implied.values()) / (2 * len(implied)))
    return tokens * flops_per_token(run.model, run.seq, run.measured.flops) / (run.gpus * run.measured.peak_tflops
                                                                               * 1e12)


def as_run(run: Run, fixed: dict[str, Any]) -> str:
    """The row's measured mode among MODES: FSDP's FULL_SHARD is zero3-full-shard."""
    mode = fixed.get("sharding", "none")
    if mode == "zero3":
        return "zero3-full-shard" if "FULL_SHARD" in run.parallel.sharding_as_run else "zero3-accumulate"
    return mode


def kinds(run: Run, fixed: Fixed, precision: Precision, d: int, m: int, total: float) -> str:
    """The states one rank holds by kind (module docstring), and the rest of `total` as activations."""
    t, p = fixed.tensor, fixed.stages
    params = float(run.model.parameters()) / (t * p)
    layer = (float(run.model.parameters()) - float(run.model.embedding())) / run.model.layers / t
    root = max(0.0, params - layer * max(1, run.model.layers // p))
    weights, master, grads, optimizer = (float(x) for x in state_bytes(
        params, precision, mode=fixed.sharding, degree=d, micro_batches=max(1, m // d),
        gradient_sync=fixed.gradient_sync or "last", root=root, unit=layer))
    states = weights + master + grads + optimizer
    return (f"weights {weights / GIB:5.1f}  master {master / GIB:5.1f}  grads {grads / GIB:5.1f}  "
            f"optimizer {optimizer / GIB:5.1f}  activations {max(0.0, total - states) / GIB:6.1f}")


def row(key: str, fast: bool) -> list[tuple[str, bool]]:
    """Print one row's configurations; (name, fits) of its measured ones."""
    run = next(r for r in RUNS if r.key == key)
    args = plan_arguments(run)
    with torch.device("meta"):
        model = args.build()
    graph, order, shardable, gm = traced(model, args.example_inputs()[0])
    cluster = args.cluster_object()
    cost = AnalyticCostModel(cluster_devices(cluster)[2])
    cost.prepare(gm)
    precision = Precision.of(run.precision)
    assert precision is not None  # every measured row names one
    flops = flops_per_token(run.model, run.seq, run.measured.flops) * run.global_batch * run.seq
    peak = run.measured.peak_tflops * 1e12
    measured = measured_mfu(run)
    base = dict(args.fixed)
    t, p = base["tensor"], base["stages"]
    d, m = run.gpus // (t * p), run.global_batch // base["micro_batch_size"]
    mode_run = as_run(run, base)
    print(f"{key}: {run.model.parameters() / 1e9:.1f}B on {run.gpus} {run.gpu}, t{t} p{p} d{d}, mbs "
          f"{base['micro_batch_size']}, recompute {base['recompute']}; measured {mode_run}, kernels "
          f"{args.kernels}, MFU {measured:.1%}", flush=True)
    found: list[tuple[str, bool]] = []
    modes = {mode_run: MODES.get(mode_run, (mode_run, "last"))} if fast and key.startswith("llama3") else \
        {**MODES, **({mode_run: (mode_run, "last")} if mode_run not in MODES else {})}
    if key.startswith("llama3"):  # section 3.3.2's sentence read literally: FSDP's SHARD_GRAD_OP (module docstring)
        modes["zero2-every"] = ("zero2", "every")
    for name, (mode, sync) in modes.items():
        for kernels in ("eager", "fused"):
            fixed = Fixed(**{**base, "sharding": mode, "gradient_sync": sync if mode != "none" else None,
                             "kernels": kernels})
            mark = "*" if (name, kernels) == (mode_run, args.kernels) else " "
            start = time.perf_counter()
            try:
                solution = price_fixed(graph, order, cluster, cost, fixed, precision=precision, shardable=shardable,
                                       headroom=HEADROOM)
            except InfeasibleError as exc:
                need = max(exc.needed_bytes) if exc.needed_bytes else float("nan")
                print(f"  {mark}{name:<17} {kernels:<5}  does not fit: needs {need / GIB:.1f} GiB per GPU of "
                      f"{HEADROOM * cluster.gpu.memory_bytes / GIB:.0f} usable ({cluster.gpu.memory_bytes / GIB:.0f})"
                      + (f" ({over_text(exc)})" if exc.held else ""),
                      flush=True)
                if mark == "*":
                    found.append((f"{key} {name} {kernels}", False))
                continue
            total = max(solution.memory)
            mfu = flops / (run.gpus * solution.step_s * peak)
            held = kinds(run, fixed, precision, d, m, total)
            print(f"  {mark}{name:<17} {kernels:<5}  {total / GIB:5.1f} GiB: {held}  MFU {mfu:.1%} "
                  f"(x{mfu / measured:.2f} measured)  [{time.perf_counter() - start:.0f} s]", flush=True)
            if mark == "*" or (mode_run == "zero3-full-shard" and name == mode_run and kernels == args.kernels):
                found.append((f"{key} {name} {kernels}", True))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--fast", action="store_true")
    options = parser.parse_args()
    measured: list[tuple[str, bool]] = []
    for key in options.rows.split(","):
        measured += row(key, options.fast)
    fits = sum(ok for _, ok in measured)
    print(f"measured FSDP configurations that fit: {fits} of {len(measured)}"
          + (f" (not: {', '.join(n for n, ok in measured if not ok)})" if fits < len(measured) else ""))


if __name__ == "__main__":
    main()
