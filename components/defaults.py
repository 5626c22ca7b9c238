"""What a request gets when it does not say, readable without torch.

``lifecycle run --help`` prints these; it imports neither torch nor the house.
"""

from __future__ import annotations

__all__ = ["DEFAULT_STEPS"]

DEFAULT_STEPS = 4
"""The denoising steps of a request that names none, where no pipeline class sets them (a
folder's recipe does: ``Recipe.default_steps``)."""
