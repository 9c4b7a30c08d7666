"""The engine side: an adapter that binds a pool to a model's layer groups, and a reference decoder."""

from .adapter import GroupStep, SparseKV

__all__ = ["GroupStep", "SparseKV"]
