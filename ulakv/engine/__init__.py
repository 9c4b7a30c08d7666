"""The engine side: an adapter that binds a pool to a model's layer groups, and a reference decoder."""

from .adapter import GroupStep, SparseKV
from .prefill import PrefillChunk, chunked_prepare

__all__ = ["GroupStep", "PrefillChunk", "SparseKV", "chunked_prepare"]
