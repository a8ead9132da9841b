"""Where measurements are kept on disk, and the key that says two measurements are the same."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["cache_dir", "cache_key", "read_json", "write_json"]

ENV_VAR = "PARTITIONER_CACHE_DIR"


def cache_dir(override: str | os.PathLike[str] | None = None) -> Path:
    """The cache folder: `override`, else $PARTITIONER_CACHE_DIR, else ~/.cache/partitioner."""
    if override is not None:
        return Path(override)
    env = os.environ.get(ENV_VAR)
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "partitioner"


def cache_key(*parts: Any) -> str:
    """A short stable hash of JSON-able parts (dict keys sorted)."""
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def read_json(path: Path) -> Any | None:
    """The file's JSON, or None when it is missing or unreadable (a damaged entry is a miss)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def write_json(path: Path, data: Any) -> None:
    """Write atomically (temp file + rename) so concurrent readers never see half a file.

    A cache that cannot be written (read-only home, full disk) is skipped silently: the
    measurement is still returned, only the next run is not instant.
    """
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        pass
