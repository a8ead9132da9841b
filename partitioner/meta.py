"""Building a model on `meta` to plan it from shapes: `with partitioner.meta.empty_weights(): model = Model()`.

partition() and plan() take such a model like any other (partitioner/capture/meta.py plans it from
shapes) and materialize each stage's weights on its own device from `weights=` or `init=`
(runtime/materialize.py).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from torch import nn

__all__ = ["empty_weights"]


@contextlib.contextmanager
def empty_weights() -> Iterator[None]:
    """Build a model with its parameters on meta and its buffers real (as accelerate's
    `init_empty_weights()`): a non-persistent buffer such as a causal mask, which no checkpoint
    holds, then keeps the value its constructor computed, and materializes like any other.

    >>> with empty_weights():
    ...     model = GPT(cfg)          # parameters on meta, the mask on the CPU
    """
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and not param.is_meta:
            kind = type(param)
            module._parameters[name] = kind(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]
