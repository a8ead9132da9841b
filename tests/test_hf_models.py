"""Hugging Face models as they come: default configs (sizes shrunk) partition, train and run like the plain model."""

from __future__ import annotations

import copy
import logging
import math
import operator
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cost_model.analytic import AnalyticCostModel
from partitioner import PartitionError, TraceError, partition
from partitioner.capture import cache
from partitioner.capture.graph import owning_module
from partitioner.capture.whole import expert_stacks
from partitioner.meta import empty_weights
from tests import zoo

pytest.importorskip("transformers")

BATCH, MICRO_BATCHES = 4, 2
LONG, SHORT = 12, 7  # tokens; a vision model's images are 40 pixels wide (5 patches a side: other than the config's
# 32, so ViT interpolates its position embeddings, as the plain model does); one 24 wide is refused by name
DEVICES = ["cpu", "cpu"]


def _side(name: str, seq: int) -> int:
    return {LONG: 40, SHORT: 24}[seq] if name == "vit" else seq


def loss_fn(out: Any, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out.logits, target)


def assert_same_gradients(model: nn.Module, reference: nn.Module) -> None:
    """Every parameter's gradient within 1e-4 of the largest gradient of the plain model."""
    pairs = [(p.grad, r.grad) for p, r in zip(model.parameters(), reference.parameters()) if r.grad is not None]
    assert pairs and all(g is not None for g, _ in pairs)
    scale = max(float(r.abs().max()) for _, r in pairs)
    worst = max(float((g - r).abs().max()) for g, r in pairs)  # type: ignore[operator]
    assert worst <= 1e-4 * scale, (worst, scale)


def assert_every_gradient_close(model: nn.Module, reference: nn.Module, tol: float = 1e-5) -> None:
    """Every parameter's gradient within `tol` of the plain model's, relative to that gradient's own norm (or to
    1e-3 of the largest, for one that is zero but for rounding: attention's key bias)."""
    pairs = [(name, p.grad, r.grad) for (name, p), r in zip(model.named_parameters(), reference.parameters())]
    scale = max(float(r.double().norm()) for _, _, r in pairs if r is not None)
    for name, g, r in pairs:
        assert (g is None) == (r is None), name
        if g is not None and r is not None:
            error = float((g.double() - r.double()).norm()) / max(float(r.double().norm()), 1e-3 * scale)
            assert error < tol, (name, error)


def without_cache(model: nn.Module) -> nn.Module:
    """The plain model as the pipeline traced it: use_cache off (partitioner.capture.cache says so in the log)."""
    for module in model.modules():
        if getattr(getattr(module, "config", None), "use_cache", False):
            module.config.use_cache = False  # type: ignore[union-attr]
    return model


class Family:
    """One family partitioned once in training mode (as constructed, dropout on) and its plain twin."""

    def __init__(self, name: str) -> None:
        torch.manual_seed(0)
        self.name = name
        self.case = zoo.hf_case(name)
        self.model = self.case.build()
        assert self.model.training
        self.reference = without_cache(copy.deepcopy(self.model))
        self.args, self.kwargs = self.case.inputs(BATCH, _side(name, LONG))
        self.pipe = partition(self.model, DEVICES, example_inputs=self.args, example_kwargs=self.kwargs,
                              micro_batches=MICRO_BATCHES, cost_model=AnalyticCostModel())


@pytest.fixture(scope="module", params=zoo.HF_FAMILIES + zoo.HF_MORE_FAMILIES)
def family(request: pytest.FixtureRequest) -> Family:
    return Family(request.param)


@pytest.mark.timeout(180)  # the family's partition (its fixture) runs here: two exports per mode
def test_partitions_in_training_mode_on_two_stages(family: Family) -> None:
    assert len(family.pipe.plan.stages) == 2
    assert all(stage.nodes for stage in family.pipe.plan.stages)
    if family.name in MIXTURES:
        assert_experts_whole(family)


MIXTURES = ["mixtral", "qwen3_moe", "gpt_oss"]


def assert_experts_whole(family: Family) -> None:
    """Each layer's stack of experts is one node of one stage (capture.whole), in both modes' stages: no stage
    runs a tensor operation of a stack of experts outside it."""
    stacks = expert_stacks(family.model)
    assert len(stacks) == family.case.config.num_hidden_layers
    stages_of: dict[str, set[int]] = {}
    for s, module in enumerate(family.pipe.stage_modules):
        for node in module.graph.nodes:
            if node.meta.get("whole"):
                stages_of.setdefault(node.meta["whole"], set()).add(s % len(family.pipe.plan.stages))
            elif node.op == "call_function" and node.target is not operator.getitem:
                inside = [p for p in stacks if owning_module(node) == p or owning_module(node).startswith(p + ".")]
                assert not inside or not isinstance(node.meta.get("val"), torch.Tensor), (node.name, inside)
    assert sorted(stages_of) == sorted(stacks) and all(len(s) == 1 for s in stages_of.values()), stages_of


def test_eval_output_equals_the_plain_model(family: Family) -> None:
    family.pipe.eval()
    family.reference.eval()
    with torch.no_grad():
        out = family.pipe(*family.args, **family.kwargs)
        zoo.assert_same_outputs(out, family.reference(*family.args, **family.kwargs))


def test_eval_train_step_gradients_equal(family: Family) -> None:
    family.pipe.eval()
    family.reference.eval()
    target = torch.randn_like(family.reference(*family.args, **family.kwargs).logits)
    family.model.zero_grad(set_to_none=True)
    family.reference.zero_grad(set_to_none=True)
    loss = family.pipe.train_step(family.args, target, loss_fn, input_kwargs=family.kwargs)
    ref_loss = loss_fn(family.reference(*family.args, **family.kwargs), target)
    ref_loss.backward()
    assert loss is not None and abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())
    assert_same_gradients(family.model, family.reference)
    if family.name in zoo.HF_MORE_FAMILIES:  # issue 36's families: every gradient on its own scale
        assert_every_gradient_close(family.model, family.reference)


def test_train_step_with_dropout_is_finite(family: Family) -> None:
    family.pipe.train()
    target = torch.randn_like(family.reference(*family.args, **family.kwargs).logits)
    family.model.zero_grad(set_to_none=True)
    loss = family.pipe.train_step(family.args, target, loss_fn, input_kwargs=family.kwargs)
    assert loss is not None and math.isfinite(float(loss))
    grads = [p.grad for p in family.model.parameters() if p.grad is not None]
    assert grads and all(bool(torch.isfinite(g).all()) for g in grads)


def test_shorter_sequence_equals_the_plain_model(family: Family) -> None:
    family.pipe.eval()
    family.reference.eval()
    torch.manual_seed(1)
    args, kwargs = family.case.inputs(BATCH, _side(family.name, SHORT))
    if family.name == "vit":  # an image's sides stay the example's (capture.export: [Note: exported dimensions])
        with pytest.raises(PartitionError, match=r"'pixel_values' has size 24 in dim 2 .*fixed dim 2 at the "
                           r"example's 40.*partition again with an example of this size"):
            family.pipe(*args, **kwargs)
        args, kwargs = family.case.inputs(BATCH + 2, _side(family.name, LONG))  # its batch is free
    with torch.no_grad():
        zoo.assert_same_outputs(family.pipe(*args, **kwargs), family.reference(*args, **kwargs))


@pytest.mark.timeout(180)
def test_built_on_meta_with_weights_equals_the_plain_model(family: Family) -> None:
    reference = family.reference.eval()
    with empty_weights():
        model = family.case.build()
    model.eval()
    pipe = partition(model, DEVICES, example_inputs=family.args, example_kwargs=family.kwargs,
                     micro_batches=MICRO_BATCHES, weights=reference.state_dict())
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    with torch.no_grad():
        zoo.assert_same_outputs(pipe(*family.args, **family.kwargs), reference(*family.args, **family.kwargs))


# --- the reproductions of issue 25 ---


def test_default_cache_is_turned_off_and_said_once(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    case = zoo.hf_case("gpt2")
    model = case.build().eval()
    assert model.config.use_cache
    args, kwargs = case.inputs(BATCH, LONG)
    cache._SAID_NO_CACHE.discard(type(model))  # said once a process: maybe already, by another test
    with caplog.at_level(logging.INFO, logger="partitioner.capture.cache"):
        pipe = partition(model, DEVICES, example_inputs=args, micro_batches=MICRO_BATCHES,
                         cost_model=AnalyticCostModel())
        partition(copy.deepcopy(model), DEVICES, example_inputs=args, micro_batches=MICRO_BATCHES,
                  cost_model=AnalyticCostModel())
    said = [r for r in caplog.records if "use_cache=False" in r.getMessage()]
    assert len(said) == 1 and model.config.use_cache
    out = pipe(*args)
    assert out.past_key_values is None
    assert zoo.rel(out.logits, model(*args, use_cache=False).logits) < 1e-5


def test_a_cache_asked_for_names_use_cache_false() -> None:
    case = zoo.hf_case("llama")
    model = case.build().eval()
    args, _ = case.inputs(BATCH, LONG)
    with pytest.raises(TraceError, match=r"use_cache=False") as caught:
        partition(model, DEVICES, example_inputs=args, example_kwargs={"use_cache": True}, micro_batches=2)
    assert "torch.where" not in str(caught.value)


def test_llama_with_attention_dropout_partitions_in_training_mode() -> None:
    torch.manual_seed(0)
    case = zoo.hf_case("llama")
    case.config.attention_dropout = 0.1
    model = case.build()
    reference = without_cache(copy.deepcopy(model)).eval()
    args, _ = case.inputs(BATCH, LONG)
    pipe = partition(model, DEVICES, example_inputs=args, micro_batches=MICRO_BATCHES,
                     cost_model=AnalyticCostModel())
    target = torch.randn(BATCH, LONG, 128)
    assert math.isfinite(float(pipe.train_step(args, target, loss_fn)))  # type: ignore[arg-type]
    pipe.eval()
    with torch.no_grad():
        zoo.assert_same_outputs(pipe(*args), reference(*args))


def test_a_failed_meta_partition_leaves_real_buffers_as_they_were() -> None:
    torch.manual_seed(0)
    case = zoo.hf_case("llama")
    weights = case.build().state_dict()
    weights.pop("lm_head.weight")
    with empty_weights():
        model = case.build()
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    args, _ = case.inputs(BATCH, LONG)
    with pytest.raises(PartitionError, match="lm_head.weight"):
        partition(model, DEVICES, example_inputs=args, micro_batches=MICRO_BATCHES, weights=weights)
    assert all(p.is_meta for p in model.parameters())
    for name, b in model.named_buffers():
        assert not b.is_meta and torch.equal(b, buffers[name]), name


def test_a_dimension_the_export_fixed_is_refused_naming_the_input() -> None:
    class Positions(nn.Module):  # *inputs: traced by torch.export; the position table fixes the length
        def __init__(self) -> None:
            super().__init__()
            self.pos = nn.Parameter(torch.randn(LONG, 8))
            self.head = nn.Linear(8, 8)

        def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
            return self.head(inputs[0] + self.pos)

    pipe = partition(Positions(), DEVICES, example_inputs=(torch.randn(BATCH, LONG, 8),), micro_batches=2)
    assert pipe(torch.randn(BATCH + 2, LONG, 8)).shape == (BATCH + 2, LONG, 8)  # the batch stays free
    with pytest.raises(PartitionError, match=rf"dim 1 at the example's {LONG}"):
        pipe(torch.randn(BATCH, SHORT, 8))


@pytest.mark.parametrize("export", [False, True])
def test_an_example_the_model_rejects_names_the_input_and_the_shape_wanted(export: bool) -> None:
    class Model(zoo.MLP):
        def forward(self, x: torch.Tensor, *rest: Any) -> torch.Tensor:  # *rest: traced by torch.export
            return super().forward(x)

    model = Model() if export else zoo.MLP()
    with pytest.raises(PartitionError, match=r"example input 'x'.*body\.0 \(Linear\).*wants \(\*, 32\)"):
        partition(model, DEVICES, example_inputs=(torch.randn(BATCH, 16),), micro_batches=2)
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_no_false_side_effect_warning_on_hugging_face_models() -> None:
    case = zoo.hf_case("gpt2")
    args, _ = case.inputs(BATCH, LONG)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*while being traced")
        partition(case.build(), DEVICES, example_inputs=args, micro_batches=2, cost_model=AnalyticCostModel())
