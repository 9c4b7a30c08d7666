"""Copies made by writes (``Tiered.write_copies``, on by default): a row written while a plain free
CPU row lies below the call's pops also gets a clean copy there, every layer of its group, so its
eviction during decode moves nothing; a later write of an entry whose copy no pop takes goes through
to the copy.

Worked by hand on small pools (a two-layer group and a one-layer short group, 12-byte rows): the
eviction of a written row, write-through and the zeros of unwritten layers, copies never taken
from rows that hold other copies, copies dropped when the tier needs the rows (admission to full
capacity), what a write costs in bytes, and writes stopped after each phase. The kernels against
their references and a pool against ``CPUTierModel`` row for row, both with write copies, are in
``tests/test_clean_evictions.py``; a replay on the models against one on a real pool in
``tests/test_traces.py``.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from helpers import RowModel, addr_tensor, assert_reads, assert_same_state, fill, random_rows
from tier_helpers import POLICIES, copies, counts, deltas, free_rows, row_bytes, split
from tier_helpers import tiered as tiered_pool

from ulakv import ExactLRU
from ulakv.errors import InvalidAddressError
from ulakv.kernels import common as K
from ulakv.transfer import PlanInterrupted, interrupt_after

GROUPS = pytest.mark.parametrize("group", [0, 1], ids=["2-layer-group", "1-layer-short-group"])


def tiered(policy, gpu: int, cpu: int, staging: int | None = None, write_copies: bool = True):
    """``test_clean_evictions.tiered``'s pool (12-byte rows, groups of layers 0-1 and 2), with write
    copies unless asked otherwise."""
    return tiered_pool(policy, gpu=gpu, cpu=cpu, staging=staging, write_copies=write_copies)


def plain_rows(pool, group: int) -> int:
    """The plain rows on top of the group's free list (``G_CPU_PLAIN``)."""
    return int(pool.internals().state.gctl[group, int(K.G_CPU_PLAIN)])


# --------------------------------------------------------------------------------------------------
# 1. a written row's eviction moves nothing


@pytest.mark.parametrize("policy", POLICIES)
@GROUPS
@pytest.mark.parametrize("write_copies", [True, False], ids=["write-copies", "swap-in-copies-only"])
def test_a_written_rows_eviction_moves_nothing(policy, group, write_copies) -> None:
    """Eight entries written on a pool of 4 GPU slots: 4 land on the GPU, 4 on the CPU. The four
    CPU-homed ones swap in and evict the four written on the GPU: with write copies every eviction
    is clean and moves nothing; without, each copies its rows out (the behaviour before)."""
    pool = tiered(policy, gpu=4, cpu=8, write_copies=write_copies)
    model = RowModel(12)
    addrs = pool.admit(8).addresses.tolist()
    fill(pool, model, addrs, seed=1)
    on_gpu, on_cpu = split(pool, group, addrs)
    assert len(on_gpu) == len(on_cpu) == 4
    assert set(copies(pool, group)) == (set(on_gpu) if write_copies else set())
    rb = row_bytes(pool, group)

    s0 = pool.stats()
    pool.prepare(group, addr_tensor(on_cpu).view(2, 2))
    out = 0 if write_copies else 4 * rb
    clean = 4 if write_copies else 0
    assert deltas(s0, pool.stats()) == counts(
        misses=4, bytes_in=4 * rb, bytes_out=out, victims=4, clean_evictions=clean
    )
    assert_reads(pool, model, addrs)  # the copies held every layer's last written bytes
    pool.check_invariants()


@pytest.mark.parametrize("policy", POLICIES)
def test_a_one_layer_group_writes_one_row_out_per_written_row(policy) -> None:
    """The SGLang case: in a one-layer group a new entry's copy is its written row, one row out per
    row written, as the CPU-offload baseline backs it up; a rewrite through to the copy is one row
    more (the baseline backs the rewrite up too). In the two-layer group a new entry's copy takes
    both layers (the written row and a zero row), and the second layer's write goes through."""
    pool = tiered(policy, gpu=4, cpu=8)
    W = 12
    addrs = pool.admit(3).addresses
    stats = [pool.stats()]
    for layer in range(3):
        pool.write(layer, addrs, random_rows(layer, 3, W))
        stats.append(pool.stats())
    out = [deltas(a, b)["bytes_out"] for a, b in itertools.pairwise(stats)]
    # layer 0: three copies of two layers; layer 1: three rows through; layer 2 (group 1): three copies
    assert out == [3 * 2 * W, 3 * W, 3 * W]
    s0 = pool.stats()
    pool.write(2, addrs, random_rows(9, 3, W))
    assert deltas(s0, pool.stats())["bytes_out"] == 3 * W
    assert set(copies(pool, 1)) == set(addrs.tolist())


# --------------------------------------------------------------------------------------------------
# 2. write-through keeps the copy intact and bit-exact; unwritten layers are zeros


@pytest.mark.parametrize("policy", POLICIES)
def test_write_through_keeps_the_copy_and_unwritten_layers_read_zero(policy) -> None:
    """Group 0 (layers 0 and 1). Four entries written in layer 0 only, then written again: the
    second write goes through to their copies. Four more land on the CPU and swap in, evicting the
    first four clean: they read the second write in layer 0 and zeros in layer 1 (the copy took the
    zeros the GPU held). Then layer 1 of the swapped-in four is written (through to the copies
    their swap-in left), and they are evicted clean in turn: every read is the last write."""
    pool = tiered(policy, gpu=4, cpu=8)
    model = RowModel(12)
    a = pool.admit(8).addresses.tolist()
    first, later = a[:4], a[4:]
    model.write(pool, 0, addr_tensor(first), random_rows(1, 4, 12))
    copied = copies(pool, 0)
    assert set(copied) == set(first)
    model.write(pool, 0, addr_tensor(first), random_rows(2, 4, 12))
    assert copies(pool, 0) == copied, "the rewrite went through: the same copies, intact"
    pool.check_invariants()  # every intact copy equals its entry, both layers
    model.write(pool, 0, addr_tensor(later), random_rows(3, 4, 12))
    assert split(pool, 0, a) == (first, later)

    s0 = pool.stats()
    pool.prepare(0, addr_tensor(later).view(1, 4))
    assert deltas(s0, pool.stats())["clean_evictions"] == 4
    assert {x: int(pool.internals().state.mapping[0, x]) - 4 for x in first} == copied  # back to their copies
    assert_reads(pool, model, a)  # layer 1 of ``first``: zeros
    assert torch.equal(pool.read(1, addr_tensor(first)), torch.zeros(4, 12, dtype=torch.uint8))

    model.write(pool, 1, addr_tensor(later), random_rows(4, 4, 12))
    assert set(copies(pool, 0)) == set(later)
    pool.check_invariants()
    s0 = pool.stats()
    pool.prepare(0, addr_tensor(first).view(2, 2))
    d = deltas(s0, pool.stats())
    assert d["clean_evictions"] == 4 and d["bytes_out"] == 0, d
    assert_reads(pool, model, a)
    pool.check_invariants()


# --------------------------------------------------------------------------------------------------
# 3. copies never come from rows that hold other copies; the tier takes them back when it needs rows


@pytest.mark.parametrize("policy", POLICIES)
def test_copies_never_take_rows_that_hold_other_copies(policy) -> None:
    """One-layer group 1 of a pool with 8 CPU rows (6 + 2 staging). Three entries written on the GPU
    take copies from the plain rows (8 -> 5); five more fill the last GPU slot and the CPU: their
    4 pops leave one plain row, which the one on the GPU takes (plain 0). Releasing the first three
    frees their slots, their copy rows staying below, not plain. Two entries written into the freed
    slots then get no copy: every free row holds a copy (intact or not), and the one intact copy
    (the fourth GPU entry's) is kept."""
    pool = tiered(policy, gpu=4, cpu=6, staging=2)
    model = RowModel(12)
    first = pool.admit(3)
    fill(pool, model, first.address_list, seed=1)
    assert plain_rows(pool, 1) == 5 and set(copies(pool, 1)) == set(first.address_list)
    second = pool.admit(5)
    fill(pool, model, second.address_list, seed=2)
    on_gpu = split(pool, 1, second.address_list)[0]
    assert len(on_gpu) == 1 and plain_rows(pool, 1) == 0
    kept = copies(pool, 1)
    assert set(kept) == {*first.address_list, *on_gpu}
    pool.release(first)
    model.forget(first.address_list)
    third = pool.admit(2)
    s0 = pool.stats()
    model.write(pool, 2, third.addresses, random_rows(3, 2, 12))
    assert deltas(s0, pool.stats())["bytes_out"] == 0, "no copy made: no row out"
    assert copies(pool, 1) == {on_gpu[0]: kept[on_gpu[0]]}
    assert plain_rows(pool, 1) == 0
    assert_reads(pool, model, second.address_list + third.address_list)
    pool.check_invariants()


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("write_copies", [True, False], ids=["write-copies", "swap-in-copies-only"])
def test_a_write_that_evicts_clean_keeps_its_copies_in_the_rows_its_victims_popped(
    policy, write_copies
) -> None:
    """One-layer group 1, 4 GPU slots, 12 CPU rows (4 of them staging). Four entries written take plain
    copies (plain 12 -> 8). A prepare of the first starts a round; three new entries written then
    evict the other three clean: each victim pops a plain row and goes back to its copy, and the row
    it popped takes the copy's place in the free list holding the new entry's copy. So the plain
    run shrinks by the pops alone (8 -> 5, not 2: with a plain copy each as well, a decode step's
    writes would spend two plain rows a token and run the tier out of them). The new entries'
    eviction then moves nothing."""
    pool = tiered(policy, gpu=4, cpu=8, staging=4, write_copies=write_copies)
    model = RowModel(12)
    a = pool.admit(4).address_list
    model.write(pool, 2, addr_tensor(a), random_rows(1, 4, 12))
    assert plain_rows(pool, 1) == (8 if write_copies else 12)
    pool.prepare(1, addr_tensor(a[:1]).view(1, 1))
    b = pool.admit(3).address_list
    held = copies(pool, 1)
    places = {x: free_rows(pool, 1).index(held[x]) for x in a[1:]} if write_copies else {}
    s0 = pool.stats()
    model.write(pool, 2, addr_tensor(b), random_rows(2, 3, 12))
    assert split(pool, 1, a + b) == ([a[0], *b], a[1:])
    W = row_bytes(pool, 1)
    clean = 3 if write_copies else 0
    # out: the new entries' copies (the victims stay where they were), or the victims' rows
    assert deltas(s0, pool.stats()) == counts(bytes_out=3 * W, victims=3, clean_evictions=clean)
    if write_copies:
        assert plain_rows(pool, 1) == 5
        now = copies(pool, 1)
        assert set(now) == {a[0], *b}
        # each new entry's copy sits where its victim's copy sat (victims in LRU order: a[1:])
        assert [free_rows(pool, 1).index(now[x]) for x in b] == [places[x] for x in a[1:]]
    pool.check_invariants()
    assert_reads(pool, model, a + b)

    s0 = pool.stats()
    pool.prepare(1, addr_tensor(a[1:]).view(1, 3))  # evicts a[0] and two of b, in LRU order
    out = 0 if write_copies else 3 * W
    assert deltas(s0, pool.stats()) == counts(
        misses=3, bytes_in=3 * W, bytes_out=out, victims=3, clean_evictions=clean
    )
    pool.check_invariants()
    assert_reads(pool, model, a + b)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("write_copies", [True, False], ids=["write-copies", "swap-in-copies-only"])
def test_admission_to_full_capacity_takes_the_copies_back(policy, write_copies) -> None:
    """A copy is free space. A pool of 4 GPU + 6 CPU slots (4 staging) admits 10 entries in three
    requests, and every write after the first pops rows that held copies; the counts are those of
    a pool without copies, and everything reads back."""
    pool = tiered(policy, gpu=4, cpu=6, write_copies=write_copies)
    model = RowModel(12)
    addrs = []
    for n, seed in ((3, 1), (4, 2), (3, 3)):
        seq = pool.admit(n)
        fill(pool, model, seq.address_list, seed=seed)
        addrs += seq.address_list
        pool.check_invariants()
    stats = pool.stats()
    assert pool.free_addresses == 0
    assert stats["distinct_entries"] == stats["physical_slots_used"] == 2 * 10
    assert stats["gpu_slots_used"] == 2 * 4 and stats["cpu_slots_used"] == 2 * 6
    assert_reads(pool, model, addrs)
    for group in (0, 1):
        pool.prepare(group, addr_tensor(split(pool, group, addrs)[1][:4]).view(2, 2))
    assert_reads(pool, model, addrs)
    pool.check_invariants()


# --------------------------------------------------------------------------------------------------
# 4. a write stopped after each phase loses nothing


def write_scenario(policy):
    """Group 0 after four entries were written on the GPU (with copies) and two on the CPU, and the
    two swapped in (a new round, evicting two written entries clean). The write: two new entries
    and one of the two written entries left on the GPU; the new ones evict the other (clean) and
    land on the CPU, and the rewritten one goes through to its copy."""
    pool = tiered(policy, gpu=4, cpu=8)
    model = RowModel(12)
    a = pool.admit(6).addresses.tolist()
    fill(pool, model, a, seed=1)
    on_gpu, on_cpu = split(pool, 0, a)
    pool.prepare(0, addr_tensor(on_cpu).view(1, 2))
    left = [x for x in on_gpu if pool.residency(0, addr_tensor([x])).item() >= 0]
    assert len(left) == 2 and set(left) <= set(copies(pool, 0))
    new = pool.admit(2).addresses.tolist()
    return pool, model, a + new, addr_tensor([new[0], left[0], new[1]])


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("layer", [0, 1])
@pytest.mark.parametrize("phase", ["out", "evict", "in"])
def test_a_write_stopped_after_each_phase_loses_nothing(policy, layer, phase) -> None:
    pool, model, addrs, sel = write_scenario(policy)
    rows = random_rows(5, 3, 12)
    whole = copy.deepcopy(pool)
    s0 = whole.stats()
    whole.write(layer, sel, rows)
    d = deltas(s0, whole.stats())
    assert d["victims"] == 1 and d["clean_evictions"] == 1, d
    assert sel[1].item() in copies(whole, 0), "the rewritten entry keeps its copy"
    assert sel[0].item() in copies(whole, 0), "the new entry on the GPU has a copy"
    mapping_before = pool.internals().state.mapping.clone()
    with interrupt_after(pool, phase), pytest.raises(PlanInterrupted):
        pool.write(layer, sel, rows)
    if phase == "out":  # data only: no home moved
        assert torch.equal(pool.internals().state.mapping, mapping_before)
    assert_reads(pool, model, [x for x in addrs if x not in sel.tolist()])
    # The next call (another group) finishes the write first; the pools are then identical.
    for p in (whole, pool):
        p.prepare(1, addr_tensor([addrs[:2]]))
    assert_same_state(whole.state_dict(), pool.state_dict())
    model.record(layer, sel, rows)
    for p in (whole, pool):
        assert_reads(p, model, addrs)
        p.check_invariants()


def test_a_refused_write_makes_no_copy() -> None:
    """A write refused on the device (a duplicate address) changes nothing: no copy, no plain row
    taken, the state as it was."""
    pool = tiered(ExactLRU(), gpu=4, cpu=8)
    seq = pool.admit(3)
    before = pool.state_dict()
    with pytest.raises(InvalidAddressError, match="more than once"):
        pool.write(2, addr_tensor([seq.address_list[0], seq.address_list[0]]), random_rows(1, 2, 12))
    assert_same_state(before, pool.state_dict())
    assert plain_rows(pool, 1) == pool.internals().state.cpu_slots
