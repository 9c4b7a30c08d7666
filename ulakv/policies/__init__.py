"""Eviction policies: which GPU entries leave when room is needed."""

from ..config import ExactLRU
from .exact_lru import ExactLRUModel

__all__ = ["ExactLRU", "ExactLRUModel"]
