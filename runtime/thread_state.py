"""Thread-local autograd state: what a stage may switch (restored after it), and what a worker thread takes.

Grad mode, inference mode, autocast, saved-tensor hooks and Python dispatch modes are per
thread in torch. A stage that switches one inside its forward must not leak it to the next
op (`caller_state`); a worker thread running a stage for the caller must run under the
caller's (`thread_state`), as `model(x)` would in the caller's thread.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

__all__ = ["caller_state", "thread_state"]


@contextlib.contextmanager
def caller_state() -> Iterator[None]:
    """Run a stage and put back the thread's grad mode and autocast state afterwards, even if it raises."""
    grad = torch.is_grad_enabled()
    autocast = [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")]
    try:
        yield
    finally:
        torch._C._set_grad_enabled(grad)
        for device, enabled, dtype in autocast:
            torch.set_autocast_enabled(device, enabled)
            torch.set_autocast_dtype(device, dtype)


def thread_state() -> Callable[[], contextlib.AbstractContextManager[Any]]:
    """The caller's thread-local autograd state, as a context to enter in a worker thread: grad mode,
    inference mode, autocast (per device type, with its dtype and cache), saved-tensor hooks
    (`torch.autograd.graph.save_on_cpu()` and the like) and Python dispatch modes (runtime.memory_meter)."""
    grad = torch.is_grad_enabled()
    inference = torch.is_inference_mode_enabled()
    autocast = [(d, torch.get_autocast_dtype(d)) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)]
    cache = torch.is_autocast_cache_enabled()
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    modes = torch.utils._python_dispatch._get_current_dispatch_mode_stack()

    @contextlib.contextmanager
    def enter() -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.set_grad_enabled(grad))
            if inference:
                stack.enter_context(torch.inference_mode())
            for device, dtype in autocast:
                stack.enter_context(torch.autocast(device, dtype=dtype, cache_enabled=cache))
            if hooks is not None:
                stack.enter_context(torch.autograd.graph.saved_tensors_hooks(*hooks))
            for mode in modes:
                stack.enter_context(mode)
            yield

    return enter
