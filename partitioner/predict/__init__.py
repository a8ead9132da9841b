"""Prediction: a plan's numbers, programs and timelines (assemble, simulators, replica folding, timeline)."""

__all__: list[str] = []
