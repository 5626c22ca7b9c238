"""The pipeline spec where design §2 first placed it; ``lifecycle.spec`` holds it now."""

from lifecycle.spec import *  # noqa: F403  (every public name of the spec, kept importable here)
from lifecycle.spec import __all__ as __all__
