"""Progress of a cluster search: a callback the caller installs for a block, that every search inside reports to."""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable, Iterator

__all__ = ["Progress", "report", "reporting"]

Progress = Callable[[str, int, int], None]  # (what, done, total)
_PROGRESS: contextvars.ContextVar[Progress | None] = contextvars.ContextVar("cluster_search_progress", default=None)


@contextlib.contextmanager
def reporting(callback: Progress) -> Iterator[None]:
    """Within the block, every cluster search reports (what, done, total) to `callback` (a progress bar)."""
    token = _PROGRESS.set(callback)
    try:
        yield
    finally:
        _PROGRESS.reset(token)


def report(what: str, done: int, total: int) -> None:
    """Tell the installed callback, if any, that `done` of `total` steps of `what` are done."""
    if (callback := _PROGRESS.get()) is not None:
        callback(what, done, total)
