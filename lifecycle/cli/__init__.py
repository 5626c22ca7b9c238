"""The ``lifecycle`` command: nothing else in the project imports this room.

``lifecycle.cli.entry.main`` is the process's entry point, imported before torch;
``lifecycle.cli.main.main`` is the command, which in-process callers run.
"""

__all__: list[str] = []
