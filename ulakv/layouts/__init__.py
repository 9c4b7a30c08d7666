"""Layouts: where the one home of every entry is (and, kept as baselines, where copies are)."""

from ..config import CPUOffloadBaseline, Replicated, Striped, Tiered

__all__ = ["CPUOffloadBaseline", "Replicated", "Striped", "Tiered"]
