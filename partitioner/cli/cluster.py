"""`plan --cluster 16x8xH100`: plan for GPUs that are not here, check the plan fits, and report its throughput.

Throughput (samples/s, tokens/s, MFU) as partitioner/cli/throughput.py counts it. --dtype casts the
model's weights and floating inputs before tracing (bf16, fp16), so the analytic model prices products
and memory at that dtype; tf32 keeps fp32 tensors and prices fp32 products on the TF32 peak.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Literal, get_args

import torch
import torch.utils._pytree as pytree
from rich import box
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from cost_model.analytic import AnalyticCostModel
from cost_model.cluster_shape import Cluster, ClusterError, as_cluster
from cost_model.gpu_table import precision_of
from cost_model.precision import Precision
from partitioner.api import plans as make_plans
from partitioner.arguments import cluster_devices
from partitioner.cli.inputs import Example, UsageError, load_example
from partitioner.cli.throughput import Throughput, throughput
from partitioner.errors import PartitionError
from partitioner.place.planning import device_capacity
from partitioner.place.search.infeasible import held_text
from partitioner.place.search.progress import reporting
from partitioner.predict.memory_kinds import KINDS, memory_kinds
from partitioner.predict.replica_fold import rank_span
from partitioner.request import SHARDING_CHOICES
from partitioner.show.hosts import text_rows
from partitioner.show.visualizer import simulated_timeline
from rules.kernels import KERNEL_SETS
from runtime.plan import Plan, human_bytes, micro_batch_words

__all__ = ["DTYPES", "ClusterPlan", "Dtype", "Throughput", "add_cluster_arguments", "cast_example", "cluster_report",
           "parse_precision", "parse_replicas", "parse_tensor", "plan_cluster", "plan_keywords", "throughput"]

Dtype = Literal["fp32", "tf32", "bf16", "fp16"]
DTYPES: tuple[str, ...] = get_args(Dtype)
_TORCH_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
Step = Callable[[str], ContextManager[None]]


def add_cluster_arguments(plan: argparse.ArgumentParser) -> None:
    """`plan`'s options for a cluster that need not be here: --cluster, --global-batch, --dtype, --replicas."""
    plan.add_argument("--cluster", metavar="SHAPE|FILE",
                      help="plan for a cluster that need not be here: HOSTSxGPUSxTYPE (e.g. 16x8xH100; any size, "
                      "2048x8xH100 too) or a JSON/YAML file; every GPU is a torchrun rank. Not with --devices")
    plan.add_argument("--global-batch", type=int, metavar="N",
                      help="the batch of one step over the whole job (same as --batch); with --cluster and no "
                      "--micro-batches, the micro-batch count predicted fastest is chosen")
    plan.add_argument("--dtype", choices=DTYPES,
                      help="what the analytic model prices: the model and its floating inputs are cast to it before "
                      "tracing (tf32: fp32 tensors, products on the TF32 peak); default: the model's own dtype")
    plan.add_argument("--replicas", metavar="auto|R,R,...",
                      help="processes per stage: auto (the hybrid planner chooses stages and replicas; schedule "
                      "gpipe, 1f1b or auto) or counts such as 2,1,1 (default: auto with --cluster, else one per "
                      "stage). Plans for torchrun")
    plan.add_argument("--precision", metavar="NAME",
                      help="the dtypes training keeps each state in: mixed (torch.amp: bf16 compute, fp32 weights, "
                      "gradients and Adam moments), bf16, fp32, COMPUTE/PARAM/GRAD/STATE[:OPTIMIZER], or none (every "
                      "state at the model's dtype). Default: mixed with --cluster (which then also shards replicas "
                      "where it pays), none otherwise")
    plan.add_argument("--sharding", choices=SHARDING_CHOICES, default="auto",
                      help="with --replicas auto, how stage replicas shard their states: auto (the planner chooses, "
                      "with a --precision), none (never, as Megatron-LM's SC'21 runs), or zero1, zero2, zero3 for "
                      "every stage (default auto)")
    plan.add_argument("--kernels", choices=KERNEL_SETS, default="eager",
                      help="the kernel set the plan is priced for: eager (this project's runtime) or fused (flash "
                      "attention, fused SwiGLU and norms: engines a plan is exported to; default eager)")
    plan.add_argument("--tensor", metavar="auto|T", default="auto",
                      help="with --replicas auto, the tensor-parallel degree of every stage: auto (the planner "
                      "chooses), 1 (no layer split) or a degree such as 8 (default auto)")


def parse_replicas(text: str | None) -> list[int] | Literal["auto"] | None:
    """--replicas: 'auto', or counts per stage '2,1,1' (None: one replica per stage)."""
    if text is None or text == "auto":
        return text  # type: ignore[return-value]
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        counts = []
    if not counts or any(c < 1 for c in counts):
        raise UsageError(f"--replicas {text!r}: write auto, or one count >= 1 per stage such as 2,1,1")
    return counts


def cast_example(example: Example, dtype: str | None) -> Example:
    """The model's weights and the example's floating tensors in `dtype` (tf32 and fp32: float32; None: as they are)."""
    if dtype is None:
        return example
    to = _TORCH_DTYPES[dtype]
    example.model.to(to)

    def cast(x: Any) -> Any:
        return x.to(to) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    example.args, example.kwargs = pytree.tree_map(cast, (example.args, example.kwargs))
    return example


def parse_precision(text: str | None, cluster: bool) -> Precision | None:
    """--precision: a Precision (cost_model.precision.Precision.parse), None for 'none'; default by --cluster."""
    if text is None:
        text = "mixed" if cluster else "none"
    if text.strip().lower() == "none":
        return None
    try:
        return Precision.parse(text)
    except ValueError as exc:
        raise UsageError(f"--precision {text}: {exc}") from None


def parse_tensor(text: str) -> int | Literal["auto"]:
    """--tensor: 'auto', or a degree >= 1."""
    if text == "auto":
        return "auto"
    if not text.isdigit() or int(text) < 1:
        raise UsageError(f"--tensor {text!r}: write auto, or a tensor degree >= 1 such as 8 (1: no layer split)")
    return int(text)


def plan_keywords(args: argparse.Namespace) -> dict[str, Any]:
    """plan()'s replicas (and processes: one per replica), precision, sharding, tensor and kernels, from `plan` without
    --cluster."""
    replicas = parse_replicas(getattr(args, "replicas", None))
    return {"replicas": replicas, "processes": True if replicas is not None else None,
            "precision": parse_precision(getattr(args, "precision", None), cluster=False),
            "sharding": getattr(args, "sharding", "auto"), "tensor": parse_tensor(getattr(args, "tensor", "auto")),
            "kernels": getattr(args, "kernels", "eager")}


def _cluster(text: str) -> Cluster:
    try:
        return as_cluster(text)
    except ClusterError as exc:
        raise UsageError(f"--cluster {text}: {exc}") from None


def _micro_batch_choices(batch: int, gpus: int) -> list[int]:
    """Micro-batch counts tried when none is given: the largest divisors of the batch up to 1, 2 and 4 per GPU."""
    divisors = [d for d in range(1, batch + 1) if batch % d == 0]
    return sorted({max(d for d in divisors if d <= k * gpus) for k in (1, 2, 4)})


def _check_batch(batch: int, micro_batches: int, replicas: list[int] | str | None) -> None:
    """A global batch the micro-batches divide, and micro-batches each given replica count divides."""
    if batch % micro_batches:
        raise UsageError(f"--global-batch {batch} does not divide into {micro_batches} micro-batches; use a "
                         f"--micro-batches that divides {batch}, or a --global-batch that is a multiple of it")
    for s, r in enumerate(replicas if isinstance(replicas, list) else []):
        if micro_batches % r:
            raise UsageError(f"--micro-batches {micro_batches} do not divide over the {r} replicas of stage {s}; "
                             f"use a multiple of {r} micro-batches, or change --replicas")


def _check_plan(plan: Plan, cluster: Cluster, capacity: int, given: bool) -> None:
    """The plan's micro-batches divide over every stage's replicas, and every stage fits its GPUs' memory."""
    for s in plan.stages:
        if plan.micro_batches % s.replicas and plan.data_split != "slice":  # sliced: every replica runs each
            raise UsageError(f"the plan puts {s.replicas} replicas on stage {s.index}, which {plan.micro_batches} "
                             f"micro-batches do not divide; " + ("use --micro-batches a multiple of "
                             f"{s.replicas}" if given else "give --micro-batches") + " or --replicas yourself")
    for s in plan.stages:
        if s.memory_bytes > (s.capacity_bytes or capacity):
            raise UsageError(f"stage {s.index} does not fit in memory per GPU: it needs {human_bytes(s.memory_bytes)}, "
                             f"over the {human_bytes(s.capacity_bytes or capacity)} usable on a {cluster.gpu.name}; "
                             "use --replicas auto, "
                             "more micro-batches, --recompute auto, a smaller --global-batch or a larger cluster")


@dataclass
class ClusterPlan:
    """A plan for a cluster, with what the report needs besides it."""

    plan: Plan
    example: Example  # the model and batch it was made for, in the dtype priced
    cluster: Cluster
    dtype: Dtype
    capacity: int  # usable bytes of one GPU (cost_model.memory.usable_bytes)
    tried: dict[int, float]  # predicted step ms of each micro-batch count tried


def plan_cluster(args: argparse.Namespace, err: Console, step: Step) -> ClusterPlan:
    """The plan `partitioner.plan(model, cluster=...)` makes for the command line's arguments, checked to run:
    micro-batches that divide the global batch and over each stage's replicas, stages within memory per GPU."""
    if args.devices:
        raise UsageError("--devices with --cluster: the cluster's GPUs are the devices; drop one of them")
    cluster = _cluster(args.cluster)
    replicas = parse_replicas(args.replicas) if args.replicas is not None else "auto"  # a cluster: searched
    precision = parse_precision(args.precision, cluster=True)
    tensor = parse_tensor(args.tensor)
    if isinstance(replicas, list) and sum(replicas) != cluster.size:
        fix = "too few GPUs for" if sum(replicas) > cluster.size else "GPUs left over by"
        raise UsageError(f"--replicas {args.replicas}: {fix} the stages: {len(replicas)} stages with {sum(replicas)} "
                         f"replicas in all, on {cluster.shape} with {cluster.size} GPUs; make them add up to "
                         f"{cluster.size}, or use --replicas auto")
    with step(f"loading {args.target}"):
        example = cast_example(load_example(args.target, args.batch, args.micro_batches or 1), args.dtype)
    tries = [args.micro_batches] if args.micro_batches else _micro_batch_choices(example.batch, cluster.size)
    for m in tries:
        _check_batch(example.batch, m, replicas)
    prices = cluster_devices(cluster)[2]  # cuda:r per rank up to 128 GPUs, each host's names above
    cost = AnalyticCostModel(prices, tf32={"fp32": False, "tf32": True}.get(args.dtype))
    capacity = device_capacity(cost, torch.device("cuda:0"))  # one GPU type: every rank holds as much
    made: dict[int, Plan] = {}
    refused: list[str] = []
    with _progress(err, args.quiet) as bar:
        task = bar.add_task(f"planning {example.batch} samples on {cluster.shape}", total=len(tries))
        search = bar.add_task("search", total=None, visible=False)

        def searched(what: str, done: int, total: int) -> None:  # the cluster search's (p, d, m) configurations
            bar.update(search, description=f"  {what}", completed=done, total=total, visible=True)

        try:  # one trace for every count (make.plan.plan_counts); a model it fails on fails every count
            each = make_plans(example.model, cluster=cluster, example_inputs=example.args,
                              example_kwargs=example.kwargs, micro_batches=tries, schedule=args.schedule,
                              replicas=replicas, cost_model=cost, recompute=args.recompute or "none",
                              update=args.update, precision=precision, sharding=args.sharding,
                              tensor=tensor, kernels=args.kernels)  # fmt: skip
            for m in tries:
                bar.update(task, description=f"planning {example.batch} samples in {m} micro-batches on "
                           f"{cluster.shape}")
                with reporting(searched):
                    _, plan = next(each)
                try:
                    if isinstance(plan, PartitionError):
                        raise plan
                    if len(tries) > 1:
                        _check_plan(plan, cluster, capacity, given=False)
                    made[m] = plan
                except (PartitionError, UsageError) as exc:
                    if len(tries) == 1:
                        raise
                    refused.append(f"{m} micro-batches: {_one_line(exc)}")
                bar.advance(task)
        except (PartitionError, UsageError) as exc:
            raise _one_line(exc) from None
    if not made:
        raise UsageError("no micro-batch count gives a plan that runs here (" + "; ".join(refused) + ")")
    best = min(made, key=lambda m: made[m].predicted_step_ms)
    _check_plan(made[best], cluster, capacity, given=True)
    example.micro_batches = best
    dtype = args.dtype
    if dtype is None:  # the model's own: the precision its weights (else float32) are priced at
        weights = next(iter(example.model.parameters()), None)
        dtype = precision_of(weights.dtype if weights is not None else torch.float32)
    return ClusterPlan(made[best], example, cluster, dtype, capacity, {m: p.predicted_step_ms for m, p in made.items()})


def _one_line(exc: Exception) -> UsageError:
    """A planner error as one line; a memory error (InfeasibleError) says how much the GPUs would need, and why
    (its fullest GPU's states and activations, where the search gave them)."""
    needed = getattr(exc, "needed_bytes", None)
    if needed:
        note, why = getattr(exc, "note", ""), held_text(getattr(exc, "held", ()))
        return UsageError(f"the model does not fit in memory per GPU: it needs at least {human_bytes(max(needed))} "
                          "on some GPU under every split" + (f". {why[:-1]}" if why else "") + "; use a larger "
                          "cluster or GPUs with more memory, --recompute auto, or a smaller --global-batch"
                          + (f". {note}" if note else ""))
    return UsageError(" ".join(str(exc).split()))


class _progress:
    """A transient progress bar on stderr (nothing with --quiet)."""

    def __init__(self, err: Console, quiet: bool) -> None:
        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                            TimeElapsedColumn(), console=err, transient=True, disable=quiet)  # fmt: skip

    def __enter__(self) -> Progress:
        self.bar.start()
        return self.bar

    def __exit__(self, *exc: object) -> None:
        self.bar.stop()


def cluster_report(out: Console, made: ClusterPlan) -> None:
    """Print the stages (ranks, replicas, tensor degree, sharding, hosts, memory per GPU by kind) and the predicted
    throughput."""
    plan, example, cluster, dtype, tried = made.plan, made.example, made.cluster, made.dtype, made.tried
    stages = f"{len(plan.stages)} stage{'s' if len(plan.stages) != 1 else ''}"
    tensor = max(s.tensor for s in plan.stages)
    split = f", {tensor} tensor ranks per replica" if tensor > 1 else ""
    # the heading on its own unwrapped line: as a table title it would wrap to the table's width
    out.print(f"{example.name} on {cluster.shape}: {stages}{split}, {cluster.size} GPUs on {cluster.hosts} hosts",
              markup=False, soft_wrap=True)
    table = Table(header_style="bold", box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 1), collapse_padding=True)
    for name in ("stage", "ranks", "replicas", "tensor", "sharding", "hosts", "nodes", "compute ms", "all-reduce ms",
                 "memory per GPU", "capacity"):
        table.add_column(name, justify="left" if name in ("ranks", "hosts", "sharding") else "right")
    for s in plan.stages:
        hosts = sorted({plan.host_of(r) for r in s.all_ranks})
        ranks = s.all_ranks
        table.add_row(str(s.index), _span(ranks) if len(ranks) <= 8 else rank_span(ranks), str(s.replicas),
                      str(s.tensor), s.sharding, _span(hosts) if len(hosts) <= 8 else rank_span(hosts),
                      str(len(s.nodes)), f"{s.compute_ms:.3f}", f"{s.allreduce_ms:.3f}", human_bytes(s.memory_bytes),
                      human_bytes(s.capacity_bytes or made.capacity))  # fmt: skip
    out.print(table)
    memory_table(out, plan)
    t = throughput(plan, example, cluster, dtype)
    precision = Precision.from_dict(plan.precision) if plan.precision else None
    out.print(f"dtype {dtype}, global batch {example.batch} in {micro_batch_words(plan, example.batch)}, "
              f"schedule {plan.schedule}; precision " + (_precision_text(precision) if precision else
                                                         "none (every state at the model's dtype)"), markup=False)
    if len(tried) > 1:
        out.print("predicted step of each micro-batch count tried: "
                  + ", ".join(f"{m} {ms:.3f} ms" for m, ms in tried.items()), markup=False)
    if plan.alternatives:
        out.print("predicted step of each candidate compared: "
                  + ", ".join(f"{n} {ms:.3f} ms" for n, ms in plan.alternatives.items()), markup=False)
    tokens = f"tokens/s {t.tokens_per_s:.1f}, " if t.tokens_per_s is not None else ""
    out.print(f"predicted step {t.step_ms:.4f} ms, samples/s {t.samples_per_s:.1f}, {tokens}MFU {t.mfu:.4%}, "
              f"{t.mfu * t.peak_flops / 1e12:.1f} TFLOP/s per GPU (model FLOPs)", markup=False)
    out.print(f"MFU counts 3 x forward FLOPs per step = {t.flops_per_step:.4g} FLOP, over {cluster.size} GPUs x "
              f"{t.peak_flops / 1e12:.1f} TFLOP/s ({cluster.gpu.name} dense {t.peak_precision} peak)", markup=False)
    timeline_rows(out, plan)


def memory_table(out: Console, plan: Plan) -> None:
    """Memory per GPU of each stage by kind (partitioner.predict.memory_kinds)."""
    table = Table(title="memory per GPU by kind", title_justify="left", header_style="bold", box=box.SIMPLE_HEAD,
                  show_edge=False, padding=(0, 1), collapse_padding=True)  # fmt: skip
    for name in ("stage", *KINDS, "total"):
        table.add_column(name, justify="right")
    for s in plan.stages:
        kinds = memory_kinds(plan, s)
        table.add_row(str(s.index), *(human_bytes(kinds[k]) for k in KINDS), human_bytes(s.memory_bytes))
    out.print(table)


def _precision_text(precision: Precision) -> str:
    """'mixed: bf16 compute, fp32 master weights, fp32 gradients, fp32 adam states'."""
    short = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16", "float64": "fp64"}
    master = f"{short.get(precision.param, precision.param)} master weights, " if precision.mixed else ""
    return (f"{precision.label}: {short.get(precision.compute, precision.compute)} compute, {master}"
            f"{short.get(precision.grad, precision.grad)} gradients, {short.get(precision.state, precision.state)} "
            f"{precision.optimizer} states")


def timeline_rows(out: Console, plan: Plan) -> None:
    """The simulated step by row: identical replicas folded into one row, rows under their hosts (show/hosts.py)."""
    timeline, note = simulated_timeline(plan)
    text = note if timeline is None else text_rows(timeline, gpus_per_host=plan.gpus_per_host)
    out.print(text, markup=False, soft_wrap=True)


def _span(values: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    parts: list[str] = []
    for v in values:
        if parts and parts[-1].split("-")[-1] == str(v - 1):
            parts[-1] = f"{parts[-1].split('-')[0]}-{v}"
        else:
            parts.append(str(v))
    return ",".join(parts)
