"""PB-LRU, parallel bucketed LRU, as a plain model: what the device bitmaps
(``ulakv.kernels.buckets``) must decide, address by address.

Every slot used in a round joins that round's bucket; a ring of ``num_buckets`` recent buckets plus
one cold bucket; victims come from free slots, then cold, then the oldest recent bucket, never from
the current round's bucket.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..errors import CapacityError
from .protocol import TraceProtocol, distinct


class PBLRUModel:
    """Plain model of PB-LRU for one layer group: which addresses are GPU-resident, in which bucket.

    Same interface and trace protocol as ``ExactLRUModel`` (``protocol=False``: a bare cache). Ties
    inside a bucket go to the lower GPU slot, so the model tracks slots: free slots are handed out in
    the order the pool's free stack does.
    """

    def __init__(self, gpu_slots: int, num_buckets: int, *, protocol: bool = True) -> None:
        self.gpu_slots, self.R = gpu_slots, num_buckets
        self.trace = TraceProtocol(type(self).__name__, gpu_slots) if protocol else None
        self.reset()

    def reset(self) -> None:
        """Every slot free, as in a fresh model: what the pool does when its last request leaves
        (invariant 6). The order of the free stack decides ties, so it matters."""
        self.round = 0
        self.slot_of: dict[int, int] = {}  # address -> slot
        self.stamp: dict[int, int] = {}  # slot -> round of last use
        self.cold: set[int] = set()  # slots merged into cold
        self.free: list[int] = list(range(self.gpu_slots - 1, -1, -1))  # stack, top = end

    @property
    def order(self) -> dict[int, int]:
        """Resident addresses (for the same checks as ExactLRUModel.order)."""
        return dict(self.slot_of)

    def resident(self, address: int) -> bool:
        return address in self.slot_of

    def residents(self) -> set[int]:
        return set(self.slot_of)

    def bucket_age(self, slot: int) -> int:
        """0 = current round ... R-1 = oldest ring bucket, R = cold."""
        if slot in self.cold:
            return self.R
        return self.round - self.stamp[slot]

    def _use(self, slot: int) -> None:
        self.cold.discard(slot)
        self.stamp[slot] = self.round

    def _victims(self, count: int) -> list[int]:
        """Slots to evict: cold, then ring buckets oldest first, lowest slot first; never current."""
        occupied = set(self.slot_of.values())
        ranked = sorted((-self.bucket_age(s), s) for s in occupied if self.bucket_age(s) > 0)
        return [s for _, s in ranked[:count]]

    def _place(self, fresh: list[int], protected: set[int]) -> tuple[list[int], list[int]]:
        n_free = min(len(fresh), len(self.free))
        slots = [self.free.pop() for _ in range(n_free)]
        owners = {s: a for a, s in self.slot_of.items()}
        taken = self._victims(len(fresh) - n_free)
        victims = [owners[s] for s in taken]
        for a in victims:
            del self.slot_of[a]
        slots += taken
        placed = fresh[: len(slots)]
        for a, s in zip(placed, slots, strict=False):
            self.slot_of[a] = s
            self._use(s)
        return placed, victims

    def prepare(self, addresses: Iterable[int]) -> tuple[list[int], list[int], list[int]]:
        addresses = list(addresses)
        selected = self.trace.check_prepare(addresses) if self.trace else distinct(addresses)
        if len(selected) > self.gpu_slots:
            raise CapacityError(f"a selection of {len(selected)} addresses, over {self.gpu_slots} GPU slots")
        self.round += 1
        hits = [a for a in selected if a in self.slot_of]
        misses = [a for a in selected if a not in self.slot_of]
        for a in hits:
            self._use(self.slot_of[a])
        _, victims = self._place(misses, set(hits))
        self._end_round()
        return hits, misses, victims

    def _end_round(self) -> None:
        retiring = self.round - self.R + 1
        occupied = set(self.slot_of.values())
        self.cold |= {s for s, st in self.stamp.items() if st == retiring and s in occupied}

    def write(self, addresses: Iterable[int], new: set[int]) -> tuple[list[int], list[int]]:
        addresses = list(addresses)
        written = distinct(addresses)
        fresh = self.trace.check_write(addresses, new) if self.trace else [a for a in written if a in new]
        for a in written:
            if a in self.slot_of:
                self._use(self.slot_of[a])
        placed = self._place(fresh, set())
        if self.trace:
            self.trace.admit(fresh)
        return placed

    def release(self, addresses: Iterable[int]) -> None:
        addresses = list(addresses)
        if self.trace:
            self.trace.check_release(addresses)
            self.trace.release(addresses)
        for a in addresses:
            s = self.slot_of.pop(a, None)
            if s is not None:
                self.cold.discard(s)
                self.free.append(s)
        if self.trace and not self.trace.batches:
            self.reset()
