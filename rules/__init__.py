"""Pure rules that both runtime/ and cost_model/ read (schedules, segment keys, timing); imports neither."""

__all__: list[str] = []
