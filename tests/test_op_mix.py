"""Each stage's compute by operator group, from a plan's stored graph and the model's module classes."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from cost_model.op_mix import GROUPS, module_kinds, op_group, stage_shares
from partitioner import plan


def test_operators_fall_in_their_groups() -> None:
    assert op_group({"op": "call_module", "flops": 10, "shapes": [[4, 8]]}, "Linear") == "gemm"
    assert op_group({"op": "call_module", "flops": 10, "shapes": [[4, 8, 5, 5]]}, "Conv2d") == "conv"
    assert op_group({"op": "call_function", "target": "scaled_dot_product_attention", "flops": 10,
                     "shapes": [[2, 4, 8, 8]]}) == "attention"
    assert op_group({"op": "call_module", "shapes": [[4, 8]], "out_bytes": 128}, "LayerNorm") == "norm"
    assert op_group({"op": "call_module", "shapes": [[4, 8, 5, 5]], "out_bytes": 128}, "BatchNorm2d") == "norm"
    assert op_group({"op": "call_function", "target": "relu", "shapes": [[4, 8]], "out_bytes": 128}) == "memory"
    assert op_group({"op": "call_method", "target": "view", "shapes": [[4, 8]], "out_bytes": 128}) == "view"
    assert op_group({"op": "call_function", "target": "getattr", "shapes": [], "out_bytes": 0}) == "view"
    assert set(GROUPS) == {"gemm", "conv", "attention", "norm", "memory", "view"}


def test_a_plans_stages_are_shared_by_group_from_its_node_times() -> None:
    model = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.ReLU(), nn.Linear(64, 8))
    made = plan(model, ["cpu", "cpu"], example_inputs=(torch.randn(16, 64),), micro_batches=2)
    shares = stage_shares(json.loads(made.to_json()), module_kinds(model))
    assert shares is not None and len(shares) == 2
    assert all(sum(s.values()) == pytest.approx(1.0) for s in shares)
    every = {g for s in shares for g in s}
    assert "gemm" in every and "norm" in every and every <= set(GROUPS)
    by_class = {"Linear": "gemm", "LayerNorm": "norm", "ReLU": "memory"}
    for s in range(len(made.stages)):  # every node here is a module: its class names its group
        nodes = [n for n in made.graph["nodes"] if n["stage"] == s]
        total = sum(n["time"] for n in nodes)
        for group in shares[s]:
            mine = sum(n["time"] for n in nodes if by_class[type(model.get_submodule(n["target"])).__name__] == group)
            assert shares[s][group] == pytest.approx(mine / total)
    assert stage_shares({"stages": [{}], "graph": None}) is None
