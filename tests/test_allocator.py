"""The logical allocator keeps free addresses as runs: lowest first, whole or nothing, and it
refuses to take back what it did not hand out."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ulakv import CapacityError, InvalidAddressError
from ulakv.address_space import LogicalAllocator, count, runs_of


@settings(max_examples=150, deadline=None)
@given(capacity=st.integers(0, 40), ops=st.lists(st.tuples(st.booleans(), st.integers(0, 12)), max_size=30))
def test_runs_match_a_set_of_free_addresses(capacity, ops) -> None:
    alloc, free, held = LogicalAllocator(capacity), set(range(capacity)), []
    for take, n in ops:
        if take:
            if n > len(free):
                with pytest.raises(CapacityError):
                    alloc.take(n)
                continue
            runs = alloc.take(n)
            got = [a for r in runs for a in r]
            assert got == sorted(free)[:n]  # the lowest free, ascending
            free -= set(got)
            held.append(runs)
        elif held:
            runs = held.pop(n % len(held))
            alloc.give_back(runs)
            free |= {a for r in runs for a in r}
        assert alloc.free == len(free)
        assert [a for r in alloc.free_runs() for a in r] == sorted(free)
        assert alloc.free_runs() == runs_of(alloc.free_runs())  # merged, ascending


@pytest.mark.parametrize(
    "back",
    [[range(8, 12)], [range(-1, 1)], "twice", [range(0, 3), range(2, 4)], [5, 5]],
    ids=["past-capacity", "negative", "given-twice", "overlapping", "repeated-int"],
)
def test_bad_give_back_changes_nothing(back) -> None:
    alloc = LogicalAllocator(10)
    taken = alloc.take(6)
    if back == "twice":
        alloc.give_back(taken)
        back = taken
    before = (alloc.free, alloc.free_runs())
    with pytest.raises(InvalidAddressError):
        alloc.give_back(back)
    assert (alloc.free, alloc.free_runs()) == before


def test_runs_of_merges_and_counts() -> None:
    assert runs_of([range(4, 6), 3, range(0, 2), range(5, 9), range(0)]) == [range(0, 2), range(3, 9)]
    assert count([range(0, 2), range(3, 9)]) == 8
