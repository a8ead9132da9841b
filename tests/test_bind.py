"""A plan binds to the model by structure (partitioner.make.bind): made on meta, it runs on real weights.

Traced on meta, Falcon and GPT-J kept `.contiguous()` calls a trace with weights drops (transformers asks the
device), so node names after them differed ('mul_13' on meta was 'mul_17' with weights). Meta models now export
on a stand-in device (partitioner.capture.export_device), so those traces agree; other differences remain
possible (another torch or transformers version, a hand-edited plan), so plans record each node's key (what it
calls, in which module) and bind by an order-keeping alignment, tested here on a model traced with one node
more; plans saved before keys were recorded bind by name and say so. Worker for the torchrun cases:
tests/bind_worker.py.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from partitioner import PartitionError, partition, plan
from partitioner.make.bind import bind, structure
from partitioner.meta import empty_weights
from runtime.plan import Plan
from tests import zoo
from tests.test_distributed import results, torchrun
from tests.test_hf_models import assert_same_gradients

WORKER = str(Path(__file__).resolve().parent / "bind_worker.py")
FAMILIES = [*zoo.HF_FAMILIES, "opt", "gpt_neox", "falcon", "gptj", "mixtral"]


def _build(family: str) -> nn.Module:
    case = zoo.hf_case(family)
    case.config.use_cache = False
    return case.cls(case.config)


def _inputs(family: str) -> tuple[tuple[Any, ...], dict[str, Any]]:
    torch.manual_seed(1)
    return zoo.hf_case(family).inputs(8, 8)


def _output(out: Any) -> torch.Tensor:
    return getattr(out, "logits", out)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_plan_made_on_meta_runs_on_the_real_model_equal_to_it(family: str) -> None:
    torch.manual_seed(0)
    model = _build(family).eval()
    reference = copy.deepcopy(model)
    with empty_weights():
        meta = _build(family).eval()
    args, kwargs = _inputs(family)
    made = plan(meta, cluster="1x2xH100", example_inputs=args, example_kwargs=kwargs, micro_batches=2)
    assert made.node_keys and len(made.stages) == 2
    saved = Plan.from_json(made.to_json())  # as a user saves it and loads it elsewhere
    pipe = partition(model, ["cpu", "cpu"], example_inputs=args, example_kwargs=kwargs, plan=saved)
    assert [len(s.nodes) for s in pipe.plan.stages] != [0, 0]
    out, ref = _output(pipe(*args, **kwargs)), _output(reference(*args, **kwargs))
    assert zoo.rel(out, ref) < 1e-5
    out.float().square().mean().backward()
    ref.float().square().mean().backward()
    assert_same_gradients(model, reference)  # an attention key's bias has only rounding noise for a gradient


class Chain(nn.Module):
    def __init__(self, extra: bool) -> None:
        super().__init__()
        self.extra = extra
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for k, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if self.extra and k == 1:  # a trace of the same model with one more node (as Falcon on meta)
                x = x.contiguous() * 1.0
        return x


def test_an_added_node_keeps_the_cut_and_takes_its_neighbours_stage() -> None:
    x = torch.randn(4, 8)
    made = plan(Chain(extra=True), ["cpu", "cpu"], example_inputs=(x,), micro_batches=2)
    planned = [name for name, _ in made.node_keys]
    assert "contiguous" in planned and "mul" in planned
    cut = planned.index("layers_2")  # stage 1 from the third layer; the extra nodes (after layer 1) in stage 0
    made.stages[0].nodes, made.stages[1].nodes = planned[:cut], planned[cut:]
    model = Chain(extra=False)
    model.load_state_dict(Chain(extra=True).state_dict())
    reference = copy.deepcopy(model)
    pipe = partition(model, ["cpu", "cpu"], example_inputs=(x,), plan=Plan.from_json(made.to_json()))
    running = [name for name, _ in structure(torch.fx.symbolic_trace(reference))]
    assert "contiguous" not in running
    cut = running.index("layers_2")
    assert [s.nodes for s in pipe.plan.stages] == [running[:cut], running[cut:]]
    assert zoo.rel(pipe(x), reference(x)) < 1e-6


def test_names_alone_that_do_not_match_are_refused_naming_the_cause_and_fix() -> None:
    x = torch.randn(4, 8)
    made = plan(Chain(extra=False), ["cpu", "cpu"], example_inputs=(x,), micro_batches=2)
    old = dataclasses.replace(made, node_keys=[])  # as a plan saved before node keys
    old.stages[0].nodes = [*old.stages[0].nodes, "mul_99"]
    with pytest.raises(PartitionError, match=r"names 1 nodes this trace of the model does not have \(mul_99\).*"
                                             r"Plan again"):
        bind(old, torch.fx.symbolic_trace(Chain(extra=False)))


def test_node_keys_survive_json_and_a_plan_without_them_still_loads() -> None:
    x = torch.randn(4, 8)
    made = plan(Chain(extra=False), ["cpu", "cpu"], example_inputs=(x,), micro_batches=2)
    text = made.to_json()
    assert Plan.from_json(text).node_keys == made.node_keys == structure(torch.fx.symbolic_trace(Chain(False)))
    older = re.sub(r',\n "node_keys": \[[^\]]*\]', "", text)
    assert "node_keys" not in older
    loaded = Plan.from_json(older)
    assert loaded.node_keys == [] and loaded.stages == made.stages
    pipe = partition(Chain(extra=False), ["cpu", "cpu"], example_inputs=(x,), plan=loaded)
    assert pipe(x).shape == (4, 8)


def test_plans_on_meta_run_with_weights_under_torchrun_sharded_and_split() -> None:
    # rank 0 plans on meta for 1x4xH100 (the search's choice, tensor=2, sharding='zero3'); 4 gloo ranks run it
    # with the plain model's weights (built with them, or on meta with weights=); loss, gradients, one Adam step
    cases = ["falcon", "gptj:zero3", "gpt_neox:tensor2", "opt:zero3:meta", "falcon:tensor2:meta"]
    proc = torchrun(4, *cases, worker=WORKER, timeout=900)
    lines = results(proc.stdout)
    assert proc.returncode == 0 and len(lines) == 4 * len(cases), proc.stdout[-4000:]
    assert all("ok=True" in line for line in lines), "\n".join(lines)

