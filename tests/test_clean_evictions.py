"""Clean evictions: an entry swapped in from a CPU row leaves that row holding its bytes (a *copy*);
evicted while the copy is intact, it goes back there and no bytes move.

Worked by hand on small pools (odd widths, a short last group): which evictions are clean and what
they cost, what ends a copy (a rewrite on the GPU, a release, a pop for someone else), the order in
which the CPU free list hands out plain rows and copies, and a tight CPU tier whose pops reach the
copies. Then plans with clean and dirty victims stopped after each phase, and a pool against
``CPUTierModel`` row for row (the kernels against their references under traffic that evicts clean
are ``tests/test_kernels_clean.py``'s).

The hand-worked pools here make copies by swap-ins alone (``Tiered(write_copies=False)``), so that a
row written on the GPU has none; the row-for-row test runs both ways.
The copies writes make are ``tests/test_write_copies.py``'s.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from helpers import (
    RowModel,
    addr_tensor,
    assert_reads,
    assert_same_state,
    fill,
    random_rows,
)
from tier_helpers import (
    POLICIES,
    copies,
    counts,
    cpu_row,
    deltas,
    free_rows,
    homes,
    row_bytes,
    split,
    tiered,
)

from ulakv import ExactLRU, Pool
from ulakv.kernels import common as K
from ulakv.policies import ExactLRUModel, PBLRUModel
from ulakv.policies.cpu_tier import CPUTierModel
from ulakv.transfer import PlanInterrupted, interrupt_after

# --------------------------------------------------------------------------------------------------
# 1. by hand: swapped in, then evicted clean to the row it came from


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("group", [0, 1], ids=["2-layer-group", "1-layer-short-group"])
def test_swapped_in_entries_go_back_to_their_rows_clean(policy, group) -> None:
    G = 5
    pool = tiered(policy, gpu=G, cpu=7, width=12)
    model = RowModel(12)
    addrs = pool.admit(2 * G).addresses.tolist()
    fill(pool, model, addrs, seed=1)
    written_gpu, written_cpu = split(pool, group, addrs)
    assert len(written_gpu) == len(written_cpu) == G
    origin = {a: cpu_row(pool, group, a) for a in written_cpu}
    rb = row_bytes(pool, group)
    other = 1 - group

    # Round 1: three CPU-homed entries swap in. The GPU entries were written there, so none has a
    # copy: all three victims are dirty.
    chosen = [written_cpu[4], written_cpu[0], written_cpu[2]]
    s0 = pool.stats()
    pool.prepare(group, addr_tensor(chosen).view(3, 1))
    s1 = pool.stats()
    assert deltas(s0, s1) == counts(misses=3, bytes_in=3 * rb, bytes_out=3 * rb, victims=3)
    evicted = split(pool, group, written_gpu)[1]
    assert len(evicted) == 3
    assert copies(pool, group) == {a: origin[a] for a in chosen}  # each remembers its row
    assert copies(pool, other) == {}
    assert_reads(pool, model, addrs)
    pool.check_invariants()

    # Round 2: the GPU-written entries again: two hits, three misses. The only entries the round
    # may evict are the three swapped in, and their copies are intact: all three go back clean.
    pool.prepare(group, addr_tensor(written_gpu).view(1, G))
    s2 = pool.stats()
    assert deltas(s1, s2) == counts(
        hits=2, misses=3, bytes_in=3 * rb, bytes_out=0, victims=3, clean_evictions=3
    )
    for a in chosen:
        assert cpu_row(pool, group, a) == origin[a], f"address {a} did not go back to its row"
    # The entries swapped in now remember the rows their dirty evictions had copied them to.
    assert set(copies(pool, group)) == set(evicted)
    assert_reads(pool, model, addrs)
    pool.check_invariants()
    assert pool.stats()["clean_evictions"] == 3  # the other group had no copies to use


# --------------------------------------------------------------------------------------------------
# 2. what ends a copy: a rewrite on the GPU, a release (and the slot's next entry)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("rewrite", [True, False], ids=["rewritten", "untouched"])
def test_a_rewrite_on_the_gpu_ends_the_copy(policy, rewrite) -> None:
    G, W = 4, 5
    pool = tiered(policy, gpu=G, cpu=6, width=W)
    model = RowModel(W)
    addrs = pool.admit(2 * G).addresses.tolist()
    fill(pool, model, addrs, seed=2)
    on_cpu = split(pool, 0, addrs)[1]
    x, y = on_cpu[1], on_cpu[3]
    origin = cpu_row(pool, 0, x)
    pool.prepare(0, addr_tensor([[x]]))
    assert copies(pool, 0) == {x: origin}
    old = pool.read(1, addr_tensor([x]))
    if rewrite:  # layer 1, the second layer of group 0
        new = random_rows(7, 1, W)
        assert not torch.equal(new, old)
        model.write(pool, 1, addr_tensor([x]), new)
        assert copies(pool, 0) == {}, "a rewritten entry's copy no longer holds its bytes"
    # Select every other GPU entry and one CPU entry: x is the only victim.
    keep = [a for a in split(pool, 0, addrs)[0] if a != x]
    s0 = pool.stats()
    pool.prepare(0, addr_tensor([[*keep, y]]))
    d = deltas(s0, pool.stats())
    rb = row_bytes(pool, 0)
    assert d["victims"] == 1 and split(pool, 0, [x])[1] == [x]
    if rewrite:
        assert (d["clean_evictions"], d["bytes_out"]) == (0, rb)
        assert cpu_row(pool, 0, x) != origin
        assert torch.equal(pool.read(1, addr_tensor([x])), new)
    else:
        assert (d["clean_evictions"], d["bytes_out"]) == (1, 0)
        assert cpu_row(pool, 0, x) == origin
        assert torch.equal(pool.read(1, addr_tensor([x])), old)
    assert_reads(pool, model, addrs)
    pool.check_invariants()


@pytest.mark.parametrize("policy", POLICIES)
def test_a_release_ends_the_copy_and_the_slots_next_entry_does_not_inherit_it(policy) -> None:
    G, W = 4, 5
    pool = tiered(policy, gpu=G, cpu=6, width=W)
    model = RowModel(W)
    keep = pool.admit(G).addresses.tolist()  # on the GPU
    gone_seq = pool.admit(G)  # on the CPU
    gone = gone_seq.addresses.tolist()
    fill(pool, model, keep + gone, seed=3)
    x = gone[2]
    origin = cpu_row(pool, 0, x)
    pool.prepare(0, addr_tensor([[x]]))
    slot = int(pool.residency(0, addr_tensor([x])))
    assert copies(pool, 0) == {x: origin}
    pool.release(gone_seq)
    model.forget(gone)
    assert copies(pool, 0) == {}
    assert int(pool.internals().state.copy_row[0, slot]) == -1
    assert origin in free_rows(pool, 0)
    # A new entry takes the freed slot; its eviction must copy its own bytes, not trust x's row.
    fresh = pool.admit(1).addresses.tolist()
    fill(pool, model, fresh, seed=4)
    assert pool.residency(0, addr_tensor(fresh)).tolist() == [slot]
    assert copies(pool, 0) == {}
    back = split(pool, 0, keep)[1]
    assert back, "one of keep was evicted by the round of x"
    s0 = pool.stats()
    pool.prepare(0, addr_tensor([[a for a in keep if a not in back] + back]))  # evicts `fresh`
    d = deltas(s0, pool.stats())
    assert split(pool, 0, fresh)[1] == fresh
    assert d["victims"] == len(back) and d["clean_evictions"] == 0
    assert d["bytes_out"] == len(back) * row_bytes(pool, 0)
    assert_reads(pool, model, keep + fresh)
    pool.check_invariants()


# --------------------------------------------------------------------------------------------------
# 3. the free list: plain rows first, copies at the bottom


@pytest.mark.parametrize("policy", POLICIES)
def test_plain_free_rows_are_handed_out_before_copies(policy) -> None:
    G, W = 6, 5
    pool = tiered(policy, gpu=G, cpu=9, width=W, layers=2, per_group=2)  # one group of two layers
    model = RowModel(W)
    addrs = pool.admit(2 * G).addresses.tolist()
    fill(pool, model, addrs, seed=5)
    written_gpu, written_cpu = split(pool, 0, addrs)
    origin = {a: cpu_row(pool, 0, a) for a in written_cpu}
    plain = free_rows(pool, 0)
    assert len(plain) == 9  # 9 CPU rows + 6 staging, 6 of them homes

    # Three swap-ins: their rows join the free list at the bottom, the first miss lowest; the
    # three dirty victims took the top three plain rows.
    first = [written_cpu[1], written_cpu[4], written_cpu[0]]
    pool.prepare(0, addr_tensor([first]))
    after = free_rows(pool, 0)
    assert after == [origin[a] for a in first] + plain[: len(plain) - 3]
    victims = split(pool, 0, written_gpu)[1]
    assert sorted(cpu_row(pool, 0, a) for a in victims) == sorted(plain[-3:])
    held = copies(pool, 0)
    assert held == {a: origin[a] for a in first}

    # The next round keeps those three (hits) and swaps three more in: its three victims pop the
    # top three rows, all plain; the copies survive below them, and the new copies go lowest.
    second = [written_cpu[5 - i] for i in (0, 2, 3)]
    top = after[-3:]
    assert not set(top) & set(held.values())
    pool.prepare(0, addr_tensor([first + second]))
    victims2 = split(pool, 0, written_gpu)[1]
    victims2 = [a for a in victims2 if a not in victims]
    assert len(victims2) == 3
    assert sorted(cpu_row(pool, 0, a) for a in victims2) == sorted(top)
    assert free_rows(pool, 0) == [origin[a] for a in second] + after[:-3]
    assert copies(pool, 0) == {a: origin[a] for a in first + second}
    assert pool.stats()["clean_evictions"] == 0
    assert_reads(pool, model, addrs)
    pool.check_invariants()


@pytest.mark.parametrize("policy", POLICIES)
def test_clean_victims_of_a_prepare_pop_nothing_and_their_misses_fill_the_holes(policy) -> None:
    """A prepare whose misses all come from the CPU: its clean victims pop no row, each miss whose
    victim was clean leaves its row in that victim's copy's place, and the top of the free list (the
    plain rows) is untouched. A write evicting clean instead pops a row per victim and puts it in
    the copy's place."""
    pool = tiered(policy, gpu=4, cpu=6, width=12)
    model = RowModel(12)
    a = pool.admit(8).addresses.tolist()
    fill(pool, model, a, seed=2)
    assert split(pool, 0, a) == (a[:4], a[4:])
    rb = row_bytes(pool, 0)
    row = {x: cpu_row(pool, 0, x) for x in a[4:]}
    plain = free_rows(pool, 0)
    pool.prepare(0, addr_tensor([[a[4], a[5]]]))  # a0, a1 leave (dirty) for the two top rows
    pool.prepare(0, addr_tensor([[a[2], a[3]]]))  # hits: a4 and a5 are now the oldest
    assert free_rows(pool, 0) == [row[a[4]], row[a[5]], *plain[:-2]]
    assert len(plain) - 2 >= 2, "the copies must lie deeper than the call pops"

    s0 = pool.stats()
    pool.prepare(0, addr_tensor([[a[6], a[7]]]))  # evicts a4 and a5, both clean
    assert deltas(s0, pool.stats()) == counts(misses=2, bytes_in=2 * rb, victims=2, clean_evictions=2)
    assert (cpu_row(pool, 0, a[4]), cpu_row(pool, 0, a[5])) == (row[a[4]], row[a[5]])
    assert free_rows(pool, 0) == [row[a[6]], row[a[7]], *plain[:-2]]  # holes filled, top as it was
    assert copies(pool, 0) == {a[6]: row[a[6]], a[7]: row[a[7]]}
    assert_reads(pool, model, a)
    pool.check_invariants()

    # A write of two new entries evicts a6 and a7 (a2, a3 were used after them): clean, but a write
    # does not fill, so each pops a top row, which takes its copy's place.
    pool.prepare(0, addr_tensor([[a[2], a[3]]]))
    new = pool.admit(2).addresses.tolist()
    top = free_rows(pool, 0)[-2:]
    s0 = pool.stats()
    for layer in pool.group_layers(0):
        model.write(pool, layer, addr_tensor(new), random_rows(50 + layer, 2, 12))
    assert deltas(s0, pool.stats())["clean_evictions"] == 2
    assert (cpu_row(pool, 0, a[6]), cpu_row(pool, 0, a[7])) == (row[a[6]], row[a[7]])
    assert free_rows(pool, 0) == [top[1], top[0], *plain[:-4]]
    assert_reads(pool, model, a + new)
    pool.check_invariants()


# --------------------------------------------------------------------------------------------------
# 4. a tight CPU tier: pops reach the copies


TIGHT_G, TIGHT_W = 4, 5
# Selections (indices into the 8 addresses, a0..a3 written on the GPU, a4..a7 on the CPU) that pop
# copies: a4 swaps in; a5 and a6 pop a4's copy for a victim; a3 is used; a0 evicts a4 (its copy
# gone: dirty) into a6's copy.
TIGHT_STEPS = [[4], [5, 6], [3], [0]]


def tight_pool(policy) -> tuple[Pool, RowModel, list[int]]:
    """4 GPU slots, 4 CPU slots and 2 staging rows (6 rows), all 8 addresses written: two free rows."""
    pool = tiered(policy, gpu=TIGHT_G, cpu=4, width=TIGHT_W, staging=2)
    model = RowModel(TIGHT_W)
    addrs = pool.admit(8).addresses.tolist()
    fill(pool, model, addrs, seed=6)
    return pool, model, addrs


@pytest.mark.parametrize("policy", POLICIES)
def test_tight_pool_pops_copies_by_hand(policy) -> None:
    pool, model, a = tight_pool(policy)
    rb = row_bytes(pool, 0)
    assert split(pool, 0, a) == (a[:4], a[4:])
    assert [cpu_row(pool, 0, x) for x in a[4:]] == [0, 1, 2, 3]
    assert free_rows(pool, 0) == [5, 4]

    def step(*picks: int) -> dict[str, int]:
        s0 = pool.stats()
        pool.prepare(0, addr_tensor([[a[i] for i in picks]]))
        assert_reads(pool, model, a)
        pool.check_invariants()
        return deltas(s0, pool.stats())

    # a4 swaps in, a0 leaves (dirty) for row 4; a4's row 0 is its copy, at the bottom.
    assert step(4) == counts(misses=1, bytes_in=rb, bytes_out=rb, victims=1)
    assert cpu_row(pool, 0, a[0]) == 4
    assert free_rows(pool, 0) == [0, 5] and copies(pool, 0) == {a[4]: 0}
    # Two misses pop both free rows: the second victim's row is a4's copy, which ends.
    assert step(5, 6) == counts(misses=2, bytes_in=2 * rb, bytes_out=2 * rb, victims=2)
    assert (cpu_row(pool, 0, a[1]), cpu_row(pool, 0, a[2])) == (5, 0)
    assert copies(pool, 0) == {a[5]: 1, a[6]: 2}
    assert free_rows(pool, 0) == [1, 2]
    assert step(3) == counts(hits=1)
    # a4, the oldest, leaves: its copy was taken, so it is dirty, and it pops a6's copy (row 2).
    assert step(0) == counts(misses=1, bytes_in=rb, bytes_out=rb, victims=1)
    assert cpu_row(pool, 0, a[4]) == 2
    assert copies(pool, 0) == {a[5]: 1, a[0]: 4}
    assert free_rows(pool, 0) == [4, 1]
    # a5, the oldest, leaves; the row popped for it is its own copy: clean.
    assert step(7) == counts(misses=1, bytes_in=rb, victims=1, clean_evictions=1)
    assert cpu_row(pool, 0, a[5]) == 1
    assert copies(pool, 0) == {a[0]: 4, a[7]: 3}
    assert free_rows(pool, 0) == [3, 4]
    # a6 leaves: its copy was taken too (dirty), and it pops a0's copy (row 4), which ends.
    assert step(1) == counts(misses=1, bytes_in=rb, bytes_out=rb, victims=1)
    assert cpu_row(pool, 0, a[6]) == 4
    assert copies(pool, 0) == {a[7]: 3, a[1]: 5}
    assert free_rows(pool, 0) == [5, 3]
    assert pool.stats()["clean_evictions"] == 1


@pytest.mark.parametrize("policy", POLICIES)
def test_a_copy_popped_by_another_miss_of_the_same_call_is_not_trusted(policy) -> None:
    """The first victim's copy sits just below the top; the call pops two rows, so the second
    victim's row is that copy. The first victim must copy its bytes to the row it popped."""
    pool, model, a = tight_pool(policy)
    rb = row_bytes(pool, 0)
    pool.prepare(0, addr_tensor([[a[4]]]))  # a0 leaves for row 4; a4's row 0 is its copy
    pool.prepare(0, addr_tensor([[a[1], a[2]]]))  # hits: a1, a2, then a3 newer than a4
    pool.prepare(0, addr_tensor([[a[3]]]))
    assert free_rows(pool, 0) == [0, 5] and copies(pool, 0) == {a[4]: 0}
    s0 = pool.stats()
    pool.prepare(0, addr_tensor([[a[5], a[6]]]))  # victims a4 (pops row 5), then a1 (pops row 0)
    assert deltas(s0, pool.stats()) == counts(misses=2, bytes_in=2 * rb, bytes_out=2 * rb, victims=2)
    assert (cpu_row(pool, 0, a[4]), cpu_row(pool, 0, a[1])) == (5, 0)
    assert_reads(pool, model, a)
    pool.check_invariants()


def copies_ended(
    pool: Pool, before: dict[int, dict[int, int]], picked: set[int]
) -> list[tuple[int, int, int]]:
    """Copies trusted before a call whose entry is still live and on the GPU, and was not selected,
    written or released by the call, but that the call ended: (group, address, row) each."""
    ended = []
    for g, held in before.items():
        now = copies(pool, g)
        held = {a: r for a, r in held.items() if a not in picked}
        on_gpu = set(split(pool, g, list(held))[0]) if held else set()
        ended += [(g, a, r) for a, r in held.items() if a in on_gpu and now.get(a) != r]
    return ended


@pytest.mark.parametrize("policy", POLICIES)
def test_tight_traffic_pops_copies_and_loses_nothing(policy) -> None:
    """Random traffic on a tight CPU tier (3 staging rows, odd widths, a short group): every call's
    clean evictions are exactly its victims that went back to an intact copy, its dirty ones cost
    their bytes, copies end only when their row is popped for someone else, and every address
    reads back what was written."""
    pool = tiered(policy, gpu=5, cpu=4, width=5, staging=3)
    model = RowModel(5)
    rng = random.Random(1)
    seqs = []
    ended = dirty_without_copy = 0
    lost: set[tuple[int, int]] = set()  # (group, address) on the GPU whose copy a pop ended
    groups = range(pool.num_groups)
    for _ in range(30):
        live = [x for s in seqs for x in s.address_list]
        before = {g: copies(pool, g) for g in groups}
        gpu_before = {g: split(pool, g, live)[0] if live else [] for g in groups}
        s0 = pool.stats()
        op, prepared = rng.random(), None
        if (op < 0.2 or len(live) < 7) and pool.free_addresses:  # kept nearly full
            seq = pool.admit(rng.randint(1, min(3, pool.free_addresses)))
            seqs.append(seq)
            fill(pool, model, seq.address_list, seed=rng.randrange(1000))  # may evict
            picked = set(seq.address_list)
        elif op < 0.28 and len(seqs) > 1:
            seq = seqs.pop(rng.randrange(len(seqs)))
            pool.release(seq)
            model.forget(seq.address_list)
            picked = set(seq.address_list)
            lost = {(g, x) for g, x in lost if x not in picked}
            gpu_before = {g: [x for x in gpu_before[g] if x not in picked] for g in groups}
        else:
            prepared = rng.randrange(pool.num_groups)
            on_cpu = split(pool, prepared, live)[1]
            misses = rng.randint(1, min(3, len(on_cpu)))  # mostly swaps: pops
            sel = rng.sample(on_cpu, misses) + rng.sample(gpu_before[prepared], 3 - misses)
            pool.prepare(prepared, addr_tensor([[*sel, sel[0], -1]]))
            picked = set(sel)
        d = deltas(s0, pool.stats())
        n_victims = n_clean = 0
        for g in groups:
            victims = split(pool, g, gpu_before[g])[1] if gpu_before[g] else []
            clean = [x for x in victims if before[g].get(x) == cpu_row(pool, g, x)]
            assert not {(g, x) for x in clean} & lost, "an entry whose copy was taken came back clean"
            dirty_without_copy += sum((g, x) in lost for x in victims)
            lost -= {(g, x) for x in victims}
            n_victims, n_clean = n_victims + len(victims), n_clean + len(clean)
            if g == prepared:
                assert d["bytes_out"] == (len(victims) - len(clean)) * row_bytes(pool, g)
        assert (d["victims"], d["clean_evictions"]) == (n_victims, n_clean)
        for g, x, r in copies_ended(pool, before, picked):
            # the row was popped: it is now somebody's home
            assert r + pool.internals().state.gpu_slots in homes(pool, g).values(), (
                f"copy row {r} of {x} ended unused"
            )
            ended += 1
            lost.add((g, x))
        assert_reads(pool, model, [x for s in seqs for x in s.address_list])
        pool.check_invariants()
    assert ended > 0, "no pop reached a copy: the pool is not tight"
    assert dirty_without_copy > 0, "no entry was evicted after its copy was taken"
    assert pool.stats()["clean_evictions"] > 0


@pytest.mark.parametrize("policy", POLICIES)
def test_describe_names_the_row_every_victim_lands_in(policy) -> None:
    """``TransferPlan.describe()``, read before the run, says where each victim's entry will live
    and which evictions move no bytes, exactly as the run then does it: the plan's clean victims,
    and those whose copy the call's actual pops (fewer than its bound) or their own pop left intact."""
    pool = tiered(policy, gpu=5, cpu=4, width=5, staging=3)
    model, rng, seqs = RowModel(5), random.Random(2), []
    G, seen = pool.internals().state.gpu_slots, {"fills": 0, "own_pop": 0, "below_the_pops": 0, "dirty": 0}
    for _ in range(40):
        live = [x for s in seqs for x in s.address_list]
        if (rng.random() < 0.2 or len(live) < 7) and pool.free_addresses:
            seqs.append(pool.admit(rng.randint(1, min(3, pool.free_addresses))))
            fill(pool, model, seqs[-1].address_list, seed=rng.randrange(1000))
            continue
        group = rng.randrange(pool.num_groups)
        gpu, cpu = split(pool, group, live)
        misses = rng.randint(1, min(3, len(cpu)))
        sel = addr_tensor([rng.sample(cpu, misses) + rng.sample(gpu, min(len(gpu), 3 - misses))])
        owner = pool.internals().state.owner[group].clone()
        s0 = pool.stats()
        plan = pool.plan(group, sel)
        moves = plan.describe()
        pool.run(plan)
        d = deltas(s0, pool.stats())
        evicted = (moves["victim_row"] >= 0) & (owner[moves["gpu_slot"].clamp(min=0)] >= 0)
        mapping = pool.internals().state.mapping[group]
        landed = zip(moves["gpu_slot"][evicted].tolist(), moves["victim_row"][evicted].tolist(), strict=True)
        for slot, row in landed:
            assert int(mapping[int(owner[slot])]) == G + row, "a victim is not where describe() put it"
        clean = moves["clean"] & evicted
        assert d["clean_evictions"] == int(clean.sum())
        assert d["bytes_out"] == int((evicted & ~clean).sum()) * row_bytes(pool, group)
        assert torch.equal(plan.slots.view(-1)[moves["position"]].long(), moves["gpu_slot"])
        seen["fills"] += int((clean & (moves["cpu_row"] < 0)).sum())
        popped = clean & (moves["cpu_row"] >= 0)  # went back to its copy all the same: the row it
        seen["own_pop"] += int((popped & (moves["victim_row"] == moves["cpu_row"])).sum())  # popped,
        seen["below_the_pops"] += int((popped & (moves["victim_row"] != moves["cpu_row"])).sum())  # or deeper
        seen["dirty"] += int((evicted & ~clean).sum())
        assert_reads(pool, model, [x for s in seqs for x in s.address_list])
    assert min(seen.values()) > 0, seen


# --------------------------------------------------------------------------------------------------
# 5. a plan with clean and dirty victims, stopped after each phase


def roomy_scenario(policy) -> tuple[Pool, RowModel, list[int], torch.Tensor]:
    """Test 1's pool after its first round. Four CPU-homed entries swap in: two victims were
    written on the GPU (dirty), two were swapped in (deep copies: clean)."""
    pool = tiered(policy, gpu=5, cpu=7, width=12)
    model = RowModel(12)
    addrs = pool.admit(10).addresses.tolist()
    fill(pool, model, addrs, seed=1)
    written_cpu = split(pool, 0, addrs)[1]
    pool.prepare(0, addr_tensor([[written_cpu[4], written_cpu[0], written_cpu[2]]]))
    return pool, model, addrs, addr_tensor(split(pool, 0, addrs)[1][:4]).view(2, 2)


def tight_scenario(policy) -> tuple[Pool, RowModel, list[int], torch.Tensor]:
    """The tight pool after ``TIGHT_STEPS`` (free rows: a0's copy, then a5's on top). a7 and a2
    swap in: a5 leaves into its own copy (clean), a6 (its copy taken earlier) pops a0's copy."""
    pool, model, a = tight_pool(policy)
    for picks in TIGHT_STEPS:
        pool.prepare(0, addr_tensor([[a[i] for i in picks]]))
    return pool, model, a, addr_tensor([[a[7], a[2]]])


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("phase", ["out", "evict", "in"])
@pytest.mark.parametrize("scenario", [roomy_scenario, tight_scenario], ids=["roomy", "tight"])
def test_interrupted_plan_with_clean_victims_equals_an_uninterrupted_run(policy, phase, scenario) -> None:
    pool, model, addrs, sel = scenario(policy)
    pool.check_invariants()
    whole = copy.deepcopy(pool)
    s0 = whole.stats()
    whole.prepare(0, sel)
    d = deltas(s0, whole.stats())
    assert 0 < d["clean_evictions"] < d["victims"], "the plan must have clean and dirty victims"

    homes_before = pool.internals().state.mapping.clone()
    with interrupt_after(pool, phase), pytest.raises(PlanInterrupted):
        pool.prepare(0, sel)
    if phase == "out":  # data only: no home moved
        assert torch.equal(pool.internals().state.mapping, homes_before)
    assert_reads(pool, model, addrs)  # every entry readable at the home its mapping names

    # The next call (another group) finishes the plan first; the two pools are then identical.
    nxt = addr_tensor([addrs[:2]])
    for p in (whole, pool):
        p.prepare(1, nxt)
    assert_same_state(whole.state_dict(), pool.state_dict())
    for p in (whole, pool):
        assert_reads(p, model, addrs)
        p.check_invariants()


# --------------------------------------------------------------------------------------------------
# 6. a pool against CPUTierModel and the policy's model, row for row


@pytest.mark.parametrize("write_copies", [False, True], ids=["swap-in-copies", "write-copies"])
@pytest.mark.parametrize("policy", POLICIES)
def test_pool_follows_the_cpu_tier_model_row_for_row(policy, write_copies) -> None:
    """One group of one layer on a tight CPU tier (5 GPU slots, 4 CPU slots, 3 staging rows):
    the policy's model says which addresses move, ``CPUTierModel`` which rows they move to. After
    every call the pool's free list (bottom first), its plain rows on top, its CPU homes, its
    trusted copies, its clean evictions and its bytes out equal the models'."""
    G, W, rows = 5, 5, 4 + 3
    pool = tiered(policy, gpu=G, cpu=4, width=W, layers=1, per_group=1, staging=3, write_copies=write_copies)
    lru = isinstance(policy, ExactLRU)
    order = ExactLRUModel(G) if lru else PBLRUModel(G, policy.num_buckets)
    tier = CPUTierModel(rows, write_copies)
    data = RowModel(W)
    rng, gen = random.Random(7), torch.Generator().manual_seed(7)
    seqs, bytes_out = [], 0

    def write(addrs: list[int], new: set[int]) -> None:
        nonlocal bytes_out
        homed_on_gpu = [a for a in addrs if a not in new and order.resident(a)]
        data.write(pool, 0, addr_tensor(addrs), random_rows(gen, len(addrs), W))
        placed, victims = order.write(addrs, new)
        fresh = [a for a in addrs if a in new]
        copied, made, through = tier.write(victims, fresh[len(placed) :], fresh[: len(placed)], homed_on_gpu)
        on_cpu = sum(not order.resident(a) for a in addrs)  # written in place or homed on the CPU
        bytes_out += (copied + made + on_cpu + through) * W  # one-layer rows

    def agree(step: int) -> None:
        where = f"step {step}: "
        assert free_rows(pool, 0) == tier.free_rows(), where + "free list"
        assert int(pool.internals().state.gctl[0, int(K.G_CPU_PLAIN)]) == tier.plain, (
            where + "plain rows on top"
        )
        stats = pool.stats()
        assert stats["clean_evictions"] == tier.clean_evictions, where + "clean evictions"
        assert stats["bytes_out"] == bytes_out, where + "bytes out"
        live = [a for s in seqs for a in s.address_list]
        on_cpu = {a: h - G for a, h in homes(pool, 0).items() if h >= G}
        assert on_cpu == tier.home, where + "CPU homes"
        assert set(split(pool, 0, live)[0]) == order.residents(), where + "GPU residents"
        intact = {a: r for a, r in tier.copy.items() if tier.copy_of.get(r) == a}
        assert copies(pool, 0) == intact, where + "copies"

    clean_seen = ended_seen = rewrote_copies = releases = 0
    for step in range(36):
        live = [a for s in seqs for a in s.address_list]
        op = rng.choices(["admit", "release", "rewrite", "prepare"], [2, 1, 2, 5])[0]
        if (op == "admit" or len(live) < 7) and pool.free_addresses:
            seq = pool.admit(rng.randint(1, min(3, pool.free_addresses)))
            seqs.append(seq)
            write(seq.address_list, set(seq.address_list))
        elif op == "release" and len(seqs) > 1:  # never the last: an empty pool resets
            seq = seqs.pop(rng.randrange(len(seqs)))
            pool.release(seq)
            order.release(seq.address_list)
            tier.release(seq.address_list)
            releases += 1
        elif op == "rewrite":  # of an entry with a copy where there is one
            held = list(copies(pool, 0))
            first = rng.choice(held or live)
            write([first, *rng.sample([x for x in live if x != first], 1)], set())
            rewrote_copies += bool(held)
        else:
            picks = rng.sample(live, 3)
            flat = [rng.choice([*picks, -1]) for _ in range(6)]
            held = {a: r for a, r in tier.copy.items() if tier.copy_of.get(r) == a}
            pool.prepare(0, addr_tensor(flat).view(2, 3))
            _, misses, victims = order.prepare(flat)
            before = tier.clean_evictions
            bytes_out += tier.prepare(victims, misses) * W
            clean_seen += tier.clean_evictions - before
            ended_seen += sum(1 for a, r in held.items() if a not in victims and tier.copy_of.get(r) != a)
        agree(step)
    assert releases > 0 and rewrote_copies > 0, (releases, rewrote_copies)
    assert clean_seen > 0 and ended_seen > 0, (clean_seen, ended_seen)
