"""Exact LRU: the plain-Python model the Triton implementation must match step for step.

The device implementation (``ulakv.kernels.victims`` and ``apply``) keeps a ring of ``(slot, version)``
pairs in recency order with lazy deletion; this model keeps an ``OrderedDict`` of addresses. Both
follow the same rules:

* A round is one ``prepare``. Its hits are determined for the whole selection first; victims are the
  least recently used entries not selected in the round; then every selected address becomes most
  recent, in the order of its first position in the flattened selection.
* Free GPU slots are used before anything is evicted.
* A ``write`` gives new entries a GPU slot (evicting the least recent entry not used in the current
  round) or, if every GPU entry was used in the current round, a CPU home; written entries become
  most recent. Entries already on the CPU are written in place.

A model takes the trace ``ulakv.policies.protocol`` states (and refuses one off it with the same
ulakv error as the pool's kernels do through ``ulakv.testing.PoolPolicy``)::

    model = ExactLRUModel(gpu_slots=4)
    model.write([10, 11, 12], new={10, 11, 12})  # one batch admitted and written
    hits, misses, victims = model.prepare([10, 12, -1])
    model.release([10, 11, 12])  # the whole batch
    model.prepare([10])  # InvalidAddressError: never written, or released

``protocol=False`` makes it a bare cache that checks nothing: the replay and the invariant checks drive
it with the pool's own calls (batches that grow, new tokens planned inside a prepare).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from ..errors import CapacityError
from .protocol import TraceProtocol, distinct

__all__ = ["ExactLRUModel", "distinct"]


class ExactLRUModel:
    """Which addresses are GPU-resident, for one layer group, under exact LRU."""

    def __init__(self, gpu_slots: int, *, protocol: bool = True) -> None:
        self.gpu_slots = gpu_slots
        self.trace = TraceProtocol(type(self).__name__, gpu_slots) if protocol else None
        self.reset()

    def reset(self) -> None:
        """Nothing resident, as in a fresh model: what the pool does when its last request leaves
        (invariant 6)."""
        self.order: OrderedDict[int, int] = OrderedDict()  # address -> round of last use, LRU first
        self.round = 0

    def resident(self, address: int) -> bool:
        return address in self.order

    def residents(self) -> set[int]:
        return set(self.order)

    def _evict(self, count: int, protected: set[int]) -> list[int]:
        victims = []
        for a, used in self.order.items():
            if len(victims) == count:
                break
            if a not in protected and used != self.round:
                victims.append(a)
        for a in victims:
            del self.order[a]
        return victims

    def prepare(self, addresses: Iterable[int]) -> tuple[list[int], list[int], list[int]]:
        """One round. Returns (hits, misses, victims), each in selection / eviction order."""
        addresses = list(addresses)
        selected = self.trace.check_prepare(addresses) if self.trace else distinct(addresses)
        if len(selected) > self.gpu_slots:
            raise CapacityError(f"a selection of {len(selected)} addresses, over {self.gpu_slots} GPU slots")
        self.round += 1
        hits = [a for a in selected if a in self.order]
        misses = [a for a in selected if a not in self.order]
        free = self.gpu_slots - len(self.order)
        victims = self._evict(max(0, len(misses) - free), set(hits))
        for a in selected:
            self.order.pop(a, None)
            self.order[a] = self.round
        return hits, misses, victims

    def write(self, addresses: Iterable[int], new: set[int]) -> tuple[list[int], list[int]]:
        """A write in the current round. ``new`` are the written addresses without a home yet; they
        get a GPU slot while free or evictable ones last, else a CPU home. Written GPU entries become
        most recent, in order of first position. Returns (new entries homed on the GPU, victims)."""
        addresses = list(addresses)
        written = distinct(addresses)
        fresh = self.trace.check_write(addresses, new) if self.trace else [a for a in written if a in new]
        hits = [a for a in written if a in self.order]
        free = self.gpu_slots - len(self.order)
        victims = self._evict(max(0, len(fresh) - free), set(hits))
        on_gpu = fresh[: free + len(victims)]
        recent = set(hits) | set(on_gpu)
        for a in written:
            if a in recent:
                self.order.pop(a, None)
                self.order[a] = self.round
        if self.trace:
            self.trace.admit(fresh)
        return on_gpu, victims

    def release(self, addresses: Iterable[int]) -> None:
        addresses = list(addresses)
        if self.trace:
            self.trace.check_release(addresses)
            self.trace.release(addresses)
        for a in addresses:
            self.order.pop(a, None)
        if self.trace and not self.trace.batches:
            self.reset()
