"""Multi-process runs on gloo under NCCL's rules: equal to single-process training, checkpoints, failures."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from runtime.distributed import NCCL_RULES_ENV
from tests import dist_worker

WORKER = str(Path(__file__).resolve().parent / "dist_worker.py")
ROOT = str(Path(__file__).resolve().parent.parent)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun(
    ranks: int, *args: str, extra: tuple[str, ...] = (), timeout: float = 240, nccl_rules: bool = True,
    worker: str = WORKER,
) -> subprocess.CompletedProcess[str]:
    """Run `worker` (default tests/dist_worker.py) on `ranks` gloo processes; with `nccl_rules`, every message
    obeys NCCL's rules (runtime.nccl_rules), so a protocol that would hang under NCCL fails here instead."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", *extra,
           worker, *args]
    env = {**os.environ, NCCL_RULES_ENV: "1" if nccl_rules else "0"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            start_new_session=True, env=env)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"torchrun timed out after {timeout} s:\n{out[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def results(output: str) -> list[str]:
    # ranks write to one pipe: a result may share its line with a progress bar or another rank
    return re.findall(r"RESULT .*?ok=(?:True|False)", output)


def check_equivalence(ranks: int, cases: list[str], nccl_rules: bool = True) -> None:
    run = torchrun(ranks, "equivalence", *cases, nccl_rules=nccl_rules)
    lines = results(run.stdout)
    assert run.returncode == 0 and len(lines) == ranks * len(cases), run.stdout[-4000:]
    assert all("ok=True" in line for line in lines), "\n".join(lines)


def test_two_ranks_every_schedule() -> None:
    check_equivalence(  # mode_dependent: partitioned in training, trained in eval (the eval graph runs)
        2, ["tiny_gpt:gpipe:-", "tiny_gpt:1f1b:-", "tiny_gpt:interleaved:-", "tiny_gpt:zb1:-", "tiny_gpt:zbv:-",
            "tiny_gpt:dualpipev:-", "inception:1f1b:-", "inception:gpipe:-:branches",
            "mode_dependent:1f1b:-:pipeline:eval"],
    )


def test_two_ranks_plain_torch_distributed() -> None:
    # the production path (runtime.comm.TorchComm), without the NCCL-rules emulation
    check_equivalence(2, ["tiny_gpt:1f1b:-", "inception:gpipe:-:branches"], nccl_rules=False)


def test_three_ranks_schedules_and_uneven_replicas() -> None:
    # [2,1]: stage 0 on ranks 0 and 1 taking micro-batches in turn, stage 1 on rank 2
    check_equivalence(3, ["tiny_gpt:gpipe:-", "tiny_gpt:1f1b:-", "tiny_gpt:gpipe:[2,1]", "tiny_gpt:1f1b:[2,1]",
                          "tiny_gpt:zb1:[2,1]", "in_place:1f1b:-"])  # in-place writes on one rank, read on another


def test_four_ranks_schedules_and_two_by_two_replicas() -> None:
    check_equivalence(
        4,
        ["tiny_gpt:1f1b:-", "tiny_gpt:interleaved:-", "tiny_gpt:gpipe:[2,2]", "tiny_gpt:1f1b:[2,2]",
         "inception:gpipe:-",
         "tiny_gpt:1f1b:auto"],  # auto: the hybrid planner picks stages and replicas
    )


def test_checkpoint_round_trip_into_another_plan(tmp_path: Path) -> None:
    run = torchrun(2, "checkpoint", str(tmp_path / "ckpt"))
    lines = results(run.stdout)
    assert run.returncode == 0 and len(lines) == 2, run.stdout[-4000:]
    assert all("ok=True" in line for line in lines), "\n".join(lines)
    assert re.search(r"after=\[[\d.]+, [\d.]+, [\d.]+\]", "\n".join(lines))  # the last stage saw 3 losses


def test_killed_rank_is_named_by_every_other_rank_within_60_s(tmp_path: Path) -> None:
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "3",
           "PYTHONPATH": ROOT, NCCL_RULES_ENV: "1"}
    start = time.monotonic()
    procs = [
        subprocess.Popen([sys.executable, WORKER, "fault", "1"], env={**env, "RANK": str(r)}, cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        for r in range(3)
    ]
    outputs, codes, elapsed = {}, {}, {}
    for r, p in enumerate(procs):
        try:
            outputs[r], _ = p.communicate(timeout=max(1.0, 90 - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            outputs[r], _ = p.communicate()
        codes[r], elapsed[r] = p.returncode, time.monotonic() - start
    assert codes[1] == -signal.SIGKILL
    for r in (0, 2):
        assert codes[r] != 0 and elapsed[r] < 60, (r, codes[r], elapsed[r], outputs[r][-2000:])
        assert "PeerError: rank 1 (stage 1) failed or stopped answering" in outputs[r], outputs[r][-2000:]


def test_torchrun_restart_resumes_from_the_last_checkpoint(tmp_path: Path) -> None:
    losses_file = tmp_path / "losses.txt"
    run = torchrun(2, "resume", str(tmp_path), str(losses_file), extra=("--max-restarts=1",))
    assert run.returncode == 0, run.stdout[-4000:]
    rows = [line.split() for line in losses_file.read_text().splitlines()]
    by_step = {int(step): (int(attempt), float(loss)) for attempt, step, loss in rows}
    assert sorted(by_step) == list(range(6)) and by_step[5][0] == 1  # steps 4 and 5 ran after the restart

    model, x, y = dist_worker.data("tiny_gpt")  # the same 6 steps in one process, uninterrupted
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(6):
        opt.zero_grad()
        loss = dist_worker.lm_loss(model(x), y)
        loss.backward()
        opt.step()
        assert abs(by_step[step][1] - loss.item()) <= 1e-5 * abs(loss.item()), step


def test_a_planning_error_on_rank_0_reaches_every_rank() -> None:
    start = time.monotonic()
    run = torchrun(2, "infeasible", timeout=110)  # each rank would otherwise wait 120 s for the plan
    lines = results(run.stdout)
    assert run.returncode == 0 and len(lines) == 2 and all("ok=True" in line for line in lines), run.stdout[-3000:]
    assert any("InfeasibleError" in line for line in lines) and any("rank 0 could not plan" in line for line in lines)
    assert time.monotonic() - start < 100


def test_two_ranks_recompute_activations() -> None:
    # the torchrun runtime recomputes too: full and selective, GPipe and 1F1B, equal to full-batch training
    check_equivalence(2, ["tiny_gpt:1f1b:-:recompute=full", "tiny_gpt:gpipe:-:recompute=selective",
                          "inception:1f1b:-:recompute=selective"])
