"""Turn an nn.Module into a torch.fx graph: symbolic_trace first, torch.export as the fallback.

An example holding a long sequence (capture.sequence.long_sequence: >= LONG_SEQUENCE tokens) is exported first,
fx the fallback: fx fixes every size, and only export's free sequence dim lets the planner split the sequence over
context ranks and the runtime run it so. The rule reads the example alone, so `plan` and a later `partition` of the
same example trace alike and the plan binds to the graph it was made on."""

from __future__ import annotations

import inspect
import logging
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from partitioner.capture.cache import without_cache
from partitioner.capture.export import export_graph
from partitioner.capture.leaves import functions_as_leaves, markers_recorded, take_markers
from partitioner.capture.meta import is_meta, on_meta
from partitioner.capture.rejected import model_rejects
from partitioner.capture.sequence import long_sequence
from partitioner.capture.untraceable import trace_error, where
from partitioner.capture.whole import expert_stacks
from partitioner.errors import PartitionError
from runtime.mutation import mutated_inputs, order_mutations

__all__ = ["Traced", "trace", "where"]

log = logging.getLogger(__name__)


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
    mutated_inputs: list[str] = field(default_factory=list)  # placeholders the graph writes into
    # The graph of the other mode (eval if traced in training, and back) where forward reads
    # `self.training` (F.dropout(x, p, self.training), `if self.training:`); None where the
    # graphs are the same. `other_mode_error` says why it could not be traced, if it could not.
    other_mode: torch.fx.GraphModule | None = None
    other_mode_error: str | None = None


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


_AUTOCAST_DEVICES = ("cpu", "cuda")


class _Tracer(torch.fx.Tracer):
    """Keeps torch.nn modules as leaves unless their weights are used elsewhere.

    A leaf module moves to one device as a whole; a module whose parameter is tied to
    another module, or which is called twice, is traced through instead so each use is a
    get_attr that the stage builder can copy to whichever device needs it.
    """

    def __init__(self, not_leaves: set[nn.Module], experts: set[nn.Module] | None = None) -> None:
        super().__init__()
        self.not_leaves = not_leaves
        self.experts = experts or set()  # stacks of experts: one node each, as on the export path (capture.whole)
        # Buffers become get_attr nodes (not baked-in constants), so they stay the model's; node.meta["stack_trace"]
        self.proxy_buffer_attributes = self.record_stack_traces = True  # lets errors name forward's lines

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if m in self.not_leaves:
            return False
        return m in self.experts or super().is_leaf_module(m, module_qualified_name)

    def trace(self, root: Any, concrete_args: dict[str, Any] | None = None) -> torch.fx.Graph:
        with functions_as_leaves(self), markers_recorded(self, root):
            return super().trace(root, concrete_args)

    def create_node(self, *args: Any, **kwargs: Any) -> torch.fx.Node:
        # torch.fx records no grad-mode switches: note the mode each node was traced under
        node = super().create_node(*args, **kwargs)
        node.meta["traced_grad"] = torch.is_grad_enabled()
        autocast = tuple(
            (device, torch.get_autocast_dtype(device))
            for device in _AUTOCAST_DEVICES
            if torch.is_autocast_enabled(device)
        )
        if autocast:  # inside `with torch.autocast(...)` in forward: the stage runs it so too (runtime.stage)
            node.meta["autocast"] = autocast
        return node


def _mark_grad_regions(enabled: torch.fx.Graph, disabled: torch.fx.Graph) -> None:
    """Set node.meta["grad_mode"] where forward forces it: False inside no_grad / inference_mode /
    set_grad_enabled(False) (seen tracing with grad on), True inside enable_grad (seen tracing
    with grad off); nodes that inherit the caller's mode get none (see runtime.stage)."""
    pairs = list(zip(enabled.nodes, disabled.nodes))
    if len(pairs) != len(enabled.nodes) or any(a.name != b.name for a, b in pairs):
        raise RuntimeError("forward traces differently with gradients on and off; its graph depends on grad mode")
    for a, b in pairs:
        if not a.meta.get("traced_grad", True):
            a.meta["grad_mode"] = False
        elif b.meta.get("traced_grad", False):
            a.meta["grad_mode"] = True


def _copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone()


def _batched_defaults(defaults: Mapping[str, Any], given: Sequence[Any]) -> list[str]:
    """The tensor defaults of forward that have the example's batch as dim 0 (2-D or more, so a 1-D table
    that happens to be as long as the batch stays one): traced as inputs and split with the batch."""
    first = next((v for v in pytree.tree_leaves(list(given)) if isinstance(v, torch.Tensor) and v.dim()), None)
    if first is None:
        return []
    found = [k for k, v in defaults.items()
             if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[0] == first.shape[0]]
    for name in found:
        log.info("forward's default %s=%s has the batch's size (%d) as dim 0: it is an input of the pipeline, split "
                 "with the batch (input_split_spec={%r: None} gives it whole to every micro-batch)",
                 name, tuple(defaults[name].shape), first.shape[0], name)
    return found


def _fx_trace(model: nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Traced:
    signature = inspect.signature(model.forward)
    for p in signature.parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise TypeError(f"forward takes {'*' if p.kind is p.VAR_POSITIONAL else '**'}{p.name}; torch.fx needs "
                            "named parameters")
    bound = signature.bind(*args, **kwargs)
    given = set(bound.arguments)
    bound.apply_defaults()
    # Non-tensor arguments (None, flags, sizes) are baked in: fx cannot branch on them. So are
    # tensor defaults the call leaves out (`y=torch.zeros(B, D)`): constants of the graph.
    defaults = {k: v for k, v in bound.arguments.items() if k not in given and _is_tensor_tree(v)}
    # ... except a default with the batch's size (`y=torch.zeros(B, D)`): an input, split with the batch
    for name in _batched_defaults(defaults, [bound.arguments[k] for k in given]):
        del defaults[name]
    concrete = {k: v for k, v in bound.arguments.items() if not _is_tensor_tree(v)}
    # the graph holds copies: the runtime moves and frees its constants, the signature's stay the user's
    concrete.update({k: pytree.tree_map_only(torch.Tensor, _copy, v) for k, v in defaults.items()})
    names = list(signature.parameters)

    not_leaves = _shared_modules(model)
    experts = {model.get_submodule(path) for path in expert_stacks(model)}

    def trace_once() -> tuple[_Tracer, torch.fx.Graph, set[nn.Module]]:
        """The trace, and the modules with weights it calls more than once that are still leaves."""
        tracer = _Tracer(not_leaves, experts)
        with warnings.catch_warnings():  # fx cannot assert a baked tensor default; flatten_inputs checks it
            warnings.filterwarnings("ignore", message="Was not able to add assertion")
            graph = tracer.trace(model, concrete_args=concrete)
        for node in list(graph.nodes):  # a tensor default is no code default: flatten_inputs always passes it
            if node.op == "placeholder" and node.all_input_nodes:
                held = node.all_input_nodes
                node.args = ()
                for attr in held:
                    if not attr.users:
                        graph.erase_node(attr)
        calls: dict[str, int] = {}
        for node in graph.nodes:
            if node.op == "call_module":
                calls[node.target] = calls.get(node.target, 0) + 1
        twice = {model.get_submodule(t) for t, c in calls.items() if c > 1}
        # BatchNorm stays a leaf however often it is called: the runtime defers its statistics per call site
        return tracer, graph, {
            m for m in twice if any(True for _ in m.parameters()) and not isinstance(m, _BatchNorm)
        } - not_leaves

    with torch.enable_grad():
        tracer, graph, twice = trace_once()
        if twice:  # trace through them too, once more
            not_leaves |= twice
            tracer, graph, _ = trace_once()
    with torch.no_grad():
        _, without_grad, _ = trace_once()
    _mark_grad_regions(graph, without_grad)
    gm = torch.fx.GraphModule(tracer.root, graph, type(model).__name__)

    def flatten_inputs(call_args: Sequence[Any], call_kwargs: Mapping[str, Any]) -> list[Any]:
        if not call_kwargs and len(call_args) == len(names) and not defaults:  # every argument given by position
            return list(call_args)
        b = signature.bind(*call_args, **call_kwargs)
        for name in defaults:
            if name in b.arguments and b.arguments[name] is not defaults[name]:
                raise PartitionError(
                    f"argument {name!r} is passed, but the pipeline was traced with its default tensor, "
                    "which the graph "
                    f"holds as a constant; partition with an example that passes {name!r} to run calls that pass it"
                )
        b.apply_defaults()
        return [b.arguments[n] for n in names]

    return Traced(gm, "fx", flatten_inputs, lambda value: value)


def _export_trace(model: nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Traced:
    exported = export_graph(model, args, kwargs)
    return Traced(exported.graph_module, "export", exported.flatten_inputs, exported.unflatten_outputs)


def _with_mutations(traced: Traced) -> Traced:
    """Markers taken out, in-place operations ordered before later readers (see runtime.mutation)."""
    take_markers(traced.graph_module)
    order_mutations(traced.graph_module)
    traced.mutated_inputs = mutated_inputs(traced.graph_module)
    return traced


_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)


def _plain(value: Any) -> bool:
    """A value the graph bakes in and that can be compared: None, numbers, strings, tuples of them."""
    if isinstance(value, (tuple, list)):
        return all(_plain(v) for v in value)
    return isinstance(value, _PLAIN)


def _guarded(traced: Traced, model: nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Traced:
    """`traced` whose `flatten_inputs` refuses a call whose non-tensor arguments differ from the example's.

    The graph holds the example's non-tensor values as constants (fx cannot branch on them;
    export specializes on them); a call with other values would silently run the example's.
    """
    inner = traced.flatten_inputs
    example = inner(args, kwargs)
    names = [n.name for n in traced.graph_module.graph.nodes if n.op == "placeholder"]
    if traced.method == "fx":  # one placeholder per parameter of forward, in order (fx renames baked-in ones)
        names = list(inspect.signature(model.forward).parameters)

    def show(value: Any) -> str:
        return f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)

    # Per example value, once: whether it is a tensor, and whether a call must pass an equal value.
    kinds = [(isinstance(was, torch.Tensor), _plain(was)) for was in example]

    def flatten(call_args: Sequence[Any], call_kwargs: Mapping[str, Any]) -> list[Any]:
        flat = inner(call_args, call_kwargs)
        for k, (value, was, (tensor, plain)) in enumerate(zip(flat, example, kinds)):
            if tensor == isinstance(value, torch.Tensor) and not (plain and value != was):
                continue
            name = names[k] if k < len(names) else f"input {k}"
            raise PartitionError(
                f"argument {name!r} is {show(value)}, but the pipeline was traced with {show(was)}: the graph holds "
                "non-tensor arguments as constants. Partition again with an example that has this value (one "
                "pipeline per value), or pass the value as a tensor"
            )
        return flat

    traced.flatten_inputs = flatten
    return traced


def _module_attributes(model: nn.Module) -> dict[tuple[str, str], Any]:
    """(module path, attribute) -> its value, for plain attributes (not weights or children)."""
    return {
        (path, key): value
        for path, module in model.named_modules()
        for key, value in vars(module).items()
        if not key.startswith("_") and key != "training"
    }


def _data(value: Any) -> bool:
    """Plain data: None, numbers, strings, and tuples, lists and dicts of them."""
    if isinstance(value, dict):
        return all(_data(k) and _data(v) for k, v in value.items())
    if isinstance(value, (tuple, list)):
        return all(_data(v) for v in value)
    return isinstance(value, _PLAIN)


def _same(before: Any, after: Any) -> bool:
    """The same object, or an equal value of plain data (torch.export rebuilds some: `normalized_shape`)."""
    return before is after or (type(before) is type(after) and _data(before) and _data(after) and before == after)


def _finish(
    traced: Traced, model: nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any], before: dict[tuple[str, str], Any]
) -> Traced:
    changed = sorted(f"{path}.{key}" if path else key for (path, key), value in _module_attributes(model).items()
                     if (path, key) not in before or not _same(before[(path, key)], value))
    if changed:
        warnings.warn(
            f"{type(model).__name__}.forward set {', '.join(changed[:5])}{' ...' if len(changed) > 5 else ''} while "
            "being traced: Python side effects in forward (counters, caches, logging) run once, when the model is "
            "traced, not on every call of the pipeline (README: equivalence contract)",
            stacklevel=3,
        )
    traced = _guarded(_with_mutations(traced), model, args, kwargs)
    _trace_other_mode(traced, model, args, kwargs)
    return traced


def _trace_other_mode(traced: Traced, model: nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    """Trace the model in the other mode, with the same tracer; keep the graph if it differs."""
    modes = {m: m.training for m in model.modules()}
    try:
        model.train(not model.training)
        other = (_fx_trace if traced.method == "fx" else _export_trace)(model, args, kwargs)
    except Exception as exc:  # noqa: BLE001 - the pipeline says so if it is ever switched to that mode
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        traced.other_mode_error = f"{type(exc).__name__}: {first_line}"
        return
    finally:
        for m, training in modes.items():
            m.training = training
    take_markers(other.graph_module)
    if other.graph_module.code == traced.graph_module.code:
        return
    order_mutations(other.graph_module)
    traced.mutated_inputs += [n for n in mutated_inputs(other.graph_module) if n not in traced.mutated_inputs]
    traced.other_mode = other.graph_module


def trace(model: nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any] | None = None, *,
          export_first: bool | None = None) -> Traced:
    """Trace `model` with torch.fx; fall back to torch.export on the example inputs (export first where the example
    holds a long sequence: the module docstring; `export_first` True or False overrides that rule).

    Raises:
        PartitionError: the model itself fails on the example (capture.rejected names the input and layer).
        TraceError: both failed; the message names the module and operation that broke
            each tracer and what the user can change.
    """
    kwargs = dict(kwargs or {})
    before = _module_attributes(model)
    if export_first is None:
        export_first = long_sequence([*pytree.tree_leaves(tuple(args)), *pytree.tree_leaves(kwargs)])
    tracers = (_export_trace, _fx_trace) if export_first else (_fx_trace, _export_trace)
    errors: dict[Callable[..., Traced], Exception] = {}
    with without_cache(model, kwargs):
        for tracer in tracers:  # any tracer failure means "try the other"
            try:
                return _finish(tracer(model, args, kwargs), model, args, kwargs, before)
            except Exception as error:  # noqa: BLE001
                errors[tracer] = error
        fx_error, export_error = errors[_fx_trace], errors[_export_trace]
        meta = is_meta(model)
        rejected = model_rejects(model, on_meta(args) if meta else args, on_meta(kwargs) if meta else kwargs)
        if rejected is not None:
            raise rejected from export_error
        raise trace_error(model, fx_error, export_error) from export_error
