"""Tests of the attention package: kernels, selection, scope and layers."""

from __future__ import annotations
