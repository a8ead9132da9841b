"""Test session set-up: profiles go to a fresh cache directory, so runs are hermetic."""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("PARTITIONER_CACHE_DIR", tempfile.mkdtemp(prefix="partitioner-test-cache-"))
