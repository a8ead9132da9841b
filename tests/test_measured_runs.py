"""benchmarks/measured_runs.py: the measured-run table is complete and consistent, and a bad row is named."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from benchmarks import measured_plan
from benchmarks.measured_plan import factory_name, plan_arguments
from benchmarks.measured_runs import RUNS, SOURCES, MeasuredRunsError, check, runs
from benchmarks.measured_types import Parallel, Run, flops_per_token, problems, region, rounded
from cost_model.cluster_shape import Cluster

BY_KEY = {r.key: r for r in RUNS}


def test_the_table_covers_every_region_on_a100_and_h100() -> None:
    assert len(RUNS) >= 30
    assert len(SOURCES) >= 4
    assert {r.family for r in RUNS} == {"A100", "H100"}
    assert {region(r) for r in RUNS} == {"3d", "fsdp+tp/pp", "fsdp-only"}
    assert {r.split for r in RUNS} == {"fit", "held-out"}
    for key in ("sc21", "llm-foundry"):
        assert {r.split for r in runs(source=key)} == {"fit"}
    for key in ("megascale", "llama3", "torchtitan"):
        assert {r.split for r in runs(source=key)} == {"held-out"}
    assert all(r.kernels.float8 is None for r in runs(bf16_only=True))


def test_every_row_is_complete_consistent_and_cited() -> None:
    check(RUNS)  # raises, naming each problem, if any row has one
    for run in RUNS:
        assert run.source.cite and run.source.url.startswith("https://") and run.where
        assert run.measured.tokens_per_s_per_gpu or run.measured.tokens_per_s or run.measured.mfu \
            or run.measured.tflops_per_gpu


def _with(run: Run, **changes: object) -> Run:
    return dataclasses.replace(run, **changes)  # type: ignore[arg-type]


def _parallel(run: Run, **changes: object) -> Run:
    return dataclasses.replace(run, parallel=dataclasses.replace(run.parallel, **changes))  # type: ignore[arg-type]


def _measured(run: Run, **changes: object) -> Run:
    return dataclasses.replace(run, measured=dataclasses.replace(run.measured, **changes))  # type: ignore[arg-type]


FOUNDRY_7B = BY_KEY["foundry-a100-40gb-7b-2048-8"]
SC21_1_7B = BY_KEY["sc21-1.7B"]
BAD_ROWS = {
    "mfu 10% high": (_measured(FOUNDRY_7B, mfu=rounded(0.5601, 0.0001)), "figures disagree on tokens/s"),
    "tokens/s per GPU off": (_measured(FOUNDRY_7B, tokens_per_s_per_gpu=rounded(3979, 1)), "figures disagree"),
    "sc21 TFLOP/s off": (_measured(SC21_1_7B, tflops_per_gpu=rounded(147, 1)), "figures disagree"),
    "degrees": (_parallel(FOUNDRY_7B, data=4), "= 4 GPUs, not 8"),
    "batch over replicas": (_with(FOUNDRY_7B, global_batch=385), "does not divide over 8 replicas"),
    "micro-batches": (_parallel(FOUNDRY_7B, micro_batch_size=5), "not whole micro-batches of 5"),
    "no source row": (_with(FOUNDRY_7B, where=""), "no source"),
    "uncited number": (_with(SC21_1_7B, provenance=tuple(
        (k, v) for k, v in SC21_1_7B.provenance if k != "parallel.micro_batch_size")),
        "parallel.micro_batch_size = 16 has no citation"),
    "citation of nothing": (_with(SC21_1_7B, provenance=(*SC21_1_7B.provenance, ("parallel.ring", "x"))),
                            "provenance names no field"),
    "parameters": (_with(FOUNDRY_7B, model=dataclasses.replace(FOUNDRY_7B.model, layers=31)),
                   "the shape has"),
    "no throughput": (_with(FOUNDRY_7B, measured=dataclasses.replace(
        FOUNDRY_7B.measured, mfu=None, tflops_per_gpu=None, tokens_per_s=None, tokens_per_s_per_gpu=None)),
        "no throughput"),
    "schedule without a pipeline": (_parallel(FOUNDRY_7B, schedule="1f1b"), "schedule '1f1b' with 1 pipeline"),
    "gpu": (_with(FOUNDRY_7B, gpu="V100-SXM2-32GB"), "neither an A100 nor an H100"),
}


@pytest.mark.parametrize("name", sorted(BAD_ROWS))
def test_a_bad_row_is_named(name: str) -> None:
    bad, expected = BAD_ROWS[name]
    assert any(expected in p for p in problems(bad)), problems(bad)
    with pytest.raises(MeasuredRunsError, match=bad.key):
        check([*RUNS[:3], bad])


def test_a_key_twice_and_a_source_split_both_ways_are_named() -> None:
    with pytest.raises(MeasuredRunsError, match="names 2 rows"):
        check([SC21_1_7B, SC21_1_7B])
    held_out = dataclasses.replace(FOUNDRY_7B.source, split="held-out")
    other = dataclasses.replace(FOUNDRY_7B, key="other", source=held_out)
    with pytest.raises(MeasuredRunsError, match="fit on a source or hold it out"):
        check([FOUNDRY_7B, other])


def test_mfu_and_tokens_agree_by_hand() -> None:
    # llm-foundry, A100 40GB, 7b / 2048 / 8 GPUs: MFU 50.92% at 3,679 tokens/s per GPU, N = 6,658,859,008
    n = 6_658_859_008
    assert FOUNDRY_7B.model.parameters() == n
    assert (6 * n + 12 * 32 * 4096 * 2048) * 3679 / 312e12 == pytest.approx(0.5092, abs=2e-4)
    # MegaScale Table 2, 256 GPUs: 39.3k tokens/s and MFU 53.0% under Megatron's model FLOPs
    mega = BY_KEY["megascale-175B-256"]
    assert 39.3e3 * flops_per_token(mega.model, 2048, "megatron") / (256 * 312e12) == pytest.approx(0.530, abs=5e-4)
    # Llama 3 Table 4: MFU is TFLOPs/GPU over the H100's 989
    assert 430 / 989 == pytest.approx(0.43, abs=0.005)


def test_torchtitans_footnote_is_its_8_gpu_fsdp_rows() -> None:
    """'33% to 39% MFU' for 1D Llama 3.1 8B without float8: the eager and compiled FSDP rows on 8 GPUs."""
    mfu = {}
    for tag in ("fsdp", "fsdp-compile"):
        run = BY_KEY[f"titan-8B-8-{tag}"]
        assert run.measured.tokens_per_s_per_gpu is not None
        rate = run.measured.tokens_per_s_per_gpu.value
        mfu[tag] = rate * flops_per_token(run.model, run.seq, "6N-emb+12lhs") / 989e12
    assert 0.33 <= mfu["fsdp"] < 0.34 and 0.39 <= mfu["fsdp-compile"] < 0.40


def test_the_hidden_tables_rows_stay_out() -> None:
    """llm-foundry's A100-80GB and H100 (8-64 GPU) tables hold issue 37's own FSDP-only figures: not here."""
    foundry = runs(source="llm-foundry")
    assert not [r.key for r in foundry if r.gpu == "A100-SXM4-80GB"]
    assert not [r.key for r in foundry if r.family == "H100" and r.gpus < 128]


def test_published_rows_are_the_same_runs() -> None:
    """benchmarks/published.py's SC'21 and Llama 3 rows equal this table's (one run, one set of numbers)."""
    from benchmarks.published import ROWS
    from cost_model.precision import Precision

    names = {"1008B": "sc21-1008B", "405B-8k": "llama3-405B-8k", "405B-16k": "llama3-405B-16k"}
    for row in ROWS:
        run = BY_KEY[names.get(row.name, f"sc21-{row.name}")]
        args = plan_arguments(run)
        assert (row.gpus, row.batch, row.seq) == (run.gpus, run.global_batch, run.seq)
        assert run.measured.tflops_per_gpu is not None and row.published == run.measured.tflops_per_gpu.value
        assert dataclasses.asdict(row.fixed) == args.fixed
        assert row.cluster == args.cluster
        mine = Precision.parse(run.precision)
        assert (mine.compute, mine.param, mine.grad, mine.state) == (
            row.precision.compute, row.precision.param, row.precision.grad, row.precision.state)


def test_plan_arguments_by_hand() -> None:
    sc21 = plan_arguments(SC21_1_7B)
    assert sc21.cluster == {"hosts": 4, "gpus_per_host": 8, "gpu": "A100-SXM4-80GB"}
    assert sc21.forced == {"precision": "fp16/fp32/fp32/fp32:adam", "micro_batches": 32, "replicas": "auto",
                           "tensor": 1, "sharding": "none", "recompute": "full", "schedule": "1f1b",
                           "kernels": "eager"}
    assert sc21.fixed == {"tensor": 1, "stages": 1, "micro_batch_size": 16, "sharding": "none", "schedule": "1f1b",
                          "virtual_stages": 1, "recompute": "full", "order": "replicas-together",
                          "sequence_parallel": False, "gradient_sync": None, "kernels": "eager"}
    assert sc21.dtype == torch.float16 and sc21.example_inputs()[0].shape == (512, 2048)
    assert sc21.cli()[4:] == [
        "benchmarks/measured_plan.py:run_sc21_1_7B", "--cluster", "4x8xA100-SXM4-80GB", "--global-batch", "512",
        "--dtype", "fp16", "--micro-batches", "32", "--precision", "fp16/fp32/fp32/fp32:adam", "--replicas", "auto",
        "--tensor", "1", "--sharding", "none", "--schedule", "1f1b", "--recompute", "full", "--kernels", "eager"]

    foundry = plan_arguments(FOUNDRY_7B)  # FULL_SHARD with checkpointing, 12 a micro-batch, 4 accumulated
    assert foundry.forced["micro_batches"] == 32 and foundry.forced["sharding"] == "zero3"
    assert foundry.cluster["fabric"] == {"inter": {"kind": "roce", "gbit_per_s": 180.0}}
    with pytest.raises(ValueError, match="cluster_file"):
        foundry.cli()

    titan = plan_arguments(BY_KEY["titan-405B-512-3d-interleaved"])  # 8 micro-batches of 4 a replica, v = 2
    assert titan.forced["micro_batches"] == 64
    assert (titan.fixed["stages"], titan.fixed["virtual_stages"], titan.fixed["sharding"]) == (8, 2, "zero1")
    assert titan.cluster_object().gpu.memory_bytes == 96 * 2**30
    h100 = Cluster.from_dict({"hosts": 64, "gpus_per_host": 8, "gpu": "H100-SXM"})
    assert titan.cluster_object().fabric == h100.fabric  # NVSwitch and 400 Gb/s NICs, not a nameless type's PCIe
    assert any("float8" in c for c in titan.caveats)

    long = plan_arguments(BY_KEY["llama3-405B-16k-cp16"])
    assert long.context == 16 and long.forced["micro_batches"] == 128
    assert any(a.startswith("virtual_stages = 8") for a in long.assumed)


@pytest.mark.parametrize("key", ["sc21-1.7B", "foundry-h100-large-1b-2048-128", "titan-8B-8-fsdp",
                                 "megascale-175B-256"])
def test_the_builders_hold_the_shapes_parameters(key: str) -> None:
    run = BY_KEY[key]
    model, tokens = getattr(measured_plan, factory_name(key))(batch=2)
    assert tokens.shape == (2, run.seq) and tokens.device.type == "meta"
    assert sum(p.numel() for p in model.parameters()) == run.model.parameters() + (
        run.model.vocab * run.model.width if run.model.family == "gpt" and run.parallel.pipeline > 1 else 0)
    with pytest.raises(AttributeError, match="run_<key>"):
        measured_plan.run_nothing  # noqa: B018


@pytest.mark.parametrize("key", ["sc21-145.6B", "foundry-a100-40gb-13b-8192-8", "titan-70B-256-2d-bf16-2025",
                                 "llama3-405B-8k", "megascale-530B-2240"])
def test_forced_arguments_make_a_valid_request(key: str) -> None:
    """plan() would take them: the request they make passes its checks (nothing is traced)."""
    from cost_model.precision import Precision
    from partitioner.arguments import cluster_devices
    from partitioner.request import PlanRequest

    args = plan_arguments(BY_KEY[key])
    cluster, devices, _ = cluster_devices(args.cluster)
    forced = dict(args.forced, precision=Precision.of(args.forced["precision"]))
    request = PlanRequest.of(devices, processes=True, cluster=True, gpus_per_host=cluster.gpus_per_host, **forced)
    assert request.tensor == BY_KEY[key].parallel.tensor and request.replicas == "auto"


def test_parallel_defaults_are_a_plain_data_parallel_run() -> None:
    p = Parallel(1, 1, 8)
    assert (p.context, p.virtual_stages, p.schedule, p.sharding, p.recompute) == (1, 1, "none", "none", "none")
