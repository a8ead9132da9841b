"""A plan as a torchtitan 0.3.0 job: the overrides its ConfigManager parses, as a torchrun script with a comment each.

torchtitan 0.3.0 reads no TOML: `torchrun ... -m torchtitan.train --module M --config C` loads a
config function, and `--section.key` arguments (parsed by tyro in
`torchtitan.config.manager.ConfigManager`) override its fields. The option names below are
`torchtitan/config/configs.py`'s (TrainingConfig, ParallelismConfig) and the activation
checkpointing subcommands of `torchtitan/distributed/activation_checkpoint.py`:

    degrees      pp x dp_replicate x dp_shard x cp x tp = the plan's ranks (torchtitan's mesh, pp outermost); ep
                 borrowed from dp_shard x cp x tp (partitioner.export.torchtitan_axes)
    pipeline     module_fqns_per_model_part (partitioner.export.model_parts), the schedule CSV and its layout
    batch        pipeline_parallel_microbatch_size x micro-batches per pipeline = local_batch_size;
                 global_batch_size = every replica's samples (no pipeline: gradient accumulation over them)
    recompute    activation-checkpoint:none | selective | full, last (tyro reads no option after it)
    kernels      the plan's kernel set: "fused" is compile.enable (torch.compile's fused kernels), "eager" not
"""

from __future__ import annotations

import os
import shlex
import stat
from dataclasses import dataclass, field
from pathlib import Path

from partitioner.errors import PartitionError
from partitioner.export.model_parts import ModelParts, model_parts
from partitioner.export.pipelines import per_pipeline, pipeline_schedule
from partitioner.export.torch_schedule import TorchSchedule
from partitioner.export.torchtitan_axes import axis_degrees, axis_options
from runtime.plan import Plan, human_bytes

__all__ = ["TorchtitanJob", "microbatch_size", "to_torchtitan", "torchtitan_job", "write_torchtitan"]

_CLASS_WHY = {
    "chain": "one stage per rank",
    "loop": "stage s on pipeline rank s % pipeline_parallel_degree",
    "v": "two stages per rank in a V (rank r holds stages r and 2p - 1 - r)",
}
_RECOMPUTE = ("none", "selective", "full")  # weakest first
_TORCH_DTYPES = ("bfloat16", "float32")  # what TrainingConfig.dtype and mixed_precision_param accept


@dataclass(frozen=True)
class TorchtitanJob:
    """torchtitan's arguments for a plan, and what it took to make them.

    Attributes:
        options: each override (its argv tokens) with why it has that value, in argv order.
        checkpointing: the activation checkpointing subcommand ("activation-checkpoint:full"),
            which must come after every option.
        world_size: ranks of the job (the plan's), torchrun's nnodes x nproc-per-node.
        hosts, gpus_per_host: torchrun's --nnodes and --nproc-per-node.
        parts: each stage's torchtitan module names.
        schedule: the schedule written to the CSV; None without a pipeline (one stage).
        notes: what torchtitan runs otherwise than the plan priced, one sentence each.
        header: the plan in a few comment lines.
        module, config: torchtitan's --module and --config, where given.
        degrees: pp, dp_replicate, dp_shard, cp, tp, ep as written (torchtitan's ParallelDims names).
    """

    options: list[tuple[list[str], str]]
    checkpointing: str
    world_size: int
    hosts: int
    gpus_per_host: int
    parts: ModelParts
    schedule: TorchSchedule | None
    notes: list[str] = field(default_factory=list)
    header: list[str] = field(default_factory=list)
    module: str | None = None
    config: str | None = None
    degrees: dict[str, int] = field(default_factory=dict)

    def args(self, module: str | None = None, config: str | None = None) -> list[str]:
        """What `torchtitan.train` reads (`ConfigManager().parse_args(job.args())`), --module and --config first.

        Raises:
            ValueError: neither the job nor the call names torchtitan's module and config.
        """
        module, config = module or self.module, config or self.config
        if not module or not config:
            raise ValueError("name torchtitan's --module and --config (e.g. args('llama3', 'llama3_8b'), or "
                             "torchtitan_job(plan, module=..., config=...))")
        return ["--module", module, "--config", config, *(t for tokens, _ in self.options for t in tokens),
                self.checkpointing]

    def write(self, path: str | os.PathLike[str]) -> Path:
        """Write `script()` to `path`, executable; returns the path."""
        out = Path(path)
        out.write_text(self.script(), encoding="utf-8")
        out.chmod(out.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        return out

    def script(self) -> str:
        """A bash script running the job under torchrun on every host (MODULE, CONFIG, NODE_RANK, ... from the env)."""
        layers = f"{self.parts.layers} layers: tok_embeddings, layers.0-{self.parts.layers - 1}, norm, lm_head"
        module = _env("MODULE", self.module, "the torchtitan --module of the model, e.g. llama3")
        config = _env("CONFIG", self.config, f"the torchtitan --config that builds the model of the plan ({layers})")
        lines = ["#!/usr/bin/env bash", *(f"# {line}" for line in self.header)]
        if self.notes:
            lines.append("# What torchtitan runs otherwise than the plan priced:")
            lines += [f"#   - {note}" for note in self.notes]
        lines += [
            f"# Run on each of the {self.hosts} host{'s' if self.hosts > 1 else ''}: NODE_RANK=<0..{self.hosts - 1}> "
            "MASTER_ADDR=<host 0> bash this.sh [more --section.key overrides]",
            "set -euo pipefail",
            f"module={module}",
            f"config={config}",
            "args=(",
            '  --module "$module" --config "$config"',
        ]
        for tokens, why in self.options:
            lines += [f"  # {why}", f"  {_shell(tokens)}"]
        lines += [
            ")",
            f"exec ${{TORCHRUN:-torchrun}} --nnodes={self.hosts} --nproc-per-node={self.gpus_per_host} "
            '--node-rank="${NODE_RANK:-0}" \\',
            '  --master-addr="${MASTER_ADDR:-localhost}" --master-port="${MASTER_PORT:-29500}" \\',
            f'  -m torchtitan.train "${{args[@]}}" "$@" {self.checkpointing}',
        ]
        return "\n".join(lines) + "\n"


def microbatch_size(plan: Plan) -> tuple[int | None, str]:
    """Samples one rank's stage takes per micro-batch, read from the first input's shape in `plan.graph` (dim 0)."""
    inputs = [n for n in (plan.graph or {}).get("nodes", []) if n.get("op") == "placeholder" and n.get("shapes")]
    if not inputs or not inputs[0]["shapes"][0]:
        return None, "unknown: the plan carries no input shapes"
    first = inputs[0]
    return int(first["shapes"][0][0]), f"dim 0 of input {first['name']}, {first['shapes'][0]} per micro-batch"


def torchtitan_job(plan: Plan, csv_path: str | os.PathLike[str] = "schedule.csv", *, module: str | None = None,
                   config: str | None = None, microbatch: int | None = None,
                   schedule: TorchSchedule | None = None) -> TorchtitanJob:
    """torchtitan 0.3.0's arguments for `plan` (module docstring): every degree, the pipeline, batch, recompute.

    Args:
        csv_path: where the schedule CSV is, as torchtitan will be given it.
        module, config: torchtitan's --module and --config (the script otherwise reads them from
            the environment).
        microbatch: samples per micro-batch on one rank; default: read from the plan's input shapes.
        schedule: `pipeline_schedule(plan)` if already made.

    Raises:
        PartitionError: what torchtitan cannot run as planned, naming the stage and the fix: stages
            with different tensor degrees, sharding modes or expert degrees, a stage holding no whole
            layer, a stage layout other than one per rank, a loop or a V, an unknown micro-batch size,
            a sequence or an expert degree torchtitan cannot split so (torchtitan_axes.axis_options).
    """
    tp, shard, sharded = _uniform(plan)
    sched = schedule or pipeline_schedule(plan)
    if sched.layout == "custom":
        raise PartitionError(f"stages sit on pipeline ranks {sched.stage_to_rank}; torchtitan lays stages out one per "
                             "rank, round robin (stage s on rank s % ranks) or in a V: plan with one of those layouts "
                             "(torch's _PipelineScheduleRuntime runs this CSV as it is)")
    replicas, pp = plan.stages[0].replicas, sched.ranks
    cp, ep = axis_degrees(plan)
    world = pp * replicas * cp * tp
    if world != plan.ranks:
        raise PartitionError(f"the plan runs on {plan.ranks} ranks, but its {pp} pipeline ranks x {replicas} replicas "
                             f"x context {cp} x tensor {tp} make {world}: torchtitan's mesh holds every rank once; "
                             "plan every rank into a stage")
    size, source = (microbatch, "given") if microbatch is not None else microbatch_size(plan)
    if size is None or size < 1:
        raise PartitionError(f"micro-batch size {source}; pass microbatch= (samples per micro-batch on one rank)")
    parts = model_parts(plan)
    count = per_pipeline(plan)
    dp_replicate, dp_shard = (1, replicas) if sharded else (replicas, 1)
    per_host = plan.gpus_per_host or world
    hosts, nproc = -(-world // per_host), min(per_host, world)
    opts = _degrees(plan, pp, dp_replicate, dp_shard, tp, shard)
    batch = _batch(plan, size, source, count, pp, replicas)
    seq = next((int(t[0].partition("=")[2]) for t, _ in batch if t[0].startswith("--training.seq_len=")), None)
    axes, axis_notes = axis_options(plan, tp, dp_shard, seq)
    opts += axes + batch
    if pp > 1:
        opts += [
            (["--parallelism.module_fqns_per_model_part", *(",".join(p) for p in parts.parts)],
             f"each stage's modules (the plan's {parts.layer_list}.N are layers.N)"),
            (["--parallelism.pipeline_parallel_layers_per_stage", "None"], "stages come from the module lists"),
            _opt("parallelism.pipeline_parallel_schedule", sched.torch_class,
                 f"the stage layout: {_CLASS_WHY[sched.layout]}; the actions come from the CSV"),
            _opt("parallelism.pipeline_parallel_schedule_csv", str(csv_path),
                 f"the plan's {plan.schedule} actions per pipeline rank (python -m partitioner export)"),
        ]
    opts += _dtypes(plan)
    if plan.kernels == "fused":
        opts.append((["--compile.enable"], "fused kernels, as the plan is priced (kernels fused: torch.compile fuses "
                     "norms, SwiGLU and the other pointwise chains; attention runs SDPA's flash kernel)"))
    opts.append((["--training.disable_cuda_graphs"],
                 f"{plan.kernels} kernels, as the plan is priced (torchtitan 0.3.0 refuses CUDA graphs with a "
                 "pipeline)"))
    checkpointing, why = _checkpointing(plan)
    notes = [*parts.moved, *([why] if why else []), *axis_notes, *_layout_notes(plan, sched, replicas, cp * tp)]
    if pp == 1 and count > 1 and replicas > 1 and any(s.gradient_sync == "last" for s in plan.stages):
        notes.append(f"gradients: torchtitan reduces them after each of its {count} accumulation steps; the plan "
                     "reduces once a step, after the last micro-batch")
    memory = ", ".join(f"stage {s.index} {human_bytes(s.memory_bytes)}" for s in plan.stages if s.memory_bytes)
    split = f"{count} micro-batches per pipeline" + (", each sliced over the replicas" if plan.data_split == "slice"
                                                     else "")
    header = [
        "torchtitan 0.3.0 job for a plan made by partitioner (python -m partitioner export --torchtitan).",
        f"Plan: {len(plan.stages)} stages x {replicas} replicas ({shard if sharded else 'unsharded'})"
        f"{f' x context {cp}' if cp > 1 else ''} x tensor {tp}{f', experts over {ep} replicas' if ep > 1 else ''} on "
        f"{world} ranks ({hosts} x {nproc} GPUs), schedule {plan.schedule}, {split}; predicted step "
        f"{plan.predicted_step_ms:.3f} ms; kernels {plan.kernels}.",
        f"Predicted memory per GPU: {memory or 'not predicted'}.",
    ]
    return TorchtitanJob(opts, checkpointing, world, hosts, nproc, parts, sched if pp > 1 else None, notes, header,
                         module, config, {"pp": pp, "dp_replicate": dp_replicate, "dp_shard": dp_shard, "cp": cp,
                                          "tp": tp, "ep": ep})


def to_torchtitan(plan: Plan, csv_path: str | os.PathLike[str] = "schedule.csv", *, microbatch: int | None = None,
                  schedule: TorchSchedule | None = None, module: str | None = None, config: str | None = None) -> str:
    """The torchrun script of `torchtitan_job(plan, ...)` (see there for the arguments and errors)."""
    return torchtitan_job(plan, csv_path, module=module, config=config, microbatch=microbatch,
                          schedule=schedule).script()


def write_torchtitan(plan: Plan, path: str | os.PathLike[str], csv_path: str | os.PathLike[str], *,
                     microbatch: int | None = None, module: str | None = None,
                     config: str | None = None) -> tuple[Path, Path]:
    """Write the schedule CSV and the executable script that names it; returns (script path, csv path)."""
    sched = pipeline_schedule(plan)
    job = torchtitan_job(plan, csv_path, microbatch=microbatch, schedule=sched, module=module, config=config)
    csv_out = sched.write_csv(csv_path)
    return job.write(path), csv_out


def _opt(name: str, value: object, why: str) -> tuple[list[str], str]:
    return [f"--{name}={value}"], why


def _env(name: str, value: str | None, what: str) -> str:
    """`"${NAME:-value}"`, or `"${NAME:?set NAME to ...}"` where no value is given (bash stops there, saying so)."""
    return f'"${{{name}:-{value}}}"' if value else f'"${{{name}:?set {name} to {what}}}"'


def _shell(tokens: list[str]) -> str:
    return " ".join(shlex.quote(t) for t in tokens)


def _uniform(plan: Plan) -> tuple[int, str, bool]:
    """(tensor degree, sharding mode, sharded?) of every stage; PartitionError naming the first stage that differs."""
    first = plan.stages[0]
    for stage in plan.stages[1:]:
        if stage.tensor != first.tensor:
            raise PartitionError(f"stage {stage.index} splits its layers over {stage.tensor} ranks and stage 0 over "
                                 f"{first.tensor}: torchtitan runs one tensor_parallel_degree for the whole model; "
                                 f"plan with one tensor degree for every stage (tensor={max(first.tensor, 2)}, CLI "
                                 f"--tensor {max(first.tensor, 2)})")
        if stage.sharding != first.sharding:
            raise PartitionError(f"stage {stage.index} shards its replicas {stage.sharding!r} and stage 0 "
                                 f"{first.sharding!r}: torchtitan runs one data-parallel mode for the whole model; "
                                 f"plan with one sharding mode for every stage (sharding='{first.sharding}', CLI "
                                 f"--sharding {first.sharding})")
    return first.tensor, first.sharding, first.sharding != "none"


def _groups(plan: Plan) -> str:
    groups = [g for s in plan.stages for g in s.tensor_groups]
    return f"{len(groups)} groups of linear layers and attention" if groups else "no group named"


def _degrees(plan: Plan, pp: int, dp_replicate: int, dp_shard: int, tp: int,
             shard: str) -> list[tuple[list[str], str]]:
    """The pipeline, data and tensor degrees of torchtitan's mesh, sequence parallelism, resharding (context and
    expert degrees: torchtitan_axes)."""
    sharded = shard != "none"
    opts: list[tuple[list[str], str]] = [
        _opt("parallelism.pipeline_parallel_degree", pp,
             f"pipeline ranks: {len(plan.stages)} stages, {len(plan.stages) // pp} per rank" if pp > 1
             else "no pipeline: the plan has one stage"),
        _opt("parallelism.data_parallel_replicate_degree", dp_replicate,
             "each stage's replicas, weights whole, gradients reduced" if not sharded else "no replica groups"),
        _opt("parallelism.data_parallel_shard_degree", dp_shard,
             f"each stage's replicas shard weights, gradients and optimizer state ({shard})" if sharded
             else "the plan shards no weights"),
        _opt("parallelism.tensor_parallel_degree", tp,
             f"ranks per replica, each stage's layers split over them ({_groups(plan)})" if tp > 1
             else "the plan splits no layer"),
    ]
    if tp > 1:
        opts.append((["--parallelism.no_enable_sequence_parallel"],
                     "activations stay whole between split layers, as the plan runs them"))
    if sharded:
        opts.append(_opt("parallelism.fsdp_reshard_after_forward", "always" if shard == "zero3" else "never",
                         "zero3 gathers each layer again for its backward" if shard == "zero3"
                         else f"{shard} keeps the gathered weights from forward to backward"))
    return opts


def _batch(plan: Plan, size: int, source: str, count: int, pp: int, replicas: int) -> list[tuple[list[str], str]]:
    """Micro-batch, local and global batch: torchtitan's micro-batch count (or accumulation steps) is the plan's."""
    total = size * count * replicas
    out: list[tuple[list[str], str]] = []
    if pp > 1:
        out += [
            _opt("parallelism.pipeline_parallel_microbatch_size", size, f"samples per micro-batch on a rank: {source}"),
            _opt("training.local_batch_size", size * count,
                 f"{size} x {count} micro-batches per pipeline (torchtitan's n_microbatches = local / micro-batch "
                 "size, as the CSV)"),
            _opt("training.global_batch_size", total, f"{replicas} pipelines x {size * count}: one step, no "
                 "accumulation"),
        ]
    else:
        out += [
            _opt("training.local_batch_size", size, f"samples per micro-batch on a rank ({source}): one forward and "
                 "backward at a time, as the plan prices its activations"),
            _opt("training.global_batch_size", total, f"{replicas} replicas x {count} micro-batches x {size}: "
                 f"{count} gradient accumulation steps, the plan's micro-batches"),
        ]
    inputs = [n for n in (plan.graph or {}).get("nodes", []) if n.get("op") == "placeholder" and n.get("shapes")]
    shape, dtypes = (inputs[0]["shapes"][0], inputs[0].get("dtypes", [])) if inputs else ([], [])
    if len(shape) == 2 and dtypes and str(dtypes[0]).startswith(("int", "torch.int")):
        out.append(_opt("training.seq_len", shape[1], f"tokens per sample: dim 1 of input {inputs[0]['name']}"))
    return out


def _dtypes(plan: Plan) -> list[tuple[list[str], str]]:
    """training.dtype (the stored weights) and mixed_precision_param (compute) from the plan's precision."""
    if plan.precision is not None:
        stored, compute, why = plan.precision.get("param"), plan.precision.get("compute"), \
            f"precision {plan.precision.get('name', 'given')}"
    else:
        floats = [d for n in (plan.graph or {}).get("nodes", []) for d in n.get("dtypes", [])
                  if "float" in str(d)]
        stored = compute = str(floats[0]).removeprefix("torch.") if floats else None
        why = "every state at the model's dtype"
    if stored not in _TORCH_DTYPES or compute not in _TORCH_DTYPES:
        return []
    return [_opt("training.dtype", stored, f"weights stored in {stored} ({why})"),
            _opt("training.mixed_precision_param", compute, f"computed in {compute} ({why})")]


def _checkpointing(plan: Plan) -> tuple[str, str]:
    """torchtitan's activation checkpointing subcommand for the plan's recompute modes, and a note where they differ."""
    modes = [s.recompute for s in plan.stages]
    strongest = max(modes, key=_RECOMPUTE.index)
    note = ""
    if len(set(modes)) > 1:
        more = [s.index for s in plan.stages if s.recompute != strongest]
        note = (f"recompute: the plan recomputes {', '.join(f'stage {s.index} {s.recompute}' for s in plan.stages)}; "
                f"torchtitan applies one mode to every layer: {strongest} (stages {more} recompute more than planned: "
                "slower, less memory)")
    if strongest == "selective":
        note = " ".join(filter(None, [note, "selective: torchtitan's policy keeps matmul outputs but recomputes every "
                                            "second matmul; the plan's keeps every one (torchtitan: less memory, "
                                            "more time)"]))
    return f"activation-checkpoint:{strongest}", note


def _layout_notes(plan: Plan, sched: TorchSchedule, replicas: int, tp: int) -> list[str]:
    """Where the plan's ranks differ from torchtitan's mesh (pp, dp, cp, tp; pp outermost, tp innermost); `tp`: the
    ranks of a replica (context x tensor)."""
    differ = [(s, j) for s in plan.stages for j, rank in enumerate(s.ranks or [s.index])
              if rank != (sched.stage_to_rank[s.index] * replicas + j) * tp]
    if not differ:
        return []
    s, _ = differ[0]
    theirs = [(sched.stage_to_rank[s.index] * replicas + j) * tp for j in range(min(3, replicas))]
    return [f"ranks: torchtitan's mesh (pp, dp_replicate, dp_shard, cp, tp; pp outermost) puts stage {s.index}'s "
            f"replicas on ranks {', '.join(map(str, theirs))}{', ...' if replicas > 3 else ''}; the plan put them on "
            f"{', '.join(map(str, s.ranks[:3]))}{', ...' if len(s.ranks) > 3 else ''}: the same degrees over other "
            "links, so its transfer and collective times are the plan's placement, not torchtitan's"]
