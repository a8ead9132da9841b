"""A plan's context and expert degrees as torchtitan 0.3.0 options, what it needs beside them, and where it differs.

Read from torchtitan 0.3.0's own source (`torchtitan/config/configs.py` ParallelismConfig,
`torchtitan/distributed/parallel_dims.py` ParallelDims.build_mesh, `seq_len_divisor`):

    context_parallel_degree       the sequence over cp ranks per replica; cp is a dim of the dense mesh
                                  (pp, dp_replicate, dp_shard, cp, tp), so the world holds pp x dp x cp x tp ranks
    context_parallel_load_balancer  "headtail": rank r of c holds chunks r and 2c - 1 - r of 2c, as the plan
                                  runs it (runtime.context_parallel); torch's context_parallel gathers K/V whole
                                  (its default rotate method, all-gather), as the plan does
    training.seq_len              must divide by tp x 2 cp (seq_len_divisor)
    expert_parallel_degree        ep borrows its ranks from dp_shard x cp x tp (the sparse mesh is
                                  pp, dp_replicate, efsdp, ep with efsdp = dp_shard x cp x tp / ep): ep must
                                  divide that product; ep is its innermost dim

torchtitan always shards with FSDP over dp_shard x cp (its `fsdp` mesh), and shards each expert's weights
over efsdp: the notes say so where the plan keeps those weights whole.
"""

from __future__ import annotations

from partitioner.errors import PartitionError
from runtime.plan import Plan

__all__ = ["axis_degrees", "axis_options"]

Option = tuple[list[str], str]


def axis_degrees(plan: Plan) -> tuple[int, int]:
    """(context degree, expert degree) of the plan: one each for the whole model, as torchtitan runs them.

    Raises:
        PartitionError: stages splitting their experts different ways.
    """
    experts = sorted({s.expert for s in plan.stages if s.expert > 1})
    if len(experts) > 1:
        raise PartitionError(f"stages split their experts {[s.expert for s in plan.stages]} ways: torchtitan runs "
                             f"one expert_parallel_degree for every MoE layer; plan one expert degree "
                             f"(expert={experts[0]})")
    return max(s.context for s in plan.stages), (experts or [1])[0]


def axis_options(plan: Plan, tp: int, dp_shard: int, seq_len: int | None) -> tuple[list[Option], list[str]]:
    """torchtitan's context and expert options for `plan`, and the notes where torchtitan runs them otherwise.

    Raises:
        PartitionError: a sequence length torchtitan cannot split, an expert degree that does not divide the
            ranks torchtitan borrows it from (unsharded replicas), naming the fix.
    """
    cp, ep = axis_degrees(plan)
    notes: list[str] = []
    opts: list[Option] = [
        ([f"--parallelism.context_parallel_degree={cp}"],
         f"each replica's sequence split over {cp} ranks ({_attentions(plan)})" if cp > 1
         else "the plan splits no sequence"),
    ]
    if cp > 1:
        opts.append((["--parallelism.context_parallel_load_balancer=headtail"],
                     f"rank r of {cp} holds chunks r and {2 * cp - 1}-r of {2 * cp}, as the plan's load balance"))
        if seq_len is not None and seq_len % (2 * cp * tp):
            raise PartitionError(f"torchtitan splits a sequence of {seq_len} tokens over tensor {tp} x 2 x context "
                                 f"{cp} = {2 * cp * tp} equal parts (its seq_len_divisor); plan with a sequence "
                                 f"length that is a multiple of {2 * cp * tp}")
        if dp_shard == 1:
            notes.append(f"context: torchtitan shards the weights over the {cp} context ranks of a replica (FSDP over "
                         "dp_shard x cp); the plan keeps them whole there and all-reduces their gradients")
        notes.append("context: torchtitan's model must use SDPA or FlexAttention (its varlen attention refuses context "
                     "parallelism); the plan split the attentions it checked causal")
    opts.append(([f"--parallelism.expert_parallel_degree={ep}"],
                 f"each MoE layer's experts split over {ep} replicas, tokens dispatched by all-to-all "
                 f"({_layers(plan)})" if ep > 1 else "the plan splits no experts"))
    if ep > 1:
        borrowed = dp_shard * cp * tp
        if borrowed % ep:
            fix = ("shard the replicas (sharding='zero1' or more: torchtitan's data_parallel_shard_degree holds the "
                   "expert ranks)" if dp_shard == 1 else f"use an expert degree dividing {borrowed}")
            raise PartitionError(f"torchtitan borrows the {ep} expert ranks from data_parallel_shard_degree {dp_shard} "
                                 f"x context {cp} x tensor {tp} = {borrowed} ranks (expert_parallel_degree must "
                                 f"divide it; the plan's replicas are {'unsharded' if dp_shard == 1 else 'sharded'}): "
                                 f"{fix}")
        if cp * tp > 1:
            notes.append(f"experts: torchtitan's expert groups are {ep} consecutive ranks of dp_shard x cp x tp (over "
                         "the context and tensor ranks first); the plan's are over replicas, each context and tensor "
                         "rank apart")
        if borrowed > ep:
            notes.append(f"experts: torchtitan shards each expert's weights over the {borrowed // ep} ranks holding "
                         "it (FSDP over efsdp); the plan keeps them whole and all-reduces their gradients")
        notes.append("experts: torchtitan splits every MoE layer's experts, stages the plan keeps whole included; its "
                     "--config must build an MoE model whose experts divide by the degree")
    return opts, notes


def _attentions(plan: Plan) -> str:
    found = [a for s in plan.stages for a in s.context_attention]
    return f"{len(found)} causal attentions" if found else "no attention named"


def _layers(plan: Plan) -> str:
    found = [e for s in plan.stages for e in s.expert_layers]
    return f"{len(found)} MoE layers" if found else "no MoE layer named"
