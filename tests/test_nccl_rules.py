"""runtime.nccl_rules on 2 gloo ranks: NCCL-safe protocols pass, and the protocols NCCL hangs on are caught."""

from __future__ import annotations

import functools
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runtime.nccl_rules import _Meta

WORKER = str(Path(__file__).resolve().parent / "nccl_rules_worker.py")
ROOT = str(Path(__file__).resolve().parent.parent)
SAFE = ("safe", "safe_torch", "gloo_allows_send_then_recv")
UNSAFE = ("unsafe_send_then_recv", "recv_first_holds_send", "tags_ignored", "all_reduce_overtakes")
HANGS = "under NCCL's rules this hangs"


@functools.cache
def torchrun(*modes: str, timeout: float = 90) -> tuple[int | None, str]:
    """Run the worker's `modes` on 2 ranks once: the exit code (None: killed at `timeout`) and the output."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", WORKER, *modes]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return None, proc.communicate()[0]
    return proc.returncode, out


def outcomes(mode: str, modes: tuple[str, ...]) -> list[tuple[str, float, str]]:
    """(outcome, seconds, detail) of `mode` on ranks 0 and 1, from one run of all `modes`."""
    code, out = torchrun(*modes)
    if code is None:
        pytest.fail(f"torchrun timed out (the emulator must turn hangs into errors):\n{out[-3000:]}")
    found = re.findall(r"RESULT (\S+) rank=(\d) (ok|caught|FAIL[^:]*:?) after=([\d.]+)s (.*)", out)
    lines = {(m, int(rank)): (outcome, float(took), detail) for m, rank, outcome, took, detail in found}
    assert code == 0 and len(lines) == 2 * len(modes), out[-4000:]
    return [lines[(mode, rank)] for rank in (0, 1)]


def test_header_round_trip() -> None:
    meta = _Meta(1 << 40, "bfloat16", 12345, 7)
    assert _Meta.decode(meta.encode()) == meta
    assert meta.encode().dtype == torch.uint8 and meta.encode().numel() == 32


@pytest.mark.parametrize("mode", SAFE)
def test_safe_protocols_pass(mode: str) -> None:
    # the emulator and TorchComm move the same data; gloo alone even passes a protocol NCCL hangs on
    for outcome, _, detail in outcomes(mode, SAFE):
        assert outcome == "ok", detail


@pytest.mark.parametrize("mode", ["unsafe_send_then_recv", "recv_first_holds_send"])
def test_ordering_deadlocks_are_caught_within_the_timeout(mode: str) -> None:
    # each rank's first batch waits for the peer's second: NCCL runs them on one stream, so both hang
    for rank, (outcome, took, detail) in enumerate(outcomes(mode, UNSAFE)):
        assert outcome == "caught", detail
        assert detail.startswith(f"rank {rank}: batch #0 ["), detail
        assert f"did not complete within 3 s: {HANGS}" in detail, detail
        assert 2.5 < took < 8, (took, detail)  # the emulator's timeout_s=3 answers, not the caller's 30 s wait


def test_tags_are_ignored_so_a_receive_meant_for_a_later_send_is_a_size_mismatch() -> None:
    (out0, took0, detail0), (out1, took1, detail1) = outcomes("tags_ignored", UNSAFE)
    assert out0 == out1 == "caught", (detail0, detail1)
    pairs = "it pairs with (rank {}'s batch #0, op 0) moves {} B"
    assert f"op 0 sends 16 B (float32) with rank 1, but the receive {pairs.format(1, 32)}" in detail0, detail0
    assert f"op 0 receives 32 B (float32) with rank 0, but the send {pairs.format(0, 16)}" in detail1, detail1
    assert took0 < 2 and took1 < 2  # found by the size check at once, not by the timeout


def test_an_all_reduce_on_the_point_to_point_group_is_ordered_with_the_batches() -> None:
    (out0, took0, detail0), (out1, took1, detail1) = outcomes("all_reduce_overtakes", UNSAFE)
    assert out0 == out1 == "caught", (detail0, detail1)
    assert detail0.startswith("rank 0: batch #0 [send 16 B to rank 1] did not complete within 3 s"), detail0
    reduce = "rank 1: all-reduce #0 of 4 B on the point-to-point group did not complete within 3 s"
    assert detail1.startswith(reduce), detail1
    assert 2.5 < took0 < 8 and 2.5 < took1 < 8
