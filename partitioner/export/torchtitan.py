"""A plan as torchtitan's job config: the [parallelism] keys (and local batch size) as TOML, a comment on each value."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from partitioner.errors import PartitionError
from partitioner.export.torch_schedule import TorchSchedule, to_torch_schedule
from runtime.plan import Plan, human_bytes

__all__ = ["microbatch_size", "to_torchtitan", "write_torchtitan"]

# The keys are torchtitan's JobConfig fields (torchtitan/config/job_config.py: Parallelism, Training).
_CLASS_WHY = {
    "chain": "one stage per rank",
    "loop": "stage s on rank s % pipeline_parallel_degree",
    "v": "two stages per rank in a V (rank r holds stages r and 2p - 1 - r)",
}


def microbatch_size(plan: Plan) -> tuple[int | None, str]:
    """Samples per micro-batch, read from the first input's shape in `plan.graph` (dim 0), and where it came from."""
    inputs = [n for n in (plan.graph or {}).get("nodes", []) if n.get("op") == "placeholder" and n.get("shapes")]
    if not inputs or not inputs[0]["shapes"][0]:
        return None, "unknown: the plan carries no input shapes"
    first = inputs[0]
    return int(first["shapes"][0][0]), f"dim 0 of input {first['name']}, {first['shapes'][0]} per micro-batch"


def to_torchtitan(plan: Plan, csv_path: str | os.PathLike[str] = "schedule.csv", *,
                  microbatch: int | None = None, schedule: TorchSchedule | None = None) -> str:
    """torchtitan's config for `plan` as TOML: [parallelism] and [training].local_batch_size, a comment per value.

    Args:
        csv_path: where the schedule CSV is (`plan.to_torch_schedule().write_csv(csv_path)`), as
            torchtitan will be given it.
        microbatch: samples per micro-batch; default: read from the plan's input shapes.
        schedule: the plan's `to_torch_schedule()` if already made.

    Raises:
        PartitionError: the plan cannot run on torch's pipelining runtime (see `to_torch_schedule`),
            or the micro-batch size is unknown and not given.
    """
    sched = schedule or to_torch_schedule(plan)
    if sched.layout == "custom":
        raise PartitionError(f"stages sit on pipeline ranks {sched.stage_to_rank}; torchtitan lays stages out one per "
                             "rank, round robin (stage s on rank s % ranks) or in a V: plan with one of those layouts "
                             "(torch's _PipelineScheduleRuntime runs this CSV as it is)")
    size, source = (microbatch, "given") if microbatch is not None else microbatch_size(plan)
    if size is None or size < 1:
        raise PartitionError(f"micro-batch size {source}; pass microbatch= (samples per micro-batch)")
    split = sched.split_points
    stage_map = ", ".join(f"{s}:{r}" for s, r in sorted(sched.stage_to_rank.items()))
    memory = ", ".join(f"stage {s.index} {human_bytes(s.memory_bytes)}" for s in plan.stages if s.memory_bytes)
    lines = [
        "# torchtitan job config for a plan made by partitioner: merge these keys into your job's TOML.",
        f"# Plan: {len(plan.stages)} stages on {plan.ranks} ranks, schedule {plan.schedule}, {plan.micro_batches} "
        f"micro-batches; predicted step {plan.predicted_step_ms:.3f} ms.",
        f"# Predicted memory per GPU: {memory or 'not predicted'}.",
        "",
        "[parallelism]",
        _key("pipeline_parallel_degree", sched.ranks, f"ranks per pipeline; stage:rank {stage_map}"),
        _key("pipeline_parallel_schedule", sched.torch_class,
             f"the stage layout: {_CLASS_WHY[sched.layout]}; the actions come from the CSV"),
        _key("pipeline_parallel_schedule_csv", str(csv_path),
             f"the plan's {plan.schedule} actions per rank (python -m partitioner export)"),
    ]
    if split.on_boundaries:
        lines.append(_key("pipeline_parallel_split_points", split.names(),
                          "the module each stage after the first begins with (the plan's cuts)"))
        lines.append(f"# newer torchtitan (split points deprecated): module_fqns_per_model_part = "
                     f"{json.dumps(split.modules)}")
    else:
        lines.append("# pipeline_parallel_split_points: not written, these cuts are not on module boundaries:")
        lines += [f"#   {line}" for line in split.off_boundary]
        lines.append("#   plan with split_spec={'<module>': SplitPoint.BEGINNING, ...} to cut where modules begin")
    local_batch = size * sched.micro_batches
    lines += [
        _key("pipeline_parallel_microbatch_size", size, f"samples per micro-batch: {source}"),
        _key("data_parallel_replicate_degree", sched.pipelines,
             "equal pipelines side by side: each stage's replica count, gradients all-reduced"),
        _key("data_parallel_shard_degree", 1, "the plan shards no weights"),
        _key("tensor_parallel_degree", 1, "the plan splits no layer (tensor parallelism is not planned yet)"),
        "",
        "[training]",
        _key("local_batch_size", local_batch,
             f"{size} x {sched.micro_batches} micro-batches per pipeline: torchtitan's n_microbatches = "
             "local_batch_size / pipeline_parallel_microbatch_size must match the CSV"),
    ]
    return "\n".join(lines) + "\n"


def write_torchtitan(plan: Plan, path: str | os.PathLike[str], csv_path: str | os.PathLike[str], *,
                     microbatch: int | None = None) -> tuple[Path, Path]:
    """Write the schedule CSV and the TOML that names it; returns (toml path, csv path)."""
    sched = to_torch_schedule(plan)
    text = to_torchtitan(plan, csv_path, microbatch=microbatch, schedule=sched)
    csv_out = sched.write_csv(csv_path)
    out = Path(path)
    out.write_text(text, encoding="utf-8")
    return out, csv_out


def _key(name: str, value: Any, why: str) -> str:
    """`name = value  # why` in TOML (strings and lists of strings through JSON, whose quoting TOML shares)."""
    text = json.dumps(value) if isinstance(value, (str, list)) else str(value)
    return f"{name} = {text}  # {why}"
