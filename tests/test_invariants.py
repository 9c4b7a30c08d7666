"""The invariant checks on pools larger than the model tests, and planted defects that only the
per-plan checks catch.

With ``ULAKV_DEBUG=1`` (set before a pool is built: the pool reads it once) every finished plan's
decisions are checked against a snapshot taken right before its plan kernels ran (invariants 3, 4,
5 and 7), and the whole state at rest after every call (invariants 1 and 6, a well-formed recency
order). The planted defects corrupt one plan's decision after the reference plan has run and mend
the state around it, so that the structural check still passes: only the per-plan check can tell.
"""

from __future__ import annotations

import random

import pytest
import torch
from helpers import policy_cases, random_rows

import ulakv.layouts.tiered as tiered_mod
from ulakv import PBLRU, EntrySpec, ExactLRU, NewRows, Pool, PoolConfig, Tiered
from ulakv.errors import InvariantError
from ulakv.invariants import check_invariants
from ulakv.kernels import common as K
from ulakv.kernels.buckets import PBLRUBits
from ulakv.kernels.decide import decide_reference
from ulakv.kernels.victims import plant_victim
from ulakv.layouts.tiered_state import REFERENCE, TRITON, Kernels
from ulakv.transfer import Phase, PlanInterrupted, interrupt_after

WIDTH = 8


@pytest.fixture
def debug(monkeypatch) -> None:
    monkeypatch.setenv("ULAKV_DEBUG", "1")


def build(policy, gpu_slots: int, cpu_slots: int, num_layers: int, per_group: int, kernels: Kernels):
    pool = Pool(
        PoolConfig(
            entry=EntrySpec(bytes_per_layer=WIDTH),
            num_layers=num_layers,
            layers_per_group=per_group,
            layout=Tiered(gpu_slots=gpu_slots, cpu_slots=cpu_slots, policy=policy),
        )
    )
    assert pool.internals().debug  # the environment was read when the pool was built
    pool.internals().runner.kernels = kernels
    return pool


def write_all(pool, addrs: torch.Tensor, gen: torch.Generator) -> None:
    for layer in range(pool.config.num_layers):
        pool.write(layer, addrs, random_rows(gen, addrs.numel(), WIDTH))


def pick(rng: random.Random, addrs: list[int], hot: list[int], k: int) -> list[int]:
    """Top-k of one request: its newest tokens, a hot set that recurs step after step, the rest
    at random (overlapping the last steps' picks by chance), a few picks turned into padding."""
    recent = addrs[-k // 4 :]
    taken = set(recent) | set(hot)
    rest = [a for a in addrs if a not in taken]
    chosen = recent + hot + rng.sample(rest, min(len(rest), k - len(recent) - len(hot)))
    chosen = [a if rng.random() > 0.05 else -1 for a in chosen]
    rng.shuffle(chosen)
    return chosen[:k]


def drive(pool, steps: int, k: int, requests: int, seed: int) -> int:
    """Decode-like traffic: admit and write prompts, extend and write a token per request per step,
    select top-k per request in every group (sometimes two speculative queries with shared picks),
    run some plans in phases or interrupt them, and release a request every few steps. Returns
    the number of evictions."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    live: list[tuple[object, list[int]]] = []
    for step in range(steps):
        while len(live) < requests and pool.free_addresses >= 6 * k:
            seq = pool.admit(rng.randint(2 * k, 5 * k))
            write_all(pool, seq.addresses, gen)
            live.append((seq, rng.sample(seq.address_list, k // 4)))
        if step % 6 == 5:
            seq, _ = live.pop(rng.randrange(len(live)))
            pool.release(seq)
        for seq, _ in live:
            write_all(pool, pool.extend(seq, 1), gen)
        for group in range(pool.num_groups):
            rows = [pick(rng, seq.address_list, hot, k) for seq, hot in live]
            topk = torch.tensor(rows)
            if step % 4 == 3:  # two speculative queries that share most picks
                second = [[a if rng.random() < 0.7 else -1 for a in row] for row in rows]
                topk = torch.stack([topk, torch.tensor(second)], dim=1)
            layers = pool.group_layers(group)
            mode = step % 5
            if mode == 1 and len(layers) > 1:  # the engine's split: first layer now, the rest later
                plan = pool.plan(group, topk)
                pool.run(plan, until=Phase.IN, in_layers=range(layers.start, layers.start + 1))
            elif mode == 2:  # stopped between phases: the next call finishes it
                with interrupt_after(pool, "evict"), pytest.raises(PlanInterrupted):
                    pool.prepare(group, topk)
            elif mode == 3:  # planned and never run: the next call runs it
                pool.plan(group, topk)
            else:
                pool.prepare(group, topk)
    pool.check_invariants()  # finishes the last plan (and checks it)
    return pool.stats()["victims"]


def count_checks(monkeypatch) -> list[int]:
    """Count the per-plan checks the pool runs."""
    calls = [0]
    check = tiered_mod.check_plan

    def counting(*args) -> None:
        calls[0] += 1
        check(*args)

    monkeypatch.setattr(tiered_mod, "check_plan", counting)
    return calls


def count_plans(pool) -> list[int]:
    calls = [0]
    kernels = pool.internals().runner.kernels

    def plan(*args) -> int:
        calls[0] += 1
        return kernels.plan(*args)

    pool.internals().runner.kernels = Kernels(plan, kernels.apply)
    return calls


POLICIES = policy_cases(4)


@pytest.mark.parametrize("policy", POLICIES)
def test_checks_hold_on_a_large_pool(debug, monkeypatch, policy) -> None:
    """400 GPU slots and a CPU tier, top-48 for 5 requests, 30 steps: every plan is checked
    (splits, interrupted and unrun plans included, once each, when finished), with evictions."""
    checks = count_checks(monkeypatch)
    pool = build(policy, gpu_slots=400, cpu_slots=2400, num_layers=3, per_group=2, kernels=REFERENCE)
    plans = count_plans(pool)
    victims = drive(pool, steps=30, k=48, requests=5, seed=1)
    assert victims > 1000  # under pressure: the decisions checked include many evictions
    assert checks[0] == plans[0] > 300


@pytest.mark.parametrize("policy", POLICIES)
def test_checks_hold_with_the_triton_kernels(debug, monkeypatch, policy) -> None:
    """The same on the kernels the pool ships (interpreted here, hence smaller)."""
    checks = count_checks(monkeypatch)
    pool = build(policy, gpu_slots=64, cpu_slots=320, num_layers=2, per_group=2, kernels=TRITON)
    plans = count_plans(pool)
    victims = drive(pool, steps=6, k=12, requests=3, seed=2)
    assert victims > 0
    assert checks[0] == plans[0] > 10


def test_no_snapshot_and_no_check_with_debug_off(monkeypatch) -> None:
    """Debug off: the hot path never snapshots, never checks a plan."""
    monkeypatch.delenv("ULAKV_DEBUG", raising=False)

    def refuse(*args, **kwargs) -> None:
        raise AssertionError("a per-plan check ran with ULAKV_DEBUG off")

    monkeypatch.setattr(tiered_mod, "snapshot_plan", refuse)
    monkeypatch.setattr(tiered_mod, "check_plan", refuse)
    pool = Pool(
        PoolConfig(
            entry=EntrySpec(bytes_per_layer=WIDTH), num_layers=1, layout=Tiered(gpu_slots=8, cpu_slots=8)
        )
    )
    pool.internals().runner.kernels = REFERENCE
    gen = torch.Generator().manual_seed(0)
    seq = pool.admit(12)
    write_all(pool, seq.addresses, gen)
    pool.prepare(0, seq.addresses[:6].view(2, 3))
    pool.check_invariants()
    assert pool.internals().audit is None


# -- planted defects ---------------------------------------------------------------------------


def plan_hits(scratch, T: int) -> list[int]:
    """GPU slots of this call's hits (protected for the call)."""
    flags, home = scratch.flags[:T].tolist(), scratch.home[:T].tolist()
    return [home[p] for p in range(T) if flags[p] & int(K.F_FIRST) and flags[p] & int(K.F_GPU)]


def keep_in_lru_order(st, g: int, slot: int) -> None:
    """ExactLRU: ``slot`` was taken as a victim (the plan moved ``head`` past its pair) but keeps its
    entry: give it back a pair just before the new head. That pair is the oldest again, as it was,
    and the position belonged to a pair this call consumed."""
    qcap = st.q_slot.shape[1]
    head = int(st.gctl[g, int(K.G_HEAD)]) - 1
    st.q_slot[g, head % qcap] = slot
    st.q_ver[g, head % qcap] = st.ver[g, slot]
    st.gctl[g, int(K.G_HEAD)] = head


def keep_in_bucket(st, g: int, old: int, new: int, old_stamp: int) -> None:
    """PB-LRU: ``old`` keeps its entry, so it goes back to the bucket its old stamp names. ``new``
    receives the miss: it leaves its bucket as a taken victim does (commit puts it in the current
    round's)."""
    bits = PBLRUBits(st, g)
    cur = int(st.gctl[g, int(K.G_ROUND)])
    ref = cur + 1  # the plan ended the round: its retired bucket is cold already
    st.stamp[g, old] = old_stamp
    bits.sets[bits.bucket_of(old_stamp, ref)].add(old)
    if int(st.stamp[g, new]) != cur:
        bits.sets[bits.bucket_of(int(st.stamp[g, new]), ref)].discard(new)
    bits.store()


def corrupting(choose) -> Kernels:
    """The reference plan stage, then one victim replaced by ``choose(st, g, scratch, T, k_free,
    V)``'s slot. The state is mended so that it stays consistent (the structural check passes).
    The group's CPU copies are forgotten first (a state without copies is a valid one): a clean
    victim pops no row, so planting another slot in its place would unbalance the free list."""

    def plan(st, g, sel, scratch, write, group_row_bytes, layer_row_bytes, new_tokens=None) -> int:
        st.copy_row[g].fill_(-1)
        stamps = st.stamp[g].clone()
        launches = REFERENCE.plan(st, g, sel, scratch, write, group_row_bytes, layer_row_bytes, new_tokens)
        n_new = 0 if new_tokens is None else new_tokens.numel()
        T = n_new + sel.numel()
        k_free, V = int(st.ctl[int(K.E_KFREE)]), int(st.ctl[int(K.E_VICTIMS)])
        assert k_free < V, "the scenario must evict"
        j, new = choose(st, g, scratch, T, k_free, V)
        old = plant_victim(scratch, st.ctl.tolist(), j, new)
        # the plan's moves follow its lists
        decide_reference(st, g, scratch, T, T if write else n_new)
        if st.policy == K.EXACT_LRU:
            keep_in_lru_order(st, g, old)
        else:
            keep_in_bucket(st, g, old, new, int(stamps[old]))
        return launches

    return Kernels(plan, REFERENCE.apply)


def hit_slot(st, g, scratch, T, k_free, V) -> tuple[int, int]:
    """(a) The oldest eviction replaced by the slot of an address this call selects (a hit)."""
    return k_free, plan_hits(scratch, T)[0]


def newest_bucket_slot(st, g, scratch, T, k_free, V) -> tuple[int, int]:
    """(b) PB-LRU: the first eviction (cold or the oldest bucket) replaced by an unprotected slot of
    the newest bucket before the current round's."""
    cur = int(st.gctl[g, int(K.G_ROUND)])
    stamps, owner = st.stamp[g].tolist(), st.owner[g].tolist()
    newest = [s for s in range(st.gpu_slots) if owner[s] >= 0 and stamps[s] == cur - 1]
    assert newest, "the scenario must leave slots of the previous round unselected"
    return k_free, newest[0]


def younger_lru_entry(st, g, scratch, T, k_free, V) -> tuple[int, int]:
    """(c) ExactLRU: the oldest eviction replaced by the youngest unprotected entry left in place."""
    qcap, gctl = st.q_slot.shape[1], st.gctl[g].tolist()
    hits = set(plan_hits(scratch, T))
    taken = set(scratch.victims[:V].tolist())
    younger = []
    for i in range(gctl[int(K.G_HEAD)], gctl[int(K.G_ROUND_TAIL)]):
        s = int(st.q_slot[g, i % qcap])
        if int(st.q_ver[g, i % qcap]) == int(st.ver[g, s]) and s not in hits and s not in taken:
            younger.append(s)
    assert younger, "the scenario must leave unprotected entries in place"
    return k_free, younger[-1]


def used_this_round(st, g, scratch, T, k_free, V) -> tuple[int, int]:
    """(a, in a write) The oldest eviction replaced by a slot the round's prepare selected: a pair
    past ``round_tail`` (ExactLRU) or a slot stamped with the current round (PB-LRU)."""
    taken = set(scratch.victims[:V].tolist())
    gctl = st.gctl[g].tolist()
    if st.policy == K.EXACT_LRU:
        qcap = st.q_slot.shape[1]
        at = range(gctl[int(K.G_ROUND_TAIL)], gctl[int(K.G_TAIL)])
        pairs = [(int(st.q_slot[g, i % qcap]), int(st.q_ver[g, i % qcap])) for i in at]
        used = [s for s, v in pairs if v == int(st.ver[g, s])]
    else:
        stamps, owner = st.stamp[g].tolist(), st.owner[g].tolist()
        used = [s for s in range(st.gpu_slots) if owner[s] >= 0 and stamps[s] == gctl[int(K.G_ROUND)]]
    used = [s for s in used if s not in taken]
    assert used, "the scenario's round must have used slots"
    return k_free, used[0]


def scenario(policy) -> tuple[object, list[int]]:
    """A full 64-slot pool after six rounds with overlap (cold, ring buckets and a long LRU order),
    and a selection for the next round: 8 of the last round's picks (hits), 16 never selected
    (misses, so there are evictions), and the rest of the last round left unselected."""
    pool = build(policy, gpu_slots=64, cpu_slots=256, num_layers=1, per_group=1, kernels=REFERENCE)
    rng, gen = random.Random(7), torch.Generator().manual_seed(7)
    seqs = [pool.admit(60) for _ in range(4)]
    for seq in seqs:
        write_all(pool, seq.addresses, gen)
    every = [a for seq in seqs for a in seq.address_list]
    last: list[int] = []
    for _ in range(6):
        last = rng.sample(last, len(last) // 2) + rng.sample([a for a in every if a not in last], 40)
        last = last[:40]
        pool.prepare(0, torch.tensor(last).view(4, 10))
    fresh = [a for a in every if a not in set(last)]
    hits = last[:8]
    misses = [a for a in fresh if int(pool.residency(0, torch.tensor([a]))) < 0][:16]
    return pool, hits + misses


DEFECTS = [
    ("a-lru-evicts-a-hit", ExactLRU(), hit_slot, "invariant 4"),
    ("a-pblru-evicts-a-hit", PBLRU(num_buckets=4), hit_slot, "invariant 4"),
    (
        "b-pblru-newest-bucket-first",
        PBLRU(num_buckets=4),
        newest_bucket_slot,
        r"invariant 5: .* evicted while",
    ),
    ("c-lru-younger-entry", ExactLRU(), younger_lru_entry, "invariant 7: evicted"),
]


@pytest.mark.parametrize(
    ("policy", "choose", "message"), [d[1:] for d in DEFECTS], ids=[d[0] for d in DEFECTS]
)
def test_planted_defect_only_the_plan_check_catches(debug, policy, choose, message) -> None:
    pool, selection = scenario(policy)
    check_invariants(pool.internals().state, pool.internals().allocator)
    pool.internals().runner.kernels = corrupting(choose)
    with pytest.raises(InvariantError, match=message):
        pool.prepare(0, torch.tensor(selection).view(2, -1))
    # The raise came after PoolFrame._after_call's structural check had passed on the corrupted
    # state, and that check still passes: the defect is one that only the per-plan check sees.
    assert pool.internals().pending is None and pool.internals().audit is None
    check_invariants(pool.internals().state, pool.internals().allocator)


@pytest.mark.parametrize("policy", POLICIES)
def test_planted_defect_in_a_write(debug, policy) -> None:
    """A write of new entries takes slots too: evicting an entry the round's prepare selected
    breaks invariant 4, and only the per-plan check sees it."""
    pool, _ = scenario(policy)
    seq = pool.admit(6)
    pool.internals().runner.kernels = corrupting(used_this_round)
    rows = random_rows(torch.Generator().manual_seed(1), 6, WIDTH)
    with pytest.raises(InvariantError, match=r"invariant 4: .* used this round"):
        pool.write(0, seq.addresses, rows)
    check_invariants(pool.internals().state, pool.internals().allocator)


def hits_not_touched(st, g, sel, scratch, write, group_row_bytes, layer_row_bytes, new=None) -> int:
    """PB-LRU recency upkeep broken: the reference plan, then this call's hits back in the buckets
    they came from (their stamps and bits agree, so the state stays consistent)."""
    stamps = st.stamp[g].clone()
    launches = REFERENCE.plan(st, g, sel, scratch, write, group_row_bytes, layer_row_bytes, new)
    bits, cur = PBLRUBits(st, g), int(st.gctl[g, int(K.G_ROUND)])
    for s in plan_hits(scratch, sel.numel() + (0 if new is None else new.numel())):
        bits.sets[cur % bits.R].discard(s)
        st.stamp[g, s] = stamps[s]
        bits.sets[bits.bucket_of(int(stamps[s]), cur + 1)].add(s)
    bits.store()
    return launches


def appends_out_of_order(st, g, scratch, flat, *args, **kwargs) -> int:
    """ExactLRU recency upkeep broken: the reference apply, then the last two pairs it appended to
    the LRU ring swapped (every entry is still in the ring once)."""
    REFERENCE.apply(st, g, scratch, flat, *args, **kwargs)
    if kwargs.get("phases", (0, int(K.PH_COMMIT)))[1] >= int(K.PH_COMMIT):
        qcap, tail = st.q_slot.shape[1], int(st.gctl[g, int(K.G_TAIL)])
        i, j = (tail - 1) % qcap, (tail - 2) % qcap
        for t in (st.q_slot, st.q_ver):
            t[g, i], t[g, j] = t[g, j].clone(), t[g, i].clone()
    return 1


RECENCY_DEFECTS = [
    ("pblru-hits-not-touched", PBLRU(num_buckets=4), Kernels(hits_not_touched, REFERENCE.apply), "5: slot"),
    ("lru-appends-out-of-order", ExactLRU(), Kernels(REFERENCE.plan, appends_out_of_order), "7: LRU order"),
]


@pytest.mark.parametrize(
    ("policy", "kernels", "message"), [d[1:] for d in RECENCY_DEFECTS], ids=[d[0] for d in RECENCY_DEFECTS]
)
def test_planted_recency_defect_only_the_plan_check_catches(debug, policy, kernels, message) -> None:
    """The decisions of this call are right, but the recency they leave behind is not. The state
    after the plan, compared with the policy's rules applied to the snapshot, shows it."""
    pool, selection = scenario(policy)
    pool.internals().runner.kernels = kernels
    with pytest.raises(InvariantError, match=f"invariant {message}"):
        pool.prepare(0, torch.tensor(selection).view(2, -1))
    check_invariants(pool.internals().state, pool.internals().allocator)


# --------------------------------------------------------------------------------------------------
# the structural check at rest: each kind of damage it claims to see, planted by hand


def _at_rest(policy, gpu_slots: int):
    """A pool with both tiers used: its GPU slots full, the rest on the CPU, one selection applied."""
    pool = Pool(
        PoolConfig(
            entry=EntrySpec(bytes_per_layer=WIDTH),
            num_layers=2,
            layers_per_group=1,
            layout=Tiered(gpu_slots=gpu_slots, cpu_slots=9, policy=policy),
        )
    )
    seq = pool.admit(num_tokens=gpu_slots + 4)
    write_all(pool, seq.addresses, torch.Generator().manual_seed(1))
    pool.prepare(0, seq.addresses[[7, 8, 0]].view(1, 3))
    pool.release(pool.admit(num_tokens=2))  # two dead addresses past the live ones
    pool.check_invariants()
    return pool, seq.addresses.tolist()


def _gpu_homed(st, addrs: list[int]) -> list[int]:
    return [a for a in addrs if 0 <= int(st.mapping[0, a]) < st.gpu_slots]


def _cpu_homed(st, addrs: list[int]) -> list[int]:
    return [a for a in addrs if int(st.mapping[0, a]) >= st.gpu_slots]


def _share_a_home(st, addrs):
    a, b = _cpu_homed(st, addrs)[:2]
    st.mapping[0, b] = st.mapping[0, a]


def _dead_keeps_a_home(st, addrs):
    st.mapping[0, max(addrs) + 1] = int(st.mapping[0, _cpu_homed(st, addrs)[0]])


def _live_marked_free(st, addrs):
    st.mapping[0, addrs[3]] = -1


def _home_out_of_range(st, addrs):
    st.mapping[0, addrs[3]] = st.gpu_slots + st.cpu_slots + 1


def _owner_disagrees(st, addrs):
    a, b = _gpu_homed(st, addrs)[:2]
    st.owner[0, int(st.mapping[0, a])] = b


def _gpu_free_stack_lists_a_used_slot(st, addrs):
    st.gpu_free[0, 0] = st.mapping[0, _gpu_homed(st, addrs)[0]]
    st.gctl[0, int(K.G_GPU_FREE)] = 1


def _cpu_row_leaks(st, addrs):
    st.gctl[0, int(K.G_CPU_FREE)] -= 1  # a free CPU row falls off the list


def _lru_entry_forgotten(st, addrs):
    st.ver[0, int(st.mapping[0, _gpu_homed(st, addrs)[0]])] += 1  # its ring pairs turn stale


def _slot_in_two_buckets(st, addrs):
    bits = PBLRUBits(st, 0)
    slot = int(st.mapping[0, _gpu_homed(st, addrs)[0]])
    bits.sets[-1].add(slot)  # also cold
    bits.store()


def _phantom_slot(st, addrs):
    st.bits[0, 0] ^= 1 << 30  # bucket 0 lists slot 30 of a 6-slot pool


def _summary_bit_wrong(st, addrs):
    st.bits[0, int(st.levels[1])] ^= 1 << 31  # a summary bit over leaf word 31, of 2


STRUCTURAL = [
    ("share-a-home", None, 6, _share_a_home, "share one home"),
    ("dead-keeps-a-home", None, 6, _dead_keeps_a_home, "not live still has a mapping"),
    ("live-marked-free", None, 6, _live_marked_free, "live address is marked free"),
    ("home-out-of-range", None, 6, _home_out_of_range, "out of range"),
    ("owner-disagrees", None, 6, _owner_disagrees, "owner"),
    ("gpu-free-stack-used-slot", None, 6, _gpu_free_stack_lists_a_used_slot, "GPU free stack"),
    ("cpu-row-leaks", None, 6, _cpu_row_leaks, "CPU free list"),
    ("lru-entry-forgotten", ExactLRU(), 6, _lru_entry_forgotten, "LRU order"),
    ("slot-in-two-buckets", PBLRU(3), 6, _slot_in_two_buckets, "buckets"),
    ("bucket-lists-a-phantom-slot", PBLRU(3), 6, _phantom_slot, "past the"),
    ("summary-bit-wrong-40-slots", PBLRU(3), 40, _summary_bit_wrong, "summary bit"),
]


@pytest.mark.parametrize(
    ("policy", "gpu_slots", "damage", "message"), [c[1:] for c in STRUCTURAL], ids=[c[0] for c in STRUCTURAL]
)
def test_the_structural_check_sees_each_kind_of_damage(policy, gpu_slots, damage, message) -> None:
    pool, addrs = _at_rest(policy or ExactLRU(), gpu_slots)  # 40 slots: a summary level exists
    damage(pool.internals().state, addrs)
    with pytest.raises(InvariantError, match=message):
        check_invariants(pool.internals().state, pool.internals().allocator)


# -- copies: the rows a clean eviction would trust -----------------------------------------------


def _a_copy(st) -> tuple[int, int]:
    """(slot, row) of a copy in group 0 that a clean eviction would trust: ``_at_rest``'s swap-ins
    left one for each of the two addresses its prepare brought in."""
    copy_row, copy_slot = st.copy_row[0].tolist(), st.copy_slot[0].tolist()
    pairs = [(s, r) for s, r in enumerate(copy_row) if r >= 0 and copy_slot[r] == s]
    assert pairs, "the state at rest must hold a copy"
    return pairs[0]


def _copy_bytes_changed(st, addrs):
    _, row = _a_copy(st)
    st.cpu_data[0, row, WIDTH - 1] ^= 1  # layer 0: group 0's only layer


def _free_row_misplaced(st, addrs):
    row = int(st.free_cpu_rows(0)[0])
    st.cpu_pos[0, row] = (int(st.cpu_pos[0, row]) + 1) % st.cpu_stack_size


def _copy_names_a_home(st, addrs):
    slot, _ = _a_copy(st)
    home = int(st.mapping[0, _cpu_homed(st, addrs)[0]]) - st.gpu_slots
    st.copy_row[0, slot] = home
    st.copy_slot[0, home] = slot


def _copy_past_the_rows(st, addrs):
    slot, _ = _a_copy(st)
    st.copy_row[0, slot] = st.cpu_slots


COPY_DAMAGE = [
    ("lru-copy-bytes-changed", ExactLRU(), _copy_bytes_changed, "no longer holds its GPU slot's bytes"),
    ("pblru-copy-bytes-changed", PBLRU(3), _copy_bytes_changed, "no longer holds its GPU slot's bytes"),
    ("free-row-misplaced", ExactLRU(), _free_row_misplaced, "recorded place in the free list is wrong"),
    ("copy-names-a-home", ExactLRU(), _copy_names_a_home, "someone's home is taken for a copy"),
    ("pblru-copy-names-a-home", PBLRU(3), _copy_names_a_home, "someone's home is taken for a copy"),
    ("copy-past-the-rows", ExactLRU(), _copy_past_the_rows, "past the CPU rows"),
]


@pytest.mark.parametrize(
    ("policy", "damage", "message"), [c[1:] for c in COPY_DAMAGE], ids=[c[0] for c in COPY_DAMAGE]
)
def test_the_structural_check_sees_each_kind_of_damage_to_copies(policy, damage, message) -> None:
    pool, addrs = _at_rest(policy, 6)
    st = pool.internals().state
    check_invariants(st, pool.internals().allocator, pool.config.group_layers)  # sound, bytes included
    damage(st, addrs)
    with pytest.raises(InvariantError, match=message):
        check_invariants(st, pool.internals().allocator, pool.config.group_layers)


def test_the_copy_check_compares_every_layer_of_the_group() -> None:
    """A copy damaged in the second layer of a two-layer group: caught when the check is given the
    groups' layers, and (as documented) not looked at without them."""
    pool = Pool(
        PoolConfig(
            entry=EntrySpec(bytes_per_layer=WIDTH),
            num_layers=3,
            layers_per_group=2,
            layout=Tiered(gpu_slots=4, cpu_slots=6),
        )
    )
    seq = pool.admit(num_tokens=8)
    write_all(pool, seq.addresses, torch.Generator().manual_seed(2))
    pool.prepare(0, seq.addresses[[5]].view(1, 1))  # on the CPU: swaps in, leaving a copy
    st = pool.internals().state
    check_invariants(st, pool.internals().allocator, pool.config.group_layers)
    _, row = _a_copy(st)
    st.cpu_data[1, row, 0] ^= 0x80
    check_invariants(st, pool.internals().allocator)  # bytes unchecked
    with pytest.raises(InvariantError, match="no longer holds its GPU slot's bytes"):
        check_invariants(st, pool.internals().allocator, pool.config.group_layers)


def one_home_for_two(plan_stage):
    """A planted wrong plan: the real plan, then its second miss given the first one's GPU slot."""

    def plan(st, g, sel, scratch, *args) -> int:
        launches = plan_stage(st, g, sel, scratch, *args)
        slots = scratch.moves[int(K.MV_SLOT)]
        assert int(st.ctl[int(K.E_MISSES)]) >= 2 and int(slots[0]) >= 0, "the scenario moves two misses"
        slots[1] = slots[0]
        return launches

    return plan


@pytest.mark.parametrize(
    ("policy", "new_rows"), [(ExactLRU(), False), (PBLRU(3), True)], ids=["lru", "pblru-new"]
)
def test_a_plan_giving_one_home_to_two_misses_fails_on_the_device(debug, policy, new_rows) -> None:
    """Under ULAKV_DEBUG apply claims every GPU slot and CPU row its moves write by an atomic
    exchange; a second claim in one call is counted on the device and raised, before the host's
    own checks look. The kernel and its reference count alike."""
    for kernels in (TRITON, REFERENCE):
        pool = build(policy, 6, 16, 1, 1, kernels)
        gen = torch.Generator().manual_seed(8)
        seq = pool.admit(12)
        write_all(pool, seq.addresses, gen)  # 6 on the GPU, 6 on the CPU
        pool.prepare(0, seq.addresses[:6].view(1, 6))
        pool.internals().runner.kernels = Kernels(one_home_for_two(kernels.plan), kernels.apply)
        new = None
        if new_rows:
            extra = pool.extend(seq, 1)
            new = NewRows(0, extra, random_rows(gen, 1, WIDTH))
        with pytest.raises(InvariantError, match="one home to two misses: 1 GPU slots or CPU rows"):
            pool.prepare(0, seq.addresses[8:12].view(1, 4), new=new)
    # Without the plant the same calls pass: nothing claims a home twice.
    pool = build(policy, 6, 16, 1, 1, TRITON)
    seq = pool.admit(12)
    write_all(pool, seq.addresses, torch.Generator().manual_seed(8))
    pool.prepare(0, seq.addresses[:6].view(1, 6))
    pool.prepare(0, seq.addresses[8:12].view(1, 4))
