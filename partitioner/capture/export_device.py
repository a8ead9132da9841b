"""A model on meta exported as the device it will run on: fake tensors of that device stand in for its meta ones.

[Note: a meta model takes its device's branches] A meta model is traced on meta tensors (capture.meta),
and code that branches on the device (`x.device.type in ("cpu", "mps")`: Mixtral's experts count
tokens with `histc` on floats on the CPU, on integers elsewhere) would take the branch no real
device takes, baking into the graph an operation its stages cannot run (histc of integers on the
CPU). So torch.export traces it with fake tensors that say they are on the device it will run on
(the accelerator if there is one, else the CPU): the model's meta parameters and buffers are
replaced by fake tensors of that device for the export (capture.export's stand-ins), its example
inputs by empty tensors of their shapes there (export reads no values), and tensors forward makes
default to it. The exported graph is then made a meta graph again, as for any meta model: the
devices it names become meta (each stage names its own: runtime.stage), and constants forward made
(fake tensors) become meta tensors of their shapes.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch import nn
from torch._guards import TracingContext, tracing
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

__all__ = ["FakeDevice", "run_device"]

_META = torch.device("meta")


def run_device() -> torch.device:
    """The device a meta model will run on, as far as tracing knows: the accelerator if there is one, else the CPU."""
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return torch.device(accelerator.type) if accelerator is not None else torch.device("cpu")


class FakeDevice:
    """One export of a meta model as `device` (see [Note: a meta model takes its device's branches])."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # as torch.export makes its own (torch._export.non_strict_utils.make_fake_inputs), which then takes this one
        self.mode = FakeTensorMode(shape_env=ShapeEnv(tracked_fakes=[]), allow_non_fake_inputs=True, export=True)

    def stand_in(self, t: torch.Tensor) -> torch.Tensor:
        """A fake tensor of `t`'s shape on the device, for a meta `t`; else an alias of `t`."""
        if not t.is_meta:
            return t.detach()
        fake = self.mode.fake_tensor_converter.from_meta_and_device(self.mode, t.detach(), self.device)
        return nn.Parameter(fake, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else fake

    def inputs(self, value: Any) -> Any:
        """`value` with each meta tensor an empty tensor of its shape and dtype on the device."""
        return pytree.tree_map_only(
            torch.Tensor, lambda t: torch.empty(t.shape, dtype=t.dtype, device=self.device) if t.is_meta else t, value)

    @contextlib.contextmanager
    def exporting(self) -> Iterator[None]:
        """torch.export runs in this fake mode; tensors forward makes without a device are on the device."""
        with tracing(TracingContext(self.mode)), torch.device(self.device):
            yield

    def to_meta(self, gm: torch.fx.GraphModule) -> None:
        """The exported graph, nested graphs included, made a meta graph: the device it names meta, its fake
        constants meta tensors."""
        for sub in gm.modules():
            if not isinstance(sub, torch.fx.GraphModule):
                continue
            for node in sub.graph.nodes:
                device = node.kwargs.get("device")
                if isinstance(device, torch.device) and device.type == self.device.type:
                    node.kwargs = {**node.kwargs, "device": _META}
            for key, value in list(vars(sub).items()):
                if isinstance(value, FakeTensor):
                    setattr(sub, key, torch.empty(value.shape, dtype=value.dtype, device=_META))
            for d in (sub._parameters, sub._buffers):
                for key, t in d.items():
                    if isinstance(t, FakeTensor):
                        meta = torch.empty(t.shape, dtype=t.dtype, device=_META)
                        d[key] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) \
                            else meta  # type: ignore[assignment]
            sub.recompile()
