"""``Pool(config)``: the one object an engine talks to, built for the layout its config names.

One table says which kind of pool serves which layout; the kinds live in ``ulakv.layouts`` and never
import this module, so the layering runs one way (config -> layouts -> pool -> engine and tools).
Every kind has the calls and counters of the contract in ``docs/design.md``.
"""

from __future__ import annotations

import abc

from .config import CPUOffloadBaseline, LayoutConfig, PoolConfig, Replicated, Striped, Tiered
from .errors import InvalidInputError
from .frame import MemoryReport, NewRows, PoolFrame, Selection
from .layouts.offload import OffloadPool
from .layouts.striped import StripedPool
from .layouts.tiered import TieredPool

__all__ = ["POOL_KINDS", "MemoryReport", "NewRows", "Pool", "Selection"]

#: The pool class of each layout: a Replicated pool is one GPU-only tiered replica counted world
#: times; a Striped config builds this rank's part; the CPU-offload baseline is its own kind.
POOL_KINDS: dict[type[LayoutConfig], type[PoolFrame]] = {
    Tiered: TieredPool,
    Replicated: TieredPool,
    Striped: StripedPool,
    CPUOffloadBaseline: OffloadPool,
}


class Pool(metaclass=abc.ABCMeta):  # noqa: B024 - an interface for isinstance, no abstract calls
    """A KV-cache pool built from a :class:`PoolConfig`: ``Pool(config)`` returns the kind its
    layout names (``POOL_KINDS``), and every kind is a ``Pool`` for ``isinstance``."""

    def __init_subclass__(cls, **kwargs) -> None:
        raise TypeError(
            "Pool is the factory of the pool kinds, not a base class: extend a kind in ulakv.layouts "
            "and add it to POOL_KINDS"
        )

    def __new__(cls, config: PoolConfig) -> TieredPool | StripedPool | OffloadPool:
        if not isinstance(config, PoolConfig):
            raise InvalidInputError(f"Pool needs a PoolConfig, got {type(config).__name__}")
        kind = POOL_KINDS.get(type(config.layout))
        if kind is None:
            raise InvalidInputError(f"no pool kind serves a {type(config.layout).__name__} layout")
        return kind(config)


for _kind in set(POOL_KINDS.values()):
    Pool.register(_kind)
