"""What fx must not trace through or drop: custom autograd Functions (one leaf each) and pipe_split markers."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch import nn

__all__ = ["function_applier", "functions_as_leaves", "functions_seen", "is_marker", "markers_recorded", "take_markers"]


# [Note: custom autograd Functions are leaves]
# fx traces through `Function.apply`, so autograd would differentiate the forward's operations
# instead of running the Function's own backward. While tracing, `apply` with a Proxy among its
# arguments is traced through once only to learn its output structure; those nodes are then
# erased and replaced by one call_function node whose target calls the real `apply` (shapes and
# FLOPs come from running it in partitioner.capture.graph). Stages run it as the plain model does.

_APPLIERS: dict[type, Callable[..., Any]] = {}


def function_applier(cls: type) -> Callable[..., Any]:
    """The call_function target standing for `cls.apply` (one per Function class)."""
    applier = _APPLIERS.get(cls)
    if applier is None:

        def applier(*args: Any, **kwargs: Any) -> Any:
            return cls.apply(*args, **kwargs)  # type: ignore[attr-defined]

        applier.__name__ = applier.__qualname__ = f"{cls.__name__}_apply"
        applier.autograd_function = cls  # type: ignore[attr-defined]
        _APPLIERS[cls] = applier
    return applier


@contextlib.contextmanager
def functions_as_leaves(tracer: torch.fx.Tracer) -> Iterator[None]:
    base: Any = torch.autograd.Function  # Any: its `apply` is swapped for a while (typed as a method, or not at all)
    original = base.__dict__["apply"]

    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        proxies = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.fx.Proxy)]
        if not proxies:
            return original.__get__(None, cls)(*args, **kwargs)
        graph = proxies[0].tracer.graph
        before = set(graph.nodes)
        traced_through = original.__get__(None, cls)(*args, **kwargs)
        for inner in reversed([n for n in graph.nodes if n not in before]):
            graph.erase_node(inner)
        leaf: Any = tracer.create_proxy("call_function", function_applier(cls), args, kwargs)
        if isinstance(traced_through, (tuple, list)):
            return type(traced_through)(leaf[i] for i in range(len(traced_through)))
        return leaf

    base.apply = classmethod(apply)
    try:
        yield
    finally:
        base.apply = original


@contextlib.contextmanager
def functions_seen(seen: list[type]) -> Iterator[None]:
    """Record every Function class whose `apply` runs (the export path cannot keep them)."""
    base: Any = torch.autograd.Function  # Any: as in functions_as_leaves
    original = base.__dict__["apply"]

    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        seen.append(cls)
        return original.__get__(None, cls)(*args, **kwargs)

    base.apply = classmethod(apply)
    try:
        yield
    finally:
        base.apply = original


def _pipe_split_functions() -> list[Callable[..., Any]]:
    try:
        from torch.distributed.pipelining import pipe_split
    except ImportError:  # a torch built without distributed
        return []
    return [pipe_split]


def is_marker(node: torch.fx.Node) -> bool:
    """A PiPPy split marker: `pipe_split()` (fx) or `torch.ops.pippy._pipe_split` (export)."""
    return node.op == "call_function" and (
        node.target in _pipe_split_functions() or "_pipe_split" in str(getattr(node.target, "__name__", node.target))
    )


@contextlib.contextmanager
def markers_recorded(tracer: torch.fx.Tracer, root: Any) -> Iterator[None]:
    """`pipe_split()` takes no tensor, so fx would run it and record nothing: while tracing, the
    name in every forward's globals records a marker node instead (see `take_markers`)."""
    markers = _pipe_split_functions()
    if not markers or not isinstance(root, nn.Module):
        yield
        return
    marker = markers[0]

    def record() -> None:
        tracer.create_node("call_function", marker, (), {})

    patched: list[tuple[dict[str, Any], str]] = []
    for module in root.modules():
        namespace = getattr(type(module).forward, "__globals__", {})
        for name, value in list(namespace.items()):
            if value is marker:  # once per namespace: after that it holds `record`
                namespace[name] = record
                patched.append((namespace, name))
    try:
        yield
    finally:
        for namespace, name in patched:
            namespace[name] = marker


def take_markers(gm: torch.fx.GraphModule) -> None:
    """Erase marker nodes; the next compute node gets `meta["cut_before"] = True` (the planner's
    forced cut). Markers before any compute node or after the last one are dropped."""
    pending = False
    for node in list(gm.graph.nodes):
        if is_marker(node):
            pending = True
            gm.graph.erase_node(node)
        elif pending and node.op in ("call_function", "call_method", "call_module") and node.target != "_guards_fn":
            node.meta["cut_before"] = True
            pending = False
    gm.recompile()
