"""The command line: `python -m partitioner plan|profile|simulate|calibrate MODULE:FACTORY ...`."""

__all__: list[str] = []
