"""The exceptions ulakv raises. Every one leaves the pool exactly as it was before the call."""

from __future__ import annotations


class UlakvError(Exception):
    """Base class of every error raised by ulakv."""


class ConfigError(UlakvError, ValueError):
    """A configuration object is inconsistent; raised at construction, never later."""


class CapacityError(UlakvError):
    """The pool cannot hold what was asked (admission beyond capacity, a selection larger than the
    GPU tier). Nothing was admitted or moved."""


class InvalidAddressError(UlakvError, IndexError):
    """A logical address is out of range, released, or repeated where it must be unique."""


class InvalidInputError(UlakvError, ValueError):
    """A tensor argument has the wrong dtype, shape, device or layout."""


class InvariantError(UlakvError, AssertionError):
    """A pool invariant (``docs/design.md``, section 4) does not hold; only raised by debug checks."""


class CollectiveError(UlakvError, RuntimeError):
    """A collective of a striped pool did not complete: another rank died, stalled past the
    layout's ``timeout_s``, or called something else. The pool's state on this rank is no longer
    in step with the others; rebuild the group."""
