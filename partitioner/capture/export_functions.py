"""Custom autograd Functions under torch.export: each call one leaf node that runs the Function, backward included.

[Note: custom autograd Functions under torch.export] Non-strict torch.export traces through
`Function.apply`: the graph holds the forward's operations, and autograd would differentiate those
instead of running the Function's own backward (BLOOM's GeLUFunction, whose backward is written
by hand). While exporting, each `apply` is recorded whole in the pre-dispatch graph, as torch's
`torch._export.wrappers.allow_in_pre_dispatch_graph` does (a `flat_apply` node), and after export
that node becomes the leaf the fx path makes (`capture.leaves.function_applier`: a call of the
Function's own `apply`; see [Note: custom autograd Functions are leaves]), so every stage runs the
Function as the plain model does. The Functions torch.library generates for a custom op with a
registered autograd (`torch.library.register_autograd`) are left alone: export keeps the op itself,
whose autograd is its own. A Function that cannot be recorded (an argument that is neither a
tensor nor a plain value) would be inlined: `Functions.inlined` names it and where it is called,
and the export is refused (capture.export).
"""

from __future__ import annotations

import contextlib
import inspect
import operator
import traceback
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch._export.wrappers import allow_in_pre_dispatch_graph
from torch._higher_order_ops.flat_apply import is_graphable
from torch._ops import _get_dispatch_mode_pre_dispatch

from partitioner.capture.leaves import function_applier

__all__ = ["Functions", "as_leaves", "functions_recorded", "source_of"]

_GENERATED = "torch._library.autograd"  # where torch.library makes a custom op's Function


@dataclass
class Functions:
    """What `functions_recorded` saw: Functions recorded whole (by the name torch puts in the graph), and
    Functions inlined (class -> the source line that calls it)."""

    kept: dict[str, type] = field(default_factory=dict)
    inlined: dict[type, str] = field(default_factory=dict)
    depth: int = 0  # inside a recorded apply: a Function its forward calls is part of it


def source_of(cls: type) -> str:
    """'file:line' of a class's definition ('' where Python cannot tell)."""
    try:
        return f"{inspect.getsourcefile(cls)}:{inspect.getsourcelines(cls)[1]}"
    except (OSError, TypeError):
        return ""


def _call_site() -> str:
    """'file:line in func' of the innermost frame outside torch and this package."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/torch/" not in frame.filename and "/partitioner/" not in frame.filename:
            return f"{frame.filename}:{frame.lineno} in {frame.name}"
    return ""


@contextlib.contextmanager
def functions_recorded(found: Functions) -> Iterator[None]:
    """While exporting, every Function's `apply` recorded whole (see [Note: custom autograd Functions under
    torch.export]); what was kept and what was not lands in `found`."""
    base: Any = torch.autograd.Function  # Any: its `apply` is swapped for a while, as in capture.leaves
    original = base.__dict__["apply"]
    record = allow_in_pre_dispatch_graph(original.__func__)

    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        call = original.__get__(None, cls)
        if cls.__module__ == _GENERATED or found.depth:
            return call(*args, **kwargs)
        mode = _get_dispatch_mode_pre_dispatch(torch._C._TorchDispatchModeKey.PROXY)
        if mode is None or not all(is_graphable(v) for v in pytree.tree_leaves((args, kwargs))):
            found.inlined.setdefault(cls, _call_site())
            return call(*args, **kwargs)
        found.kept[f"{cls.__module__}.{cls.__qualname__}"] = cls
        found.depth += 1
        try:
            return record(cls, *args, **kwargs)
        finally:
            found.depth -= 1

    base.apply = classmethod(apply)
    try:
        yield
    finally:
        base.apply = original


def as_leaves(gm: torch.fx.GraphModule, found: Functions) -> None:
    """Each recorded Function's `flat_apply` node (in nested graphs too) replaced by the fx path's leaf."""
    flat_apply = torch.ops.higher_order.flat_apply
    for sub in list(gm.modules()):
        if not isinstance(sub, torch.fx.GraphModule):
            continue
        changed = False
        for node in list(sub.graph.nodes):
            if node.target is not flat_apply:
                continue
            spec_node = node.args[1]
            spec = operator.attrgetter(str(spec_node.target))(sub)
            (name, *args), kwargs = pytree.tree_unflatten(list(node.args[2:]), spec)
            cls = found.kept[name]
            with sub.graph.inserting_before(node):
                leaf = sub.graph.call_function(function_applier(cls), tuple(args), dict(kwargs))
            leaf.meta = dict(node.meta)
            node.replace_all_uses_with(leaf)
            sub.graph.erase_node(node)
            changed = True
        if changed:
            specs = [n for n in sub.graph.nodes if n.op == "get_attr" and not n.users
                     and isinstance(operator.attrgetter(str(n.target))(sub), pytree.TreeSpec)]
            for n in specs:
                sub.graph.erase_node(n)
            for target in {str(n.target) for n in specs}:
                if hasattr(sub, target):
                    delattr(sub, target)
            sub.recompile()
