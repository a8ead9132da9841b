"""FSDP2's 'returned a view tensor' warning: not shown where the stage writes into no unit's output, explained once,
kept (with the node named) where it does."""

from __future__ import annotations

import logging
import warnings
from typing import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.testing._internal.distributed.fake_pg import FakeStore

from runtime import fsdp_warnings
from runtime.fsdp_warnings import unit_outputs_written
from runtime.sharding import ShardingConfig, data_mesh, shard_stage


class TwoLinears(nn.Module):
    """Two nn.Linear units on a 3-D input (each returns a view); `inplace`: the first one's output written in place."""

    def __init__(self, inplace: bool) -> None:
        super().__init__()
        self.a, self.b, self.inplace = nn.Linear(8, 8), nn.Linear(8, 8), inplace

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.inplace:
            h.add_(1)
        else:
            h = h + 1
        return self.b(h)


@pytest.fixture
def fake_group() -> Iterator[None]:
    """Two ranks in this process (collectives do nothing): enough for FSDP2 to shard and run a forward."""
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        with warnings.catch_warnings():  # the filter a stage adds is taken off with the test
            yield
    finally:
        dist.destroy_process_group()


def sharded_forward_backward(model: nn.Module) -> list[str]:
    """Shard `model` traced by fx (each Linear one unit) under zero3, run it forward and backward: the warnings."""
    gm = torch.fx.symbolic_trace(model)
    mesh = data_mesh([0, 1])
    assert mesh is not None
    with warnings.catch_warnings(record=True) as caught:
        stage = shard_stage(gm, mesh, ShardingConfig("zero3"))
        stage.before_backward(last=True)
        stage(torch.randn(4, 5, 8)).sum().backward()
    return [str(w.message) for w in caught]


def test_the_view_warning_is_not_shown_and_said_once_why(fake_group: None, caplog: pytest.LogCaptureFixture,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fsdp_warnings, "_explained", False)
    with caplog.at_level(logging.INFO, logger=fsdp_warnings.__name__):
        for _ in range(2):  # two stages sharded in one process
            shown = sharded_forward_backward(TwoLinears(inplace=False))
            assert not [m for m in shown if "returned a view tensor" in m], shown
    said = [r.getMessage() for r in caplog.records if "returned a view tensor" in r.getMessage()]
    assert len(said) == 1 and "no sharded stage here writes into a unit's output" in said[0]


def test_a_stage_writing_into_a_units_output_keeps_the_warning_and_names_the_node(fake_group: None) -> None:
    gm = torch.fx.symbolic_trace(TwoLinears(inplace=True))
    assert unit_outputs_written(gm, [gm.a, gm.b]) == ["add_"]
    assert unit_outputs_written(torch.fx.symbolic_trace(TwoLinears(inplace=False)), [gm.a, gm.b]) == []
    sharded_forward_backward(TwoLinears(inplace=False))  # filtered for that stage
    shown = sharded_forward_backward(TwoLinears(inplace=True))
    assert any("writes in place into the output of an FSDP2 unit (add_)" in m for m in shown), shown
    assert any("returned a view tensor" in m for m in shown), shown  # FSDP2's own, true here, shown again
