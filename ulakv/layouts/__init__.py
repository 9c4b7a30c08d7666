"""Layouts: where the one home of every entry is."""

from ..config import Striped, Tiered

__all__ = ["Striped", "Tiered"]
