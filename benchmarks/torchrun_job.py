"""One torchrun job of a benchmark's worker on this machine, and the JSON result it wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def torchrun_json(script: str | Path, args: list[str], ranks: int, out: Path, label: str,
                  timeout_s: float) -> dict[str, Any]:
    """Run `script args` on `ranks` gloo ranks (one thread each, the checkout first on PYTHONPATH) and read the
    JSON it writes to `out`; a RuntimeError naming `label` with the job's last output when it fails."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", str(script),
           *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0 or not out.is_file():
        raise RuntimeError(f"{label} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return dict(json.loads(out.read_text()))
