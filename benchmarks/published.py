"""Published training runs planned from models on meta: the published configuration forced, and the search's own.

Rows (each model built from torch.nn on meta, benchmarks/published_models.py; nothing is run):

    Megatron-LM, Narayanan et al., SC'21 (https://arxiv.org/abs/2104.04473), Table 1: the ten GPT models,
    1.7B on 32 A100 to 1T on 3,072, each with its t, p and batch; micro-batch size, interleaving (layers per
    virtual stage) and full recomputation from the paper's reproduction script
    (https://github.com/NVIDIA/Megatron-LM/blob/main/examples/sc21/run_table_1.sh). Achieved TFLOP/s per GPU
    by the paper's eq. 3, F = 96 B s l h^2 (1 + s / 6h + V / 16 l h) per step (it counts the recomputed
    forward). Fp16 weights with fp32 master weights, gradients and Adam states; DGX A100 80GB (Selene).
    Llama 3 405B, Llama Team 2024 (https://arxiv.org/abs/2407.21783), Table 4: 8,192 and 16,384 H100, TP 8 x
    PP 16, 16M tokens a step (sequence 8,192), BF16 MFU 43% / 41% (430 / 400 TFLOP/s per GPU). FLOPs as the
    paper's MFU cites them (Chowdhery et al., PaLM appendix B): 6 N + 12 l h s per token. Its section 3.3:
    FSDP over the data-parallel ranks (weights not resharded after forward, gradients accumulated and
    reduce-scattered in fp32: zero1 here), ranks ordered [TP, CP, PP, DP], interleaved pipeline whose first
    chunk on the first stage holds the embedding alone after one layer less there (126 layers in 128 slots of
    16 ranks: one layer a chunk, v = 8), no activation recomputation at 8K, 400 Gb/s RoCE per GPU.
    Sequence parallelism beside TP is assumed (Megatron-style; the runtime here does not run it, so only the
    forced configuration prices it: partitioner/place/search/tensor_split.py).

For each row: the published configuration and throughput; ours forced to it (partitioner/place/cluster/fixed.py:
only the cuts searched), its TFLOP/s, memory per GPU and the largest part of its step (benchmarks/
published_costs.py); where it does not fit, what it would predict were memory no limit. Then two choices:
"runs here", the Plan the cluster search makes over what the runtime runs (plan_on_cluster: tensor degree,
stages, replicas and their sharding, micro-batches, schedule, recomputation none or full), its step as the plan
simulates it; and "every priced axis" (cluster.priced.search_priced: the same axes with interleaved 1F1B and
sequence parallelism, which the runtime does not run but the published runs do), its search objective. The
second's space holds the forced configuration and both are search objectives, so "chosen plan at least as fast"
compares those two. Prices are the analytic model's from the GPU table (cost_model/gpus.json: GEMM efficiency
by precision, fused attention, NCCL bus bandwidths, each with its source).

Usage: python benchmarks/published.py [--rows 1.7B,405B-8k] [--no-chosen]
Last line: `published runs: K of N within 15% (forced configuration), J of N chosen plan at least as fast as
predicted for the published one`.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.published_costs import step_parts  # noqa: E402
from benchmarks.published_models import LLAMA3_405B, Llama, LlamaShape, MegatronGPT, MegatronShape  # noqa: E402
from cost_model.analytic import AnalyticCostModel  # noqa: E402
from cost_model.cluster_shape import Cluster  # noqa: E402
from cost_model.precision import MIXED, Precision  # noqa: E402
from partitioner.arguments import cluster_devices  # noqa: E402
from partitioner.capture.graph import build_graph, compute_nodes  # noqa: E402
from partitioner.capture.meta import shapes_only  # noqa: E402
from partitioner.capture.shardable import find_shardable  # noqa: E402
from partitioner.capture.trace import trace  # noqa: E402
from partitioner.place.cluster.fixed import Fixed, price_fixed  # noqa: E402
from partitioner.place.cluster.plan import plan_on_cluster  # noqa: E402
from partitioner.place.cluster.priced import search_priced  # noqa: E402
from partitioner.place.search.infeasible import InfeasibleError  # noqa: E402
from partitioner.place.search.space import SearchSpace  # noqa: E402

MEGATRON_FP16 = Precision("float16", "float32", "float32", "float32", name="fp16 / fp32 master")
WITHIN = 0.15
GIB = float(1 << 30)


@dataclasses.dataclass(frozen=True)
class Row:
    """One published run: its model, cluster, batch, configuration and throughput (TFLOP/s per GPU)."""

    name: str
    build: Callable[[], torch.nn.Module]
    gpus: int
    batch: int  # sequences a step
    seq: int
    fixed: Fixed
    published: float
    flops: Callable[[torch.nn.Module, int], float]  # FLOPs of a step as the source counts them
    cluster: dict[str, Any]
    precision: Precision


def eq3(s: MegatronShape) -> Callable[[torch.nn.Module, int], float]:
    """SC'21 eq. 3: 96 B s l h^2 (1 + s / 6h + V / 16 l h)."""
    def flops(_: torch.nn.Module, batch: int) -> float:
        h, l_ = s.width, s.layers
        return 96 * batch * s.seq * l_ * h * h * (1 + s.seq / (6 * h) + s.vocab / (16 * l_ * h))
    return flops


def palm(shape: LlamaShape) -> Callable[[torch.nn.Module, int], float]:
    """6 N + 12 l h s per token, N the model's parameters: PaLM's MFU count (appendix B), which Llama 3's MFU cites."""
    def flops(model: torch.nn.Module, batch: int) -> float:
        per_token = 6.0 * sum(p.numel() for p in model.parameters()) + 12.0 * shape.layers * shape.width * shape.seq
        return per_token * batch * shape.seq
    return flops


def _megatron(name: str, layers: int, width: int, heads: int, t: int, p: int, gpus: int, batch: int,
              published: float, mbs: int, per_virtual: int | None) -> Row:
    shape = MegatronShape(layers, width, heads)
    v = layers // p // per_virtual if per_virtual else 1
    return Row(name, lambda: MegatronGPT(shape, tied=p == 1).to(torch.float16), gpus, batch, shape.seq,
               Fixed(t, p, mbs, virtual_stages=v, recompute="full"), published, eq3(shape),
               {"hosts": gpus // 8, "gpus_per_host": 8, "gpu": "A100-SXM4-80GB"}, MEGATRON_FP16)


LLAMA_FABRIC = {"inter": {"kind": "roce", "gbit_per_s": 400 * 0.9}}  # 400 Gb/s RoCE x NCCL's 0.9 (gpus.json fabrics)
LLAMA = Fixed(8, 16, 1, sharding="zero1", virtual_stages=8, order="pipelines-together", sequence_parallel=True,
              kernels="fused")  # the engine that trained it saved flash attention's statistics (issue 37)
ROWS = [
    _megatron("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137, 16, None),
    _megatron("3.6B", 30, 3072, 32, 2, 1, 64, 512, 138, 16, None),
    _megatron("7.5B", 36, 4096, 32, 4, 1, 128, 512, 142, 16, None),
    _megatron("18.4B", 40, 6144, 48, 8, 1, 256, 1024, 135, 8, None),
    _megatron("39.1B", 48, 8192, 64, 8, 2, 512, 1536, 138, 4, None),
    _megatron("76.1B", 60, 10240, 80, 8, 4, 1024, 1792, 140, 2, 5),
    _megatron("145.6B", 80, 12288, 96, 8, 8, 1536, 2304, 148, 2, 5),
    _megatron("310.1B", 96, 16384, 128, 8, 16, 1920, 2160, 155, 1, 3),
    _megatron("529.6B", 105, 20480, 128, 8, 35, 2520, 2520, 163, 1, 1),
    _megatron("1008B", 128, 25600, 160, 8, 64, 3072, 3072, 163, 1, None),
    *(Row(f"405B-{g // 1024}k", lambda: Llama(LLAMA3_405B).to(torch.bfloat16), g, 2048, LLAMA3_405B.seq, LLAMA,
          tflops, palm(LLAMA3_405B), {"hosts": g // 8, "gpus_per_host": 8, "gpu": "H100-SXM", "fabric": LLAMA_FABRIC},
          MIXED)
      for g, tflops in ((8192, 430), (16384, 400))),
]


def traced(model: torch.nn.Module, tokens: torch.Tensor) -> tuple[Any, list[str], Any, Any]:
    """(graph, compute order, split groups, graph module) of `model` on meta, module kinds annotated as
    partitioner/place/planning.py annotates them (what each call saves for backward)."""
    with shapes_only(model) as swaps:
        gm = trace(model, (tokens,), {}, export_first=False).graph_module  # fx at any length: the kinds below
        swaps.add(model, [gm])
        graph = build_graph(gm, [tokens])
        shardable = find_shardable(gm, graph)
    for node in gm.graph.nodes:
        if node.op == "call_module" and node.name in graph:
            graph.nodes[node.name]["kind"] = type(gm.get_submodule(str(node.target))).__name__
    return graph, [n.name for n in compute_nodes(gm)], shardable, gm


def configuration(t: int, p: int, d: int, extra: str) -> str:
    return f"t{t} p{p} d{d}{extra}"


def run(row: Row, chosen: bool) -> tuple[bool, bool]:
    """Print one row; (forced within 15%, chosen at least as fast as forced)."""
    start = time.perf_counter()
    with torch.device("meta"):
        model = row.build()
    graph, order, shardable, gm = traced(model, torch.zeros(row.batch, row.seq, dtype=torch.long, device="meta"))
    cluster = Cluster.from_dict(row.cluster)
    cost = AnalyticCostModel(cluster_devices(cluster)[2])
    cost.prepare(gm)  # is_causal of fused attention
    flops = row.flops(model, row.batch)
    published_step = flops / (row.gpus * row.published * 1e12)
    f = row.fixed
    d = row.gpus // (f.tensor * f.stages)
    shown = configuration(f.tensor, f.stages, d, f", mbs {f.micro_batch_size}" + (
        f", v{f.virtual_stages}" if f.virtual_stages > 1 else "") + (", recompute" if f.recompute == "full" else "")
        + (f", {f.sharding}" if f.sharding != "none" else "") + (", SP" if f.sequence_parallel else ""))
    print(f"{row.name:>8} on {row.gpus:>5} {cluster.gpu.name}: published {shown}: {row.published:.0f} TFLOP/s "
          f"per GPU, step {published_step:.2f} s", flush=True)
    try:
        forced = price_fixed(graph, order, cluster, cost, f, precision=row.precision, shardable=shardable)
    except InfeasibleError as exc:
        print(f"         forced: does not fit: {exc}", flush=True)
        try:  # what its prices say were memory no limit (not counted as within: it must fit)
            free = price_fixed(graph, order, cluster, cost, f, precision=row.precision, shardable=shardable,
                               headroom=1e6)
            rate = flops / (row.gpus * free.step_s) / 1e12
            print(f"         forced, memory not limited: {rate:.0f} TFLOP/s ({rate / row.published - 1:+.1%}), step "
                  f"{free.step_s:.2f} s, memory {max(free.memory) / GIB:.1f} GiB per GPU", flush=True)
        except InfeasibleError:
            pass
        return False, True
    capacity = float(cost.spec("cuda:0").memory_bytes) * 0.9
    achieved = flops / (row.gpus * forced.step_s) / 1e12
    error = achieved / row.published - 1
    parts = step_parts(graph, order, shardable, cluster, cost, f, forced)
    largest = max(parts, key=lambda k: parts[k])
    memory = max(forced.memory)
    print(f"         forced: {achieved:.0f} TFLOP/s ({error:+.1%}), step {forced.step_s:.2f} s, memory "
          f"{memory / GIB:.1f} GiB per GPU ({'fits' if memory <= capacity else 'over'} {capacity / GIB:.0f}); "
          f"largest cost: {largest} {parts[largest]:.2f} s ({parts[largest] / forced.step_s:.0%}; "
          + ", ".join(f"{k} {v / forced.step_s:.0%}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1])[1:4])
          + ")", flush=True)
    ok = abs(error) <= WITHIN
    if not chosen:
        return ok, True
    try:
        plan, found = plan_on_cluster(graph, order, cluster, cost, shardable=shardable,
                                      space=SearchSpace(recompute="auto", precision=row.precision))
        step = plan.predicted_step_ms / 1e3
        extra = f", {found.sharding}" if found.sharding != "none" else ""
        print(f"         chosen, runs here: {configuration(found.tensor, found.stages, found.replicas, extra)}, "
              f"{found.micro_batches} micro-batches of {row.batch / found.micro_batches:g}, {plan.schedule}, "
              f"recompute {plan.stages[0].recompute}: {flops / (row.gpus * step) / 1e12:.0f} TFLOP/s, step "
              f"{step:.2f} s simulated (objective {found.step_s:.2f} s), memory "
              f"{max(s.memory_bytes for s in plan.stages) / GIB:.1f} GiB per GPU", flush=True)
    except InfeasibleError as exc:
        print(f"         chosen, runs here: nothing fits: {exc}", flush=True)
    try:
        best, mode = search_priced(graph, order, cluster, cost, precision=row.precision, shardable=shardable)
    except InfeasibleError as exc:
        print(f"         chosen, every priced axis: nothing fits: {exc}", flush=True)
        return ok, False
    extra = (f", v{best.virtual}" if best.virtual > 1 else "") + (
        f", {best.sharding}" if best.sharding != "none" else "") + (", SP" if best.tensor > 1 else "")
    print(f"         chosen, every priced axis: {configuration(best.tensor, best.stages, best.replicas, extra)}, "
          f"{best.micro_batches} micro-batches of {row.batch / best.micro_batches:g}, {best.schedule}, recompute "
          f"{mode}, {best.order}: {flops / (row.gpus * best.step_s) / 1e12:.0f} TFLOP/s, step {best.step_s:.2f} s "
          f"(objective), memory {max(best.memory) / GIB:.1f} GiB per GPU "
          f"({time.perf_counter() - start:.0f} s for the row)", flush=True)
    return ok, best.step_s <= forced.step_s * (1 + 1e-9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="", help="names of rows to run (default: all), e.g. 1.7B,405B-8k")
    parser.add_argument("--no-chosen", action="store_true", help="skip the search over every axis")
    args = parser.parse_args()
    wanted = [r for r in ROWS if not args.rows or r.name in args.rows.split(",")]
    within = faster = 0
    for row in wanted:
        ok, fast = run(row, not args.no_chosen)
        within += ok
        faster += fast
    n = len(wanted)
    print(f"published runs: {within} of {n} within 15% (forced configuration), {faster} of {n} chosen plan at least "
          "as fast as predicted for the published one")


if __name__ == "__main__":
    main()
