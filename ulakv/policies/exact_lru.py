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
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


def distinct(addresses: Iterable[int]) -> list[int]:
    """The addresses of a selection or write, padding dropped, each once, in first-seen order."""
    return list(dict.fromkeys(a for a in addresses if a != -1))


class ExactLRUModel:
    """Which addresses are GPU-resident, for one layer group, under exact LRU."""

    def __init__(self, gpu_slots: int) -> None:
        self.gpu_slots = gpu_slots
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
        self.round += 1
        selected = distinct(addresses)
        if len(selected) > self.gpu_slots:
            raise ValueError("selection larger than the GPU tier")
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
        written = distinct(addresses)
        fresh = [a for a in written if a in new]
        hits = [a for a in written if a in self.order]
        free = self.gpu_slots - len(self.order)
        victims = self._evict(max(0, len(fresh) - free), set(hits))
        on_gpu = fresh[: free + len(victims)]
        recent = set(hits) | set(on_gpu)
        for a in written:
            if a in recent:
                self.order.pop(a, None)
                self.order[a] = self.round
        return on_gpu, victims

    def release(self, addresses: Iterable[int]) -> None:
        for a in addresses:
            self.order.pop(a, None)
