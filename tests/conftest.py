"""Test session set-up: profiles go to a fresh cache directory, so runs are hermetic; the slowest files start first."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

os.environ.setdefault("PARTITIONER_CACHE_DIR", tempfile.mkdtemp(prefix="partitioner-test-cache-"))

# [Note: slowest files first]
# CI runs two xdist workers with --dist loadfile: a worker takes a whole file at a time, and xdist by default hands
# out the files with the most tests first. The slowest files are torchrun files with few tests, so they went out
# last and one worker ran the last of them while the other sat idle. They go out first instead, slowest first (rough
# seconds of each alone on 2 cores); every other file follows in collection order.
SLOWEST = {"test_split_layers.py": 600, "test_ep_cp.py": 300, "test_distributed.py": 180, "test_ep_cp_search.py": 120,
           "test_tensor_parallel.py": 60, "test_hier_allreduce.py": 50, "test_sharding.py": 30, "test_export.py": 30}


def pytest_configure(config: object) -> None:
    """Files go out to xdist's workers in the order `pytest_collection_modifyitems` leaves them."""
    option = config.option  # type: ignore[attr-defined]
    if hasattr(option, "loadscopereorder"):
        option.loadscopereorder = False


def pytest_collection_modifyitems(config: object, items: list[object]) -> None:
    """The slowest files first ([Note: slowest files first]); tests marked `cuda` skip cleanly where no CUDA device
    is visible (`pytest -m cuda` runs only them)."""
    import pytest
    import torch

    items.sort(key=lambda item: -SLOWEST.get(Path(str(item.fspath)).name, 0))  # type: ignore[attr-defined]
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:  # type: ignore[attr-defined]
            item.add_marker(skip)  # type: ignore[attr-defined]
