"""Test session set-up: profiles go to a fresh cache directory, so runs are hermetic.

The process that makes the directory (pytest, or its xdist controller: the workers inherit the variable) removes it
when it exits."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

if "PARTITIONER_CACHE_DIR" not in os.environ:
    os.environ["PARTITIONER_CACHE_DIR"] = tempfile.mkdtemp(prefix="partitioner-test-cache-")
    atexit.register(shutil.rmtree, os.environ["PARTITIONER_CACHE_DIR"], ignore_errors=True)


def pytest_collection_modifyitems(config: object, items: list[object]) -> None:
    """Tests marked `cuda` skip cleanly where no CUDA device is visible (`pytest -m cuda` runs only them)."""
    import pytest
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:  # type: ignore[attr-defined]
            item.add_marker(skip)  # type: ignore[attr-defined]
