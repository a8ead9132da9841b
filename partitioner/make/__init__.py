"""A request into a Plan (trace, place; one rank plans under torchrun) and a Plan into a running pipeline."""

__all__: list[str] = []
