"""The profiler: per-node times keyed by node name, the disk cache, and no side effects on the model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import pytest
import torch
import torch.fx
from torch import nn

from cost_model.cache import ENV_VAR
from cost_model.profiler import ProfiledCostModel, profile_graph
from cost_model.timing import make_timer

CPU = torch.device("cpu")


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(512, 512)  # large enough that its backward dwarfs timer noise
        self.bn = nn.BatchNorm1d(512)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.fc(x))
        h = h.add_(1.0)  # an in-place op on an activation (its input is a leaf when profiled)
        return torch.relu(h).sum(dim=1)


def traced() -> tuple[torch.fx.GraphModule, list[torch.Tensor]]:
    torch.manual_seed(0)
    return torch.fx.symbolic_trace(Small()), [torch.randn(64, 512)]


def quick(gm: torch.fx.GraphModule, inputs: list[Any], cache_dir: Any, **kw: Any) -> Any:
    return profile_graph(gm, inputs, "cpu", warmup=1, repeats=2, cache_dir=cache_dir, progress=False, **kw)


def test_profiles_every_compute_node_forward_and_backward(tmp_path: Path) -> None:
    gm, inputs = traced()
    profile = quick(gm, inputs, tmp_path)
    assert list(profile.forward) == ["fc", "bn", "add_", "relu", "sum_1"]
    assert all(t > 0 for t in profile.forward.values())
    assert "fc" in profile.backward  # weight gradient timed even though x needs none
    assert all(t >= 0 for t in profile.backward.values()) and sum(profile.backward.values()) > 0
    assert profile.total() == pytest.approx(sum(profile.node_time(n) for n in profile.forward))
    assert profile.node_time("x") == 0.0  # the placeholder does no work


def test_second_call_hits_the_disk_cache(tmp_path: Path) -> None:
    gm, inputs = traced()
    first = quick(gm, inputs, tmp_path)
    files = list((tmp_path / "profiles").glob("*.json"))
    assert not first.from_cache and len(files) == 1
    second = quick(gm, inputs, tmp_path)
    assert second.from_cache
    assert (second.forward, second.backward) == (first.forward, first.backward)
    # Another shape is another key: measured again, a second file.
    other = quick(gm, [torch.randn(32, 512)], tmp_path)
    assert not other.from_cache and len(list((tmp_path / "profiles").glob("*.json"))) == 2


def test_cache_dir_from_environment_and_damaged_entries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "env"))
    gm, inputs = traced()
    profile_graph(gm, inputs, warmup=0, repeats=1, progress=False)
    (entry,) = (tmp_path / "env" / "profiles").glob("*.json")
    assert json.loads(entry.read_text())["device"] == "cpu"
    entry.write_text("{ half a file")
    again = profile_graph(gm, inputs, warmup=0, repeats=1, progress=False)
    assert not again.from_cache  # a damaged entry is a miss, then rewritten
    assert json.loads(entry.read_text())["key"] == again.key


def test_profiling_leaves_the_model_as_it_was(tmp_path: Path) -> None:
    gm, inputs = traced()
    before = {k: v.clone() for k, v in gm.state_dict().items()}
    quick(gm, inputs, tmp_path, cache=False)
    assert all(p.grad is None for p in gm.parameters())
    for k, v in gm.state_dict().items():
        assert torch.equal(v, before[k]), k  # BatchNorm running stats included


class Flat:
    """A fallback that says 1 s for every node and 2 s for every transfer."""

    def node_time(self, node: Mapping[str, Any], device: torch.device) -> float:
        return 1.0

    def transfer_time(self, nbytes: float, src: torch.device, dst: torch.device) -> float:
        return 2.0


def test_cost_model_uses_profiles_where_present_and_fallback_elsewhere(tmp_path: Path) -> None:
    gm, inputs = traced()
    model = ProfiledCostModel(gm, inputs, fallback=Flat(), warmup=0, repeats=1, cache_dir=str(tmp_path),
                              progress=False, present=lambda d: d.type == "cpu")
    profile = model.profile(CPU)
    fc = {"name": "fc", "op": "call_module"}
    assert model.node_time(fc, CPU) == pytest.approx(profile.forward["fc"] + profile.backward["fc"])
    assert model.forward_time(fc, CPU) == pytest.approx(profile.forward["fc"])
    assert model.node_time({"name": "x", "op": "placeholder"}, CPU) == 0.0
    assert model.node_time(fc, torch.device("cuda", 3)) == 1.0  # absent: the fallback answers
    assert model.transfer_time(10, CPU, torch.device("cuda", 0)) == 2.0


def test_cost_model_without_a_graph_says_what_to_do() -> None:
    model = ProfiledCostModel(fallback=Flat())
    with pytest.raises(RuntimeError, match="prepare"):
        model.profile(CPU)


def test_bad_options() -> None:
    gm, inputs = traced()
    with pytest.raises(ValueError, match="repeats >= 1"):
        profile_graph(gm, inputs, repeats=0)
    with pytest.raises(ValueError, match="not present"):
        profile_graph(gm, inputs, "cuda:7" if not torch.cuda.is_available() else "cuda:99")


def test_cpu_clock_needs_one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    with pytest.raises(ValueError, match="set_num_threads"):
        make_timer(CPU, "cpu")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    timer = make_timer(CPU, "cpu")
    assert timer() >= 0
