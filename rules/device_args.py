"""A graph node's `device=` argument names the device it runs on: a stage's, or the one a profiler times it on.

Graphs from torch.export hard-code the device they were traced on (`arange(..., device=cpu)`,
`_assert_tensor_metadata(x, device=cpu)`). A stage placed on cuda:1 runs such a node on
cuda:1 (runtime/stage.py), and the profiler, timing the graph on a GPU, does the same: with the
traced device kept, the node makes its tensor on the wrong device or its assertion fails.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

__all__ = ["on_device"]


def on_device(kwargs: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
    """`kwargs` of a node run on `device`: a `device=` argument (a torch.device) becomes `device`."""
    if isinstance(kwargs.get("device"), torch.device):
        return {**kwargs, "device": device}
    return dict(kwargs)
