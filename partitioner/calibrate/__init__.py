"""Calibration from measured runs: measure steps, fit the cost model, keep auto choices that win when run."""

__all__: list[str] = []
