"""Tracing: fx first with non-tensor arguments fixed, export as fallback, one clear error when both fail."""

from __future__ import annotations

import copy
import re
import weakref
from typing import Any

import pytest
import torch
from torch import nn
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from cost_model.analytic import AnalyticCostModel
from partitioner import partition
from partitioner.capture.trace import trace
from partitioner.errors import PartitionError, TraceError
from tests import zoo


def test_fx_is_used_where_it_works_and_graph_matches_model() -> None:
    model, (x,), _ = zoo.mlp()
    traced = trace(model, (x,))
    assert traced.method == "fx"
    assert torch.equal(traced.graph_module(*traced.flatten_inputs((x,), {})), model(x))


class TokenMixer(nn.Module):
    """fx traces it; its sequence axis (dim 1) is what context parallelism splits."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.out = nn.Embedding(16, 4), nn.Linear(4, 16)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        return self.out(h + h.cumsum(1) / 16)


def test_a_long_sequence_is_exported_first_and_runs_as_the_model() -> None:
    # fx fixes every size, so a long sequence could never split over context ranks: export's free sequence dim can
    from partitioner.capture.sequence import LONG_SEQUENCE

    torch.manual_seed(0)
    model = TokenMixer()
    long, short = torch.randint(0, 16, (1, LONG_SEQUENCE)), torch.randint(0, 16, (1, LONG_SEQUENCE - 1))
    traced = trace(model, (long,))
    assert traced.method == "export"
    assert torch.allclose(traced.graph_module(*traced.flatten_inputs((long,), {}))[0], model(long), atol=1e-5)
    assert trace(model, (short,)).method == "fx"  # an ordinary length traces as before
    pipe = partition(model, ["cpu", "cpu"], example_inputs=(long,), micro_batches=1, cost_model=AnalyticCostModel())
    out, expected = pipe(long), model(long)  # the exported graph, cut into two stages, is the model
    assert torch.allclose(out, expected, atol=1e-5)
    out.square().mean().backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad()
    expected.square().mean().backward()
    params = list(model.parameters())
    assert len(grads) == len(params) and all(torch.allclose(g, p.grad, atol=1e-5) for g, p in zip(grads, params))
    wide = nn.Linear(LONG_SEQUENCE, 2)  # (batch, features): no sequence, however wide
    assert trace(wide, (torch.randn(2, LONG_SEQUENCE),)).method == "fx"


def test_optional_none_argument_is_fixed_not_traced_as_a_tensor() -> None:
    model, (x,), kwargs = zoo.keyword_dict()
    traced = trace(model, (x,), kwargs)
    assert traced.method == "fx"
    flat = traced.flatten_inputs((x,), kwargs)
    assert flat[2] is None  # scale: left at its default, the `if scale is not None` branch not taken
    out = traced.graph_module(*flat)
    ref = model(x, **kwargs)
    assert torch.equal(out["logits"], ref["logits"])


def test_tied_modules_are_traced_through_so_the_weight_is_a_get_attr() -> None:
    model, (idx,), _ = zoo.tiny_gpt()
    gm = trace(model, (idx,)).graph_module
    modules = {n.target for n in gm.graph.nodes if n.op == "call_module"}
    attrs = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    assert "head" not in modules and "tok" not in modules
    assert "tok.weight" in attrs
    assert "blocks.0.qkv" in modules  # untied leaves stay modules
    assert any(t.endswith("mask") for t in attrs)  # buffers are proxied, not baked constants


def test_module_called_twice_is_traced_through() -> None:
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(torch.relu(self.lin(x)))

    gm = trace(Twice(), (torch.randn(2, 4),)).graph_module
    assert not [n for n in gm.graph.nodes if n.op == "call_module"]


def test_export_fallback_for_transformers_gpt2() -> None:
    pytest.importorskip("transformers")
    model, (idx,), _ = zoo.hf_gpt2()
    traced = trace(model, (idx,))
    assert traced.method == "export"
    assert len(traced.flatten_inputs((idx[:3],), {})) == 1
    result = traced.graph_module(idx[:3])  # another batch size: the batch dimension is dynamic
    expected = model(idx[:3])
    assert type(result) is type(expected)
    assert torch.allclose(result.logits, expected.logits, atol=1e-6)


def test_both_tracers_fail_with_one_error() -> None:
    class Branchy(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.max() > 0:
                return x * 2
            return x

    with pytest.raises(TraceError, match=r"cannot trace Branchy:(.|\n)*test_trace.py:\d+ in forward"):
        trace(Branchy(), (torch.randn(3, 2),))


def test_custom_function_is_one_leaf_node_and_markers_become_cut_marks() -> None:
    model, (x,), _ = zoo.custom_functions()
    gm = trace(model, (x,)).graph_module
    leaves = [n for n in gm.graph.nodes if n.op == "call_function" and n.target.__name__.endswith("_apply")]
    assert [n.target.__name__ for n in leaves] == ["StraightThrough_apply", "CountingFn_apply", "ScaleSplit_apply"]
    assert leaves[2].args[1:] == (0.5, True)  # non-tensor arguments are constants of the node
    assert torch.allclose(gm(x), model(x))
    markers, (y,), _ = zoo.markers()
    gm = trace(markers, (y,)).graph_module
    assert [n.target for n in gm.graph.nodes if n.meta.get("cut_before")] == ["rest.0"]
    assert not any("pipe_split" in str(n.target) for n in gm.graph.nodes)  # the marker itself runs nowhere


def test_export_leaves_the_model_tensors_free_to_swap_and_its_own() -> None:
    pytest.importorskip("transformers")
    model, (idx,), _ = zoo.hf_gpt2()
    traced = trace(model, (idx,))
    assert traced.method == "export"
    ours = {id(t) for t in [*model.parameters(), *model.buffers()]}
    assert {id(t) for t in [*traced.graph_module.parameters(), *traced.graph_module.buffers()]} <= ours
    for t in [*model.parameters(), *model.buffers()]:  # runtime.materialize and capture.meta swap them
        assert not weakref.getweakrefs(t)


def test_export_keeps_the_sequence_length_free() -> None:
    pytest.importorskip("transformers")
    model, (idx,), _ = zoo.hf_gpt2()
    model.eval()
    traced = trace(model, (idx,))
    shorter = idx[:3, :6]
    assert torch.allclose(traced.graph_module(*traced.flatten_inputs((shorter,), {})).logits, model(shorter).logits,
                          atol=1e-6)


def test_export_frees_an_images_batch_dim_alone_and_every_dim_of_a_sequence() -> None:
    """[Note: exported dimensions]: images keep their channels and pixels (a model that windows them, such as Swin,
    took minutes to export with them free), token ids and embeddings keep every dim free."""

    class Both(nn.Module):  # *inputs: traced by torch.export
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.emb, self.proj = nn.Conv2d(3, 4, 3), nn.Embedding(10, 4), nn.Linear(4, 4)

        def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
            images, ids, embeds = inputs
            return self.conv(images).mean((2, 3)) + self.emb(ids).mean(1) + self.proj(embeds).mean(1)

    model = Both()
    example = (torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4, 7)), torch.randn(4, 7, 4))
    traced = trace(model, example)
    assert traced.method == "export"
    shapes = [n.meta["val"].shape for n in traced.graph_module.graph.nodes if n.op == "placeholder"]
    free = [[d for d, size in enumerate(shape) if not is_concrete_int(size)] for shape in shapes]
    assert free == [[0], [0, 1], [0, 1]]  # the embeddings' features: free, then fixed by the Linear reading them
    other = (torch.randn(2, 3, 16, 16), torch.randint(0, 10, (2, 5)), torch.randn(2, 5, 4))
    assert torch.allclose(traced.graph_module(*traced.flatten_inputs(other, {})), model(*other), atol=1e-6)
    with pytest.raises(PartitionError, match=r"has size 12 in dim 2 .*fixed dim 2 at the example's 16"):
        traced.flatten_inputs((torch.randn(2, 3, 12, 12), *other[1:]), {})


def test_a_returned_cache_is_named_with_its_fix() -> None:
    class Cache:
        def __init__(self, t: torch.Tensor) -> None:
            self.t = t

    class ReturnsCache(nn.Module):
        def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, Cache]:
            return inputs[0] * 2, Cache(inputs[0])

    with pytest.raises(TraceError, match=r"forward returns a .*Cache .*use_cache=False") as caught:
        trace(ReturnsCache(), (torch.randn(3, 2),))
    assert "torch.where" not in str(caught.value)


def test_only_real_side_effects_warn() -> None:
    class Counting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.calls = 0
            self.shape = (2,)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            self.shape = (2,)  # an equal value: no side effect anyone sees
            return self.lin(x)

    with pytest.warns(UserWarning, match=r"forward set calls while being traced"):
        trace(Counting(), (torch.randn(3, 2),))


# --- issue 36: custom autograd Functions and custom ops under torch.export, errors without torch's graph dumps ---


class Rounded(torch.autograd.Function):
    """Rounds to quarters; its backward (3 x the incoming gradient) is deliberately not the forward's derivative
    (0 almost everywhere): only the Function's own backward gives these gradients."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * 3


class Tagged:
    """A plain object, which a graph cannot hold as an argument."""

    scale = 2.0


class TaggedScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tag: Tagged) -> torch.Tensor:
        return x * tag.scale

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * Tagged.scale, None


class WithKwargs(nn.Module):
    """forward takes **kwargs, as Hugging Face models do: torch.fx refuses it, so torch.export traces it."""

    def __init__(self, tagged: bool = False) -> None:
        super().__init__()
        self.tagged = tagged
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        h = self.a(x)
        h = TaggedScale.apply(h, Tagged()) if self.tagged else Rounded.apply(h)
        return self.c(torch.relu(self.b(h)))


def test_a_function_under_export_is_one_leaf_running_its_own_backward() -> None:
    torch.manual_seed(0)
    model, x = WithKwargs(), torch.randn(6, 8)
    traced = trace(model, (x,))
    assert traced.method == "export"
    leaves = [n for n in traced.graph_module.graph.nodes if getattr(n.target, "autograd_function", None) is Rounded]
    assert len(leaves) == 1
    reference = copy.deepcopy(model)
    pipe = partition(model, ["cpu", "cpu"], example_inputs=(x,), micro_batches=2, cost_model=AnalyticCostModel())
    assert len(pipe.plan.stages) == 2
    pipe(x).square().sum().backward()
    reference(x).square().sum().backward()
    assert zoo.rel(pipe(x), reference(x)) < 1e-6
    for (name, p), r in zip(model.named_parameters(), reference.parameters()):
        assert p.grad is not None and r.grad is not None and zoo.rel(p.grad, r.grad) < 1e-5, name


def test_a_function_export_cannot_keep_is_named_with_its_lines_and_the_fix() -> None:
    with pytest.raises(TraceError) as caught:
        trace(WithKwargs(tagged=True), (torch.randn(6, 8),))
    text = str(caught.value)
    assert re.search(r"TaggedScale \(defined at .*test_trace\.py:\d+\), called at .*test_trace\.py:\d+ in forward",
                     text)
    assert "forward takes **kwargs" in text
    assert "Fix: pass the Function only tensors and plain values" in text and "torch.library.custom_op" in text


def test_a_custom_op_with_its_autograd_is_kept_and_its_gradients_are_eager_ones() -> None:
    pytest.importorskip("transformers")
    from transformers.integrations import moe  # noqa: F401 - registers transformers::grouped_mm_fallback

    op = torch.ops.transformers.grouped_mm_fallback

    class Grouped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(3, 8, 5))

        def forward(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
            offsets = torch.tensor([2, 5, 6], dtype=torch.int32)
            return op(x, self.weight, offsets)

    torch.manual_seed(0)
    model, x = Grouped(), torch.randn(6, 8, requires_grad=True)
    traced = trace(model, (x,))
    assert traced.method == "export"
    assert any(n.target is op.default for n in traced.graph_module.graph.nodes)
    out = traced.graph_module(*traced.flatten_inputs((x,), {}))
    weights = torch.randn(6, 5)
    (out * weights).sum().backward()
    grad_x, grad_w = x.grad.clone(), model.weight.grad.clone()  # type: ignore[union-attr]
    x.grad, model.weight.grad = None, None
    expected = torch.cat([x[:2] @ model.weight[0], x[2:5] @ model.weight[1], x[5:] @ model.weight[2]])
    (expected * weights).sum().backward()
    assert zoo.rel(out, expected) < 1e-6
    assert zoo.rel(grad_x, x.grad) < 1e-6 and zoo.rel(grad_w, model.weight.grad) < 1e-6  # type: ignore[arg-type]


def test_a_data_dependent_branch_fails_without_torch_graph_dumps(capfd: pytest.CaptureFixture[str]) -> None:
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.max() > 0:
                return self.lin(x) * 2
            return x

    with pytest.raises(TraceError, match=r"(?s)test_trace\.py:\d+ in forward.*Fix: make that code independent"):
        trace(Branchy(), (torch.randn(4, 2),))
    out, err = capfd.readouterr()
    assert "def forward" not in out + err and "Unable to find user code" not in out + err, out + err
