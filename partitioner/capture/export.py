"""torch.export of a model: batch and sequence dims free where the model allows it, its tensors its own, inputs checked.

[Note: exported dimensions] The dimensions a pipeline is called with other sizes of are exported as
`Dim.AUTO` (of size 2 or more): the batch dim of every tensor input, and every dim of a sequence:
integer tensors (token ids, masks, positions) and floating ones of up to 3 dims (embeddings, audio
features). torch.export keeps such a dim symbolic where the model's code works for any size and fixes
it to the example's where the code needs that size (a reshape to a constant, a table of positions read
whole). So a pipeline of a Hugging Face model takes a shorter sequence as the fx path does, with the
same graph and the same cuts. A floating tensor of 4 dims or more (images, video) keeps its channels
and pixels at the example's size: a model that pads and windows them (Swin) makes torch's symbolic
shapes simplify a floor division and modulus of every padded side at each reshape (sympy): a tiny Swin
took 148 s to export against 1.8 s with the batch alone free, and a pipeline trains on one image size. A
call whose size differs in a dimension the export fixed is refused by `flatten_inputs`, naming the
input and the dimension, instead of failing inside a stage. Where exporting those dimensions fails,
the batch dimension alone is exported free (the other dimensions then stay fixed, and are checked alike).

[Note: the model's tensors stay free of weak references] torch.export turns each parameter and
buffer into a fake tensor through a memo that holds a weak reference to it, and torch keeps the
export's fake mode alive after it returns (in caches and in reference cycles through C++ that the
garbage collector cannot see). `torch.utils.swap_tensors` refuses a tensor with a weak reference,
and the meta path (capture.meta, runtime.materialize) swaps the model's tensors. So the model is
exported holding stand-ins (new tensor objects on the same storage), and the graph's attributes
are pointed back at the model's own tensors afterwards; tensors of the graph's own (constants that
forward creates) are replaced by copies.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence, cast

import torch
import torch.fx
import torch.fx._pytree as fx_pytree
import torch.utils._pytree as pytree
from torch import nn
from torch.fx.experimental.symbolic_shapes import is_concrete_int
from torch.fx.graph import _PyTreeCodeGen

from cost_model.progress import say
from partitioner.capture.export_device import FakeDevice, run_device
from partitioner.capture.export_functions import Functions, as_leaves, functions_recorded, source_of
from partitioner.capture.meta import is_meta
from partitioner.capture.whole import keep_experts_whole
from partitioner.errors import PartitionError, TraceError

__all__ = ["Exported", "export_graph"]

@dataclass
class Exported:
    """The exported graph and its adapters between the user's call and the graph's flat inputs and outputs."""

    graph_module: torch.fx.GraphModule
    flatten_inputs: Callable[[Sequence[Any], Mapping[str, Any]], list[Any]]
    unflatten_outputs: Callable[[Any], Any]


def _free_dims(value: Any, every: bool) -> dict[int, Any] | None:
    """The dims of an input exported free: the batch, and (`every`) all of a sequence (see [Note: exported
    dimensions])."""
    from torch.export import Dim

    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return None
    sequence = not value.is_floating_point() or value.dim() <= 3  # not an image or a video
    dims = range(value.dim()) if every and sequence else range(1)
    return {d: Dim.AUTO for d in dims if value.shape[d] > 1} or None


@contextlib.contextmanager
def _quiet(logger: logging.Logger) -> Iterator[None]:
    """`logger` silent: torch logs the traceback of an operation that fails on fake tensors, and the exception
    it raises then reaches the caller (trace names the input and layer, or what to change)."""
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


class _Writes(io.StringIO):
    """A stand-in for sys.stderr that keeps each write apart, to write them on later."""

    def __init__(self) -> None:
        super().__init__()
        self.parts: list[str] = []

    def write(self, text: str) -> int:
        self.parts.append(text)
        return len(text)


@contextlib.contextmanager
def _without_graph_dumps() -> Iterator[None]:
    """torch.export prints the partial graph of a trace that stopped at a data-dependent value to stderr (the
    exception's `partial_fx_graph`, once per nested export call: some 50 lines per failed export); the error
    names the source line instead (capture.trace). Everything else written to stderr meanwhile is written
    after, unchanged."""
    real, writes = sys.stderr, _Writes()
    dump: str | None = None
    sys.stderr = writes
    try:
        yield
    except BaseException as exc:
        dump = getattr(exc, "partial_fx_graph", None)
        raise
    finally:
        sys.stderr = real
        parts, skip = writes.parts, False
        for text in parts:
            if dump is not None and text == dump:
                skip = True  # print(dump) writes the text, then "\n"
                continue
            if not (skip and text == "\n"):
                real.write(text)
            skip = False


def _export(model: nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any], every: bool,
            fake: FakeDevice | None) -> tuple[torch.fx.GraphModule, Functions, dict[int, torch.Tensor]]:
    """The exported graph (its tensors still the stand-ins), the Functions seen, stand-in id -> the model's tensor."""
    from torch.export import export

    bound = inspect.signature(model.forward).bind(*args, **kwargs)
    dynamic_shapes = {k: pytree.tree_map(lambda v: _free_dims(v, every), v) for k, v in bound.arguments.items()}
    found = Functions()
    args, kwargs = (fake.inputs(args), fake.inputs(kwargs)) if fake is not None else (args, kwargs)
    with _stand_ins(model, fake) as originals, functions_recorded(found), \
            fake.exporting() if fake is not None else contextlib.nullcontext(), \
            _quiet(logging.getLogger("torch._subclasses.fake_tensor")), \
            _quiet(logging.getLogger("torch.fx.experimental.symbolic_shapes")), _without_graph_dumps():
        program = export(model, tuple(args), dict(kwargs), dynamic_shapes=dynamic_shapes, strict=False)
        gm = program.module()
        del program
    if found.inlined:  # export inlined a Function's forward and would drop its backward: refuse, never run it wrong
        raise TraceError(_inlined(found.inlined))
    return gm, found, originals


def _inlined(inlined: dict[type, str]) -> str:
    """Why each Function could not be kept whole, where it is, and what to change."""
    unknown = "an unknown place"
    lines = [f"- {cls.__name__} (defined at {source_of(cls) or unknown}), called at {site or unknown}"
             for cls, site in inlined.items()]
    return ("forward calls custom autograd Function(s) that torch.export cannot keep whole (an argument is neither a "
            "tensor nor a plain value), so their own backward would be dropped:\n" + "\n".join(lines) + "\nFix: pass "
            "the Function only tensors and plain values (numbers, strings, None), or make it a torch.library.custom_op "
            "with register_autograd, which export keeps; in a library model, replace the module that calls it "
            "(setattr(model, path, ...)) with one that does")


def _fixed_dims(gm: torch.fx.GraphModule) -> list[tuple[str, dict[int, int]]]:
    """Each input placeholder's name and the dimensions the export fixed, with their sizes."""
    fixed = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            val = node.meta.get("val")
            shape = val.shape if isinstance(val, torch.Tensor) else ()
            fixed.append((node.name, {d: int(s) for d, s in enumerate(shape) if is_concrete_int(s)}))
    return fixed


def _tensor_dicts(model: nn.Module) -> list[dict[str, Any]]:
    """Every module's parameter and buffer dicts (a tied weight is in several)."""
    return [cast(dict[str, Any], d) for m in model.modules() for d in (m._parameters, m._buffers)]


@contextlib.contextmanager
def _stand_ins(model: nn.Module, fake: FakeDevice | None) -> Iterator[dict[int, torch.Tensor]]:
    """The model holding stand-ins of its parameters and buffers while exported; yields stand-in id -> tensor
    (see [Note: the model's tensors stay free of weak references]; for a meta model, fake tensors of the device
    it runs on: see [Note: a meta model takes its device's branches])."""
    slots = [(d, key) for d in _tensor_dicts(model) for key, t in d.items() if t is not None]
    pairs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for d, key in slots:
        t = d[key]
        if id(t) not in pairs:  # a tied weight keeps one stand-in
            if fake is not None:
                pairs[id(t)] = (t, fake.stand_in(t))
                continue
            alias = t.detach()
            pairs[id(t)] = (t, nn.Parameter(alias, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter)
                            else alias)
    try:
        for d, key in slots:
            d[key] = pairs[id(d[key])][1]
        yield {id(stand_in): t for t, stand_in in pairs.values()}
    finally:
        back = {id(stand_in): t for t, stand_in in pairs.values()}
        for d, key in slots:
            d[key] = back.get(id(d[key]), d[key])


def _point_back(gm: torch.fx.GraphModule, originals: dict[int, torch.Tensor]) -> None:
    """The graph's tensors: the model's own where they stood in for them, fresh copies of its own constants."""
    for d in _tensor_dicts(gm):
        for key, t in d.items():
            if t is not None:
                d[key] = originals[id(t)] if id(t) in originals else _fresh(t)
    for module in gm.modules():
        for key, value in list(vars(module).items()):
            if isinstance(value, torch.Tensor):
                setattr(module, key, originals[id(value)] if id(value) in originals else _fresh(value))


def _devices_as_keywords(gm: torch.fx.GraphModule) -> None:
    """Positional device arguments (`aten.to.device(x, device(type='cpu'), ...)`) passed by keyword, as export
    passes the others (`arange(..., device=...)`), in nested graphs too (the bodies of `wrap_with_set_grad_enabled`
    and similar): the stage builder gives each its stage's device (the graph holds the tracing device, meta for a
    model on meta). Export's `_assert_tensor_metadata` checks of that device in nested graphs are dropped, as the
    stage builder drops the top-level ones (torch 2.11 puts one in Llama's rotary embedding)."""
    check = torch.ops.aten._assert_tensor_metadata.default
    for sub in gm.modules():
        if not isinstance(sub, torch.fx.GraphModule):
            continue
        for node in list(sub.graph.nodes):
            if sub is not gm and node.target is check and not node.users:
                sub.graph.erase_node(node)
                continue
            if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
                continue
            at = next((i for i, a in enumerate(node.args) if isinstance(a, torch.device)), None)
            names = [a.name for a in node.target._schema.arguments]
            if at is None or len(node.args) > len(names):
                continue
            node.kwargs = {**dict(zip(names[at:], node.args[at:])), **node.kwargs}
            node.args = node.args[:at]
        sub.recompile()


def _fresh(t: torch.Tensor) -> torch.Tensor:
    copy = t.detach().clone()
    return nn.Parameter(copy, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else copy


def _checked(flat: list[Any], fixed: list[tuple[str, dict[int, int]]], guards: Callable[..., Any] | None) -> list[Any]:
    """`flat`, refused where a size differs from one the export fixed or breaks a condition it traced under."""
    for value, (name, sizes) in zip(flat, fixed):
        if not isinstance(value, torch.Tensor):
            continue
        for d, size in sizes.items():
            if d >= value.dim() or value.shape[d] != size:
                got = f"size {value.shape[d]} in dim {d}" if d < value.dim() else f"{value.dim()} dims"
                raise PartitionError(
                    f"input {name!r} has {got} (shape {tuple(value.shape)}), but torch.export fixed dim {d} at the "
                    f"example's {size}: the model's code needs that size (a reshape to a constant, a table read "
                    f"whole). Call it with dim {d} = {size}, partition again with an example of this size (one "
                    "pipeline per size), or make forward traceable by torch.fx, whose graph takes any size"
                )
    if guards is not None:
        try:
            guards(*flat)
        except AssertionError as exc:  # torch's "Guard failed: x.size()[2] <= 39"
            raise PartitionError(
                f"the inputs break a condition the exported graph was traced under ({exc}): torch.export "
                "specialized the model's code on the example there (a branch on a size). Call it with inputs that "
                "meet it, partition again with an example like this call (one pipeline per shape), or make forward "
                "traceable by torch.fx"
            ) from None
    return flat


def export_graph(model: nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Exported:
    """`model` exported on the example (see [Note: exported dimensions]).

    Raises:
        Exception: what torch.export raised exporting the batch dimension alone; TraceError for
            custom autograd Functions it cannot keep whole (capture.export_functions).
    """
    fake = FakeDevice(run_device()) if is_meta(model) else None
    what = f"tracing {type(model).__name__} ({'training' if model.training else 'eval'} mode) with torch.export"
    say(f"{what}, batch and sequence dims free")
    try:
        gm, found, originals = _export(model, args, kwargs, True, fake)
    except TraceError:
        raise
    except Exception:  # noqa: BLE001 - some dimension cannot be free: only the batch's, as before
        say(f"{what}, the batch dim alone free")
        fake = FakeDevice(fake.device) if fake is not None else None  # a fresh fake mode
        gm, found, originals = _export(model, args, kwargs, False, fake)
    _point_back(gm, originals)
    as_leaves(gm, found)
    _devices_as_keywords(gm)
    if fake is not None:
        fake.to_meta(gm)
    keep_experts_whole(gm, model)  # after the line above: the nested graphs it makes hold keyword devices
    codegen = cast(_PyTreeCodeGen, gm.graph._codegen)  # export's graphs take and give pytrees
    in_spec = codegen.pytree_info.in_spec
    out_spec = codegen.pytree_info.out_spec
    fixed = _fixed_dims(gm)
    guards = getattr(gm, "_guards_fn", None)  # the stages drop its node: the call is checked here instead

    def flatten_inputs(call_args: Sequence[Any], call_kwargs: Mapping[str, Any]) -> list[Any]:
        flat = list(fx_pytree.tree_flatten_spec((tuple(call_args), dict(call_kwargs)), in_spec))
        return _checked(flat, fixed, guards)

    def unflatten_outputs(value: Any) -> Any:
        return pytree.tree_unflatten(list(value), out_spec) if out_spec is not None else value

    return Exported(gm, flatten_inputs, unflatten_outputs)
