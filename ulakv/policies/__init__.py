"""Eviction policies: which GPU entries leave when room is needed.

Both run inside the pool's fused kernels; each has a plain model the kernels must match.
"""

from ..config import PBLRU, ExactLRU
from .exact_lru import ExactLRUModel
from .pblru import PBLRUModel

__all__ = ["PBLRU", "ExactLRU", "ExactLRUModel", "PBLRUModel"]
