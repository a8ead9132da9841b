"""What a search says when nothing fits: InfeasibleError, with the memory each device would need."""

from __future__ import annotations

import numpy as np

from partitioner.errors import PartitionError

__all__ = ["InfeasibleError", "size_text"]


class InfeasibleError(PartitionError):
    """No split of the devices keeps every stage within its devices' memory."""

    def __init__(self, message: str, needed_bytes: list[int], note: str = "") -> None:
        super().__init__(f"{message} {note}" if note else message)
        self.needed_bytes = needed_bytes  # per device, under the split that needs the least
        self.note = note  # what else would fit (another training precision), or ""


def size_text(x: float) -> str:
    """Bytes as the errors print them: "512 B", "1.50 GiB", "no limit" (inf)."""
    if not np.isfinite(x):
        return "no limit"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if x < 1024 or unit == "GiB":
            return f"{x:.0f} B" if unit == "B" else f"{x:.2f} {unit}"
        x /= 1024
    return ""
