"""Turn an nn.Module into a torch.fx graph: symbolic_trace first, torch.export as the fallback."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx
import torch.fx._pytree as fx_pytree
import torch.utils._pytree as pytree
from torch import nn

from partitioner.errors import TraceError

__all__ = ["Traced", "trace"]


@dataclass
class Traced:
    """A traced model and the adapters between the user's call signature and the graph.

    `flatten_inputs(args, kwargs)` gives one value per placeholder, in graph order;
    `unflatten_outputs(value)` turns what the graph's output node holds into what the
    model itself returns (tuple, dict, ModelOutput, ...).
    """

    graph_module: torch.fx.GraphModule
    method: str  # "fx" or "export"
    flatten_inputs: Callable[[Sequence[Any], Mapping[str, Any]], list[Any]]
    unflatten_outputs: Callable[[Any], Any]


def _is_tensor_tree(value: Any) -> bool:
    return any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(value))


def _shared_modules(model: nn.Module) -> set[nn.Module]:
    """Modules that share a parameter or buffer with another module (tied weights)."""
    owners: dict[int, set[int]] = {}
    by_id: dict[int, nn.Module] = {}
    for _, module in model.named_modules(remove_duplicate=False):
        by_id[id(module)] = module
        for tensor in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
            owners.setdefault(id(tensor), set()).add(id(module))
    shared: set[nn.Module] = set()
    for module_ids in owners.values():
        if len(module_ids) > 1:
            shared.update(by_id[i] for i in module_ids)
    return shared


class _Tracer(torch.fx.Tracer):
    """Keeps torch.nn modules as leaves unless their weights are used elsewhere.

    A leaf module moves to one device as a whole; a module whose parameter is tied to
    another module, or which is called twice, is traced through instead so each use is a
    get_attr that the stage builder can copy to whichever device needs it.
    """

    def __init__(self, not_leaves: set[nn.Module]) -> None:
        super().__init__()
        self.not_leaves = not_leaves
        # Buffers become get_attr nodes (not baked-in constants), so they stay the model's.
        self.proxy_buffer_attributes = True

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if m in self.not_leaves:
            return False
        return super().is_leaf_module(m, module_qualified_name)


def _fx_trace(model: nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Traced:
    signature = inspect.signature(model.forward)
    for p in signature.parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise TypeError(f"forward takes *{p.name}; torch.fx needs named parameters")
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    # Non-tensor arguments (None, flags, sizes) are baked in: fx cannot branch on them.
    concrete = {k: v for k, v in bound.arguments.items() if not _is_tensor_tree(v)}
    names = list(signature.parameters)

    not_leaves = _shared_modules(model)
    for _ in range(2):
        tracer = _Tracer(not_leaves)
        graph = tracer.trace(model, concrete_args=concrete)
        calls: dict[str, int] = {}
        for node in graph.nodes:
            if node.op == "call_module":
                calls[node.target] = calls.get(node.target, 0) + 1
        twice = {model.get_submodule(t) for t, c in calls.items() if c > 1}
        twice = {m for m in twice if any(True for _ in m.parameters())} - not_leaves
        if not twice:
            break
        not_leaves |= twice
    gm = torch.fx.GraphModule(tracer.root, graph, type(model).__name__)

    def flatten_inputs(call_args: Sequence[Any], call_kwargs: Mapping[str, Any]) -> list[Any]:
        if not call_kwargs and len(call_args) == len(names):  # every argument given by position
            return list(call_args)
        b = signature.bind(*call_args, **call_kwargs)
        b.apply_defaults()
        return [b.arguments[n] for n in names]

    return Traced(gm, "fx", flatten_inputs, lambda value: value)


def _export_trace(model: nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Traced:
    from torch.export import Dim, export

    def dyn(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] > 1:
            return {0: Dim.AUTO}
        return None

    bound = inspect.signature(model.forward).bind(*args, **kwargs)
    dynamic_shapes = {k: pytree.tree_map(dyn, v) for k, v in bound.arguments.items()}
    program = export(model, tuple(args), dict(kwargs), dynamic_shapes=dynamic_shapes, strict=False)
    gm = program.module()
    codegen = gm.graph._codegen
    in_spec = codegen.pytree_info.in_spec
    out_spec = codegen.pytree_info.out_spec

    def flatten_inputs(call_args: Sequence[Any], call_kwargs: Mapping[str, Any]) -> list[Any]:
        return list(fx_pytree.tree_flatten_spec((tuple(call_args), dict(call_kwargs)), in_spec))

    def unflatten_outputs(value: Any) -> Any:
        return pytree.tree_unflatten(list(value), out_spec) if out_spec is not None else value

    return Traced(gm, "export", flatten_inputs, unflatten_outputs)


def _where(exc: BaseException) -> str:
    """The innermost frame of user code (not torch's) in a traceback, as 'file:line in func'."""
    tb = exc.__traceback__
    where = ""
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        if "/torch/" not in filename and "/partitioner/" not in filename:
            where = f"{filename}:{tb.tb_lineno} in {tb.tb_frame.f_code.co_name}"
        tb = tb.tb_next
    return where


def trace(model: nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any] | None = None) -> Traced:
    """Trace `model` with torch.fx; fall back to torch.export on the example inputs.

    Raises:
        TraceError: both failed; the message names the module and operation that broke
            each tracer and what the user can change.
    """
    kwargs = dict(kwargs or {})
    try:
        return _fx_trace(model, args, kwargs)
    except Exception as fx_error:  # noqa: BLE001 - any tracer failure means "try export"
        try:
            return _export_trace(model, args, kwargs)
        except Exception as export_error:  # noqa: BLE001
            name = type(model).__name__
            raise TraceError(
                f"cannot trace {name}:\n"
                f"- torch.fx.symbolic_trace failed at {_where(fx_error) or 'an unknown place'}: "
                f"{type(fx_error).__name__}: {str(fx_error).strip().splitlines()[0]}\n"
                f"- torch.export failed at {_where(export_error) or 'an unknown place'}: "
                f"{type(export_error).__name__}: {str(export_error).strip().splitlines()[0]}\n"
                "Fix: make that code independent of tensor values (torch.where instead of an "
                "if on a tensor, no .item() or data-dependent shapes), or pass example_inputs "
                "that torch.export accepts."
            ) from export_error
