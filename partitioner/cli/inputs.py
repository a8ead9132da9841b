"""The command line's MODULE:FACTORY: import it, call it and bring its example inputs to the batch asked for."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree
from torch import nn

from partitioner.capture.trace import trace
from runtime.microbatch import scatter

__all__ = ["Example", "UsageError", "load_example", "load_factory"]


class UsageError(ValueError):
    """A command-line argument is wrong; the message says which and how to fix it (exit code 2)."""


@dataclass
class Example:
    """A model and one full batch of example inputs, as the factory gave them."""

    name: str
    model: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    batch: int = 1
    micro_batches: int = 1

    def trace(self) -> tuple[torch.fx.GraphModule, list[Any]]:
        """The traced graph and the flat inputs of its first micro-batch."""
        traced = trace(self.model, self.args, self.kwargs)
        flat = traced.flatten_inputs(self.args, self.kwargs)
        try:
            first = scatter(flat, self.micro_batches)[0]
        except ValueError as exc:
            raise UsageError(f"--micro-batches {self.micro_batches}: {exc}") from None
        return traced.graph_module, first


def load_factory(spec: str) -> Callable[..., Any]:
    """Import MODULE and return its FACTORY; MODULE may be dotted or a .py file path.

    Raises:
        UsageError: a malformed spec, a module that is not found, or a missing or
            non-callable attribute.
    """
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise UsageError(
            f"{spec!r} is not MODULE:FACTORY; write e.g. mymodels:make_model or path/to/models.py:make_model"
        )
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_file():
            raise UsageError(f"{spec!r}: no file {path} (from {os.getcwd()}); check the path")
        loader = importlib.util.spec_from_file_location(path.stem, path)
        if loader is None or loader.loader is None:
            raise UsageError(f"{spec!r}: cannot import {path} as a Python module")
        module = importlib.util.module_from_spec(loader)
        sys.modules[path.stem] = module
        loader.loader.exec_module(module)
    else:
        if "" not in sys.path and os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())  # `python -m` puts it there; an entry-point script does not
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
                raise UsageError(
                    f"cannot import {module_name!r} (looked in {os.getcwd()} and PYTHONPATH); run from the folder "
                    "that holds it, add that folder to PYTHONPATH, or give a file path such as models.py:FACTORY"
                ) from None
            raise
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
            raise UsageError(f"{module_name} has no {attr!r}; callables there: {', '.join(public[:15]) or 'none'}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise UsageError(f"{spec}: {attr} is a {type(obj).__name__}, not a function returning (model, example_inputs)")
    return obj  # type: ignore[no-any-return]


def _takes_batch(factory: Callable[..., Any]) -> bool:
    try:
        return "batch" in inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False


def _dim0(values: Any) -> int | None:
    for leaf in pytree.tree_leaves(values):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    return None


def _repeat(values: Any, size: int, times: int) -> Any:
    """Tensors whose dim 0 is `size` repeated `times` along dim 0; everything else as it is."""

    def grow(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == size:
            return torch.cat([x] * times)
        return x

    return pytree.tree_map(grow, values)


def load_example(spec: str, batch: int | None, micro_batches: int) -> Example:
    """Call the factory (with batch=N when it takes `batch`) and return a full-batch Example.

    Raises:
        UsageError: the factory's result is not (model, inputs[, kwargs]), or its batch fits
            neither --batch nor --batch / --micro-batches.
    """
    factory = load_factory(spec)
    try:
        result = factory(batch=batch) if batch is not None and _takes_batch(factory) else factory()
    except Exception as exc:  # noqa: BLE001 - whatever the user's factory raises, say so plainly
        raise UsageError(
            f"calling {spec} failed: {type(exc).__name__}: {exc}; FACTORY must be a function that takes no "
            "arguments (or `batch`) and returns (model, example_inputs)"
        ) from None
    if not isinstance(result, tuple) or len(result) not in (2, 3) or not isinstance(result[0], nn.Module):
        got = type(result).__name__ if not isinstance(result, tuple) else f"a tuple of {len(result)}"
        raise UsageError(
            f"{spec} returned {got}; it must return (model, example_inputs) or (model, example_inputs, example_kwargs)"
        )
    model, inputs = result[0], result[1]
    kwargs = dict(result[2]) if len(result) == 3 and result[2] else {}
    args = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    have = _dim0((args, kwargs))
    if have is None:
        raise UsageError(f"{spec} returned example inputs with no tensor of at least one dimension; dim 0 is the batch")
    if batch is not None and have != batch:
        if have * micro_batches == batch:
            args, kwargs = _repeat((args, kwargs), have, micro_batches)
        else:
            needs = (f"with --micro-batches {micro_batches} needs {batch} (a full batch) or "
                     f"{batch / micro_batches:g} (one micro-batch)" if micro_batches > 1 else f"needs {batch}")
            raise UsageError(
                f"{spec} gave example inputs with batch {have}, but --batch {batch} {needs}; change --batch, or let "
                "the factory take a `batch` argument (it is called with batch=N)"
            )
    full = batch if batch is not None else have
    if micro_batches > full:
        raise UsageError(
            f"--micro-batches {micro_batches} is more than the batch of {full} samples; use at most {full}"
        )
    return Example(spec, model, tuple(args), kwargs, full, micro_batches)
