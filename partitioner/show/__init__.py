"""Display: the drawable Plan, its HTML page, static pictures and the cluster view."""

__all__: list[str] = []
