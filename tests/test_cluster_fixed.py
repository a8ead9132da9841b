"""A configuration given whole, priced by the cluster search (cluster_fixed.py), and the search over every priced
axis (cluster_priced.py) that must never do worse than it, on the example GPT."""

from __future__ import annotations

import networkx as nx
import pytest
import torch

from cost_model.analytic import AnalyticCostModel
from cost_model.cluster_shape import Cluster
from examples.models import make_gpt
from partitioner.arguments import cluster_devices
from partitioner.capture.graph import build_graph, compute_nodes
from partitioner.capture.shardable import Shardable, find_shardable
from partitioner.capture.trace import trace
from partitioner.errors import PartitionError
from partitioner.place.cluster.fixed import Fixed, price_fixed
from partitioner.place.cluster.priced import search_priced
from partitioner.place.cluster.space import ClusterSolution
from rules.generators import interleaved_fill

CLUSTER = Cluster.parse("2x4xH100")


@pytest.fixture(scope="module")
def gpt() -> tuple[nx.DiGraph, list[str], Shardable, AnalyticCostModel]:
    torch.manual_seed(0)
    model, (x,) = make_gpt(batch=16)  # width 128, 4 heads, 4 blocks
    gm = trace(model, (x,), {}).graph_module
    graph = build_graph(gm, [x])
    return (graph, [n.name for n in compute_nodes(gm)], find_shardable(gm, graph),
            AnalyticCostModel(cluster_devices(CLUSTER)[2]))


Traced = tuple[nx.DiGraph, list[str], Shardable, AnalyticCostModel]


def test_a_fixed_configuration_is_priced_as_given(gpt: Traced) -> None:
    graph, order, shardable, cost = gpt
    fixed = Fixed(tensor=2, stages=2, micro_batch_size=1, virtual_stages=2, sequence_parallel=True)
    found = price_fixed(graph, order, CLUSTER, cost, fixed, shardable=shardable)
    assert (found.tensor, found.stages, found.replicas, found.micro_batches, found.virtual, found.schedule) == (
        2, 2, 2, 16, 2, "interleaved")
    # the step is interleaved 1F1B's fill over 8 micro-batches a pipeline times the slowest stage's work
    assert found.step_s == pytest.approx(interleaved_fill(8, 2, 2) * max(found.work_s))
    plain = price_fixed(graph, order, CLUSTER, cost, Fixed(tensor=2, stages=2, micro_batch_size=1),
                        shardable=shardable)
    assert max(found.memory) < max(plain.memory)  # sequence parallelism: the layers' neighbours hold 1/t


@pytest.mark.parametrize("fixed, words", [
    (Fixed(tensor=3), "must divide the 8 GPUs"),
    (Fixed(stages=2, micro_batch_size=16), "cannot be dealt to 4 replicas"),
    (Fixed(stages=4, micro_batch_size=4, virtual_stages=2), "a multiple of the stages"),
    (Fixed(stages=2, schedule="zbv"), "schedule='zbv'"),
])
def test_configurations_that_cannot_run_say_why(gpt: tuple[nx.DiGraph, list[str], Shardable, AnalyticCostModel],
                                                fixed: Fixed, words: str) -> None:
    graph, order, shardable, cost = gpt
    with pytest.raises(PartitionError, match=words):
        price_fixed(graph, order, CLUSTER, cost, fixed, shardable=shardable)


def test_the_search_over_every_priced_axis_is_never_worse_than_a_fixed_configuration(
        gpt: tuple[nx.DiGraph, list[str], Shardable, AnalyticCostModel]) -> None:
    graph, order, shardable, cost = gpt
    best, mode = search_priced(graph, order, CLUSTER, cost, shardable=shardable)
    assert mode in ("none", "full")
    for fixed in (Fixed(tensor=2, stages=2, micro_batch_size=1, virtual_stages=2, sequence_parallel=True),
                  Fixed(stages=4, micro_batch_size=2, recompute="full"), Fixed(tensor=4, micro_batch_size=4)):
        assert best.step_s <= price_fixed(graph, order, CLUSTER, cost, fixed, shardable=shardable).step_s * (1 + 1e-9)


ONE_GPU = Cluster.parse("1x1xH100")


def _on_one_gpu(model: torch.nn.Module, seq: int, micro_batch_size: int, modes: tuple[str, ...],
                ) -> tuple[nx.DiGraph, list[str], AnalyticCostModel, dict[str, ClusterSolution]]:
    """(graph, order, cost, each recompute mode priced): `model` in bf16 on meta, a batch of 8 of `seq` tokens,
    one H100, micro-batches of `micro_batch_size`."""
    x = torch.zeros(8, seq, dtype=torch.long, device="meta")
    gm = trace(model.to(torch.bfloat16), (x,), {}).graph_module
    graph = build_graph(gm, [x])
    order, cost = [n.name for n in compute_nodes(gm)], AnalyticCostModel(cluster_devices(ONE_GPU)[2])
    return graph, order, cost, {mode: price_fixed(graph, order, ONE_GPU, cost, Fixed(
        micro_batch_size=micro_batch_size, recompute=mode)) for mode in modes}


def test_recomputing_the_attention_core_drops_the_scores_and_runs_the_core_again() -> None:
    """Megatron-LM's selective recomputation (Korthikanti et al.): of a layer's 34 s b h + 5 a s^2 b saved bytes the
    second term goes; the step grows by the core's forward, less than full recomputation's whole forward."""
    from benchmarks.published_models import MegatronGPT, MegatronShape
    from partitioner.place.cluster.plan import plan_on_cluster
    from partitioner.place.search.space import SearchSpace

    layers, h, a, s, b = 2, 256, 4, 256, 2
    with torch.device("meta"):
        model = MegatronGPT(MegatronShape(layers=layers, width=h, heads=a, vocab=128, seq=s, dropout=0.1))
    graph, order, cost, priced = _on_one_gpu(model, s, b, ("none", "attention", "full"))
    # one stage: one micro-batch's activations at a time; per layer the bf16 probabilities (2 a s^2 b), the dropout's
    # byte mask and bf16 output (3 a s^2 b) are no longer kept
    assert priced["none"].memory[0] - priced["attention"].memory[0] == layers * 5 * a * s * s * b
    assert priced["full"].memory[0] < priced["attention"].memory[0]
    assert priced["none"].step_s < priced["attention"].step_s < priced["full"].step_s
    with pytest.raises(PartitionError, match="recompute=.attention. .*priced for a configuration given whole"):
        plan_on_cluster(graph, order, ONE_GPU, cost, space=SearchSpace(recompute="attention"))


def test_torchtitans_op_policy_keeps_every_second_product_and_the_attention_output() -> None:
    """torchtitan's selective op policy: per block the outputs of q, v, gate and down (its 1st, 3rd, 5th and 7th
    matrix products) and of the attention kernel are kept; the rest recomputed as in full recomputation."""
    from benchmarks.published_models import Llama, LlamaShape
    from cost_model.recompute_cost import graph_nodes, saved_bytes_per_node

    layers, h, ffn, heads, kv, s, b = 2, 256, 704, 4, 1, 64, 2
    with torch.device("meta"):
        model = Llama(LlamaShape(layers=layers, width=h, ffn=ffn, heads=heads, kv_heads=kv, vocab=128, seq=s))
    graph, order, _, priced = _on_one_gpu(model, s, b, ("none", "attention", "selective-op", "full"))
    # a fused attention call keeps no scores: recomputing the core reruns it and keeps as much as none
    assert priced["attention"].memory[0] == priced["none"].memory[0]
    assert priced["attention"].step_s > priced["none"].step_s
    outside = [n for n in order if not str(graph.nodes[n].get("module", "")).startswith("layers.")]
    eager_outside = sum(saved_bytes_per_node(graph_nodes(graph, order), "cuda")[n] for n in outside) * b // 8
    kept = layers * 2 * b * s * (h + kv * (h // heads) + ffn + h + h)  # q, v, gate, down, attention: bf16
    assert priced["selective-op"].memory[0] - priced["full"].memory[0] == kept + eager_outside
    assert priced["full"].memory[0] < priced["selective-op"].memory[0] < priced["none"].memory[0]
    assert priced["none"].step_s < priced["selective-op"].step_s < priced["full"].step_s


def test_a_norm_written_op_by_op_is_priced_per_kernel_it_launches() -> None:
    """torchtitan's eager RMSNorm (fp32 cast, square, mean, rsqrt, scale, cast back, weight: eight kernels) against
    one fused norm, on one H100: the layer's GEMMs the same, its norms priced at several times the fused one's
    time and memory, so the step is slower and keeps more."""
    from benchmarks.published_models import Llama, LlamaShape

    runs = {}
    for written in ("kernels", "torchtitan-2412"):
        with torch.device("meta"):
            model = Llama(LlamaShape(layers=2, width=512, ffn=1536, heads=8, kv_heads=2, vocab=256, seq=256,
                                     written=written))  # type: ignore[arg-type]
        runs[written] = _on_one_gpu(model, 256, 2, ("none",))
    fused_g, _, fused_cost, fused = runs["kernels"]
    ops_g, ops_order, ops_cost, ops = runs["torchtitan-2412"]
    device = torch.device("cuda", 0)

    def flops(g: nx.DiGraph) -> float:
        return sum(float(g.nodes[n].get("flops", 0) or 0) for n in g.nodes)

    assert flops(fused_g) == pytest.approx(flops(ops_g), rel=1e-3)
    norm = fused_cost.forward_time(fused_g.nodes["layers_0_norm1"], device)
    ops_norm = [n for n in ops_order if n.startswith("layers_0_norm1") or str(ops_g.nodes[n].get("module", ""))
                .startswith("layers.0.norm1")]
    assert len([n for n in ops_norm if ops_g.nodes[n].get("shapes")]) >= 8
    assert sum(ops_cost.forward_time(ops_g.nodes[n], device) for n in ops_norm) > 5 * norm
    assert ops["none"].step_s > fused["none"].step_s
    assert ops["none"].memory[0] > fused["none"].memory[0]
