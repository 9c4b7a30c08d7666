"""Layouts: where the one home of every entry is."""

from ..config import Tiered

__all__ = ["Tiered"]
