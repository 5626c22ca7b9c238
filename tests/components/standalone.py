"""The kinds a test can build from their options alone.

A folder kind (``components.folders.loader.FolderLoader``) needs a pipeline folder to
be anything at all; ``test_folder_kinds.py`` holds those to the same declarations on
real folders.
"""

from __future__ import annotations

from components import registry
from components.folders.loader import FolderLoader

STANDALONE_KINDS = tuple(
    kind for kind in registry.names() if not issubclass(registry.get(kind), FolderLoader)
)
