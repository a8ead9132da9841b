"""The search over a list of devices: uneven replicas per stage, a tensor degree per stage, by dynamic programming."""

__all__: list[str] = []
