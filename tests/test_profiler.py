"""The profiler: per-node times keyed by node name, the disk cache, no side effects on the model, chunk by
chunk profiling of a model larger than the device, the fallback where memory runs out, and nodes that
cannot run alone (timed inside whole forwards: partitioned models equal the plain ones)."""

from __future__ import annotations

import copy
import json
import logging
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping

import pytest
import torch
import torch.fx
from torch import nn

from cost_model import chunks, profiler
from cost_model.analytic import AnalyticCostModel
from cost_model.cache import ENV_VAR
from cost_model.chunks import node_bytes, plan_chunks
from cost_model.cluster import DeviceSet
from cost_model.profiler import ProfiledCostModel, profile_graph
from cost_model.progress import LOGGER, Progress
from cost_model.timing import NodeRunner, make_timer, materialize
from partitioner import partition
from partitioner.capture.graph import build_graph
from partitioner.capture.trace import trace

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
    grads = [torch.ones_like(p) for p in gm.parameters()]
    for p, g in zip(gm.parameters(), grads):
        p.grad = g.clone()  # a model profiled between backward and optimizer.step()
    quick(gm, inputs, tmp_path, cache=False)
    assert all(torch.equal(p.grad, g) for p, g in zip(gm.parameters(), grads))


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


# ---- chunk by chunk (a model larger than the device), and out of memory ----


def needs_cuda(test: Callable[..., Any]) -> Callable[..., Any]:
    """Marked `cuda` (the GPU suite selects it) and skipped where no CUDA device is visible."""
    skip = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
    return pytest.mark.cuda(skip(test))


class Mixed(nn.Module):
    """A weight read by get_attr, a tied weight used twice, and a value of type torch.device."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(64, 64, bias=False)
        self.scale = nn.Parameter(torch.ones(64))
        self.bn = nn.BatchNorm1d(64)
        self.head = nn.Linear(64, 64, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.embed(x)) * self.scale
        h = h + torch.ones(h.shape[1], device=x.device)
        return self.head(torch.relu(h)).sum()


def snapshot(gm: nn.Module) -> dict[str, tuple[torch.device, torch.Tensor]]:
    return {k: (v.device, v.detach().clone()) for k, v in gm.state_dict(keep_vars=True).items()}


def assert_unchanged(gm: nn.Module, before: dict[str, tuple[torch.device, torch.Tensor]], params: list[Any]) -> None:
    assert list(gm.parameters()) == params  # the same Parameter objects
    assert all(p.grad is None for p in gm.parameters())
    after = gm.state_dict(keep_vars=True)
    assert after.keys() == before.keys()
    for k, (device, value) in before.items():
        assert after[k].device == device and torch.equal(after[k], value), k


def largest_node(gm: torch.fx.GraphModule, inputs: list[Any]) -> int:
    gm = copy.deepcopy(gm)  # a forward moves BatchNorm's running statistics
    values = materialize(gm, inputs)
    return max(node_bytes(gm, n, values) for n in gm.graph.nodes if n.op.startswith("call"))


@pytest.mark.parametrize("make", [traced, lambda: (torch.fx.symbolic_trace(Mixed()), [torch.randn(8, 64)])])
def test_chunked_profile_equals_the_whole_one_and_leaves_the_model(make: Any, tmp_path: Path) -> None:
    gm, inputs = make()
    budget = largest_node(gm, inputs)
    values = materialize(gm, inputs)
    nodes = [n for n in gm.graph.nodes if n.op.startswith("call")]
    assert len(plan_chunks(gm, nodes, values, budget)) > 1  # the budget forces several chunks
    gm, inputs = make()
    before, params = snapshot(gm), list(gm.parameters())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # thread CPU time: steady on a loaded machine
    try:
        whole = quick(gm, inputs, tmp_path, cache=False, clock="cpu")
        chunked = quick(gm, inputs, tmp_path, cache=False, clock="cpu", memory_budget_bytes=budget)
    finally:
        torch.set_num_threads(threads)
    assert_unchanged(gm, before, params)
    assert chunked.key == whole.key and chunked.unmeasured == whole.unmeasured == []
    assert list(chunked.forward) == list(whole.forward) and list(chunked.backward) == list(whole.backward)
    assert all(t >= 0 for t in [*chunked.forward.values(), *chunked.backward.values()])
    assert whole.total() / 10 < chunked.total() < whole.total() * 10  # the same work, within any noise


def test_a_chunked_profile_is_cached_under_the_whole_profiles_key(tmp_path: Path) -> None:
    gm, inputs = traced()
    whole = quick(gm, inputs, tmp_path)
    again = quick(gm, inputs, tmp_path, memory_budget_bytes=largest_node(gm, inputs))
    assert again.from_cache and again.key == whole.key


def out_of_memory_on(shape: tuple[int, ...], error: Exception, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make moving any tensor of `shape` to the device fail as a full GPU does."""
    move = chunks.to_device

    def failing(t: torch.Tensor, device: torch.device) -> torch.Tensor:
        if tuple(t.shape) == shape:
            raise error
        return move(t, device)

    monkeypatch.setattr(chunks, "to_device", failing)


@pytest.mark.parametrize("error", [
    torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 MiB"),
    RuntimeError("CUDA error: out of memory"),
])
def test_out_of_memory_falls_back_to_the_analytic_model_and_says_so(
    error: Exception, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    gm, inputs = traced()
    budget = largest_node(gm, inputs)
    before, params = snapshot(gm), list(gm.parameters())
    out_of_memory_on((512, 512), error, monkeypatch)  # fc's weight
    model = ProfiledCostModel(gm, inputs, fallback=Flat(), warmup=0, repeats=1, cache_dir=str(tmp_path),
                              progress=False, memory_budget_bytes=budget)
    with caplog.at_level(logging.WARNING, logger="cost_model.profiler"):
        profile = model.profile(CPU)
    assert profile.unmeasured == ["fc"] and list(profile.forward) == ["bn", "add_", "relu", "sum_1"]
    (record,) = caplog.records
    assert "timed 4 of 5 nodes" in record.message and "other 1 (out of memory on cpu): fc" in record.message
    fc = {"name": "fc", "op": "call_module"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an unmeasured node is no surprise: no "not in the profiled graph" warning
        assert model.node_time(fc, CPU) == 1.0 and model.forward_time(fc, CPU) == pytest.approx(1.0 / 3)
    assert model.node_time({"name": "bn", "op": "call_module"}, CPU) == profile.node_time("bn")
    assert not list((tmp_path / "profiles").glob("*.json"))  # a partial profile is not cached
    assert_unchanged(gm, before, params)


def test_a_node_alone_over_the_budget_is_left_to_the_fallback(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    gm, inputs = traced()
    values = materialize(gm, inputs)
    fc = next(n for n in gm.graph.nodes if n.name == "fc")
    rest = max(node_bytes(gm, n, values) for n in gm.graph.nodes if n.op.startswith("call") and n is not fc)
    assert rest < node_bytes(gm, fc, values)
    with caplog.at_level(logging.WARNING, logger="cost_model.profiler"):
        profile = quick(gm, inputs, tmp_path, memory_budget_bytes=rest)
    assert profile.unmeasured == ["fc"] and "fc" not in profile.forward
    assert "memory budget" in caplog.text


def test_whole_graph_out_of_memory_retries_chunk_by_chunk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    gm, inputs = traced()

    def full(*args: Any) -> Any:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory.")

    monkeypatch.setattr(profiler, "_on_device", full)
    with caplog.at_level(logging.INFO, logger="cost_model.profiler"):
        profile = quick(gm, inputs, tmp_path, cache=False)
    assert list(profile.forward) == ["fc", "bn", "add_", "relu", "sum_1"] and profile.unmeasured == []
    assert "chunk by chunk" in caplog.text


def test_no_memory_for_the_models_own_run_leaves_every_node_to_the_fallback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    gm, inputs = traced()

    def full(*args: Any) -> Any:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory.")

    monkeypatch.setattr(chunks, "record", full)
    with caplog.at_level(logging.WARNING, logger="cost_model.profiler"):
        profile = quick(gm, inputs, tmp_path, memory_budget_bytes=largest_node(gm, inputs))
    assert profile.forward == {} and profile.unmeasured == ["fc", "bn", "add_", "relu", "sum_1"]
    assert "timed 0 of 5 nodes" in caplog.text and "out of memory running the model on cpu" in caplog.text


def test_other_errors_propagate_and_leave_the_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gm, inputs = traced()
    before, params = snapshot(gm), list(gm.parameters())
    out_of_memory_on((512,), ValueError("a bug, not memory"), monkeypatch)  # bn's tensors
    with pytest.raises(ValueError, match="a bug"):
        quick(gm, inputs, tmp_path, memory_budget_bytes=largest_node(gm, inputs))
    assert_unchanged(gm, before, params)


def test_negative_budget_is_refused() -> None:
    gm, inputs = traced()
    with pytest.raises(ValueError, match="memory_budget_bytes"):
        profile_graph(gm, inputs, memory_budget_bytes=-1)


@needs_cuda
def test_cuda_profile_chunk_by_chunk_leaves_the_model_on_cpu(tmp_path: Path) -> None:
    gm, inputs = traced()
    before, params = snapshot(gm), list(gm.parameters())
    device = torch.device("cuda", torch.cuda.current_device())
    whole = profile_graph(gm, inputs, device, warmup=1, repeats=2, cache=False, progress=False)
    chunked = profile_graph(gm, inputs, device, warmup=1, repeats=2, cache=False, progress=False,
                            memory_budget_bytes=largest_node(gm, inputs))
    assert_unchanged(gm, before, params)
    assert chunked.key == whole.key and list(chunked.forward) == list(whole.forward)
    assert all(t > 0 for t in chunked.forward.values()) and chunked.unmeasured == []


def test_prepare_also_prepares_the_analytic_fallback(tmp_path: Path) -> None:
    """An absent device is priced by the fallback from the same graph: a Conv2d priced as a convolution."""
    class Conv(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(8, 8, 3, padding=1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.conv(x)

    gm = torch.fx.symbolic_trace(Conv())
    inputs = [torch.randn(2, 8, 16, 16)]
    graph = build_graph(gm, inputs)
    node = dict(graph.nodes["conv"])
    node["name"] = "conv"
    absent = torch.device("cuda", 0)
    described = {"devices": {"cuda:0": {"gpu_type": "H100-SXM"}}}
    alone, fallback = (AnalyticCostModel(DeviceSet.from_dict(described)) for _ in range(2))
    alone.prepare(gm, inputs)
    model = ProfiledCostModel(gm, inputs, fallback=fallback, cache_dir=str(tmp_path), progress=False,
                              present=lambda d: d.type == "cpu")
    assert fallback._kinds == {"conv": "Conv2d"}
    assert model.node_time(node, absent) == pytest.approx(alone.node_time(node, absent))


# ---- nodes that cannot run alone on the values recorded for them: never an error to the user ----


class IndexArithmetic(nn.Module):
    """In-place index arithmetic on the torch.export path (issue 25's reduction of T5's relative buckets):
    `b += arange(n)` is `aten.add_.Tensor`, whose name does not end in "_"; run alone seven times on one
    tensor, b grew past the embedding's 16 rows (IndexError)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] > 4:  # control flow on a shape: torch.fx fails, torch.export specializes
            x = x * 2
        n = x.shape[1]
        b = torch.zeros(n, dtype=torch.long)
        b += torch.arange(n)
        return self.fc2(self.fc1(x) + self.emb(b))


class ReadThenWrite(nn.Module):
    """A node reads `b`, a later node changes `b` in place (torch.export keeps `aten.add_`; fx traces
    `b += 100` as `b = b + 100`): the value after the forward is not what the first embedding read
    (it was out of its range: IndexError when profiled on it)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] > 4:  # torch.export, as above
            x = x * 2
        b = torch.arange(x.shape[1])
        first = self.emb(b)
        b += 100
        return self.fc(x + first + self.emb(b - 100))


def partitioned_equals_plain(model: nn.Module, x: torch.Tensor, **kw: Any) -> None:
    """Partition on two CPU stages with the profiled cost model (the default) and compare with the plain model."""
    expected = model(x)
    pipe = partition(model, ["cpu", "cpu"], example_inputs=(x,), micro_batches=2, **kw)
    torch.testing.assert_close(pipe(x), expected)


def test_in_place_index_arithmetic_on_the_export_path_profiles_and_partitions(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, x = IndexArithmetic(), torch.randn(4, 12, 8)
    assert trace(model, (x,)).method == "export"  # the path the reduction is about
    partitioned_equals_plain(model, x, cost_model=ProfiledCostModel(cache_dir=str(tmp_path), progress=False))


def test_a_value_changed_in_place_after_it_was_read_profiles_and_partitions(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, x = ReadThenWrite(), torch.randn(4, 12, 8)
    traced = trace(model, (x,))
    assert traced.method == "export"
    profile = quick(traced.graph_module, [x], tmp_path, cache=False)
    assert profile.unmeasured == [] and "timed_in_forward" not in profile.meta  # each node ran alone, on what it read
    partitioned_equals_plain(model, x, cost_model=ProfiledCostModel(cache_dir=str(tmp_path), progress=False))


def test_t5_from_its_default_config_profiles_and_partitions(tmp_path: Path) -> None:
    """T5's relative position buckets (`relative_buckets += ...`) crashed the profiler with IndexError."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_heads=2,
                                   use_cache=False)  # fmt: skip
    model = transformers.T5ForConditionalGeneration(config).eval()
    ids, decoder_ids = torch.randint(0, 64, (4, 8)), torch.randint(0, 64, (4, 6))
    expected = model(ids, decoder_input_ids=decoder_ids).logits
    pipe = partition(model, ["cpu", "cpu"], example_inputs=(ids,), example_kwargs={"decoder_input_ids": decoder_ids},
                     micro_batches=2, cost_model=ProfiledCostModel(cache_dir=str(tmp_path), progress=False))
    torch.testing.assert_close(pipe(ids, decoder_input_ids=decoder_ids).logits, expected)


def refuse_alone(monkeypatch: pytest.MonkeyPatch, module: type[nn.Module]) -> None:
    """Make every node that calls a `module` raise when the profiler runs it alone (as a node given values
    it cannot take would), while whole forwards of the model still run it."""
    run_once = NodeRunner.run_once

    def refusing(self: NodeRunner) -> tuple[int, int | None]:
        if isinstance(self.fn, module):
            raise IndexError("index out of range in self")
        return run_once(self)

    monkeypatch.setattr(NodeRunner, "run_once", refusing)


def test_a_node_that_cannot_run_alone_is_timed_inside_whole_forwards_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    gm, inputs = traced()
    before, params = snapshot(gm), list(gm.parameters())
    refuse_alone(monkeypatch, nn.Linear)
    with caplog.at_level(logging.INFO, logger="cost_model.profiler"):
        profile = quick(gm, inputs, tmp_path, cache=False)
    assert list(profile.forward) == ["fc", "bn", "add_", "relu", "sum_1"] and profile.unmeasured == []
    assert profile.forward["fc"] > 0 and profile.backward["fc"] > 0  # its backward timed in the whole backward
    assert profile.meta["timed_in_forward"] == ["fc"]
    assert "1 nodes cannot run alone" in caplog.text and "IndexError" in caplog.text
    assert_unchanged(gm, before, params)


def test_chunk_by_chunk_a_node_that_cannot_run_alone_is_left_to_the_fallback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    gm, inputs = traced()
    refuse_alone(monkeypatch, nn.Linear)
    with caplog.at_level(logging.WARNING, logger="cost_model.profiler"):
        profile = quick(gm, inputs, tmp_path, memory_budget_bytes=largest_node(gm, inputs))
    assert profile.unmeasured == ["fc"] and "fc" not in profile.forward and profile.forward["bn"] > 0
    assert "timed 4 of 5 nodes" in caplog.text and "it cannot run alone (IndexError" in caplog.text


def test_the_profiling_phase_is_one_line_and_its_count_is_the_graphs_nodes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    counted: list[Progress] = []
    real = profiler.phase
    monkeypatch.setattr(profiler, "phase", lambda *a, **k: counted.append(real(*a, **k)) or counted[-1])
    gm, inputs = traced()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        quick(gm, inputs, tmp_path)
        cached = quick(gm, inputs, tmp_path)  # from the cache: said, not counted
    assert [r.getMessage() for r in caplog.records if r.name == LOGGER] == [
        "profiling 5 nodes on cpu (3 runs each)",
        f"profiling on cpu: 5 nodes read from the cache ({tmp_path / 'profiles' / cached.key}.json)",
    ]
    assert [(p.total, p.done) for p in counted] == [(5, 5.0)]


@needs_cuda
def test_cuda_a_node_that_cannot_run_alone_is_timed_by_events_inside_whole_forwards(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gm, inputs = traced()
    before, params = snapshot(gm), list(gm.parameters())
    refuse_alone(monkeypatch, nn.Linear)
    device = torch.device("cuda", torch.cuda.current_device())
    profile = profile_graph(gm, inputs, device, warmup=1, repeats=2, cache=False, progress=False)
    assert profile.meta["timed_in_forward"] == ["fc"] and profile.unmeasured == []
    assert profile.forward["fc"] > 0 and profile.backward["fc"] > 0
    assert_unchanged(gm, before, params)


@needs_cuda
def test_cuda_profile_of_a_graph_traced_on_cpu_runs_its_device_arguments_on_the_gpu(tmp_path: Path) -> None:
    """torch.export bakes the tracing device in (`arange(device=cpu)`, `_assert_tensor_metadata(device=cpu)`);
    profiled on a GPU, such nodes run there, as a stage on that GPU runs them."""
    torch.manual_seed(0)
    model, x = IndexArithmetic(), torch.randn(4, 12, 8)
    traced = trace(model, (x,))
    assert any(isinstance(n.kwargs.get("device"), torch.device) for n in traced.graph_module.graph.nodes)
    device = torch.device("cuda", torch.cuda.current_device())
    for budget in (None, largest_node(traced.graph_module, [x])):  # whole, and chunk by chunk
        profile = profile_graph(traced.graph_module, [x], device, warmup=1, repeats=2, cache=False, progress=False,
                                memory_budget_bytes=budget)
        assert profile.unmeasured == [] and "timed_in_forward" not in profile.meta
