"""Expert and context degrees priced and searched (issue 39 item 4): the all-to-all against a hand count, the problem
one rank of the groups runs, memory falling with the degrees, the search choosing them only where they pay."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from torch import nn

from cost_model.all_to_all import NodeLimited, all_to_all_affine, all_to_all_time
from cost_model.analytic import AnalyticCostModel
from cost_model.cluster_shape import Cluster
from cost_model.precision import MIXED
from partitioner.arguments import cluster_devices
from partitioner.capture.experts import find_experts
from partitioner.capture.graph import build_graph, compute_nodes
from partitioner.capture.sequence import find_sequence_split
from partitioner.capture.shardable import find_shardable
from partitioner.capture.trace import trace
from partitioner.place.cluster.split_axes import search_split, views
from partitioner.place.replicated import plan_split
from partitioner.place.search.experts_context import SplitFacts, split_problem
from partitioner.place.search.infeasible import InfeasibleError
from partitioner.place.search.problem import SearchProblem
from tests import zoo


def test_all_to_all_is_priced_at_the_bus_bandwidth_inside_and_across_hosts() -> None:
    cluster = Cluster.parse("2x8xH100")
    intra, inter = cluster.fabric.intra, cluster.fabric.inter
    b = 1e9
    assert all_to_all_time(cluster, b, range(8)) == pytest.approx(intra.latency_s + 7 / 8 * b / intra.bandwidth)
    assert all_to_all_time(cluster, b, range(16)) == pytest.approx(  # half of each rank's bytes leave over its NIC
        inter.latency_s + max(7 / 16 * b / intra.bandwidth, 8 / 16 * b / inter.bandwidth))
    assert all_to_all_time(cluster, b, [0]) == 0.0 and all_to_all_time(cluster, 0.0, range(8)) == 0.0
    latency, slope = all_to_all_affine(cluster, range(16))
    assert latency + slope * b == pytest.approx(all_to_all_time(cluster, b, range(16)))


def test_node_limited_routing_sends_a_token_once_a_host() -> None:
    # DeepSeek-V3 (arXiv 2412.19437 section 3.2.2): 8 experts a token, on at most 4 of the group's 8 hosts; a
    # token crosses the NIC once per other host reached: 4 x 7/8 of 8 x 7/8 slots' bytes, half the unlimited
    cluster = Cluster.parse("8x8xH100")
    intra, inter = cluster.fabric.intra, cluster.fabric.inter
    b, limited = 1e9, NodeLimited(max_nodes=4, top_k=8)
    assert limited.across(8) == pytest.approx(0.5)  # 8 x (1 - (7/8)^8) = 5.25 hosts reached unlimited, 4 with it
    assert limited.across(2) == pytest.approx(2 * (1 - 0.5**8) / 8)  # 2 hosts: 1.99 reached, under the limit
    assert all_to_all_time(cluster, b, range(64), limited) == pytest.approx(
        inter.latency_s + max(63 / 64 * b / intra.bandwidth, 56 / 64 * b / inter.bandwidth * 0.5))
    assert all_to_all_time(cluster, b, range(8), limited) == all_to_all_time(cluster, b, range(8))  # one host
    latency, slope = all_to_all_affine(cluster, range(64), limited)
    assert latency + slope * b == pytest.approx(all_to_all_time(cluster, b, range(64), limited))
    with pytest.raises(ValueError, match="max_nodes=0"):
        NodeLimited(max_nodes=0, top_k=8)


def _problem(batch: int = 8) -> SearchProblem:
    """Three nodes: an attention (0), a stack of experts (1), a head (2); 1 s of work each for the whole batch."""
    n = 3
    return SearchProblem(
        np.zeros((1, n)), np.ones((1, n)), np.zeros(1, dtype=np.int64), np.array([-1, 0, 1, 2]),
        [np.array([0]), np.array([1]), np.array([2]), np.array([3])], np.full(4, 100.0),
        np.array([10.0, 1000.0, 20.0]), np.array([40.0, 40.0, 40.0]), np.zeros((1, 1, 2)), np.zeros((1, 2, 2)),
        np.array([np.inf]), 2, batch, ["cuda:0"], np.full(n, 8.0))


def _facts(batch: int = 8) -> SplitFacts:
    return SplitFacts(batch, np.array([0.0, 1e6, 0.0]), np.array([1]), np.array([800.0]), np.array([64.0]),
                      np.array([0.0]), (1, 2, 4), np.array([0]), np.array([32.0]), (1, 2, 4),
                      ("experts",), ("attention",))


def test_the_problem_one_rank_runs_against_a_hand_count() -> None:
    plain, facts = _problem(), _facts()
    a2a, ring = (1e-3, 1e-4), (2e-3, 1e-5)
    m = 4
    whole = plain.micro_batch_times(m)[0]
    ep = split_problem(plain, facts, expert=4, all_to_all=a2a)
    assert ep.param_bytes.tolist() == [10.0, 1000.0 - 800.0 * 3 / 4, 20.0]  # the stack's 800 bytes / 4
    four = 4 * (a2a[0] + a2a[1] * 64.0 / m)  # dispatch and combine, forward and backward, of 64 / m bytes
    # the stack's time as one rank of 4 runs it: its 1e6 FLOPs at the graph's product rate (no product of 1e9
    # FLOPs here: an unbounded rate) or the whole stack's time / 4 (its weights read: a quarter held), the larger
    assert ep.micro_batch_times(m)[0].tolist() == pytest.approx([whole[0], whole[1] / 4 + four, whole[2]])
    skewed = split_problem(plain, facts, expert=4, all_to_all=a2a, skew=1.5)
    assert skewed.micro_batch_times(m)[0][1] == pytest.approx(whole[1] / 4 * 1.5 + 4 * (a2a[0] + a2a[1] * 96.0 / m))
    fast = dataclasses.replace(plain, batch_times=np.array([[1.0, 1.0, 1e-3]]))  # a 3e9-FLOP product in 1 ms
    bound = split_problem(fast, dataclasses.replace(facts, flops=np.array([0.0, 1e6, 1e9])), expert=4)
    assert bound.batch_times[0][1] == pytest.approx(1.0 / 4)  # 3e6 FLOPs at 3e12 FLOP/s: the read bounds it
    compute = split_problem(fast, dataclasses.replace(facts, flops=np.array([0.0, 1e12, 1e9])), expert=4)
    assert compute.batch_times[0][1] == pytest.approx(3e12 / 3e12)  # 3e12 FLOPs at 3e12 FLOP/s: 1 s
    cp = split_problem(plain, facts, context=2, gather=ring)
    gathered = ring[0] + ring[1] * 32.0 / m  # all-gather K/V forward, reduce-scatter backward: a ring's worth
    grads = [(ring[0] + ring[1] * p) / m for p in plain.param_bytes]  # gradients summed once a step
    assert cp.micro_batch_times(m)[0].tolist() == pytest.approx(
        [whole[0] / 2 + gathered + grads[0], whole[1] / 2 + grads[1], whole[2] / 2 + grads[2]])
    # a sequence stays split between stages (runtime/context_parallel.py): each value crossing one is / 2 too
    assert cp.saved_bytes.tolist() == [20.0] * 3 and cp.value_bytes.tolist() == [v / 2 for v in plain.value_bytes]
    assert split_problem(plain, facts) is plain  # nothing split: the problem as it was
    with pytest.raises(ValueError, match="skew"):
        split_problem(plain, facts, expert=2, skew=0.5)


def test_a_rank_of_an_expert_group_reads_its_share_of_the_weights_every_micro_batch() -> None:
    # the stack (node 1) costs 6 ms a micro-batch whatever its size (its weights read, fixed_times) and 1 s of
    # work for the batch of 8; probed at 1 and 2 samples. As one rank of 4: the read / 4, and the work the larger
    # of 3 x 1e12 FLOPs at the product rate (node 2: 3e9 FLOPs in 1 ms, 3e12 FLOP/s: 1 s) and 1 s / 4
    fixed = np.array([[0.0, 6e-3, 0.0]])
    sizes = {k: fixed + np.array([[1.0, 1.0, 1e-3]]) * k / 8 for k in (1, 2)}
    plain = dataclasses.replace(_problem(), fixed_times=fixed, batch_times=np.array([[1.0, 1.0, 1e-3]]),
                                size_times=sizes)
    facts = dataclasses.replace(_facts(), flops=np.array([0.0, 1e12, 1e9]))
    ep = split_problem(plain, facts, expert=4)
    assert ep.micro_batch_times(8)[0][1] == pytest.approx(max(1.0 / 8, (6e-3 + 1.0 / 8) / 4))  # probed: 1 sample
    assert ep.micro_batch_times(4)[0][1] == pytest.approx(max(2.0 / 8, (6e-3 + 2.0 / 8) / 4))
    assert ep.fixed_times[0][1] == pytest.approx(6e-3 / 4) and ep.batch_times[0][1] == pytest.approx(1.0)
    light = split_problem(plain, dataclasses.replace(facts, flops=np.array([0.0, 1e8, 1e9])), expert=4)
    assert light.micro_batch_times(8)[0][1] == pytest.approx((6e-3 + 1.0 / 8) / 4)  # the read bounds it


def test_under_sequence_parallelism_a_tensor_rank_dispatches_and_computes_its_share_of_the_tokens() -> None:
    # the stack (node 1): 1e12 forward FLOPs for the batch of 8, priced at 3e12 FLOP/s (given: the rate before
    # the tensor split), 1 s of its own; one of t = 2 tensor ranks with sequence parallelism sends 64 / 2 bytes a
    # dispatch and computes 3e12 / 2 FLOPs; without it, every token on each tensor rank
    plain, a2a, m = _problem(), (1e-3, 1e-4), 4
    facts = dataclasses.replace(_facts(), flops=np.array([0.0, 1e12, 0.0]))
    whole = plain.micro_batch_times(m)[0]
    sp = split_problem(plain, facts, expert=4, tensor=2, all_to_all=a2a, sequence=True, rate=3e12)
    assert sp.micro_batch_times(m)[0][1] == pytest.approx(max(0.5, 1.0 / 4) / m + 4 * (a2a[0] + a2a[1] * 32.0 / m))
    no_sp = split_problem(plain, facts, expert=4, tensor=2, all_to_all=a2a, rate=3e12)
    assert no_sp.micro_batch_times(m)[0][1] == pytest.approx(1.0 / m + 4 * (a2a[0] + a2a[1] * 64.0 / m))
    assert sp.micro_batch_times(m)[0][[0, 2]].tolist() == pytest.approx(whole[[0, 2]].tolist())
    assert sp.param_bytes.tolist() == no_sp.param_bytes.tolist()  # the weights: / e, not / t


def test_uncounted_experts_run_at_the_products_rate_not_attentions() -> None:
    # nodes: an attention (2e9 forward FLOPs, 1 s), a product (2e9, 0.25 s), a stack of experts whose FLOPs the
    # tracer did not count (1e9 forward); the stack runs at the product's rate, 3 x 2e9 / 0.25 s, not at the
    # blend with attention's (which runs at its own, lower, efficiency and stays bf16 where products run FP8)
    plain = dataclasses.replace(_problem(), batch_times=np.array([[1.0, 0.0, 0.25]]))
    flops = np.array([2e9, 0.0, 2e9])
    facts = dataclasses.replace(_facts(), flops=flops, expert_flops=np.array([1e9]),
                                attends=np.array([True, False, False]))
    assert facts.rate(plain) == pytest.approx(3 * 2e9 / 0.25)
    blended = dataclasses.replace(facts, attends=None)
    assert blended.rate(plain) == pytest.approx(3 * 4e9 / 1.25)
    assert split_problem(plain, facts).batch_times[0][1] == pytest.approx(3 * 1e9 / (3 * 2e9 / 0.25))


def test_memory_per_gpu_falls_with_the_degrees() -> None:
    plain, facts = _problem(), _facts()
    held = [split_problem(plain, facts, expert=e).param_bytes.sum() for e in (1, 2, 4)]
    saved = [split_problem(plain, facts, context=c).saved_bytes.sum() for c in (1, 2, 4)]
    assert held[0] > held[1] > held[2] and saved[0] > saved[1] > saved[2]


class _BigExperts(nn.Module):
    """A plain MoE whose experts hold almost all of its weights (tests.zoo's PlainExperts, wider)."""

    def __init__(self, layers: int = 2, width: int = 32, experts: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, width)
        self.norms = nn.ModuleList(nn.LayerNorm(width) for _ in range(layers))
        self.moes = nn.ModuleList(zoo.PlainMoE(width, experts) for _ in range(layers))
        for moe in self.moes:
            moe.experts = zoo.PlainExperts(experts, width, 512)
        self.head = nn.Linear(width, 64)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for norm, moe in zip(self.norms, self.moes):
            x = x + moe(norm(x))
        return self.head(x)


def _traced(model: nn.Module, x: torch.Tensor, long_sequence: int = 1 << 30) -> tuple:
    torch.manual_seed(0)
    traced = trace(model, (x,))
    gm = traced.graph_module
    graph = build_graph(gm, [x])
    order = [n.name for n in compute_nodes(gm)]
    sequence = find_sequence_split(gm)
    facts = SplitFacts.of(graph, order, find_experts(gm, model), sequence, gm, long_sequence=long_sequence)
    return graph, order, facts, find_shardable(gm, graph), gm


def _cost(cluster: Cluster, gm: torch.fx.GraphModule) -> AnalyticCostModel:
    cost = AnalyticCostModel(cluster_devices(cluster)[2])
    cost.prepare(gm)
    return cost


def test_the_search_splits_experts_where_they_fit_no_other_way_and_the_plan_checks() -> None:
    torch.manual_seed(0)
    model, x = _BigExperts(), torch.randint(0, 64, (8, 16))
    graph, order, facts, shardable, gm = _traced(model, x)
    assert facts.has_experts and not facts.has_context and facts.expert_degrees == (1, 2, 4, 8)
    cluster = Cluster.parse("1x4xH100")
    cost = _cost(cluster, gm)
    capacity = float(cost.spec("cuda:0").memory_bytes)
    whole = search_split(graph, order, cluster, cost, facts, precision=MIXED, shardable=shardable, expert=1,
                         headroom=1e3)  # memory no limit: what the model needs with every expert on every rank
    need = max(whole.solution.memory)
    split = search_split(graph, order, cluster, cost, facts, precision=MIXED, shardable=shardable, expert=4,
                         headroom=1e3)
    assert max(split.solution.memory) < need  # expert states / 4
    assert split.kinds[0]["weights"] < whole.kinds[0]["weights"]
    room = 0.5 * (need + max(split.solution.memory)) / capacity  # between the two: only a split fits
    with pytest.raises(InfeasibleError):
        search_split(graph, order, cluster, cost, facts, precision=MIXED, shardable=shardable, expert=1,
                     headroom=room)
    plan, chosen = plan_split(graph, order, cluster, cost, facts, precision=MIXED, shardable=shardable, headroom=room)
    assert chosen.expert > 1 and chosen.tried[1, 1] == math.inf
    plan.check()
    held = [s for s in plan.stages if s.expert_layers]
    assert held and all(s.expert == chosen.expert and s.replicas % s.expert == 0 for s in held)
    assert plan.data_split == "slice" and sorted(r for s in plan.stages for r in s.all_ranks) == list(range(4))


def test_a_dense_model_gets_no_expert_or_context_degree() -> None:
    model, x = zoo.PlainMoEModel(), torch.randint(0, 64, (8, 16))
    dense = nn.Sequential(nn.Embedding(64, 32), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 64))
    graph, order, facts, shardable, gm = _traced(dense, x)
    assert not facts.has_experts and not facts.has_context
    cluster = Cluster.parse("1x4xH100")
    found = search_split(graph, order, cluster, _cost(cluster, gm), facts, precision=MIXED, shardable=shardable)
    assert (found.expert, found.context) == (1, 1) and list(found.tried) == [(1, 1)]
    assert find_experts(trace(model, (x,)).graph_module, model).layers  # the MoE of the zoo is found (above: not)


def _long_llama() -> tuple:
    """A Hugging Face Llama traced at 256 tokens, its sequence long enough to split (long_sequence=256)."""
    pytest.importorskip("transformers")
    case = zoo.hf_case("llama")
    case.config.use_cache = False
    case.config.max_position_embeddings = 256
    torch.manual_seed(0)
    model, x = case.build(), torch.randint(0, 128, (2, 256))
    return _traced(model, x, long_sequence=256)


def test_a_long_sequence_splits_over_context_ranks_and_the_plan_checks() -> None:
    graph, order, facts, shardable, gm = _long_llama()
    assert facts.has_context and len(facts.attention_pos) == 2 and (facts.kv_bytes > 0).all()
    short = SplitFacts.of(graph, order, None, find_sequence_split(gm), gm, long_sequence=512)
    assert not short.has_context  # shorter than the long-sequence mark: whole, as before
    cluster = Cluster.parse("1x4xH100")
    cost = _cost(cluster, gm)
    whole = search_split(graph, order, cluster, cost, facts, precision=MIXED, shardable=shardable, context=1,
                         headroom=1e3)
    plan, split = plan_split(graph, order, cluster, cost, facts, precision=MIXED, shardable=shardable, context=2,
                             headroom=1e3)
    saved = [x.axes.degree(1).problem.saved_bytes.sum() for x in (whole, split)]
    assert saved[1] == pytest.approx(saved[0] / 2)  # activations / 2 on each context rank
    plan.check()
    assert all(s.context == 2 for s in plan.stages) and plan.data_split == "slice"
    assert [a for s in plan.stages for a in s.context_attention] == [f"model.layers.{k}.self_attn" for k in range(2)]
    assert [(v.hosts, v.gpus_per_host, ts) for v, ts in views(cluster, 2)] == [(1, 2, None)]
    assert [(v.hosts, v.gpus_per_host, ts) for v, ts in views(Cluster.parse("32x8xH100"), 4)] == [
        (32, 2, None), (8, 8, (4, 8))]  # inside a host, or TP 4 / 8 inside one with the context ranks on others


@pytest.mark.timeout(300)
def _llama_at_131k() -> tuple[torch.nn.Module, torch.Tensor]:
    """A 4-layer Llama 3 8B shape on meta (fx can trace it) and 8 sequences of 131,072 token ids."""
    from benchmarks.published_models import Llama, LlamaShape

    with torch.device("meta"):
        model = Llama(LlamaShape(layers=4, width=4096, ffn=14336, heads=32, kv_heads=8, seq=131072)).to(torch.bfloat16)
    return model, torch.zeros(8, 131072, dtype=torch.long, device="meta")


def test_the_front_door_splits_the_long_sequence_of_an_fx_traceable_llama_within_memory() -> None:
    # plan(): a Llama fx can trace, at 131,072 tokens, is exported (its sequence free) and planned with a context
    # degree; recompute="auto" keeps the search's choice for the split stage, whose memory the search counted per
    # rank (the whole graph's count judged it over and recomputed it to 102.5 GiB per GPU of 72)
    from partitioner import plan

    model, tokens = _llama_at_131k()
    made = plan(model, cluster="4x8xH100", example_inputs=(tokens,), micro_batches=8, replicas="auto",
                schedule="auto", precision="mixed", recompute="auto")
    made.check()
    assert all(s.context > 1 for s in made.stages)
    assert all(s.capacity_bytes and 0 < s.memory_bytes <= s.capacity_bytes for s in made.stages), [
        (s.memory_bytes / 2**30, s.recompute) for s in made.stages]
    # a stage's time per micro-batch over its replicas (the summary's and the picture's bottleneck) is the split
    # rank's, so its micro-batches fit inside the step; it kept the whole sequence's time (x c) before
    assert 0.5 * made.predicted_step_ms <= made.bottleneck_ms * made.pieces <= made.predicted_step_ms


def test_a_replicas_context_ranks_shard_its_states_too() -> None:
    from partitioner.place.search.split_costs import lower_static_bytes
    from partitioner.place.search.states import StateRule

    rule = StateRule(MIXED, 2)
    alone = lower_static_bytes(1e9, rule, "zero3", 4, 1)
    over_context = lower_static_bytes(1e9, dataclasses.replace(rule, shard_degree=2), "zero3", 4, 1)
    assert over_context == pytest.approx(alone / 2)  # zero3: every state / (4 replicas x 2 context ranks)
    assert lower_static_bytes(1e9, dataclasses.replace(rule, shard_degree=2), "zero3", 8, 1) == pytest.approx(
        over_context / 2)


def test_a_split_plan_that_does_not_fit_names_the_cluster_given_and_more_micro_batches() -> None:
    # the search runs on the cluster one context rank sees (4x1xH100 for 4x8xH100 split 8 ways); the error names the
    # user's, and where the micro-batch count was given below the batch, more micro-batches as a fix (8 fit)
    from partitioner import plan
    from partitioner.place.search.infeasible import InfeasibleError

    model, tokens = _llama_at_131k()
    with pytest.raises(InfeasibleError) as caught:
        plan(model, cluster="4x8xH100", example_inputs=(tokens,), micro_batches=1, replicas="auto", schedule="auto",
             precision="mixed")
    text = str(caught.value)
    assert "does not fit on 4x8xH100-SXM (its sequence split" in text and "micro_batches up to 8" in text, text


def test_the_sharded_collectives_span_every_replicas_context_ranks() -> None:
    from partitioner.place.search.states import StateRule

    rule = StateRule(MIXED, 2, shard_degree=4, shard_ring=(1e-5, 2e-12))
    assert rule.data_group("zero3", 1, (0.0, 0.0)) == (4, (1e-5, 2e-12))  # one replica: its context ranks alone
    assert rule.data_group("zero1", 2, (3e-5, 1e-12)) == (8, (3e-5, 2e-12))  # 2 x 4 ranks, the slower of each
    assert rule.data_group("none", 2, (3e-5, 1e-12)) == (2, (3e-5, 1e-12))  # DDP: replicas only
    assert StateRule(MIXED, 2).data_group("zero3", 2, (3e-5, 1e-12)) == (2, (3e-5, 1e-12))


def test_one_replica_split_over_context_ranks_shards_its_states_over_them() -> None:
    # torchtitan's FSDP over dp_shard x cp (titan-8B-8-cp8-256k: d 1, c 8): the search had offered sharding only
    # with two replicas or more, so a replica of c context ranks held every state whole (an 8B model: 186 GiB)
    from partitioner.place.search.space import SearchSpace

    graph, order, facts, shardable, gm = _long_llama()
    cluster = Cluster.parse("1x2xH100")
    cost = _cost(cluster, gm)
    found = {}
    for mode in ("none", "zero3"):
        space = SearchSpace(2, precision=MIXED, sharding=(mode,))
        found[mode] = plan_split(graph, order, cluster, cost, facts, space=space, shardable=shardable, context=2,
                                 headroom=1e3)
    (whole, whole_split), (sharded, split) = found["none"], found["zero3"]
    assert split.solution.replicas == 1 and split.context == 2 and split.solution.modes == ["zero3"]
    sharded.check()
    assert [s.sharding for s in sharded.stages] == ["zero3"] and sharded.stages[0].context == 2
    for kind in ("master", "grads", "optimizer"):  # fp32 states: over the 2 context ranks
        assert split.kinds[0][kind] == pytest.approx(whole_split.kinds[0][kind] / 2, rel=0.02)
    assert max(split.solution.memory) < max(whole_split.solution.memory)
    # each rank steps its half of the weights (its FSDP2 shard), a sharded plan's gradients follow its choice
    assert sharded.stages[0].optimizer_ms == pytest.approx(whole.stages[0].optimizer_ms / 2)
    assert sharded.stages[0].gradient_sync == split.choice["gradients"] and whole.stages[0].gradient_sync == "last"
