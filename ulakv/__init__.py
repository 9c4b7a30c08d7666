"""ulakv: one logical address and one physical home for every KV entry of a sparse-attention LLM."""

from .address_space import Sequence
from .config import PBLRU, CPUOffloadBaseline, EntrySpec, ExactLRU, PoolConfig, Replicated, Striped, Tiered
from .errors import (
    CapacityError,
    CollectiveError,
    ConfigError,
    InvalidAddressError,
    InvalidInputError,
    InvariantError,
    UlakvError,
)
from .kernels.compact import compact_slots
from .pool import MemoryReport, NewRows, Pool, Selection

__all__ = [
    "PBLRU",
    "CPUOffloadBaseline",
    "CapacityError",
    "CollectiveError",
    "ConfigError",
    "EntrySpec",
    "ExactLRU",
    "InvalidAddressError",
    "InvalidInputError",
    "InvariantError",
    "MemoryReport",
    "NewRows",
    "Pool",
    "PoolConfig",
    "Replicated",
    "Selection",
    "Sequence",
    "Striped",
    "Tiered",
    "UlakvError",
    "compact_slots",
]
