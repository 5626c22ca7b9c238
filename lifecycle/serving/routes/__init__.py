"""The worker's HTTP routes, one module per family of endpoints."""

__all__: list[str] = []
