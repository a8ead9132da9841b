"""The memory table by kind (partitioner.predict.memory_kinds) counts sharded states as the runtime holds them:
over replicas x context ranks (FSDP2's mesh holds both), and gradients by the stage's gradient mode."""

from __future__ import annotations

from cost_model.precision import MIXED
from partitioner.predict.memory_kinds import memory_kinds
from runtime.plan import Plan, StagePlan

PARAMS = 1 << 20  # parameters of the stage; bf16 weights: 2 bytes each


def stage_memory(*, context: int, sync: str, micro_batches: int = 4) -> dict[str, int]:
    stage = StagePlan(0, "cuda:0", ["a"], param_bytes=2 * PARAMS, memory_bytes=64 * PARAMS, activation_bytes=PARAMS,
                      sharding="zero2", gradient_sync=sync, context=context)  # type: ignore[arg-type]
    stage.ranks = [0, 2 * context]  # two replicas of `context` ranks each
    plan = Plan([stage], micro_batches=micro_batches, precision=MIXED.to_dict(), data_split="slice")
    return memory_kinds(plan, stage)


def test_sharded_states_split_over_replicas_and_context_ranks() -> None:
    alone, split = stage_memory(context=1, sync="every"), stage_memory(context=2, sync="every")
    # fp32 master 4 bytes and Adam's two fp32 states 8 bytes a parameter, over 2 and 4 ranks
    assert (alone["master"], alone["optimizer"]) == (4 * PARAMS // 2, 8 * PARAMS // 2)
    assert (split["master"], split["optimizer"]) == (4 * PARAMS // 4, 8 * PARAMS // 4)
    assert split["weights"] == 2 * PARAMS  # zero2 keeps the bf16 weights whole
    assert sum(split.values()) == 64 * PARAMS


def test_gradients_follow_the_stages_gradient_mode() -> None:
    every, last = stage_memory(context=1, sync="every"), stage_memory(context=1, sync="last")
    assert every["gradients"] == 4 * PARAMS // 2  # reduce-scattered each micro-batch: a shard kept
    assert last["gradients"] == 4 * PARAMS  # accumulated whole over 4 micro-batches (fp32), reduced once a step
