"""Hugging Face key/value caches: `config.use_cache` off while a model is traced, said once in the log."""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator, Mapping

from torch import nn

__all__ = ["without_cache"]

log = logging.getLogger(__name__)

# [Note: no key/value cache in a pipeline] Hugging Face models default to `use_cache=True` and then
# return a cache object (DynamicCache) beside the logits: state for the next generation step, which
# neither tracer can return and a pipeline does not carry between calls. Where the caller leaves
# `use_cache` unset, every `config.use_cache` of the model is off while it is traced (and back after),
# so the graph returns what the model returns with use_cache=False: `past_key_values` is None.
_SAID_NO_CACHE: set[type] = set()


@contextlib.contextmanager
def without_cache(model: nn.Module, kwargs: Mapping[str, Any]) -> Iterator[None]:
    """`config.use_cache` off while tracing (see [Note: no key/value cache in a pipeline])."""
    configs: dict[int, Any] = {} if "use_cache" in kwargs else {
        id(c): c for m in model.modules() if getattr(c := getattr(m, "config", None), "use_cache", None) is True
    }
    if configs and type(model) not in _SAID_NO_CACHE:
        _SAID_NO_CACHE.add(type(model))
        log.info("%s: traced with use_cache=False (a pipeline keeps no key/value cache between calls; its outputs "
                 "have past_key_values=None); pass use_cache in example_kwargs to choose", type(model).__name__)
    for c in configs.values():
        c.use_cache = False
    try:
        yield
    finally:
        for c in configs.values():
            c.use_cache = True
