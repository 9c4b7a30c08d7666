"""Plain model of one group's CPU tier as the kernels keep it: homes, the free list, and the copies
that make an eviction clean.

KV rows never change once written, so an entry swapped in from a CPU row leaves that row holding
its bytes. The row is free (it counts for admission like any other), but while nobody has taken it
the entry can go back there with no copy when it is evicted: a *clean* eviction. The free list is a
deque in a ring (``ulakv.layouts.tiered_state``): pops take the top, a release puts its rows on top,
a swap-in leaves its row at the bottom, so plain free rows are handed out before copies and the
oldest copies go first. A victim is clean when its copy is intact and no other miss of the same call
popped that row; its own popped row then takes the copy's place in the list.

The policies' models say which addresses move; this model says which rows they move to and what
it costs, row for row what ``ulakv.kernels.apply`` does (``tests/test_traces.py`` holds a replay on
the models equal to one on a real pool).
"""

from __future__ import annotations

from collections.abc import Iterable


class CPUTierModel:
    """One group's CPU rows: ``rows`` physical rows (staging included), all free at first, row 0 on
    top. Addresses name entries; the model follows only those homed on the CPU and the copies of
    those on the GPU."""

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self.cap = max(rows, 1)
        self.ring = [rows - 1 - i for i in range(rows)] + [0] * (self.cap - rows)
        self.pos = {row: i for i, row in enumerate(self.ring[:rows])}
        self.bottom, self.count = 0, rows
        self.home: dict[int, int] = {}  # address on the CPU -> its row
        self.copy: dict[int, int] = {}  # address on the GPU -> free row still holding its bytes
        self.copy_of: dict[int, int] = {}  # free row -> the address it holds (valid if both agree)
        self.clean_evictions = 0

    def on_cpu(self, address: int) -> bool:
        return address in self.home

    def free_rows(self) -> list[int]:
        """The free list, bottom first."""
        return [self.ring[(self.bottom + i) % self.cap] for i in range(self.count)]

    def _intact(self, address: int) -> int | None:
        row = self.copy.get(address)
        return row if row is not None and self.copy_of.get(row) == address else None

    def place(self, victims: list[int], to_cpu: list[int]) -> int:
        """One call's moves out of the GPU: ``victims`` (evicted, in eviction order), then
        ``to_cpu`` (a write's new entries that found no GPU slot) each pop a row off the top.
        Returns the victims whose bytes were copied (the others were clean)."""
        top = self.bottom + self.count - 1
        pops = len(victims) + len(to_cpu)
        if pops > self.count:
            raise ValueError(f"{pops} CPU rows needed, {self.count} free")
        popped = [self.ring[(top - d) % self.cap] for d in range(pops)]
        # Every decision reads the state as the call began, as apply's programs do.
        clean = []
        for a, row in zip(victims, popped, strict=False):
            copy = self._intact(a)
            deep = copy is not None and (top - self.pos[copy]) % self.cap >= pops
            clean.append(copy if deep or copy == row else None)
        copied, returned = 0, set()
        for i, row in enumerate(popped):
            copy = clean[i] if i < len(victims) else None
            dest = row if copy is None else copy
            a = victims[i] if i < len(victims) else to_cpu[i - len(victims)]
            self.copy_of.pop(dest, None)
            self.copy.pop(a, None)
            self.home[a] = dest
            if i >= len(victims):
                continue
            if copy is None:
                copied += 1
                continue
            self.clean_evictions += 1
            if copy != row:  # the unused popped row takes the copy's place in the list
                hole = self.pos.pop(copy)
                self.ring[hole] = row
                self.pos[row] = hole
                returned.add(row)
        for row in popped:
            if row not in returned:
                del self.pos[row]
        self.count -= pops
        return copied

    def swap_in(self, addresses: list[int]) -> None:
        """Misses that came from the CPU, in miss order, now on the GPU: each row, still holding its
        entry's bytes, goes to the bottom of the free list (the first miss's lowest)."""
        rows = [self.home.pop(a) for a in addresses]
        self.bottom = (self.bottom - len(rows)) % self.cap
        for k, (a, row) in enumerate(zip(addresses, rows, strict=True)):
            at = (self.bottom + k) % self.cap
            self.ring[at] = row
            self.pos[row] = at
            self.copy_of[row] = a
            self.copy[a] = row
        self.count += len(rows)

    def rewrite(self, addresses: Iterable[int]) -> None:
        """Entries on the GPU written again: a copy of them no longer matches."""
        for a in addresses:
            self.copy.pop(a, None)

    def release(self, addresses: Iterable[int]) -> None:
        """Entries leaving the pool, in order: CPU rows go on top of the free list."""
        for a in addresses:
            self.copy.pop(a, None)
            row = self.home.pop(a, None)
            if row is not None:
                at = (self.bottom + self.count) % self.cap
                self.ring[at] = row
                self.pos[row] = at
                self.count += 1
