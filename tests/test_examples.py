"""The examples run end to end on the CPU and do what they say."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.torchrun_report import failure

ROOT = Path(__file__).resolve().parent.parent


def test_demo_trains_and_prints_the_plan() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "demo.py"), "--steps", "10", "--batch", "16"],
        capture_output=True, text=True, timeout=300, check=True,
    )
    assert "bottleneck" in result.stdout
    losses = [float(v) for v in re.findall(r"loss (\d+\.\d+)", result.stdout)]
    assert len(losses) >= 2 and losses[-1] < losses[0]


def test_inception_branches_places_branches_and_trains(tmp_path: Path) -> None:
    out = tmp_path / "plan.png"
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "inception_branches.py"), "--steps", "4", "--channels", "16",
         "--size", "8", "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "branches on 2 of 2 devices" in result.stdout and out.stat().st_size > 10_000


def test_gpt_hybrid_under_torchrun_with_uneven_replicas(tmp_path: Path) -> None:
    out = tmp_path / "plan.html"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
           str(ROOT / "examples" / "gpt_hybrid.py"), "--replicas", "2,1,1", "--steps", "6", "--layers", "3",
           "--width", "64", "--out", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    text = result.stdout + result.stderr
    assert result.returncode == 0, failure(text)
    assert re.search(r"step 1 loss ([\d.]+), one process \1", text)  # equal to one process's loss
    assert "samples/s" in text and out.exists()


def test_async_updates_trains_every_rule_under_torchrun(tmp_path: Path) -> None:
    out = tmp_path / "async.png"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3",
           str(ROOT / "examples" / "async_updates.py"), "--steps", "4", "--layers", "3", "--width", "32",
           "--out", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    text = result.stdout + result.stderr
    assert result.returncode == 0, failure(text)
    assert "the same in every run but stash" in text and out.stat().st_size > 10_000
    for name in ("sync", "2bw", "stash", "staleness 0", "staleness 1", "staleness 2"):
        assert re.search(rf"^{name} +\d+\.\d+ ", text, re.M), name
