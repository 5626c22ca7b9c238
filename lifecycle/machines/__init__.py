"""The state machines: their tables, the guarded engine, one module per machine
(component, pipeline, adapter, worker)."""

__all__: list[str] = []
