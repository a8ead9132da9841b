"""A plan's pipelines as torch runs them: micro-batches dealt to the replicas, or every micro-batch sliced over them.

    deal  (data_split="deal"):  m micro-batches, replica j runs j, j + d, ...   -> m / d per pipeline
    slice (data_split="slice"): m micro-batches, every replica runs all m, each -> m per pipeline,
                                on its 1/d of the samples (sharded replicas)       each on its slice

torch.distributed.pipelining (and torchtitan) run one schedule on every pipeline, so both become
one CSV: dealt plans through `to_torch_schedule` (which renumbers each pipeline's micro-batches
0 .. m/d - 1), sliced plans from replica 0's pipeline, whose micro-batch numbers already are 0 .. m - 1.
"""

from __future__ import annotations

import dataclasses

from partitioner.errors import PartitionError
from partitioner.export.torch_schedule import TorchSchedule, to_torch_schedule, torch_action
from runtime.plan import Plan

__all__ = ["per_pipeline", "pipeline_schedule"]


def pipeline_schedule(plan: Plan) -> TorchSchedule:
    """The CSV's actions for `plan` (dealt or sliced micro-batches); `.pipelines` is each stage's replica count.

    Raises:
        PartitionError: what `to_torch_schedule` refuses, or a sliced plan whose replicas run
            different orders (torch runs one schedule on every pipeline).
    """
    if plan.data_split != "slice":
        return to_torch_schedule(plan)
    counts = sorted({s.replicas for s in plan.stages})
    if len(counts) > 1:
        raise PartitionError(f"stages run on {[s.replicas for s in plan.stages]} replicas each; sliced micro-batches "
                             "need every stage on as many (replica j of every stage is pipeline j)")
    first = [s.ranks[0] if s.ranks else s.index for s in plan.stages]
    _check_replicas_agree(plan)
    one = dataclasses.replace(
        plan, data_split="deal", programs=[p for p in plan.programs if p.rank in set(first)],
        stages=[dataclasses.replace(s, ranks=[rank]) for s, rank in zip(plan.stages, first)])
    return dataclasses.replace(to_torch_schedule(one), pipelines=counts[0])


def per_pipeline(plan: Plan) -> int:
    """Micro-batches one pipeline runs per step: the step's (Plan.pieces) over the replicas (m / d dealt, m sliced).

    Raises:
        PartitionError: dealt micro-batches the replicas do not share equally.
    """
    replicas = max(s.replicas for s in plan.stages)
    if plan.pieces % replicas:  # sliced: every pipeline runs each of its micro-batches on its slice
        raise PartitionError(f"{plan.micro_batches} micro-batches dealt over {replicas} replicas of each stage: every "
                             "pipeline must run as many; use a multiple of the replica count")
    return plan.pieces // replicas


def _check_replicas_agree(plan: Plan) -> None:
    """Raise PartitionError if the programs of replica j run other compute actions than replica 0's."""
    if not plan.programs:
        return  # lowered where they run, all from the same plan: one order
    ops = {p.rank: [torch_action(op) for op in p.ops if op.is_compute] for p in plan.programs}
    for j in range(1, plan.stages[0].replicas):
        for stage in plan.stages:
            mine, theirs = ops.get(stage.ranks[j]), ops.get(stage.ranks[0])
            if mine is not None and theirs is not None and mine != theirs:
                raise PartitionError(f"replica {j} of stage {stage.index} (rank {stage.ranks[j]}) runs another order "
                                     f"than replica 0 (rank {stage.ranks[0]}); torch runs one schedule on every "
                                     "pipeline")
