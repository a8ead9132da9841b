"""Exported torchtitan jobs beside torchtitan 0.3.0 itself: its ConfigManager parses them, its ParallelDims takes their
degrees, its own _split_module cuts its Llama 3 (built on meta) by the exported module lists, its schedule builder loads
the CSV. Every expected value is read from the plan (stages, ranks, graph), not from the exporter."""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.testing._internal.distributed.fake_pg import FakeStore

import partitioner
from partitioner.cli.main import main
from partitioner.export.pipelines import pipeline_schedule
from partitioner.export.torchtitan import torchtitan_job
from partitioner.meta import empty_weights
from runtime.plan import Plan
from tests.test_export import run_script

llama3 = pytest.importorskip("torchtitan.models.llama3", reason="needs torchtitan 0.3.0 (Python 3.11+): pip install "
                             "-e '.[test]'")
from torchtitan.config.manager import ConfigManager  # noqa: E402
from torchtitan.distributed import ParallelDims  # noqa: E402
from torchtitan.distributed.pipeline_parallel import (  # noqa: E402
    _build_pipeline_schedule,
    _get_pp_rank_to_stage_indices_mapping,
    _split_module,
)
from torchtitan.models.common.attention import ScaledDotProductAttention  # noqa: E402

from partitioner import PartitionError  # noqa: E402


def debug_llama(sdpa: bool) -> nn.Module:
    """torchtitan's own Llama 3 debug model on meta (6 layers); with SDPA inside, so that our tracer can plan it."""
    spec = llama3.model_registry("debugmodel")
    if sdpa:  # FlexAttention needs a BlockMask argument; the module names stay the same
        for layer in spec.model.layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    with torch.device("meta"):
        return spec.model.build()


def plan_layers(plan: Plan) -> tuple[list[set[int]], list[set[int]]]:
    """For each stage, from the plan's graph: the layers it runs any node of, and those it runs every node of."""
    stages = len(plan.stages)
    touched: list[set[int]] = [set() for _ in range(stages)]
    where: dict[int, set[int]] = {}
    for node in (plan.graph or {}).get("nodes", []):
        found = re.search(r"(?:^|\.)layers\.(\d+)(?:\.|$)", str(node.get("module", "")))
        if found and node.get("stage", -1) >= 0:
            touched[node["stage"]].add(int(found.group(1)))
            where.setdefault(int(found.group(1)), set()).add(node["stage"])
    whole = [{k for k, s in where.items() if s == {stage}} for stage in range(stages)]
    return touched, whole


def check_in_torchtitan(plan: Plan, args: list[str], *, csv: Path | None = None) -> Any:
    """Parse `args` with torchtitan, and hold its degrees, batch and stages to the plan's; returns the config."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = ConfigManager().parse_args(args)
    par, training = config.parallelism, config.training
    first = plan.stages[0]
    pipeline_ranks = len({s.ranks[0] for s in plan.stages})
    replicas, sharded = first.replicas, first.sharding != "none"
    dims = ParallelDims.from_config(par, plan.ranks)  # raises unless the degrees multiply to the plan's ranks
    assert (dims.pp, dims.tp, dims.cp, dims.ep) == (pipeline_ranks, first.tensor, first.context,
                                                    max(s.expert for s in plan.stages))
    assert (dims.dp_replicate, dims.dp_shard) == ((1, replicas) if sharded else (replicas, 1))
    inputs = [n for n in (plan.graph or {})["nodes"] if n["op"] == "placeholder"]
    size, seq = inputs[0]["shapes"][0]  # samples and tokens one rank's stage takes per micro-batch
    steps = plan.micro_batches if plan.data_split == "slice" else plan.micro_batches // replicas
    assert training.global_batch_size == size * steps * replicas and training.seq_len == seq
    if dims.pp > 1:
        assert par.pipeline_parallel_microbatch_size == size
        assert training.local_batch_size // size == steps  # torchtitan's n_microbatches: the plan's per pipeline
        assert training.disable_cuda_graphs  # torchtitan 0.3.0 refuses a pipeline otherwise
        touched, whole = plan_layers(plan)
        with torch.device("meta"):
            real = config.model_spec.model.build()  # the --config's own model, as torchtitan builds it
        kept = []
        for stage, names in enumerate(par.module_fqns_per_model_part):
            part = _split_module(real, names)
            layers = {int(k) for k in part.layers.keys()}
            assert whole[stage] <= layers <= touched[stage], (stage, names)
            kept.append(layers)
            assert (part.tok_embeddings is not None) == (stage == 0) and (part.lm_head is not None) == (
                stage == len(plan.stages) - 1)
        assert sorted(k for layers in kept for k in layers) == list(range(len(real.layers)))  # each layer once
        if csv is not None:
            check_schedule(par, training.local_batch_size, dims.pp, plan)
    else:
        assert training.global_batch_size // (training.local_batch_size * replicas) == steps  # accumulation
    return config


def check_schedule(par: Any, local_batch: int, pp: int, plan: Plan) -> None:
    """torchtitan's own schedule builder loads the exported CSV for pipeline rank 0 (a fake process group)."""
    total = len(par.module_fqns_per_model_part)
    mine = _get_pp_rank_to_stage_indices_mapping(0, pp, par.pipeline_parallel_schedule, total)
    dist.init_process_group("fake", rank=0, world_size=pp, store=FakeStore())
    try:
        stages = [PipelineStage(nn.Linear(2, 2), s, total, torch.device("cpu"), input_args=(torch.empty(1, 2),),
                                output_args=(torch.empty(1, 2),)) for s in mine]
        schedule = _build_pipeline_schedule(parallelism=par, local_batch_size=local_batch, stages=stages,
                                            loss_fn=lambda *a: (a[0].sum(), None))
        sched = pipeline_schedule(plan)
        assert schedule.stage_index_to_group_rank == sched.stage_to_rank
        loaded = {r: [str(a) for a in row] for r, row in schedule.pipeline_order.items()}
        assert loaded == dict(enumerate(sched.actions))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def sdpa_llama() -> Iterator[nn.Module]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield debug_llama(sdpa=True)


def test_tp2_pp2_plan_runs_in_torchtitan_as_planned(sdpa_llama: nn.Module, tmp_path: Path) -> None:
    tokens = torch.zeros(6, 64, dtype=torch.long, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the SDPA module sets its backends while traced
        plan = partitioner.plan(sdpa_llama, cluster="1x4xH100", example_inputs=(tokens,), micro_batches=3, tensor=2,
                                sharding="none", replicas="auto", schedule="1f1b")  # 3 micro-batches: 1 replica
    assert [(s.tensor, s.replicas) for s in plan.stages] == [(2, 1), (2, 1)] and plan.ranks == 4
    csv = pipeline_schedule(plan).write_csv(tmp_path / "schedule.csv")
    job = torchtitan_job(plan, csv, module="llama3", config="llama3_debugmodel")
    config = check_in_torchtitan(plan, job.args(), csv=csv)
    assert config.parallelism.enable_sequence_parallel is False  # the plan runs no sequence parallelism
    assert config.activation_checkpoint is None  # the plan recomputes nothing


def test_zero3_on_16_ranks_parses_with_torchtitans_degrees(sdpa_llama: nn.Module) -> None:
    tokens = torch.zeros(64, 64, dtype=torch.long, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = partitioner.plan(sdpa_llama, cluster="2x8xH100", example_inputs=(tokens,), micro_batches=32,
                                sharding="zero3", precision="mixed", replicas="auto", recompute="full")
    assert plan.ranks == 16 and {s.sharding for s in plan.stages} == {"zero3"}
    job = torchtitan_job(plan, module="llama3", config="llama3_debugmodel")
    config = check_in_torchtitan(plan, job.args())
    assert config.parallelism.fsdp_reshard_after_forward == "always"  # zero3: gathered again for backward
    assert type(config.activation_checkpoint).__qualname__ == "FullAC.Config"
    assert (config.training.dtype, config.training.mixed_precision_param) == ("float32", "bfloat16")


def llama_7b(batch: int = 8) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """README's 7B Llama (Hugging Face's LlamaForCausalLM, Llama 2 7B's shape) on meta."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                                      max_position_embeddings=2048, use_cache=False)
    with empty_weights():
        model = transformers.LlamaForCausalLM(config)
    return model, (torch.zeros(batch, 2048, dtype=torch.long, device="meta"),)


def test_readme_7b_llama_on_16x8_h100_exports_its_sliced_plan(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    plan_json, csv, script = tmp_path / "plan.json", tmp_path / "schedule.csv", tmp_path / "job.sh"
    assert main(["plan", "tests.test_torchtitan_export:llama_7b", "--cluster", "16x8xH100", "--global-batch", "1536",
                 "--dtype", "bf16", "--micro-batches", "512", "--save", str(plan_json), "--quiet"]) == 0
    plan = Plan.from_json(plan_json.read_text())
    assert plan.data_split == "slice" and plan.ranks == 128  # sharded replicas: each runs every micro-batch
    capsys.readouterr()
    assert main(["export", "--plan", str(plan_json), "--csv", str(csv), "--torchtitan", str(script)]) == 0, \
        capsys.readouterr().err
    launch, args = run_script(script, MODULE="llama3", CONFIG="llama3_8b")  # 32 layers, as the plan's model
    assert launch[:2] == ["--nnodes=16", "--nproc-per-node=8"]
    config = check_in_torchtitan(plan, args)  # stages cut from torchtitan's Llama 3 8B on meta
    assert config.training.global_batch_size == 1536


def test_context_parallel_plan_exports_its_degree_and_load_balance(sdpa_llama: nn.Module, tmp_path: Path) -> None:
    # pp 2 x cp 2 on 4 ranks: torchtitan's dense mesh (pp, dp_replicate, dp_shard, cp, tp) holds the context ranks,
    # its "headtail" balancer holds chunks r and 2c - 1 - r as the plan's runtime does, and 64 tokens divide by
    # tp x 2 cp (its seq_len_divisor)
    tokens = torch.zeros(4, 64, dtype=torch.long, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = partitioner.plan(sdpa_llama, cluster="1x2xH100", example_inputs=(tokens,), micro_batches=2,
                                sharding="none", replicas=[1, 1], schedule="1f1b")
    assert len(plan.stages) == 2
    for stage in plan.stages:  # the planner does not choose a context degree yet: set by hand, as a user would
        stage.ranks, stage.context = [2 * stage.index], 2
        stage.context_attention = [f"layers.{k}.attention" for k in range(6)][3 * stage.index:3 * stage.index + 3]
    plan.data_split, plan.programs = "slice", []
    plan.check()
    csv = pipeline_schedule(plan).write_csv(tmp_path / "schedule.csv")
    job = torchtitan_job(plan, csv, module="llama3", config="llama3_debugmodel")
    config = check_in_torchtitan(plan, job.args(), csv=csv)
    assert config.parallelism.context_parallel_load_balancer == "headtail" and job.degrees["cp"] == 2
    dims = ParallelDims.from_config(config.parallelism, plan.ranks)
    assert config.training.seq_len % dims.seq_len_divisor == 0
    assert any("shards the weights over the 2 context ranks" in n for n in job.notes)  # the plan keeps them whole
    plan.stages[0].context = plan.stages[1].context = 3  # 64 tokens are not 2 x 3 equal parts
    plan.stages[0].ranks, plan.stages[1].ranks = [0], [3]
    with pytest.raises(PartitionError, match="multiple of 6"):
        torchtitan_job(plan, csv, module="llama3", config="llama3_debugmodel")


@pytest.fixture(scope="module")
def moe_plan() -> Plan:
    """torchtitan's own Qwen3 MoE debug model (SDPA inside) on meta, planned on 4 H100s: one stage, 4 sharded
    replicas; the planner does not choose an expert degree yet, so the test sets 2, as a user would."""
    qwen3 = pytest.importorskip("torchtitan.models.qwen3")
    spec = qwen3.model_registry("debugmodel_moe")
    for layer in spec.model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    with torch.device("meta"):
        model = spec.model.build()
    tokens = torch.zeros(8, 64, dtype=torch.long, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = partitioner.plan(model, cluster="1x4xH100", example_inputs=(tokens,), micro_batches=4, tensor=1,
                                sharding="zero1", precision="mixed", replicas="auto", schedule="1f1b",
                                cross_batch="allow")
    assert [(s.replicas, s.sharding) for s in plan.stages] == [(4, "zero1")]
    plan.stages[0].expert = 2
    plan.stages[0].expert_layers = [f"layers.{k}.moe.experts" for k, _ in enumerate(spec.model.layers)]
    plan.check()
    return plan


def test_expert_parallel_plan_exports_a_degree_torchtitans_mesh_takes(moe_plan: Plan) -> None:
    # torchtitan borrows ep from dp_shard x cp x tp (its sparse mesh pp, dp_replicate, efsdp, ep): 4 sharded replicas
    # give efsdp = 4 / 2 = 2, each expert's weights sharded over the 2 replicas holding it
    job = torchtitan_job(moe_plan, module="qwen3", config="qwen3_moe_debug")
    config = check_in_torchtitan(moe_plan, job.args())
    par = config.parallelism
    assert (par.expert_parallel_degree, par.data_parallel_shard_degree, job.degrees["ep"]) == (2, 4, 2)
    dims = ParallelDims.from_config(par, moe_plan.ranks)
    assert dims.ep_enabled and (dims.dp_shard * dims.cp * dims.tp) % dims.ep == 0  # build_mesh's efsdp
    assert any("over the 2 ranks holding it" in n for n in job.notes)
    moe_plan.stages[0].sharding = "none"  # unsharded replicas are dp_replicate, which ep cannot borrow from
    try:
        with pytest.raises(PartitionError, match="shard the replicas"):
            torchtitan_job(moe_plan, module="qwen3", config="qwen3_moe_debug")
    finally:
        moe_plan.stages[0].sharding = "zero1"
