"""What both placement searches stand on: the problem, a stage's price, the space, how candidates compare."""

__all__: list[str] = []
