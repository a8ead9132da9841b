"""examples/resnet_pipeline.py runs end to end on the CPU at small sizes and does what it says."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_resnet_pipeline_trains_matches_and_draws(tmp_path: Path) -> None:
    picture = tmp_path / "resnet_plan.html"
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "resnet_pipeline.py"), "--devices", "cpu,cpu,cpu", "--width", "4",
         "--blocks", "1", "--image", "16", "--batch", "8", "--micro-batches", "2", "--steps", "10", "--lr", "0.1",
         "--out", str(picture)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "3 stages (pipeline), 2 micro-batches" in out
    diffs = [float(v) for v in re.findall(r"max \|[^|]+\|[^:]*: (\S+)", out)]
    assert len(diffs) == 2 and max(diffs) <= 1e-5  # before and after training, against the plain model
    losses = [float(v) for v in re.findall(r"loss (\d+\.\d+)", out)]
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert re.search(r"\d+ samples/s", out)
    assert picture.exists() and 'id="plan-data"' in picture.read_text()
