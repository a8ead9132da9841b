"""A measured run (benchmarks/measured_runs.py) as the arguments partitioner.plan() and the CLI take, nothing planned.

    args = plan_arguments(run)
    with torch.device("meta"):
        model = args.build()
    forced = partitioner.plan(model, cluster=args.cluster_object(), example_inputs=args.example_inputs(),
                              **args.forced)            # what plan() can be told of the measured configuration
    free = partitioner.plan(model, cluster=args.cluster, example_inputs=..., micro_batches=m, **args.free)
    Fixed(**args.fixed)                                  # the whole configuration, for the cluster search's pricing
    args.cli(forced=True, cluster_file="cluster.json")   # python -m partitioner plan ... (args.cluster as that file)

The model is built with benchmarks/published_models.py's builders: MegatronGPT for "gpt" rows (MPT's shape is the
same module list: learned positions, biases, fused q/k/v, GELU 4h, tied head; its parameter count equals
llm-foundry's NumParams), Llama for "llama" rows. The CLI imports this file's `run_<key>` factories
(`benchmarks/measured_plan.py:run_sc21_1_7B`, dots and dashes as underscores).

What plan() cannot be told yet goes to `caveats`: the stage count and interleaving with replicas (plan() searches
those; `fixed` carries them), context parallelism, float8, and every value the source does not state (`assumed`,
each with the reason it was chosen).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import sys
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.measured_runs import RUNS  # noqa: E402
from benchmarks.measured_types import Run  # noqa: E402
from benchmarks.published_models import Llama, LlamaShape, MegatronGPT, MegatronShape  # noqa: E402
from cost_model.cluster_shape import Cluster  # noqa: E402
from cost_model.gpu_table import GpuTable  # noqa: E402

__all__ = ["NCCL_EFFICIENCY", "PlanArguments", "factory_name", "plan_arguments"]

NCCL_EFFICIENCY = 0.9  # a NIC's line rate x this is what NCCL moves (cost_model/gpus.json fabrics, bus_efficiency)
_TITAN_GPU = "H100-HBM2e-96GB-500W"


@dataclass(frozen=True)
class PlanArguments:
    """What planning one measured run takes (module docstring).

    `build`: the model (call it under `torch.device("meta")`), at `dtype`. `batch`, `seq`: the example tokens.
    `cluster`: plan(cluster=...)'s description (the CLI's --cluster file), on a GPU type of cost_model/gpus.json;
    `gpu_extra`: a GPU type closer to the measured one, where gpus.json has none (`cluster_object` uses it).
    `forced`: plan() keywords fixing what plan() can fix; `free`: the search's own choice (the CLI's defaults with
    --cluster; give micro_batches, or let the CLI choose them from --global-batch). `fixed`: the measured
    configuration in partitioner/place/cluster/fixed.py's Fixed fields. `context`: the context-parallel degree.
    `kernels`: "eager" or "fused" (issue 37 item 2). `assumed`: values the source does not state, with why.
    `caveats`: what plan() cannot be told of this run.
    """

    key: str
    build: Callable[[], nn.Module]
    dtype: torch.dtype
    batch: int
    seq: int
    cluster: dict[str, Any]
    forced: dict[str, Any]
    free: dict[str, Any]
    fixed: dict[str, Any]
    context: int
    kernels: str
    gpu_extra: dict[str, Any] | None = None
    assumed: tuple[str, ...] = ()
    caveats: tuple[str, ...] = field(default=())

    def example_inputs(self, device: str | torch.device = "meta") -> tuple[torch.Tensor]:
        """One full batch of token ids (batch x seq, int64)."""
        return (torch.zeros(self.batch, self.seq, dtype=torch.long, device=device),)

    def cluster_object(self) -> Cluster:
        """The cluster, on `gpu_extra` where there is one (the measured GPU's memory), else as `cluster` says."""
        if self.gpu_extra is None:
            return Cluster.from_dict(self.cluster)
        # the links are the table type's (H100-SXM: NVSwitch at NCCL's measured bus bandwidth, the row's NICs):
        # gpus.json's fabric defaults go by type name, and a type they do not name falls back to PCIe and Ethernet
        table = GpuTable.load(extra=[self.gpu_extra])
        return dataclasses.replace(Cluster.from_dict(self.cluster), gpu=table.get(self.gpu_extra["name"]))

    @property
    def shape(self) -> str:
        """The cluster as HOSTSxGPUSxTYPE (its fabric left to the type's defaults)."""
        c = self.cluster
        return f"{c['hosts']}x{c['gpus_per_host']}x{c['gpu']}"

    def cli(self, *, forced: bool = True, cluster_file: str | None = None) -> list[str]:
        """argv of `python -m partitioner plan` for this run: the forced configuration or the free search.

        `cluster_file`: where `cluster` was written as JSON (needed when it names a fabric; else the shape is used).
        """
        if "fabric" in self.cluster and cluster_file is None:
            raise ValueError(f"{self.key}: the cluster names a fabric ({self.cluster['fabric']}); write "
                             "json.dumps(args.cluster) to a file and pass cluster_file=")
        dtype = {torch.float16: "fp16", torch.bfloat16: "bf16"}[self.dtype]
        argv = [sys.executable, "-m", "partitioner", "plan", f"benchmarks/measured_plan.py:{factory_name(self.key)}",
                "--cluster", cluster_file or self.shape, "--global-batch", str(self.batch), "--dtype", dtype]
        chosen = self.forced if forced else self.free
        flags = {"micro_batches": "--micro-batches", "precision": "--precision", "replicas": "--replicas",
                 "tensor": "--tensor", "sharding": "--sharding", "schedule": "--schedule", "recompute": "--recompute",
                 "kernels": "--kernels"}
        for name, flag in flags.items():
            if name in chosen:
                argv += [flag, str(chosen[name])]
        return argv


def factory_name(key: str) -> str:
    """The CLI factory of a row: run_ and its key, dots and dashes as underscores ("sc21-1.7B" -> run_sc21_1_7B)."""
    return "run_" + re.sub(r"[^0-9A-Za-z]", "_", key)


def _builder(run: Run, dtype: torch.dtype) -> Callable[[], nn.Module]:
    m = run.model
    if m.family == "gpt":
        dropout = 0.0 if run.source.key == "llm-foundry" else 0.1
        shape = MegatronShape(m.layers, m.width, m.heads, vocab=m.vocab, seq=m.positions, dropout=dropout,
                              flash=run.kernels.kernels == "fused")  # llm-foundry's triton/flash attention
        tied = run.parallel.pipeline == 1
        return lambda: MegatronGPT(shape, tied=tied).to(dtype)
    llama = LlamaShape(m.layers, m.width, m.ffn, m.heads, m.kv_heads, vocab=m.vocab, seq=run.seq, written=m.written)
    return lambda: Llama(llama).to(dtype)


def _gpu_default(gpu: str) -> tuple[str, float]:
    """(inter kind, bandwidth in bytes/s) a cluster of this type gets when it names no fabric."""
    inter = Cluster.from_dict({"hosts": 2, "gpus_per_host": 8, "gpu": gpu}).fabric.inter
    return inter.kind, inter.bandwidth


def _cluster(run: Run) -> dict[str, Any]:
    described: dict[str, Any] = {"hosts": run.gpus // run.gpus_per_host, "gpus_per_host": run.gpus_per_host,
                                 "gpu": run.gpu}
    if run.inter_gbit_per_s is not None:  # a stated NIC rate: what NCCL moves on it, unless the type's default
        default_kind, default_bytes = _gpu_default(run.gpu)
        kind = run.inter_kind or default_kind
        rate = run.inter_gbit_per_s * NCCL_EFFICIENCY
        if kind != default_kind or abs(rate * 1e9 / 8 - default_bytes) > 1.0:
            described["fabric"] = {"inter": {"kind": kind, "gbit_per_s": rate}}
    return described


def _titan_gpu() -> dict[str, Any]:
    """torchtitan's H100s (96 GB HBM2e, 2.4 TB/s, 500 W) as a GPU type: cost_model's H100-SXM with that memory."""
    table = json.loads(resources.files("cost_model").joinpath("gpus.json").read_text())
    entry: dict[str, Any] = copy.deepcopy(next(g for g in table["gpus"] if g["name"] == "H100-SXM"))
    entry.update(name=_TITAN_GPU, aliases=[], memory_gib=96, memory_gb_per_s=2400,
                 source="torchtitan benchmarks/llama3_h100_202412_torchtitan.md, hardware section: 'Each H100 GPU "
                        "is equipped with 96GB HBM2e with 2.4 TB/sec peak memory bandwidth', 500 W limit",
                 note="Peak between H100 SXM and NVL (the same file), not measured: H100-SXM's tflops kept.")
    return entry


# Values the sources do not state, per source: (what, the value, why this one).
_ASSUMED: dict[str, dict[str, tuple[Any, str]]] = {
    "llama3": {
        "micro_batch_size": (1, "benchmarks/published.py's reading of section 3.3.2 (one sequence a micro-batch)"),
        "virtual_stages": (8, "benchmarks/published.py: 126 layers in 128 slots of 16 ranks, one layer a chunk"),
        "sequence_parallel": (True, "Megatron-style sequence parallelism beside TP, as benchmarks/published.py "
                                    "assumes"),
        "recompute": ("none", "the 8K rows' 'without activation checkpointing' (section 3.3.2), for the 128K row too"),
    },
    "megascale": {
        "micro_batch_size": (1, "Megatron-LM's default --micro-batch-size (1); MegaScale does not say"),
        "sequence_parallel": (False, "not stated for the Megatron-LM baseline"),
        "recompute": ("none", "not stated for the Megatron-LM baseline"),
        "sharding": ("none", "not stated (Megatron-LM's DDP; MegaScale's own ZeRO-2 is not the baseline's)"),
    },
}
_ORDER = {"llama3": "pipelines-together"}  # [TP, CP, PP, DP]; Megatron-LM and torchtitan keep a stage's replicas near


def plan_arguments(run: Run) -> PlanArguments:
    """The arguments planning `run` takes (PlanArguments), without planning it."""
    p = run.parallel
    guesses = _ASSUMED.get(run.source.key, {})
    assumed: list[str] = []

    def value(name: str, given: Any) -> Any:
        if given is not None:
            return given
        chosen, why = guesses[name]
        assumed.append(f"{name} = {chosen}: {why}")
        return chosen

    mbs = value("micro_batch_size", p.micro_batch_size)
    v = value("virtual_stages", p.virtual_stages)
    sp = value("sequence_parallel", p.sequence_parallel)
    recompute = value("recompute", p.recompute)
    sharding = value("sharding", p.sharding)
    if run.precision_as_run.startswith("not stated"):
        assumed.append(f"precision = {run.precision}: not stated; bf16 mixed precision, as Megatron-LM runs GPT "
                       "at this scale")
    dtype = torch.float16 if run.precision.startswith("fp16") else torch.bfloat16
    caveats: list[str] = []
    if p.pipeline > 1:
        caveats.append(f"plan() with replicas='auto' chooses the stage count itself: {p.pipeline} stages"
                       + (f" of {v} interleaved chunks" if v > 1 else "") + " are in `fixed` only")
    if p.context > 1:
        caveats.append(f"context parallelism {p.context} is not a plan() axis yet: `context` carries it")
    if run.kernels.float8:
        caveats.append(f"float8 ({run.kernels.float8}) linear layers: planned in bf16 here")
    if recompute == "selective":
        caveats.append("selective recomputation as the trainer ran it (torchtitan's op policy) is not rules' "
                       "'selective' (every product's output kept): Fixed prices it as 'selective-op'")
    extra = _titan_gpu() if run.source.key == "torchtitan" else None
    if extra is not None:
        caveats.append(f"the CLI plans on {run.gpu} (80 GiB); cluster_object() uses {_TITAN_GPU} (96 GB)")
    forced: dict[str, Any] = {
        "precision": run.precision, "micro_batches": run.global_batch // mbs, "replicas": "auto",
        "tensor": p.tensor, "sharding": sharding, "recompute": recompute,
        "schedule": "1f1b",  # one stage: gradient accumulation, each micro-batch's backward after its forward
        "kernels": run.kernels.kernels,
    }
    free = {"precision": run.precision, "replicas": "auto", "schedule": "auto", "recompute": "auto",
            "sharding": "auto", "tensor": "auto", "kernels": run.kernels.kernels}
    fixed = {"tensor": p.tensor, "stages": p.pipeline, "micro_batch_size": mbs, "sharding": sharding,
             "schedule": "1f1b", "virtual_stages": v, "recompute": recompute,
             "order": _ORDER.get(run.source.key, "replicas-together"), "sequence_parallel": bool(sp),
             "gradient_sync": None, "kernels": run.kernels.kernels}
    return PlanArguments(run.key, _builder(run, dtype), dtype, run.global_batch, run.seq, _cluster(run), forced, free,
                         fixed, p.context, run.kernels.kernels, extra, tuple(assumed), tuple(caveats))


def _factory(run: Run) -> Callable[..., tuple[nn.Module, torch.Tensor]]:
    def factory(batch: int | None = None) -> tuple[nn.Module, torch.Tensor]:
        """The row's model on meta and a batch of token ids (the run's global batch unless `batch`)."""
        args = plan_arguments(run)
        with torch.device("meta"):
            model = args.build()
        return model, torch.zeros(batch or args.batch, args.seq, dtype=torch.long, device="meta")
    return factory


_FACTORIES = {factory_name(r.key): r for r in RUNS}


def __getattr__(name: str) -> Callable[..., tuple[nn.Module, torch.Tensor]]:
    """`run_<key>`: the CLI's MODULE:FACTORY for a row (module docstring)."""
    if name in _FACTORIES:
        return _factory(_FACTORIES[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}; factories are run_<key> of "
                         "benchmarks/measured_runs.py's rows, e.g. run_sc21_1_7B")
