"""What a component is, how it is loaded and how its weights move."""

from components.layout import ParallelLayout
from components.residency import OffloadTarget, OffloadVerify, ResidencyMode

__all__ = ["OffloadTarget", "OffloadVerify", "ParallelLayout", "ResidencyMode"]
