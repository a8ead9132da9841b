"""What a failed torchrun launch printed, cut to what explains it.

torchrun's summary names the rank that failed first ("Root Cause"); the others are usually stopped by
its failure and print only that a peer went away. A plain tail of the output keeps those echoes and
drops the cause, so a report keeps the root-cause ranks' own lines ("[rankN]: ...") first.
"""

from __future__ import annotations

import re


def root_ranks(text: str) -> list[int]:
    """The ranks torchrun's summaries name as the first observed failure, in order, once each."""
    ranks: list[int] = []
    for block in text.split("Root Cause")[1:]:
        found = re.search(r"rank\s*:\s*(\d+)", block)
        if found and int(found.group(1)) not in ranks:
            ranks.append(int(found.group(1)))
    return ranks


def failure(text: str, limit: int = 8000) -> str:
    """The root-cause ranks' own lines (their last `limit` // 2 characters), then the output's tail."""
    parts = []
    for rank in root_ranks(text):
        own = "\n".join(line for line in text.splitlines() if line.startswith(f"[rank{rank}]:"))
        if own:
            parts.append(f"--- rank {rank} (root cause) ---\n{own[-(limit // 2):]}")
    parts.append(f"--- the output's last {limit // 2} characters ---\n{text[-(limit // 2):]}")
    return "\n".join(parts)
