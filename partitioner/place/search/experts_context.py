"""Experts and sequences split over ranks, priced once for the searches: the problem as one rank of an expert group
(e replicas) and of a context group (c ranks of a replica) runs it.

    SplitFacts.of(graph, order, experts, sequence, gm)    what the finders report, as positions in `order`
    split_problem(problem, facts, expert=e, context=c, ...)   the SearchProblem one rank prices

Context degree c (runtime/context_parallel.py: two load-balanced chunks of 2c per rank, K/V all-gathered):
    every node's batch-proportional time / c (causal attention balanced by the head-tail chunks), the saved
    activations and working outputs / c; each split attention adds an all-gather of its K and V (whole
    sequence, per micro-batch) in forward and a reduce-scatter of their gradients in backward, not
    overlapped with compute: the runtime gathers before attending; the weights' gradients are summed over the
    context ranks once a step (`grad_scale`: gradient bytes per weight byte), spread over the micro-batches
    (a replica of m / d micro-batches pays it / d, where its replicas' own all-reduce crosses the same
    links). Ring attention (K/V passed in c - 1 steps
    under the compute) is not built, so it is not priced. Weights stay whole on every context rank of an
    unsharded stage; a sharded one's FSDP2 mesh holds the context ranks (StateRule.shard_degree and data_group:
    its states / d x c, its gathers and reduce-scatters over those ranks; the context all-reduce above is still
    added, which that reduce-scatter already does: an overcount of one gradient reduction a step); values
    between stages are / c too (`value_bytes`: their messages and the buffers in flight), as the runtime keeps
    a sequence split between stages of one degree ([Note: boundaries that stay split] in
    runtime/context_parallel.py; every stage of a split plan has the one context degree).
Expert degree e (runtime/expert_parallel.py, dropless): each stack's weights / e (and with them its
    gradients and optimizer states, which the searches count from `param_bytes`); per micro-batch four
    all-to-alls per layer (dispatch and combine, forward and backward) of tokens x top-k x hidden bytes
    (cost_model.all_to_all, on the group's ranks), and the experts' work on the busiest rank: the mean
    (uniform routing) times `skew`. A stack traced as one node whose FLOPs the tracer could not count
    (torch's grouped GEMMs on meta) is priced at 2 x one expert's weights per token-slot at the graph's
    own GEMM rate (its matrix products' FLOPs over their time; fused attention, which runs at its own lower
    efficiency and in BF16 where products run FP8, is not a product here).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

import networkx as nx
import numpy as np

from partitioner.capture.sequence import LONG_SEQUENCE
from partitioner.place.search.problem import SearchProblem

__all__ = ["GEMM_FLOPS", "LONG_SEQUENCE", "SplitFacts", "split_problem"]

GEMM_FLOPS = 1e9  # whole-batch forward FLOPs above which a node is a GEMM the graph's rate is read from
Affine = tuple[float, float]  # (latency s, seconds per byte)


@dataclass(frozen=True)
class SplitFacts:
    """Where the splittable experts and attentions sit in a compute order, and what splitting them moves."""

    batch: int  # samples of the whole-batch graph
    flops: np.ndarray  # [n] forward FLOPs per node, whole batch
    expert_pos: np.ndarray  # positions of the expert calls
    expert_bytes: np.ndarray  # their stacked weights' bytes
    dispatch_bytes: np.ndarray  # whole batch: tokens x top-k x hidden x itemsize, what one dispatch sends
    expert_flops: np.ndarray  # whole batch, forward: 2 x one expert's weights x token-slots
    expert_degrees: tuple[int, ...]
    attention_pos: np.ndarray  # positions of the causal attentions whose sequence splits
    kv_bytes: np.ndarray  # whole batch: their keys' and values' bytes (what an all-gather ends with)
    context_degrees: tuple[int, ...]
    expert_paths: tuple[str, ...] = ()  # module path of each expert call (the plan's StagePlan.expert_layers)
    attention_paths: tuple[str, ...] = ()  # module path of each split attention (StagePlan.context_attention)
    attends: np.ndarray | None = None  # [n] True at fused attention nodes (left out of the GEMM rate)
    top_k: int = 1  # experts a token goes to (the largest of the layers'): what node-limited routing bounds

    @property
    def has_experts(self) -> bool:
        return len(self.expert_pos) > 0 and len(self.expert_degrees) > 1

    @property
    def has_context(self) -> bool:
        return len(self.attention_pos) > 0 and len(self.context_degrees) > 1

    @classmethod
    def of(cls, graph: nx.DiGraph, order: Sequence[str], experts: Any = None, sequence: Any = None,
           gm: Any = None, long_sequence: int = LONG_SEQUENCE) -> SplitFacts:
        """From partitioner.capture.experts.Experts and capture.sequence.SequenceSplit (either None: none found);
        the sequence is split only from `long_sequence` tokens (shorter ones plan as they did)."""
        position = {name: i for i, name in enumerate(order)}
        first = next((a for _, a in graph.nodes(data=True) if a["op"] == "placeholder" and a.get("shapes")), None)
        batch = int(first["shapes"][0][0]) if first and first["shapes"] and first["shapes"][0] else 1
        flops = np.array([float(graph.nodes[x].get("flops", 0) or 0) for x in order])
        attends = np.array(["scaled_dot_product_attention" in str(graph.nodes[x].get("target", "")) for x in order],
                           dtype=bool)
        pos, wbytes, sent, work, paths, ks = [], [], [], [], [], [1]
        for layer in (experts.layers if experts is not None else []):
            if layer.node not in position:
                continue
            attrs = graph.nodes[layer.node]
            rows = attrs.get("shapes") or [(0, 0)]
            tokens, hidden = (rows[0][0], rows[0][-1]) if len(rows[0]) >= 2 else (0, 0)
            itemsize = max(1, int(attrs.get("out_bytes", 0) or 0) // max(1, tokens * hidden)) if tokens else 2
            k = layer.top_k or 1
            ks.append(k)
            pos.append(position[layer.node])
            paths.append(layer.path)
            wbytes.append(float(layer.param_bytes))
            sent.append(float(tokens * k * hidden * itemsize))
            work.append(2.0 * layer.param_bytes / itemsize / layer.experts * tokens * k)
        e_deg = experts.degrees() if experts is not None and experts.layers else (1,)
        apos, kv, heads = [], [], []
        split = sequence is not None and sequence.splits and (sequence.length or 0) >= long_sequence
        nodes = {n.name: n for n in gm.graph.nodes} if gm is not None else {}
        for a in (sequence.attention if split else []):
            if a.node not in position:
                continue
            node = nodes.get(a.node)
            args = [x for x in (node.args[1:3] if node is not None else []) if hasattr(x, "name")]
            apos.append(position[a.node])
            heads.append(a.path)
            kv.append(sum(float(graph.nodes[x.name].get("out_bytes", 0) or 0) for x in args if x.name in graph))
        c_deg = sequence.degrees() if split else (1,)
        return cls(batch, flops, np.array(pos, dtype=np.int64), np.array(wbytes), np.array(sent), np.array(work),
                   tuple(e_deg), np.array(apos, dtype=np.int64), np.array(kv), tuple(c_deg), tuple(paths), tuple(heads),
                   attends, max(ks))

    def rate(self, problem: SearchProblem) -> float:
        """The graph's own GEMM rate: forward + backward FLOPs (3 x forward) of its big products (not attention)
        over their time."""
        big = self.flops >= GEMM_FLOPS
        if self.attends is not None and np.any(big & ~self.attends):
            big &= ~self.attends
        seconds = float(problem.batch_times[0][big].sum())
        return 3.0 * float(self.flops[big].sum()) / seconds if seconds > 0 else float("inf")


def _add(problem: SearchProblem, pos: np.ndarray, latency: np.ndarray, per_sample: np.ndarray) -> SearchProblem:
    """`problem` with latency[i] per micro-batch and per_sample[i] x samples added to node pos[i]'s time."""
    if not len(pos) or not (np.any(latency) or np.any(per_sample)):
        return problem
    once, each = np.zeros(problem.n), np.zeros(problem.n)
    np.add.at(once, pos, latency)
    np.add.at(each, pos, per_sample)
    fixed, batch = problem.fixed_times + once, problem.batch_times + each * (problem.batch or 1)
    sizes = {k: v + once + each * k for k, v in problem.size_times.items()} if problem.size_times else None
    return dataclasses.replace(problem, fixed_times=fixed, batch_times=batch, size_times=sizes)


def _held(problem: SearchProblem, pos: np.ndarray, compute: np.ndarray, expert: int,
          samples: float) -> SearchProblem:
    """`problem` with node pos[i] as one rank of `expert` runs it: the larger of compute[i] (seconds for the whole
    batch of `samples`, forward + backward) and its time / expert, at every probed micro-batch size; fixed / expert and
    max(compute, per-sample / expert) where unprobed ([Note: a split stack reads its own experts' weights])."""
    fixed, batch = problem.fixed_times.copy(), problem.batch_times.copy()
    fixed[:, pos] /= expert
    batch[:, pos] = np.maximum(compute, batch[:, pos] / expert)
    sizes = None
    if problem.size_times:
        sizes = {k: v.copy() for k, v in problem.size_times.items()}
        for k, v in sizes.items():
            v[:, pos] = np.maximum(compute * k / samples, v[:, pos] / expert)
    return dataclasses.replace(problem, fixed_times=fixed, batch_times=batch, size_times=sizes)


# [Note: experts under sequence parallelism]
# Megatron-LM runs tensor parallelism beside experts only with sequence parallelism (megatron/core/transformer/
# transformer_config.py: "When using expert parallelism and tensor parallelism, sequence parallelism must be
# used"): each tensor rank routes, dispatches and computes the 1/t of the sequence it holds, so a rank's
# all-to-all bytes and its experts' FLOPs are / t (DeepSeek-V3 at TP 2, one 4k sequence: 470 MB -> 235 MB a
# dispatch); the stack's weights stay whole on each tensor rank (its experts, not the tokens, split over the
# expert group). Without it (what the runtime runs: eager DTensor, no SequenceParallel) every tensor rank
# dispatches and computes every token. Like sequence parallelism itself, priced only (search/space.py).

# [Note: a split stack reads its own experts' weights]
# A stack of experts is one node: the cost model prices it as one product that reads every expert's weights
# each pass (DeepSeek-V3: 256 experts, 22.5 GB a layer, 8.5 ms forward on an H100 for one 4k sequence, where its
# FLOPs take 1.9 ms at the FP8 rate). A rank of an expert group holds and reads 1 / e of them, so for a
# micro-batch of s samples its time is the larger of the stack's FLOPs for s (counted, or 2 x one expert's
# weights per token-slot) at the graph's product rate and the whole stack's time for s / e (the weight read,
# where that bounds it). The read is mostly the per-micro-batch part of the stack's time (`fixed_times`, paid
# whatever s): it is / e too (DeepSeek-V3 at TP 2, MBS 1: 59.6 of the stack's 65.3 ms forward + backward; before,
# only the per-sample part was bounded and 52 ms of read stayed on every rank). Where the problem has no probe
# at s, fixed / e + max(FLOPs, per-sample / e) x s, above the larger by at most the read / e.


def split_problem(problem: SearchProblem, facts: SplitFacts, *, expert: int = 1, context: int = 1, tensor: int = 1,
                  all_to_all: Affine = (0.0, 0.0), gather: Affine = (0.0, 0.0), skew: float = 1.0,
                  grad_scale: float = 1.0, sequence: bool = False, rate: float | None = None) -> SearchProblem:
    """The problem as one rank of an expert group of `expert` replicas and a context group of `context` ranks runs
    it (module docstring); `problem` is as one of `tensor` ranks runs it. `all_to_all`: the expert group's
    all-to-all (cost_model.all_to_all.all_to_all_affine); `gather`: the context group's all-reduce ring
    (cost_model.collectives.ring_of; an all-gather is half of it). `sequence`: `problem` was priced with sequence
    parallelism (search/tensor_split.py), so each tensor rank dispatches and computes 1/t of the tokens ([Note:
    experts under sequence parallelism]). `rate`: the graph's product rate (FLOP/s, `SplitFacts.rate`) read on the
    problem before its tensor split (`facts` counts every FLOP of the whole graph, a rank of t runs 1/t of a split
    product's); None: read on `problem`. Where nothing splits, `problem` itself."""
    if skew < 1:
        raise ValueError(f"skew={skew}: the busiest rank's expert load over the mean is 1 (uniform) or more")
    out = problem
    c, samples = max(1, context), float(facts.batch or 1)
    share = max(1, tensor) if sequence else 1  # the tensor ranks a micro-batch's tokens are split over
    if rate is None:
        rate = facts.rate(problem) if len(facts.expert_pos) else float("inf")
    if len(facts.expert_pos):  # the experts' work where the tracer counted none, and the busiest rank's skew
        skew = skew if expert > 1 else 1.0  # a replica holding every expert computes its own tokens' slots
        counted = facts.flops[facts.expert_pos] > 0
        work = np.where(counted, 0.0, facts.expert_flops * 3.0 / rate) / samples / share
        own = problem.batch_times[0][facts.expert_pos] / samples
        if expert > 1:  # [Note: a split stack reads its own experts' weights]
            flops = np.where(counted, facts.flops[facts.expert_pos], facts.expert_flops) / share
            out = _held(out, facts.expert_pos, flops * 3.0 / rate, expert, samples)
            own, work = out.batch_times[0][facts.expert_pos] / samples, np.zeros(len(work))
        out = _add(out, facts.expert_pos, np.zeros(len(work)), (work + own) * (skew - 1.0) + work)
    if c > 1:
        size = {k: v / c for k, v in (out.size_times or {}).items()}
        out = dataclasses.replace(out, batch_times=out.batch_times / c, size_times=size or None,
                                  saved_bytes=out.saved_bytes / c, value_bytes=out.value_bytes / c,
                                  out_bytes=out.out_bytes / c if out.out_bytes is not None else None)
        latency, slope = gather
        kv = facts.kv_bytes / max(1, tensor)  # heads split over the tensor ranks
        out = _add(out, facts.attention_pos, np.full(len(kv), latency), slope * kv / samples)  # 2 x half a ring
        grads = out.param_bytes * grad_scale  # summed over the context ranks once a step (runtime/axis_reduce.py)
        everywhere = np.arange(out.n)
        out = _add(out, everywhere, np.zeros(out.n), np.where(grads > 0, latency + slope * grads, 0.0) / samples)
    if expert > 1:
        latency, slope = all_to_all
        sent = facts.dispatch_bytes / c / share / samples * skew
        out = _add(out, facts.expert_pos, np.full(len(sent), 4 * latency), 4 * slope * sent)
        params = out.param_bytes.copy()
        held = np.minimum(params[facts.expert_pos], facts.expert_bytes)
        params[facts.expert_pos] -= held * (1.0 - 1.0 / expert)
        out = dataclasses.replace(out, param_bytes=params)
    return out
