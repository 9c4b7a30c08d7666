"""Which entries the tiered pool's ``ExactLRU`` evicts, worked by hand (``docs/design.md``, section 4:
invariants 3, 4 and 7).

Two scenarios small enough to follow on paper: a 3-slot GPU over four entries, round after round,
where the victim is always the least recently used entry that the current round did not select, and
recency within a round follows the first position in the selection (row-major), not the address;
and invariant 4 on a full GPU: what the current round selected is not evicted by writes in that same
round, while unselected residents may be.
"""

from __future__ import annotations

import torch
from helpers import RowModel, addr_tensor, assert_reads, assert_selection_holds, fill, random_rows, small_pool

# --------------------------------------------------------------------------------------------------
# ExactLRU: LRU order over rounds, first-position recency within one


def test_exact_lru_victims_hand_worked() -> None:
    pool = small_pool(gpu_slots=3, cpu_slots=4, bytes_per_layer=5, num_layers=1, layers_per_group=1)
    model = RowModel(5)
    seq = pool.admit(num_tokens=4)
    a, b, c, d = seq.addresses.tolist()

    def where(*xs: int) -> list[int]:
        return pool.residency(0, addr_tensor(list(xs))).tolist()

    def select(*xs: int) -> torch.Tensor:
        topk = addr_tensor([list(xs)])
        slots = pool.prepare(0, topk).slots
        assert_selection_holds(pool, model, 0, topk, slots)
        return slots

    model.write(pool, 0, addr_tensor([a, b, c]), random_rows(21, 3, 5))  # three free GPU slots
    assert all(r >= 0 for r in where(a, b, c))
    slot_of = dict(zip((a, b, c), where(a, b, c), strict=True))
    select(a)  # round 1
    select(b)  # round 2
    select(c)  # round 3
    s0 = pool.stats()
    # d is new and the GPU is full: c is protected (this round), a is the least recently used.
    model.write(pool, 0, addr_tensor([d]), random_rows(22, 1, 5))
    assert where(a, b, c) == [-1, slot_of[b], slot_of[c]]
    assert where(d)[0] >= 0
    s1 = pool.stats()
    assert s1["victims"] - s0["victims"] == 1
    # a goes back to the copy its write left (clean); the one row out is d's own copy
    assert s1["bytes_out"] - s0["bytes_out"] == 5 and s1["clean_evictions"] - s0["clean_evictions"] == 1
    assert s1["bytes_in"] == s0["bytes_in"]

    # Round 4 brings a back: b (round 2) is older than c and d (round 3).
    select(a)
    assert where(b) == [-1]
    assert all(r >= 0 for r in where(a, c, d))
    s2 = pool.stats()
    assert s2["victims"] - s1["victims"] == 1 and s2["misses"] - s1["misses"] == 1
    # b too goes back to its write copy: nothing out
    assert s2["bytes_in"] - s1["bytes_in"] == 5 and s2["bytes_out"] - s1["bytes_out"] == 0

    # Round 5 selects b and c: c is protected, d (round 3) is older than a (round 4).
    select(b, c)
    assert where(d) == [-1]
    assert all(r >= 0 for r in where(a, b, c))
    s3 = pool.stats()
    assert s3["hits"] - s2["hits"] == 1 and s3["misses"] - s2["misses"] == 1

    # Round 6 selects d: a (round 4) is the oldest resident.
    select(d)
    assert where(a) == [-1]

    # Within a round, recency follows the first position in the selection (row-major).
    # Round 7 selects a: b and c were both used in round 5, b at the earlier position: b leaves.
    select(a)
    assert where(b) == [-1]
    assert all(r >= 0 for r in where(a, c, d))
    # Round 8 selects b, then a (b first although its address is larger): c (round 5) leaves.
    assert b > a
    select(b, a)
    assert where(c) == [-1]
    # Round 9 selects c and d: of b and a (both round 8) b came first, so b leaves, not a.
    select(c, d)
    assert where(b) == [-1]
    assert all(r >= 0 for r in where(a, c, d))
    assert_reads(pool, model, [a, b, c, d])
    pool.check_invariants()


# --------------------------------------------------------------------------------------------------
# invariant 4: what the current round selected is not evicted by writes in that round


def test_selected_entries_survive_writes_in_the_same_round() -> None:
    pool = small_pool(gpu_slots=7, cpu_slots=13, bytes_per_layer=12)
    model = RowModel(12)
    seq = pool.admit(num_tokens=10)
    addrs = seq.addresses.tolist()
    fill(pool, model, addrs, seed=17)  # group 0: 7 on the GPU (full), 3 on the CPU
    res = pool.residency(0, seq.addresses).tolist()
    on_cpu = [x for x, r in zip(addrs, res, strict=True) if r < 0]
    on_gpu = [x for x, r in zip(addrs, res, strict=True) if r >= 0]
    chosen = on_cpu[:2] + on_gpu[:3]  # 5 selected: 2 swap in, 2 unselected residents stay evictable
    topk = addr_tensor([chosen])
    sel = pool.prepare(0, topk)
    assert_selection_holds(pool, model, 0, topk, sel.slots)

    new = pool.extend(seq, 5).tolist()  # same round: extend does not start one
    for layer in (0, 1):
        model.write(pool, layer, addr_tensor(new), random_rows(18 + layer, 5, 12))
    assert_selection_holds(pool, model, 0, topk, sel.slots)  # still there, same slots
    res_new = pool.residency(0, addr_tensor(new)).tolist()
    # The two unselected GPU residents could be evicted for new entries; the selected ones not.
    assert sum(r >= 0 for r in res_new) == 2
    stats = pool.stats()
    assert stats["gpu_slots_used"] == 7 + min(7, 10)  # group 0 full; group 1 (layer 2) full
    assert stats["distinct_entries"] == stats["physical_slots_used"]
    assert_reads(pool, model, addrs + new)
    pool.check_invariants()
