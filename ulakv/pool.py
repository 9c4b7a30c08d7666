"""``Pool(config)``: the one object an engine talks to, built for the layout its config names.

One table says which kind of pool serves which layout; the kinds live in ``ulakv.layouts`` and never
import this module, so the layering runs one way (config -> layouts -> pool -> engine and tools).
Every kind has the calls and counters of the contract in ``docs/design.md``.
"""

from __future__ import annotations

import abc
import inspect

import torch

from .config import CPUOffloadBaseline, LayoutConfig, PoolConfig, Replicated, Striped, Tiered
from .errors import ConfigError, InvalidInputError
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
        device = torch.device(config.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            built = "with" if torch.backends.cuda.is_built() else "without"
            raise ConfigError(
                f"PoolConfig.device is {str(config.device)!r}, but this torch sees no CUDA device "
                f"(torch {torch.__version__}, built {built} CUDA): use device='cpu' (kernels under "
                "the Triton interpreter) or a CUDA build of torch"
            )
        return kind(config)


for _kind in set(POOL_KINDS.values()):
    Pool.register(_kind)


def _summary(member: object) -> str:
    """A member's docstring up to its first full stop (one line)."""
    doc = " ".join((inspect.getdoc(member) or "").split("\n\n")[0].split())
    head, dot, _ = doc.partition(". ")
    return head + ("." if dot else "")


def _members_help(kind: type) -> str:
    """Every public method and property of ``kind`` with its summary, for ``help(Pool)``."""
    lines = []
    for name, member in inspect.getmembers(kind):
        if name.startswith("_"):
            continue
        if isinstance(member, property):
            lines.append(f"{name} (property)\n    {_summary(member)}")
        elif callable(member):
            lines.append(f"{name}{inspect.signature(member)}\n    {_summary(member)}")
    return "\n".join(lines)


# ``Pool(config)`` builds a kind, so ``help(Pool)`` would show only the factory: list what every
# pool offers instead, as the tiered pool (the most complete kind) has it.
Pool.__doc__ = (
    (Pool.__doc__ or "")
    + "\n\nWhat a pool offers (``TieredPool``'s; ``docs/design.md``, section 5, says which calls each kind"
    + " has):\n\n"
    + _members_help(TieredPool)
)
