"""Why a model cannot be traced: one TraceError naming where each tracer stopped and what to change."""

from __future__ import annotations

import inspect
import re

from torch import nn

from partitioner.errors import TraceError

__all__ = ["trace_error", "where"]

_DATA_DEPENDENT = ("data-dependent", "data dependent", "symbolically traced variables cannot be used as inputs to "
                   "control flow", "GuardOnDataDependentSymNode", "Could not guard")


def where(exc: BaseException) -> str:
    """The innermost frame of user code (not torch's) in a traceback, as 'file:line in func'."""
    tb = exc.__traceback__
    found = ""
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        if "/torch/" not in filename and "/partitioner/" not in filename:
            found = f"{filename}:{tb.tb_lineno} in {tb.tb_frame.f_code.co_name}"
        tb = tb.tb_next
    return found


def _forward_at(model: nn.Module) -> str:
    """'file:line' of the model's forward ('' where Python cannot tell)."""
    try:
        forward = inspect.unwrap(type(model).forward)
        return f"{inspect.getsourcefile(forward)}:{inspect.getsourcelines(forward)[1]}"
    except (OSError, TypeError):
        return ""


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else ""


def _fix(model: nn.Module, fx_error: BaseException, export_error: BaseException) -> str:
    """What to change, read off what the tracers said."""
    found = re.search(r"Found <class '([^']+)'> in output", str(export_error))
    if found and "cache" in found.group(1).rpartition(".")[2].lower():
        return (f"forward returns a {found.group(1).rpartition('.')[2]} (a key/value cache for generation), which "
                "a pipeline does not pass between calls: pass use_cache=False (example_kwargs={'use_cache': False}, "
                "or config.use_cache = False)")
    if found:
        return (f"forward returns a {found.group(1)}, which is neither a tensor nor a container of tensors: return "
                "tensors, tuples, lists, dicts or dataclasses registered with torch.utils._pytree")
    if any(marker in str(e) for e in (fx_error, export_error) for marker in _DATA_DEPENDENT):
        return ("make that code independent of tensor values (torch.where instead of an if on a tensor, no .item() "
                "or data-dependent shapes)")
    at = "at those lines" if where(fx_error) or where(export_error) else (
        f"of {type(model).__name__}.forward ({_forward_at(model) or 'its source is not available'})")
    return (f"change the code {at} so that torch.fx (named parameters, no control flow on tensors) or "
            "torch.export (no data-dependent shapes or control flow) can trace it, or pass example_inputs that "
            "torch.export accepts")


def trace_error(model: nn.Module, fx_error: BaseException, export_error: BaseException) -> TraceError:
    """The error for a model neither tracer could trace. Our own refusals of an export (a custom autograd
    Function it cannot keep whole: capture.export_functions) say where and what to change themselves."""
    unknown = "an unknown place"
    fx = (f"- torch.fx.symbolic_trace failed at {where(fx_error) or _forward_at(model) or unknown}: "
          f"{type(fx_error).__name__}: {_first_line(fx_error)}\n")
    if isinstance(export_error, TraceError):
        return TraceError(f"cannot trace {type(model).__name__}:\n{fx}- torch.export: {export_error}")
    return TraceError(
        f"cannot trace {type(model).__name__}:\n{fx}"
        f"- torch.export failed at {where(export_error) or unknown}: "
        f"{type(export_error).__name__}: {_first_line(export_error)}\n"
        f"Fix: {_fix(model, fx_error, export_error)}."
    )
