"""Plan.check verifies a plan's programs against its micro-batches, stages, ranks and devices (issue 25, item 5).

A plan JSON edited by hand used to pass the check and then train to a wrong loss (micro_batches 4 -> 8:
half the micro-batches never ran) or crash in the interpreter (4 -> 2: KeyError: 2; a missing field:
KeyError: 1). Each is now a ValueError from Plan.check (a PartitionError from partition(plan=...))
naming the field and the fix, and the plan with its programs regenerated trains as the plain model.
"""

from __future__ import annotations

import copy
import gzip
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cost_model.analytic import AnalyticCostModel
from partitioner import PartitionError, partition
from runtime.plan import Plan
from tests.zoo import rel

FIX = r"plan.programs = \[\]"


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def saved_plan() -> tuple[nn.Module, torch.Tensor, dict[str, Any]]:
    model = mlp()
    x = torch.randn(8, 8)
    pipe = partition(copy.deepcopy(model), ["cpu", "cpu"], example_inputs=(x,), micro_batches=4,
                     cost_model=AnalyticCostModel())
    return model, x, json.loads(pipe.plan.to_json())


@pytest.mark.parametrize("edit,match", [
    ("micro_batches=8", r"with micro_batches=8 the programs never run F s0 mb4"),
    ("micro_batches=2", r"programs name micro-batches, stages or ranks the plan does not have \(micro_batches=2"),
    ("no micro_batches", r"micro-batches, stages or ranks the plan does not have \(micro_batches=1"),
    ("an op deleted", r"never run F s1 mb1"),
    ("an op on another rank", r"ops on the wrong rank: F s1 mb0 .* on rank 0"),
    ("a message deleted", r"messages not paired: s0->s1 mb2 \(rank 0 -> 1\) sent 1, received 0"),
    ("a device changed", r"programs\[1\] on cuda:1 runs stage 1 of cpu"),
])
def test_an_edited_plan_is_refused_naming_the_field_and_the_fix(edit: str, match: str, tmp_path: Path) -> None:
    model, x, data = saved_plan()
    programs = data["programs"]
    if edit.startswith("micro_batches="):
        data["micro_batches"] = int(edit.split("=")[1])
    elif edit == "no micro_batches":
        del data["micro_batches"]
    elif edit == "an op deleted":
        programs[1]["ops"] = [o for o in programs[1]["ops"] if not o.startswith("F s1 mb1 ")]
    elif edit == "an op on another rank":
        moved = next(o for o in programs[1]["ops"] if o.startswith("F s1 mb0 "))
        programs[1]["ops"].remove(moved)
        programs[0]["ops"].insert(0, moved)
    elif edit == "a message deleted":
        programs[1]["ops"] = [o for o in programs[1]["ops"] if not o.startswith("RECV s0->s1 mb2 ")]
    elif edit == "a device changed":
        programs[1]["device"] = "cuda:1"
    text = json.dumps(data)
    with pytest.raises(ValueError, match=match) as raised:
        Plan.from_json(text)
    assert "plan.programs = []" in str(raised.value)
    path = tmp_path / "plan.json"
    path.write_text(text)
    with pytest.raises(PartitionError, match=FIX):
        partition(copy.deepcopy(model), ["cpu", "cpu"], example_inputs=(x,), plan=str(path))


def test_the_fix_regenerates_programs_that_train_as_the_plain_model() -> None:
    model, x, data = saved_plan()
    data["micro_batches"] = 8
    data["programs"] = []  # the fix the error names
    plan = Plan.from_json(json.dumps(data))
    reference = copy.deepcopy(model)
    pipe = partition(model, ["cpu", "cpu"], example_inputs=(x,), plan=plan)
    y = torch.randn(8, 4)
    loss = pipe.train_step(x, y, F.mse_loss)
    ref = F.mse_loss(reference(x), y)
    ref.backward()
    assert loss is not None and rel(loss, ref) < 1e-5
    for p, q in zip(model.parameters(), reference.parameters()):
        assert p.grad is not None and q.grad is not None and rel(p.grad, q.grad) < 1e-5


@pytest.mark.parametrize("path", sorted(Path(__file__).parent.glob("data/plans/*.json.gz")), ids=lambda p: p.name)
def test_plans_the_planners_made_pass(path: Path) -> None:
    plan = Plan.from_json(gzip.decompress(path.read_bytes()).decode())
    assert plan.programs  # checked by from_json, with programs
