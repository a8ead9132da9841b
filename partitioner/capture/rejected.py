"""Example inputs the model rejects: a PartitionError naming the input, the first layer that fails, what it wants.

Shape propagation (the fx path) and torch.export run the model on the example; where the model
cannot take the example (`mat1 and mat2 shapes cannot be multiplied`, an index past an embedding),
the raw error names neither the input nor the layer. Here the example runs once more (no gradients,
the random state forked, buffers restored) to find the first module or graph node that fails.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.conv import _ConvNd
from torch.nn.modules.instancenorm import _InstanceNorm

from partitioner.capture.graph import owning_module
from partitioner.capture.untraceable import where
from partitioner.errors import PartitionError

__all__ = ["graph_rejects", "model_rejects", "wanted"]


def wanted(module: nn.Module) -> str | None:
    """What the layer takes, as a shape (`*` any number of dims), for the common layers; None for others."""
    if isinstance(module, nn.Linear):
        return f"(*, {module.in_features})"
    if isinstance(module, _ConvNd):
        spatial = len(module.kernel_size)
        return f"(N, {module.in_channels}{', *' * spatial})"
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
        return f"integer indices in [0, {module.num_embeddings})"
    if isinstance(module, nn.LayerNorm):
        return f"(*, {', '.join(map(str, module.normalized_shape))})"
    if isinstance(module, (_BatchNorm, _InstanceNorm)):
        return f"(N, {module.num_features}, *)"
    if isinstance(module, nn.GroupNorm):
        return f"(N, {module.num_channels}, *)"
    if isinstance(module, nn.MultiheadAttention):
        return f"(*, {module.embed_dim})"
    if isinstance(module, nn.RNNBase):
        return f"(*, {module.input_size})"
    return None


def _shapes(values: Any) -> list[tuple[int, ...]]:
    return [tuple(t.shape) for t in pytree.tree_leaves(values) if isinstance(t, torch.Tensor)]


def _show(shapes: Sequence[tuple[int, ...]]) -> str:
    return ", ".join(str(s) for s in shapes) or "no tensor"


def _error(inputs: Mapping[str, Any], path: str, module: nn.Module | None, got: Any, exc: BaseException,
           of: str = "of shape") -> PartitionError:
    named = [f"{name!r} ({of} {tuple(v.shape)})" for name, v in inputs.items() if isinstance(v, torch.Tensor)]
    which = f"example input {named[0]}" if len(named) == 1 else f"example inputs {', '.join(named) or '(none)'}"
    layer = f"{path or 'the model'} ({type(module).__name__})" if module is not None else (path or "the model")
    want = wanted(module) if module is not None else None
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return PartitionError(
        f"the model rejects its {which}: {layer}, the first layer that fails, "
        f"{f'wants {want} and ' if want else ''}got {_show(got)} ({type(exc).__name__}: {first}). "
        "Pass example_inputs shaped as the model takes them (the whole batch, split along dim 0)"
    )


def _needs_values(exc: BaseException, example: Any) -> bool:
    """Whether `exc` is meta tensors' lack of values (`.item()`, a copy out, a data-dependent size), not the
    example's fault: the example is on meta and the message says meta."""
    on_meta = any(isinstance(t, torch.Tensor) and t.is_meta for t in pytree.tree_leaves(example))
    return on_meta and "meta" in str(exc).lower()


def _values_error(path: str, module: nn.Module | None, exc: BaseException) -> PartitionError:
    layer = f"{path or 'the model'} ({type(module).__name__})" if module is not None else (path or "the model")
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    line = where(exc)
    return PartitionError(
        f"the model is on meta, and {layer} needs tensor values{f' at {line}' if line else ''} ({type(exc).__name__}: "
        f"{first}); meta tensors have shapes only. Make that code independent of tensor values (no .item(), no "
        "data-dependent shapes), or build the model on a real device"
    )


@contextlib.contextmanager
def _restored(root: nn.Module) -> Iterator[None]:
    """No gradients, the random state forked, the buffers as they were afterwards."""
    buffers = [(b, b.detach().clone()) for b in root.buffers() if not b.is_meta]
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            yield
    finally:
        with torch.no_grad():
            for b, value in buffers:
                b.copy_(value)


def model_rejects(model: nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any]) -> PartitionError | None:
    """The error naming the first module that fails when `model` runs the example; None if it runs."""
    active: list[tuple[str, nn.Module, list[tuple[int, ...]]]] = []

    def enter(path: str) -> Callable[..., None]:
        def hook(module: nn.Module, a: Any, k: Any) -> None:
            active.append((path, module, _shapes((a, k))))
        return hook

    def leave(module: nn.Module, a: Any, k: Any, out: Any) -> None:
        if active and active[-1][1] is module:
            active.pop()

    handles = []
    for path, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(enter(path), with_kwargs=True))
        handles.append(module.register_forward_hook(leave, with_kwargs=True))
    try:
        with _restored(model):
            model(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - whatever the model raises on its example is the answer
        path, module, got = active[-1] if active else ("", model, _shapes((args, kwargs)))
        if _needs_values(exc, (args, kwargs)):
            return _values_error(path, module, exc)
        bound = inspect.signature(model.forward).bind_partial(*args, **kwargs)
        return _error(dict(bound.arguments), path, module, got, exc)
    finally:
        for h in handles:
            h.remove()
    return None


class _Failing(torch.fx.Interpreter):
    """Runs a graph and remembers the node it is running."""

    node: torch.fx.Node | None = None

    def run_node(self, n: torch.fx.Node) -> Any:
        self.node = n
        return super().run_node(n)


def graph_rejects(gm: torch.fx.GraphModule, values: Sequence[Any]) -> PartitionError | None:
    """The error naming the input and the node's module where `gm` fails on `values` (a micro-batch of the
    example, one value per placeholder); None if it runs."""
    runner = _Failing(gm)
    try:
        with _restored(gm):
            runner.run(*values)
    except Exception as exc:  # noqa: BLE001 - whatever the graph raises on the example is the answer
        node = runner.node
        if node is None or node.op not in ("call_module", "call_function", "call_method"):
            return None
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        reads = set()
        todo = [node]
        while todo:
            n = todo.pop()
            for p in n.all_input_nodes:
                if p not in reads:
                    reads.add(p)
                    todo.append(p)
        named = {p.name: v for p, v in zip(placeholders, values) if p in reads}
        path = owning_module(node)
        try:
            module: nn.Module | None = gm.get_submodule(path) if path else None
        except AttributeError:
            module = None
        got = _shapes([runner.env[a] for a in node.all_input_nodes if a in runner.env and a.op != "get_attr"])
        return _error(named, path, module, got, exc, of="a micro-batch of it has shape")
    return None
