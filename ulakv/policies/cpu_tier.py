"""Plain model of one group's CPU tier as the kernels keep it: homes, the free list, and the copies
that make an eviction clean.

KV rows never change once written, so an entry swapped in from a CPU row leaves that row holding
its bytes. The row is free (it counts for admission like any other), but while nobody has taken it
the entry can go back there with no copy when it is evicted: a *clean* eviction. The free list is a
deque in a ring (``ulakv.layouts.tiered_state``): pops take the top, a release puts its rows on top,
a swap-in leaves its row at the bottom, so plain free rows are handed out before copies and the
oldest copies go first.

A call decides which victims are clean from the state as it began: those whose copy is intact and
lies at least as deep as the call can pop (a row per miss past the free GPU slots), so no pop of the
call takes it. In a prepare whose misses all come from the CPU, a clean victim pops nothing and the
row its own miss leaves takes its copy's place in the list: the rows the other victims pop come off
the top, and no copy is lost to a victim that needed no row. Otherwise (a write; a prepare of an entry
never written) every victim pops a row. A victim that popped a row goes back to its copy all the
same when no pop of the call took it (deeper than the rows the call actually pops, or the very row
it popped), and the row it popped takes the copy's place.

A write also gives copies (``Tiered.write_copies``): a new entry that takes a clean victim's slot
keeps its copy in the row that victim popped (which takes the victim's copy's place in the list);
each other new entry it puts on the GPU, in miss order, takes one while *plain* rows (the run on top
of the list that holds no copy: ``plain``) lie below the call's pops, and that row goes to the bottom
like a swap-in's; an entry on the GPU written again
writes through to its copy when the copy is intact and no pop of the call takes it, and loses it
otherwise.

A prepare with new rows (``prepare_new``) gives its new tokens copies the same way, and fills for
its other misses when they all come from the CPU; their rows join the bottom above those copies.

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

    def __init__(self, rows: int, write_copies: bool = True) -> None:
        self.rows = rows
        self.write_copies = write_copies  # ``Tiered.write_copies``
        self.cap = max(rows, 1)
        self.ring = [rows - 1 - i for i in range(rows)] + [0] * (self.cap - rows)
        self.pos = {row: i for i, row in enumerate(self.ring[:rows])}
        self.bottom, self.count = 0, rows
        self.home: dict[int, int] = {}  # address on the CPU -> its row
        self.copy: dict[int, int] = {}  # address on the GPU -> free row still holding its bytes
        self.copy_of: dict[int, int] = {}  # free row -> the address it holds (valid if both agree)
        self.plain = rows  # rows on top of the free list known to hold no copy (``G_CPU_PLAIN``)
        self.clean_evictions = 0

    def on_cpu(self, address: int) -> bool:
        return address in self.home

    def free_rows(self) -> list[int]:
        """The free list, bottom first."""
        return [self.ring[(self.bottom + i) % self.cap] for i in range(self.count)]

    def _intact(self, address: int) -> int | None:
        row = self.copy.get(address)
        return row if row is not None and self.copy_of.get(row) == address else None

    def _clean_rows(self, victims: list[int], pops: int) -> list[int | None]:
        """Each victim's intact copy if it lies below every row the call may pop (``pops``, the
        state as the call began, as the classify programs decide it), else None."""
        top = self.bottom + self.count - 1
        rows: list[int | None] = []
        for a in victims:
            copy = self._intact(a)
            deep = copy is not None and (top - self.pos[copy]) % self.cap >= pops
            rows.append(copy if deep else None)
        return rows

    def copy_of_entry(self, address: int) -> int | None:
        """The free row holding ``address``'s intact copy, if any."""
        return self._intact(address)

    def _pop(self, n: int) -> list[int]:
        """The top ``n`` rows, off the list (a popped row keeps its copy until it becomes a home)."""
        if n > self.count:
            raise ValueError(f"{n} CPU rows needed, {self.count} free")
        top = self.bottom + self.count - 1
        rows = [self.ring[(top - d) % self.cap] for d in range(n)]
        for row in rows:
            del self.pos[row]
        self.count -= n
        self.plain = max(self.plain - n, 0)
        return rows

    def _push(self, rows: list[int]) -> None:
        """``rows`` at the bottom of the list, the first lowest."""
        self.bottom = (self.bottom - len(rows)) % self.cap
        for k, row in enumerate(rows):
            at = (self.bottom + k) % self.cap
            self.ring[at] = row
            self.pos[row] = at
        self.count += len(rows)

    def _home(self, address: int, row: int) -> None:
        """``address`` now lives in ``row``: neither holds a copy any more."""
        self.copy.pop(address, None)
        self.copy_of.pop(row, None)
        self.home[address] = row

    def _fill(self, leaving: int, row: int) -> None:
        """``row`` takes the place in the free list of ``leaving``, a row that becomes a home."""
        at = self.pos.pop(leaving)
        self.ring[at] = row
        self.pos[row] = at

    def place(self, victims: list[int], to_cpu: list[int]) -> int:
        """A write's moves out of the GPU (or a prepare's that brings in an entry never written):
        ``victims`` (evicted, in eviction order), then ``to_cpu`` (new entries that found no GPU
        slot) each pop a row off the top; a clean victim goes back to its copy, and the row it
        popped, unused, takes the copy's place in the list. Returns the victims whose bytes were
        copied."""
        return self._place(victims, to_cpu)[0]

    def _place(self, victims: list[int], to_cpu: list[int]) -> tuple[int, list[int]]:
        """``place``, also returning the rows popped, in pop order (the victims' first)."""
        pops = len(victims) + len(to_cpu)
        back, mine = self._clean_rows(victims, pops), [self._intact(a) for a in victims]
        popped = self._pop(pops)
        copied = 0
        for a, row, copy, own in zip(victims, popped, back, mine, strict=False):
            copied += self._evict(a, row, copy if copy is not None else (own if own == row else None))
        for a, row in zip(to_cpu, popped[len(victims) :], strict=True):
            self._home(a, row)
        return copied, popped

    def write(
        self, victims: list[int], to_cpu: list[int], placed: list[int], rewritten: list[int]
    ) -> tuple[int, int, int]:
        """A write's moves, as ``place`` (``victims`` out, ``to_cpu`` homed on the CPU), and its
        copies (``placed``: new entries given a GPU slot, in miss order, the free slots' first,
        then one a victim in eviction order). A new entry that takes a clean victim's slot keeps
        its copy in the row that victim popped, which took the victim's copy's place in the list;
        the others take one each while plain rows lie below the call's pops, in those rows (now at
        the bottom of the list, the first lowest). ``rewritten`` (entries on the GPU written again)
        write through to a copy no pop of the call takes, and lose any other. Returns the victims
        whose bytes were copied, the copies made and the rows written through."""
        pops = len(victims) + len(to_cpu)
        deep = self._clean_rows(rewritten, pops) if self.write_copies else [None] * len(rewritten)
        through = [a for a, row in zip(rewritten, deep, strict=True) if row is not None]
        kept = set(through)
        for a in rewritten:
            if a not in kept:
                self.copy.pop(a, None)
        k_free = len(placed) - len(victims)
        clean = self._clean_rows(victims, pops) if self.write_copies else [None] * len(victims)
        paired = {k_free + i for i, row in enumerate(clean) if row is not None}
        others = [a for j, a in enumerate(placed) if j not in paired]
        made = min(len(others), max(self.plain - pops, 0)) if self.write_copies else 0
        copied, popped = self._place(victims, to_cpu)
        for j in sorted(paired):  # the row the clean victim popped, now in its copy's place
            self._copy(placed[j], popped[j - k_free])
        rows = self._pop(made)
        self._push(rows)
        for a, row in zip(others, rows, strict=False):
            self._copy(a, row)
        return copied, made + len(paired), len(through)

    def _copy(self, address: int, row: int) -> None:
        """``row``, a free row, now holds ``address``'s copy."""
        self.copy_of[row] = address
        self.copy[address] = row

    def _evict(self, address: int, popped: int | None, copy: int | None) -> int:
        """``address`` leaves the GPU: back to its ``copy`` if given (the row it ``popped``, if any
        and another, takes the copy's place in the list), else to the row it popped. Returns 1 if
        its bytes were copied."""
        if copy is None:
            self._home(address, popped)
            return 1
        if popped is not None and popped != copy:
            self._fill(copy, popped)
        self._home(address, copy)
        self.clean_evictions += 1
        return 0

    def prepare(self, victims: list[int], misses: list[int]) -> int:
        """One prepare's moves: ``misses`` (in miss order) come in, the last ``len(victims)`` of
        them into the victims' slots. A victim counted clean pops nothing: it goes back to its copy,
        and the row its miss leaves takes the copy's place in the list. The others pop rows off the
        top; one whose copy no pop of the call took (deeper than the call's pops, or the row it
        popped itself) goes back there all the same, its popped row in the copy's place. The other
        misses' rows go to the bottom, the first lowest. Every row a miss leaves still holds its
        entry's bytes: a copy. Returns the victims whose bytes were copied."""
        if any(a not in self.home for a in misses):  # an entry never written has no row to leave
            copied = self.place(victims, [])
            self.swap_in([a for a in misses if a in self.home])
            return copied
        clean = self._clean_rows(victims, len(victims))
        pops = sum(1 for copy in clean if copy is None)
        back, mine = self._clean_rows(victims, pops), [self._intact(a) for a in victims]
        popped = iter(self._pop(pops))
        rows = [self.home.pop(a) for a in misses]
        k_free = len(misses) - len(victims)
        pushed, copied = [], 0
        for j, row in enumerate(rows):
            i = j - k_free
            if i >= 0 and clean[i] is not None:
                self._fill(clean[i], row)
                copied += self._evict(victims[i], None, clean[i])
                continue
            pushed.append(row)
            if i >= 0:
                top = next(popped)
                own = mine[i] if mine[i] == top else None
                copied += self._evict(victims[i], top, back[i] if back[i] is not None else own)
        self._push(pushed)
        for a, row in zip(misses, rows, strict=True):
            self.copy_of[row] = a
            self.copy[a] = row
        return copied

    def prepare_new(self, victims: list[int], misses: list[int], new: int) -> tuple[int, int]:
        """One prepare with new rows (``NewRows``): ``misses`` in miss order, the ``new`` new tokens
        (never written, no row to leave) first, the last ``len(victims)`` of them into the victims'
        slots. The new tokens are a write's new entries: each victim of theirs pops a row, and they
        get copies, one in a clean victim's slot in the row that victim popped, the others in plain
        rows below the pops while they last (at the bottom of the list). The selection's misses
        are ``prepare``'s: when all come from the CPU the call fills (their clean victims pop
        nothing, each miss's row takes its victim's copy's place); their other rows join the
        bottom above the new tokens' copies. Returns the victims whose bytes were copied, and the
        copies made."""
        k_free = len(misses) - len(victims)
        fill = all(a in self.home for a in misses[new:])
        clean = self._clean_rows(victims, len(victims))
        fills = [fill and k_free + i >= new and c is not None for i, c in enumerate(clean)]
        pops = len(victims) - sum(fills)
        back, mine = self._clean_rows(victims, pops), [self._intact(a) for a in victims]
        paired = set()
        if self.write_copies:
            paired = {k_free + i for i, c in enumerate(clean) if c is not None and k_free + i < new}
        others = [a for j, a in enumerate(misses[:new]) if j not in paired]
        made = min(len(others), max(self.plain - pops, 0)) if self.write_copies else 0
        popped = iter(self._pop(pops))
        copied, pushed, rows_of = 0, [], {}
        for j, a in enumerate(misses):
            i = j - k_free
            row = self.home.pop(a) if j >= new and a in self.home else None  # a swap-in's row
            if i >= 0 and fills[i]:
                self._fill(clean[i], row)
                copied += self._evict(victims[i], None, clean[i])
            else:
                if row is not None:
                    pushed.append(row)
                if i >= 0:
                    top = rows_of[j] = next(popped)
                    own = mine[i] if mine[i] == top else None
                    copied += self._evict(victims[i], top, back[i] if back[i] is not None else own)
            if row is not None:
                self._copy(a, row)
        for j in sorted(paired):  # the row the clean victim popped, now in its copy's place
            self._copy(misses[j], rows_of[j])
        rows = self._pop(made)
        self._push(pushed)
        self._push(rows)  # below the swapped-in rows
        for a, row in zip(others, rows, strict=False):
            self._copy(a, row)
        return copied, made + len(paired)

    def swap_in(self, addresses: list[int]) -> None:
        """Misses that came from the CPU, in miss order, now on the GPU: each row, still holding its
        entry's bytes, goes to the bottom of the free list (the first miss's lowest)."""
        rows = [self.home.pop(a) for a in addresses]
        self._push(rows)
        for a, row in zip(addresses, rows, strict=True):
            self.copy_of[row] = a
            self.copy[a] = row

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
                self.plain += 1
