"""The CUDA stream protocol of the local transport, checked on CPU with recording stand-ins."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import pytest
import torch

import runtime.cuda_streams as streams
from runtime.cuda_streams import CopyStreams, Handoff, join_caller
from runtime.microbatch import to_device


def test_cpu_to_cpu_moves_nothing_and_waits_for_nothing() -> None:
    x = torch.randn(3)
    handoff = CopyStreams().send([x], torch.device("cpu"), torch.device("cpu"), to_device)
    assert handoff.event is None and handoff.receive(torch.device("cpu"))[0] is x


class FakeStream:
    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def wait_stream(self, other: FakeStream) -> None:
        self.log.append(f"{self.name} waits {other.name}")

    def wait_event(self, event: FakeEvent) -> None:
        self.log.append(f"{self.name} waits {event.name}")


class FakeEvent:
    def __init__(self, log: list[str]) -> None:
        self.log, self.name = log, "event"

    def record(self, stream: FakeStream) -> None:
        self.name = f"event@{stream.name}"
        self.log.append(f"record {self.name}")


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    log: list[str] = []
    compute = {0: FakeStream("compute0", log), 1: FakeStream("compute1", log)}
    monkeypatch.setattr(streams, "_cuda", lambda d: d.type == "cuda")
    monkeypatch.setattr(streams, "current", lambda d: compute[d.index] if d.type == "cuda" else None)
    monkeypatch.setattr(torch.cuda, "Stream", lambda d: FakeStream(f"copy{d.index}", log))
    monkeypatch.setattr(torch.cuda, "Event", lambda: FakeEvent(log))

    @contextlib.contextmanager
    def use(stream: FakeStream) -> Iterator[None]:
        log.append(f"use {stream.name}")
        yield

    monkeypatch.setattr(torch.cuda, "stream", use)
    monkeypatch.setattr(streams, "record_on", lambda value, s: log.append(f"record {value[0]} on {s.name}")
                        if s is not None else None)
    return log


def test_gpu_to_gpu_copy_runs_on_copy_streams_after_the_producer(fake_cuda: list[str]) -> None:
    log = fake_cuda

    def move(values: Any, dst: torch.device) -> Any:
        log.append(f"copy to {dst}")
        return ["moved"]

    handoff = CopyStreams().send(["made"], torch.device("cuda", 0), torch.device("cuda", 1), move)
    assert log == [
        "copy0 waits compute0",  # the copy starts after the producer's compute of these values
        "use copy0", "use copy1",  # both ends' current streams are copy streams: compute goes on
        "copy to cuda:1",
        "record made on copy0",  # the source stays allocated until the copy ends
        "record event@copy1",
    ]
    log.clear()
    assert handoff.receive(torch.device("cuda", 1)) == ["moved"]
    assert log == ["compute1 waits event@copy1", "record moved on compute1"]


def test_same_gpu_hands_over_with_an_event_and_no_copy(fake_cuda: list[str]) -> None:
    handoff = CopyStreams().send(["made"], torch.device("cuda", 0), torch.device("cuda", 0), lambda v, d: ["copied"])
    assert handoff.values == ["made"] and fake_cuda == ["record event@compute0"]


def test_gpu_to_cpu_is_ready_when_the_copy_returns(fake_cuda: list[str]) -> None:
    handoff = CopyStreams().send(["made"], torch.device("cuda", 0), torch.device("cpu"), lambda v, d: ["host"])
    assert handoff.event is None and handoff.values == ["host"]
    assert fake_cuda[0] == "copy0 waits compute0" and "record made on copy0" in fake_cuda


def test_a_worker_stream_starts_after_and_ends_before_the_caller() -> None:
    log: list[str] = []
    worker, caller = FakeStream("worker", log), FakeStream("caller", log)
    with contextlib.ExitStack() as stack:
        patch = stack.enter_context(pytest.MonkeyPatch.context())
        patch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
        with join_caller(worker, caller):
            log.append("work")
    assert log == ["worker waits caller", "work", "caller waits worker"]
    assert Handoff(["v"]).receive(torch.device("cpu")) == ["v"]
