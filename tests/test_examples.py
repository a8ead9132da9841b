"""The examples run end to end on the CPU and do what they say."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_demo_trains_and_prints_the_plan() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "demo.py"), "--steps", "10", "--batch", "16"],
        capture_output=True, text=True, timeout=300, check=True,
    )
    assert "bottleneck" in result.stdout
    losses = [float(v) for v in re.findall(r"loss (\d+\.\d+)", result.stdout)]
    assert len(losses) >= 2 and losses[-1] < losses[0]
