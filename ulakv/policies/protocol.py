"""The trace a policy takes, checked alike for the plain models and the pool's kernels.

A policy object (``ExactLRUModel``, ``PBLRUModel``, ``ulakv.testing.PoolPolicy``) speaks three calls,
and this is what each may name:

* ``write(addresses, new)`` admits the addresses in ``new`` (all of them written by this call, none
  admitted before) as one batch and writes them together with earlier written ones;
* ``prepare(addresses)`` selects addresses written before (``-1`` is padding), at most ``gpu_slots``
  distinct ones;
* ``release(addresses)`` names exactly one admitted batch: the ``new`` addresses of one write.

``TraceProtocol`` checks a call before the policy changes anything and raises the ulakv error that
says what to do; the caller records the call after it has taken effect. Every policy builds its own,
so a trace off the protocol is refused by all of them with the same error and the same words.
"""

from __future__ import annotations

from collections.abc import Iterable
from numbers import Integral

from ..errors import CapacityError, InvalidAddressError, InvalidInputError


def distinct(addresses: Iterable[int]) -> list[int]:
    """The addresses of a selection or write, padding dropped, each once, in first-seen order."""
    return list(dict.fromkeys(a for a in addresses if a != -1))


class TraceProtocol:
    """The admitted batches of one policy and the checks of its calls (see the module docstring).

    ``owner`` names the policy in error messages (``"ExactLRUModel"``, ``"PoolPolicy"``)."""

    def __init__(self, owner: str, gpu_slots: int) -> None:
        self.owner = owner
        self.gpu_slots = gpu_slots
        self.batch_of: dict[int, int] = {}  # written address -> first address of its batch
        self.batches: dict[int, frozenset[int]] = {}  # first address -> the batch

    def live(self, address: int) -> bool:
        return address in self.batch_of

    def check_write(self, addresses: list[int], new: set[int]) -> list[int]:
        """The batch this write admits (``new`` in first-written order), or the error that refuses it."""
        written = distinct(addresses)
        _check_addresses(f"{self.owner}.write", [*written, *new])
        if stray := sorted(set(new) - set(written)):
            raise InvalidInputError(
                f"{self.owner}.write: new names addresses the write does not: {stray[:5]}; "
                "new is the subset of addresses admitted by this write"
            )
        if again := [a for a in written if a in new and self.live(a)]:
            raise InvalidAddressError(
                f"{self.owner}.write: new names addresses admitted before: {again[:5]}; "
                "an address is new once, in the write that admits it"
            )
        if unknown := [a for a in written if a not in new and not self.live(a)]:
            raise InvalidAddressError(
                f"{self.owner}.write: addresses neither written before nor in new: {unknown[:5]}; "
                "write(addresses, new=...) admits them"
            )
        return [a for a in written if a in new]

    def admit(self, batch: list[int]) -> None:
        """Records a write's batch, once the write has taken effect."""
        if batch:
            self.batches[batch[0]] = frozenset(batch)
            self.batch_of.update(dict.fromkeys(batch, batch[0]))

    def check_prepare(self, addresses: list[int]) -> list[int]:
        """The distinct selected addresses, or the error that refuses the selection."""
        selected = distinct(addresses)
        _check_addresses(f"{self.owner}.prepare", selected)
        if unknown := [a for a in selected if not self.live(a)]:
            raise InvalidAddressError(
                f"{self.owner}.prepare: addresses never written (or released): {unknown[:5]}; "
                "write(addresses, new=...) admits them first"
            )
        if len(selected) > self.gpu_slots:
            raise CapacityError(
                f"{self.owner}.prepare: {len(selected)} distinct addresses selected, more than the "
                f"{self.gpu_slots} GPU slots can hold at once"
            )
        return selected

    def check_release(self, addresses: list[int]) -> None:
        first = self.batch_of.get(addresses[0]) if addresses else None
        batch = self.batches.get(first, frozenset())
        if not batch or set(addresses) != batch or len(addresses) != len(batch):
            raise InvalidInputError(
                f"{self.owner}.release: {list(addresses)[:5]} is not one admitted batch: release "
                "names exactly the new addresses of one write"
            )

    def release(self, addresses: list[int]) -> None:
        """Forgets a batch, once ``check_release`` has passed and the release has taken effect."""
        for a in self.batches.pop(self.batch_of[addresses[0]]):
            del self.batch_of[a]


def _check_addresses(what: str, addresses: Iterable[int]) -> None:
    if bad := [a for a in addresses if not isinstance(a, Integral) or isinstance(a, bool) or a < 0]:
        raise InvalidAddressError(f"{what}: addresses are ints >= 0 (-1 pads a selection): {bad[:5]}")
