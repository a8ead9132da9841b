"""Tensor parallelism on DTensor: a whole model as one stage on 2 gloo ranks equals the plain model."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import torch

from partitioner.capture.graph import compute_nodes
from partitioner.capture.trace import trace
from runtime.plan import Plan, StagePlan
from runtime.stage import build_stages
from runtime.tensor_parallel import parallelize_stage, region
from runtime.tensor_parallel_spec import ShardedParam, TensorParallelGroup
from tests import tp_worker
from tests.test_distributed import results, torchrun

WORKER = str(Path(__file__).resolve().parent / "tp_worker.py")

EXAMPLES = ["gpt", "gpt_export", "cnn"]
HUGGING_FACE = ["llama", "gpt2"]
LAUNCH_S = 600  # the whole launch; the first test waits for it
Launched = tuple[subprocess.CompletedProcess[str], dict[str, list[str]]]  # the launch, and each case's lines


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Launched:
    """Every case of the tests below from one 2-rank launch (a launch costs each rank an import of torch,
    transformers and partitioner), and each case's RESULT lines; the worker reports a case that raises as failed
    and runs the next."""
    run = torchrun(2, *EXAMPLES, *HUGGING_FACE, "--checkpoint", str(tmp_path_factory.mktemp("tp")), worker=WORKER,
                   timeout=LAUNCH_S)
    by_case: dict[str, list[str]] = {}
    for line in results(run.stdout):
        found = re.search(r"case=(\S+)", line)
        by_case.setdefault(found.group(1) if found else "?", []).append(line)
    return run, by_case


def check(two_ranks: Launched, cases: list[str]) -> None:
    # each case: output and every gradient within 1e-5 of the plain model, both ranks posting the same
    # collectives in the same order and as many as partitioner.capture.shardable predicted, and a DCP
    # checkpoint (after one SGD step) that loads into the plain model with its own keys
    run, by_case = two_ranks
    lines = [line for case in cases for line in by_case.get(case, [])]
    assert len(lines) == 2 * len(cases), run.stdout[-4000:]
    assert all("ok=True" in line for line in lines), "\n".join(lines)
    # the exit code: a failed case explains a non-zero one, nothing else does
    failed = any("ok=False" in line for found in by_case.values() for line in found)
    assert run.returncode == 0 or failed, run.stdout[-4000:]


@pytest.mark.timeout(LAUNCH_S + 60)
def test_example_gpt_fx_and_export_and_cnn_on_two_ranks(two_ranks: Launched) -> None:
    check(two_ranks, EXAMPLES)


@pytest.mark.timeout(LAUNCH_S + 60)
def test_hugging_face_llama_and_gpt2_on_two_ranks(two_ranks: Launched) -> None:
    check(two_ranks, HUGGING_FACE)


def gpt_stage() -> torch.fx.GraphModule:
    torch.manual_seed(0)
    model, args = tp_worker.gpt()
    gm = trace(model, args).graph_module
    stages, _ = build_stages(gm, Plan([StagePlan(0, "cpu", [n.name for n in compute_nodes(gm)])]))
    return stages[0].module


def group(*params: tuple[str, str, int | None, int]) -> TensorParallelGroup:
    return TensorParallelGroup("g", tuple(ShardedParam(*p) for p in params))  # type: ignore[arg-type]


def test_region_runs_from_the_colwise_uses_to_the_rowwise_ones() -> None:
    module = gpt_stage()
    mlp = group(("blocks.0.mlp.0.weight", "colwise", 0, 1), ("blocks.0.mlp.2.weight", "rowwise", 1, 1))
    assert sorted(n.name for n in region(module, mlp)) == ["blocks_0_mlp_0", "blocks_0_mlp_1", "blocks_0_mlp_2"]
    attention = group(("blocks.0.qkv.weight", "colwise", 0, 3), ("blocks.0.proj.weight", "rowwise", 1, 1))
    names = {n.name for n in region(module, attention)}
    assert {"blocks_0_qkv", "split", "matmul", "softmax", "matmul_1", "reshape", "blocks_0_proj"} <= names
    assert not names & {"blocks_0_ln1", "add_1", "blocks_0_mask"}  # its input, the residual, the mask stay out
    tied = group(("tok.weight", "vocab", 0, 1))  # no rowwise parameter: each use alone, not the model between
    assert sorted(n.name for n in region(module, tied)) == ["embedding", "linear"]


def test_wrong_groups_are_refused_before_anything_moves() -> None:
    module = gpt_stage()
    with pytest.raises(KeyError, match="no parameter 'blocks.9.qkv.weight'"):
        region(module, group(("blocks.9.qkv.weight", "colwise", 0, 1)))
    twice = [group(("blocks.0.proj.weight", "rowwise", 1, 1)), group(("blocks.0.proj.weight", "colwise", 0, 1))]
    with pytest.raises(ValueError, match="is in groups"):
        parallelize_stage(module, object(), twice)  # type: ignore[arg-type]  # refused before the mesh is read
