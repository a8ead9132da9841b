"""Tensor parallelism on DTensor: a whole model as one stage on 2 gloo ranks equals the plain model."""

from __future__ import annotations

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


def check(cases: list[str], tmp_path: Path) -> None:
    # each case: output and every gradient within 1e-5 of the plain model, both ranks posting the same
    # collectives in the same order and as many as partitioner.capture.shardable predicted, and a DCP
    # checkpoint (after one SGD step) that loads into the plain model with its own keys
    run = torchrun(2, *cases, "--checkpoint", str(tmp_path), worker=WORKER, timeout=420)
    lines = results(run.stdout)
    assert run.returncode == 0 and len(lines) == 2 * len(cases), run.stdout[-4000:]
    assert all("ok=True" in line for line in lines), "\n".join(lines)


def test_example_gpt_fx_and_export_and_cnn_on_two_ranks(tmp_path: Path) -> None:
    check(["gpt", "gpt_export", "cnn"], tmp_path)


def test_hugging_face_llama_and_gpt2_on_two_ranks(tmp_path: Path) -> None:
    check(["llama", "gpt2"], tmp_path)


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
