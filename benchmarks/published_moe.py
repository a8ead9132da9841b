"""Published mixture-of-experts and long-context training runs planned from models on meta: forced and free.

Rows (issue 39's Why; each number's source in its row; nothing is run):

    DSv3-H800     DeepSeek-V3 on 2,048 H800 (DeepSeek-AI, https://arxiv.org/abs/2412.19437, sections 1 and 3.2-3.4):
                  PP 16 (DualPipe), EP 64 over 8 nodes, ZeRO-1 data parallelism, no TP; 180K H800 GPU hours per
                  trillion tokens = 1,543 tokens/s per GPU; sequence 4,096, batch 15,360; H800: NVLink 160 GB/s,
                  InfiniBand 50 GB/s per GPU (section 3.2.2). Trained in FP8 (products FP8: Precision.matmul).
                  Node-limited routing (section 3.2.2: each token to at most 4 nodes, sent once a node over IB and
                  forwarded over NVLink): max_nodes=4 (cost_model.all_to_all.NodeLimited).
    DSv3-H100     DeepSeek-V3 on 1,024 H100, Megatron-Bridge (https://docs.nvidia.com/nemo/megatron-bridge/latest/
                  performance-summary-archive.html, 25.09 container, "DeepSeekV3 (dropless)"): GBS 8192, MBS 1,
                  sequence 4096, TP 2 x PP 8 x VP 4 x EP 64, GA 128, 1,297 tokens/s per GPU (338 model TFLOP/s), FP8
                  (128x128 weight and 1x128 activation blocks, as DeepSeek-V3 trained). Its dispatcher is
                  Megatron's flex dispatcher (scripts/performance/configs/deepseek/, H100: moe_flex_dispatcher_backend
                  from the workload's base config, "hybridep" in every version read: DeepEP's hierarchical mode, a
                  token sent once a node over RDMA and forwarded over NVLink; the 25.09 container's own value is
                  assumed the same), and the model routes each token to at most 4 of its 8 expert groups
                  (config.json: n_group 8, topk_group 4), a group one node of the 8 that EP 64 spans: max_nodes=4,
                  as the H800 row (priced with the plain all-to-all: ratio 0.75).
    Qwen3-235B    Qwen3-235B-A22B on 256 H100, Megatron-Bridge (same page, 26.02 container): FP8, GBS 8192, MBS 1,
                  sequence 4096, TP 2 x PP 8 x VP 4 x EP 32, 1,633 tokens/s per GPU (242 model TFLOP/s).
    GPT-OSS-120B  GPT-OSS-120B on 64 H100, Megatron-Bridge (same page, 26.02 container): BF16, GBS 1280, MBS 1,
                  sequence 4096, PP 4 x EP 8, 5,993 tokens/s per GPU (163 model TFLOP/s).
    405B-128k     Llama 3 405B's long-context stage (Llama Team, https://arxiv.org/abs/2407.21783, Table 4): 16,384
                  H100, TP 8 x CP 16 x PP 16 x DP 8 at 131,072 tokens, 38% MFU (BF16 dense peak 989 TFLOP/s), 16M
                  tokens a step; FLOPs per token 6 N + 12 L s h, N the parameters (the MFU's count: PaLM's
                  appendix B, which the paper cites for it; not halved for the causal mask)
    7B-128k       NeMo's Llama 2 7B at 128k tokens (https://docs.nvidia.com/nemo-framework/user-guide/latest/
                  longcontext/index.html, as issue 39 quotes it): TP 4 x CP 4 x DP 8 on 128 H100, 1.31x the
                  throughput of the same job without CP (TP 4 x DP 32): the row compares predicted ratios.

Models: benchmarks/published_moe_models.py (MoE decoders at their published shapes, every layer) and
benchmarks/published_models.py's Llama (Llama 2 7B: 32 layers of 4096, 32 heads, SwiGLU 11008, vocabulary 32000).
Each row's global batch and micro-batch size are its source's (DeepSeek's paper gives no micro-batch size:
searched there); forced rows run the published micro-batch count (batch / MBS). Virtual stages are priced where
a row gives them (`virtual`: interleaved 1F1B, as published.py's forced rows price it; the runtime here does not
interleave stages with replicas, so the free search never chooses them); DualPipe is priced as 1F1B, and
all-to-alls as the runtime runs them (BF16, not overlapped with compute); FP8 rows run their products at the
FP8 rate (Precision.matmul, cost_model/analytic.py).
Long-context models are traced by torch.export (their sequence symbolic: what
partitioner/capture/sequence.py reads). Forced: the published tensor, stage, expert and context degrees (the
rest searched: cuts, micro-batches, recomputation; a row whose source splits its layers evenly over its stages,
as GPT-OSS-120B's recipe does, is cut there: `even_layers`); free: every degree searched
(partitioner/place/cluster/split_axes.py). Throughput is the search's objective's.

A free plan predicted above 1.15x the published throughput names the axes on which it differs from the
published configuration (`differing`: tensor, stages, expert, context, sharding, the micro-batch size where the
source gives one); a plan above it that names none is a price to question, and the last line counts those.

Usage: python benchmarks/published_moe.py [--rows GPT-OSS-120B,7B-128k] [--no-free]
Last line: `moe/long-context rows forced within 20%: K of N; free above 1.15x: A, with no axis named: U`.
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

from benchmarks.published import traced  # noqa: E402
from benchmarks.published_models import LLAMA3_405B, Llama, LlamaShape  # noqa: E402
from benchmarks.published_moe_models import DEEPSEEK_V3, GPT_OSS_120B, QWEN3_235B, MoEShape, MoETransformer  # noqa: E402
from cost_model.analytic import AnalyticCostModel  # noqa: E402
from cost_model.cluster_shape import Cluster  # noqa: E402
from cost_model.precision import MIXED, Precision  # noqa: E402
from partitioner.arguments import cluster_devices  # noqa: E402
from partitioner.capture.experts import find_experts  # noqa: E402
from partitioner.capture.graph import build_graph, compute_nodes  # noqa: E402
from partitioner.capture.meta import shapes_only  # noqa: E402
from partitioner.capture.sequence import find_sequence_split  # noqa: E402
from partitioner.capture.shardable import find_shardable  # noqa: E402
from partitioner.capture.trace import _export_trace  # noqa: E402
from partitioner.place.cluster.split_axes import Split, search_split  # noqa: E402
from partitioner.place.search.experts_context import SplitFacts  # noqa: E402
from partitioner.place.search.infeasible import InfeasibleError  # noqa: E402
from partitioner.place.search.space import SearchSpace  # noqa: E402

WITHIN = 0.20
ABOVE = 1.15  # a free plan predicted above this x published names the axes that make it faster
GIB = float(1 << 30)
H100 = {"gpus_per_host": 8, "gpu": "H100-SXM"}
H800 = {**H100, "fabric": {"intra": {"kind": "nvswitch", "gb_per_s": 160}, "inter": {"kind": "infiniband",
                                                                                      "gb_per_s": 50}}}
# FP8 training as DeepSeek-V3 and Megatron-Bridge's FP8 rows run it: products FP8, the rest as MIXED.
FP8 = dataclasses.replace(MIXED, matmul="float8_e4m3fn", name="fp8 mixed")
LLAMA2_7B = LlamaShape(layers=32, width=4096, ffn=11008, heads=32, kv_heads=32, vocab=32000, seq=131072)
LLAMA3_405B_128K = dataclasses.replace(LLAMA3_405B, seq=131072)


@dataclasses.dataclass(frozen=True)
class Row:
    """One published run: model, cluster, batch, forced degrees (t, p, e, c, sharding), published tokens/s per GPU."""

    name: str
    build: Callable[[], torch.nn.Module]
    gpus: int
    batch: int  # sequences a step
    seq: int
    forced: tuple[int, int, int, int, str]  # tensor, stages, expert, context, sharding
    published: float  # tokens/s per GPU (a ratio for 7B-128k)
    cluster: dict[str, Any]
    source: str
    export: bool = False  # trace by torch.export (a long sequence to split)
    baseline: tuple[int, int, int, int, str] | None = None  # the forced configuration's no-CP twin (ratio rows)
    mbs: int | None = None  # the published micro-batch size (None: not published, searched)
    precision: Precision = MIXED  # FP8 where the run's products were FP8
    max_nodes: int | None = None  # node-limited routing where the run's dispatch sends a token once a host
    even_layers: bool = False  # the run splits its layers evenly over its stages (embedding and loss not counted)
    virtual: int = 1  # chunks per rank, interleaved 1F1B (priced only: the runtime interleaves no replicated stage)
    sequence_parallel: bool = False  # beside TP (priced only), where the source's engine runs it
    kernels: str = "eager"  # "fused": the engine saved flash attention's statistics and fused norms (issue 37)


def _moe(shape: MoEShape) -> Callable[[], torch.nn.Module]:
    return lambda: MoETransformer(shape).to(torch.bfloat16)


def _llama(shape: LlamaShape) -> Callable[[], torch.nn.Module]:
    return lambda: Llama(shape).to(torch.bfloat16)


def _per_token_405b() -> float:
    s = LLAMA3_405B_128K
    n = 405e9
    return 6 * n + 12 * s.layers * s.seq * s.width


ROWS = [
    Row("DSv3-H800", _moe(DEEPSEEK_V3), 2048, 15360, 4096, (1, 16, 64, 1, "zero1"), 1e12 / (180e3 * 3600),
        {"hosts": 256, **H800}, "arXiv 2412.19437: 180K H800 GPU hours / 1T tokens; PP16 EP64 ZeRO-1; batch 15360; "
        "FP8; each token to at most 4 nodes (3.2.2)", precision=FP8, max_nodes=4),
    Row("DSv3-H100", _moe(DEEPSEEK_V3), 1024, 8192, 4096, (2, 8, 64, 1, "zero1"), 1297,
        {"hosts": 128, **H100}, "Megatron-Bridge performance summary 25.09: GBS 8192 MBS 1, TP2 PP8 VP4 EP64, FP8; "
        "HybridEP dispatch (once a node over RDMA, then NVLink), the model's routing to 4 of 8 expert groups",
        mbs=1, precision=FP8, virtual=4, max_nodes=4),
    Row("Qwen3-235B", _moe(QWEN3_235B), 256, 8192, 4096, (2, 8, 16, 1, "zero1"), 1633,
        {"hosts": 32, **H100}, "Megatron-Bridge performance summary 26.02: GBS 8192 MBS 1, TP2 PP8 VP4 EP32, FP8; "
        "EP 32 spans Megatron's TP x DP ranks, here experts split over the 16 replicas (EP 16)", mbs=1,
        precision=FP8, virtual=4),
    Row("GPT-OSS-120B", _moe(GPT_OSS_120B), 64, 1280, 4096, (1, 4, 8, 1, "zero1"), 5993,
        {"hosts": 8, **H100}, "Megatron-Bridge performance summary 26.02: GBS 1280 MBS 1, PP4 EP8, BF16; 9 layers a "
        "stage (recipes/gpt_oss/gpt_oss.py: account_for_embedding/loss_in_pipeline_split False)", mbs=1,
        even_layers=True),
    Row("405B-128k", _llama(LLAMA3_405B_128K), 16384, 128, 131072, (8, 16, 1, 16, "zero1"),
        0.38 * 989e12 / _per_token_405b(), {"hosts": 2048, **H100},
        "arXiv 2407.21783 Table 4: TP8 CP16 PP16 DP8 at 131072 tokens, 38% MFU, 16M tokens a step; the 8K rows' engine "
        "(benchmarks/published.py's LLAMA): interleaved v 8, sequence parallelism, fused kernels", export=True,
        virtual=8, sequence_parallel=True, kernels="fused"),
    Row("7B-128k", _llama(LLAMA2_7B), 128, 32, 131072, (4, 1, 1, 4, "zero1"), 1.31, {"hosts": 16, **H100},
        "NeMo long context (as issue 39 quotes it): TP4 CP4 DP8 at 128k, 1.31x over no CP", export=True,
        baseline=(4, 1, 1, 1, "zero1")),
]


def split_traced(model: torch.nn.Module, tokens: torch.Tensor, *, export: bool,
                 ) -> tuple[Any, list[str], Any, Any, SplitFacts]:
    """(graph, compute order, split groups, graph module, experts and sequence found) of `model` on meta; `export`:
    through torch.export, the sequence symbolic (what capture/sequence.py reads), else benchmarks/published.traced."""
    if export:
        with shapes_only(model) as swaps:
            gm = _export_trace(model, (tokens,), {}).graph_module
            swaps.add(model, [gm])
            graph = build_graph(gm, [tokens])
            shardable = find_shardable(gm, graph)
        order = [n.name for n in compute_nodes(gm)]
    else:
        graph, order, shardable, gm = traced(model, tokens)
    return graph, order, shardable, gm, SplitFacts.of(graph, order, find_experts(gm, model),
                                                      find_sequence_split(gm), gm)


def prepare(row: Row) -> tuple[Any, list[str], Any, SplitFacts, AnalyticCostModel, Cluster]:
    """The row's model on meta, traced, annotated and found (experts, sequence), with its cost model."""
    with torch.device("meta"):
        model = row.build()
    tokens = torch.zeros(row.batch, row.seq, dtype=torch.long, device="meta")
    graph, order, shardable, gm, facts = split_traced(model, tokens, export=row.export)
    cluster = Cluster.from_dict(row.cluster)
    cost = AnalyticCostModel(cluster_devices(cluster)[2], matmul=row.precision.matmul or None)
    cost.prepare(gm)
    return graph, order, shardable, facts, cost, cluster


def layer_bounds(graph: Any, order: list[str], stages: int) -> list[int]:
    """Stage boundaries (positions in `order`) of an even split of the model's `layers.K` blocks over `stages`, as
    Megatron-LM splits them where embedding and loss are not counted: the embedding with the first stage, the final
    norm, head and loss with the last."""
    first: dict[int, int] = {}
    for i, name in enumerate(order):
        parts = str(graph.nodes[name].get("module", "") or "").split(".")
        if len(parts) > 1 and parts[0] == "layers" and parts[1].isdigit():
            first.setdefault(int(parts[1]), i)
    if not first or len(first) % stages:
        raise ValueError(f"{len(first)} layers do not split evenly over {stages} stages; drop even_layers")
    each = len(first) // stages
    return [0] + [first[k * each] for k in range(1, stages)] + [len(order)]


def forced(row: Row, parts: tuple, config: tuple[int, int, int, int, str]) -> Split:
    graph, order, shardable, facts, cost, cluster = parts
    t, p, e, c, mode = config
    counts = row.batch // row.mbs if row.mbs else None  # the published micro-batch size: batch / MBS in all
    # Megatron-LM runs TP beside EP only with sequence parallelism (megatron/core/transformer/transformer_config.py:
    # "When using expert parallelism and tensor parallelism, sequence parallelism must be used"): priced only
    sequence = t > 1 and (e > 1 or row.sequence_parallel)
    space = SearchSpace(counts, recompute="auto", precision=row.precision, tensor=(t,), sharding=(mode,),
                        sequence_parallel=sequence, kernels=row.kernels)
    bounds = layer_bounds(graph, order, p) if row.even_layers else None
    return search_split(graph, order, cluster, cost, facts, space=space, shardable=shardable, expert=e, context=c,
                        stages=p, max_nodes=row.max_nodes, bounds=bounds, virtual=row.virtual)


def rate(row: Row, split: Split) -> float:
    """Tokens/s per GPU the search predicts."""
    return row.batch * row.seq / split.solution.step_s / row.gpus


def differing(row: Row, split: Split) -> tuple[str, ...]:
    """The free plan's axes whose values differ from the published configuration's (benchmarks/published_runs.py's
    `_axes`): tensor, stages, expert, context degrees, sharding, and the micro-batch size where the source gives it."""
    s, (t, p, e, c, mode) = split.solution, row.forced
    named = [("tensor", s.tensor != t), ("stages", s.stages != p), ("expert", split.expert != e),
             ("context", split.context != c), ("sharding", s.sharding != mode),
             ("micro-batch size", row.mbs is not None and row.batch != row.mbs * s.micro_batches)]
    return tuple(name for name, differs in named if differs)


def shown(split: Split) -> str:
    s = split.solution
    kinds = max(split.kinds, key=lambda k: sum(k.values()))
    by_kind = ", ".join(f"{k} {v / GIB:.1f}" for k, v in kinds.items() if v > 0)
    return (f"t{s.tensor} p{s.stages}{f' v{s.virtual}' if s.virtual > 1 else ''} e{split.expert} c{split.context} "
            f"d{s.replicas}"
            f"{', ' + s.sharding if s.sharding != 'none' else ''}, m {s.micro_batches}, recompute "
            f"{s.choice.get('recompute', 'none')}; memory per GPU {max(s.memory) / GIB:.1f} GiB ({by_kind} GiB)")


def run(row: Row, free: bool) -> tuple[bool, bool, bool]:
    """Print one row; whether the forced configuration is within 20% of the published number, whether the free plan
    is predicted above ABOVE x published, and whether it is so naming no axis that differs from the published."""
    start = time.perf_counter()
    print(f"{row.name:>12} on {row.gpus:>5} GPUs [{row.source}]", flush=True)
    parts = prepare(row)
    facts = parts[3]
    print(f"{'':>12} traced in {time.perf_counter() - start:.0f} s; experts "
          f"{facts.expert_degrees[-1] if facts.has_experts else '-'}, sequence "
          f"{'splits' if facts.has_context else 'whole'}", flush=True)
    ok = above = unnamed = False
    try:
        made = forced(row, parts, row.forced)
        predicted = rate(row, made)
        if row.baseline is not None:
            base = forced(row, parts, row.baseline)
            predicted = base.solution.step_s / made.solution.step_s
            print(f"{'':>12} forced: {shown(made)}; predicted {predicted:.2f}x the no-CP twin ({shown(base)}), "
                  f"published {row.published:.2f}x: ratio {predicted / row.published:.2f}", flush=True)
        else:
            print(f"{'':>12} forced: {shown(made)}; {predicted:.0f} tokens/s per GPU, published {row.published:.0f}: "
                  f"ratio {predicted / row.published:.2f}", flush=True)
        ok = abs(predicted / row.published - 1) <= WITHIN
    except InfeasibleError as exc:
        print(f"{'':>12} forced: does not fit: {str(exc)[:300]}", flush=True)
    if free and row.baseline is None:
        try:
            best = search_split(parts[0], parts[1], parts[5], parts[4], parts[3], precision=row.precision,
                                shardable=parts[2], max_nodes=row.max_nodes)
            ratio = rate(row, best) / row.published
            axes = differing(row, best)
            above = ratio > ABOVE
            unnamed = above and not axes
            why = (f"; above {ABOVE:.2f}x, differs in {', '.join(axes)}" if axes else
                   f"; above {ABOVE:.2f}x naming no axis that differs") if above else ""
            print(f"{'':>12} free: {shown(best)}; {rate(row, best):.0f} tokens/s per GPU, ratio {ratio:.2f}{why} "
                  f"({time.perf_counter() - start:.0f} s for the row)", flush=True)
        except InfeasibleError as exc:
            print(f"{'':>12} free: nothing fits: {str(exc)[:300]}", flush=True)
    return ok, above, unnamed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="", help="names of rows to run (default: all)")
    parser.add_argument("--no-free", action="store_true", help="skip the free search")
    args = parser.parse_args()
    wanted = [r for r in ROWS if not args.rows or r.name in args.rows.split(",")]
    results = [run(row, not args.no_free) for row in wanted]
    within, above, unnamed = (sum(r[k] for r in results) for k in range(3))
    print(f"moe/long-context rows forced within {WITHIN:.0%}: {within} of {len(wanted)}; free above {ABOVE:.2f}x: "
          f"{above}, with no axis named: {unnamed}")


if __name__ == "__main__":
    main()
