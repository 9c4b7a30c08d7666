"""Checks of the invariants of ``docs/design.md`` (section 4), run on the host. They synchronise,
so only tests and ``ULAKV_DEBUG=1`` use them; the hot path never does.

There are two kinds of check, because some invariants hold of a resting state and others hold of a
decision:

* :func:`check_invariants` checks a whole state at rest. It covers invariant 1 and the
  bookkeeping that invariant 6's release relies on, and it checks that the policy's recency
  structure is well formed. Under ``ULAKV_DEBUG=1`` every pool kind runs it after each call that
  changes it.
* :func:`snapshot_plan` and :func:`check_plan` check one plan's decisions (invariants 3, 4, 5 and
  7). They compare those decisions with a host snapshot of the group, taken right before the plan
  kernels ran. Under ``ULAKV_DEBUG=1`` a ``TieredPool`` (tiered or replicated layout, and a striped
  rank's inner slice) takes the snapshot and checks each plan once it has finished. A striped
  rank's buffer and the offload baseline's buffers drive ``TieredRunner`` directly, so they get
  the structural check only.

The data half of invariant 3 ("the returned slot holds its data") needs the bytes a caller wrote.
Only tests that keep a reference copy check it; nothing here does.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

import torch

from .address_space import FREE, UNHOMED, LogicalAllocator
from .errors import InvariantError
from .kernels import common as K
from .kernels.buckets import PBLRUBits
from .policies.exact_lru import ExactLRUModel
from .policies.protocol import distinct


def _fail(group: int, message: str) -> NoReturn:
    raise InvariantError(f"group {group}: {message}")


def check_invariants(
    state, allocator: LogicalAllocator, group_layers: Callable[[int], range] | None = None
) -> None:
    """Check the structure of ``state`` (a ``TieredState`` or ``BufferState``) at rest, in every
    group, and raise InvariantError if it is broken.

    * Invariant 1: no live address is marked FREE, and no two addresses map to one home (GPU slot
      or CPU row). Each GPU slot's owner and each address's mapping agree, and the GPU and
      CPU free lists hold exactly the slots that hold nothing. Together these make
      distinct entries = physical slots used.
    * Invariant 6, first half: after a release no address that is not live keeps a mapping, and no
      GPU slot is owned by such an address. The second half, "a pool with no requests equals a
      fresh pool", is not checked here.
    * Well-formed policy order. Exact LRU: every occupied GPU slot appears exactly once among the
      valid ring pairs, and no free slot appears. PB-LRU: every occupied slot is in exactly the
      bucket its stamp names, free slots are in none, and the summary bits match the words below
      them. This is the state that the per-plan checks of invariants 4, 5 and 7 (:func:`check_plan`)
      read their recency order from. Whether a decision was right is not a property of a resting
      state, so this function checks none of invariants 3, 4, 5 or 7.
    """
    G, C, N = state.gpu_slots, state.cpu_slots, state.num_addresses
    live = torch.ones(N, dtype=torch.bool)
    for run in allocator.free_runs():
        live[run.start : run.stop] = False
    for g in range(state.num_groups):
        mapping = state.mapping[g].cpu().to(torch.int64)
        owner = state.owner[g].cpu().to(torch.int64)
        gctl = state.gctl[g].cpu().tolist()
        if bool((mapping[~live] != FREE).any()):
            _fail(g, "invariant 6: an address that is not live still has a mapping")
        if bool((mapping[live] == FREE).any()):
            _fail(g, "invariant 1: a live address is marked free")
        if bool(((mapping < -2) | (mapping >= G + C)).any()):
            _fail(g, "invariant 1: a mapping value is out of range")
        homed = torch.nonzero(mapping >= 0).flatten()
        homes = mapping[homed]
        if homes.unique().numel() != homes.numel():
            _fail(g, "invariant 1: two addresses share one home")
        on_gpu = homes < G
        if not torch.equal(owner[homes[on_gpu]], homed[on_gpu]):
            _fail(g, "invariant 1: a GPU slot's owner disagrees with the mapping")
        owned = torch.nonzero(owner >= 0).flatten()
        dead = owned[~live[owner[owned].clamp(max=N - 1)] | (owner[owned] >= N)]
        if dead.numel():
            s = int(dead[0])
            _fail(g, f"invariant 6: GPU slot {s} is owned by address {int(owner[s])}, which is not live")
        if not torch.equal(mapping[owner[owned]], owned):
            _fail(g, "invariant 1: a GPU slot is owned by an address that does not map to it")
        n_gpu_free, n_cpu_free = gctl[int(K.G_GPU_FREE)], gctl[int(K.G_CPU_FREE)]
        gpu_free = state.gpu_free[g, :n_gpu_free].cpu().to(torch.int64)
        expected_gpu_free = torch.nonzero(owner < 0).flatten()
        if not torch.equal(gpu_free.sort().values, expected_gpu_free):
            _fail(g, "invariant 1: the GPU free stack does not list exactly the unowned slots")
        cpu_used = torch.zeros(max(C, 1), dtype=torch.bool)
        cpu_used[homes[~on_gpu] - G] = True
        if not 0 <= n_cpu_free <= C or not 0 <= gctl[int(K.G_CPU_BOT)] < state.cpu_stack_size:
            _fail(g, f"invariant 1: the CPU free list's bounds are broken ({n_cpu_free} rows)")
        cpu_free = state.free_cpu_rows(g).to(torch.int64)
        expected_cpu_free = torch.nonzero(~cpu_used[:C]).flatten()
        if not torch.equal(cpu_free.sort().values, expected_cpu_free):
            _fail(g, "invariant 1: the CPU free list does not hold exactly the unused CPU rows")
        _check_copies(state, g, owner, cpu_free, group_layers(g) if group_layers else None)
        if state.policy == K.EXACT_LRU:
            _check_lru_ring(state, g, owner, gctl)
        else:
            _check_buckets(state, g, owner, gctl)


def _check_copies(state, g: int, owner: torch.Tensor, cpu_free: torch.Tensor, layers: range | None) -> None:
    """Every free row knows its place in the free list, and every copy a clean eviction would
    trust (a slot and a free row naming each other) is of an occupied slot, not among the plain
    rows on top of the list (``G_CPU_PLAIN``: a write takes its copies there), and equal, every
    layer of the group (``layers``; unchecked when ``None``), to the slot's bytes."""
    cap = state.cpu_stack_size
    bot = int(state.gctl[g, int(K.G_CPU_BOT)])
    at = (bot + torch.arange(cpu_free.numel())) % cap
    if not torch.equal(state.cpu_pos[g].cpu().to(torch.int64)[cpu_free], at):
        _fail(g, "a free CPU row's recorded place in the free list is wrong")
    copy_row = state.copy_row[g].cpu().to(torch.int64)
    slots = torch.nonzero(copy_row >= 0).flatten()
    if bool((copy_row[slots] >= state.cpu_slots).any()):
        _fail(g, "a GPU slot names a CPU copy past the CPU rows")
    rows = copy_row[slots]
    trusted = state.copy_slot[g].cpu().to(torch.int64)[rows] == slots
    slots, rows = slots[trusted], rows[trusted]
    if bool((owner[slots] < 0).any()):
        _fail(g, "a free GPU slot has a CPU copy")
    free = torch.zeros(max(state.cpu_slots, 1), dtype=torch.bool)
    free[cpu_free] = True
    if bool((~free[rows]).any()):
        _fail(g, "a CPU row that is someone's home is taken for a copy")
    plain = int(state.gctl[g, int(K.G_CPU_PLAIN)])
    on_top = cpu_free[cpu_free.numel() - plain :] if plain else cpu_free[:0]
    if not 0 <= plain <= cpu_free.numel() or bool(torch.isin(rows, on_top).any()):
        _fail(g, f"the {plain} plain rows on top of the free list include a copy a write would take")
    if layers is None:
        return
    gpu = state.gpu_data[layers.start : layers.stop].cpu()
    cpu = state.cpu_data[layers.start : layers.stop].cpu()
    if not torch.equal(gpu[:, slots], cpu[:, rows]):
        _fail(g, "a CPU copy no longer holds its GPU slot's bytes (a clean eviction would lose them)")


def _ring_pairs(state, g: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact LRU: the slots of the ring's valid pairs from ``head`` (oldest first), and whether each
    lies past ``round_tail``, that is, was used in the current round."""
    gctl = state.gctl[g].cpu().tolist()
    head, tail, round_tail = gctl[int(K.G_HEAD)], gctl[int(K.G_TAIL)], gctl[int(K.G_ROUND_TAIL)]
    at = torch.arange(head, tail)
    idx = at % state.q_slot.shape[1]
    q_slot = state.q_slot[g].cpu().to(torch.int64)[idx]
    valid = state.q_ver[g].cpu()[idx] == state.ver[g].cpu()[q_slot]
    return q_slot[valid], (at >= round_tail)[valid]


def _check_lru_ring(state, g: int, owner: torch.Tensor, gctl: list[int]) -> None:
    G = state.gpu_slots
    head, tail = gctl[int(K.G_HEAD)], gctl[int(K.G_TAIL)]
    round_tail, qcap = gctl[int(K.G_ROUND_TAIL)], state.q_slot.shape[1]
    if not head <= round_tail <= tail or tail - head > qcap:
        _fail(g, f"LRU queue bounds broken: head {head}, round tail {round_tail}, tail {tail}")
    slots, _ = _ring_pairs(state, g)
    counts = torch.bincount(slots, minlength=G)
    if not torch.equal(counts, (owner >= 0).to(torch.int64)):
        _fail(g, "a GPU entry is missing from the LRU order, or a free slot is in it")


def _check_buckets(state, g: int, owner: torch.Tensor, gctl: list[int]) -> None:
    """PB-LRU: every occupied slot is in exactly the bucket its stamp names, free slots in none,
    and every summary bit says exactly whether the word below it is non-empty."""
    bitmaps = PBLRUBits(state, g)
    ref = gctl[int(K.G_ROUND)] + 1
    stamps = state.stamp[g].cpu().tolist()
    where = {}
    for b, slots in enumerate(bitmaps.sets):
        for s in slots:
            if s in where:
                _fail(g, f"slot {s} is in buckets {where[s]} and {b}")
            if s >= state.gpu_slots:
                _fail(g, f"bucket {b} lists slot {s}, past the {state.gpu_slots} GPU slots")
            where[s] = b
    for s in range(state.gpu_slots):
        occupied = int(owner[s]) >= 0
        if occupied != (s in where):
            _fail(
                g,
                f"slot {s}: occupied is {occupied}, in a bucket is {not occupied}",
            )
        expected = bitmaps.bucket_of(stamps[s], ref) if occupied else None
        if occupied and where[s] != expected:
            _fail(g, f"slot {s} sits in bucket {where[s]}, its stamp {stamps[s]} says {expected}")
    if not torch.equal(bitmaps.packed(), state.bits[g].cpu()):
        _fail(g, "a PB-LRU summary bit disagrees with the words below it")


# -- one plan's decisions ------------------------------------------------------------------------


@dataclass(frozen=True)
class PlanSnapshot:
    """What one group looked like right before a plan's kernels ran. It is a host copy, and it
    holds everything the plan's decisions are checked against."""

    group: int
    write: bool
    selection: list[int]  # the flattened selection or write (-1: padding)
    homes: dict[int, int]  # mapping value of each selected address in range
    owner: list[int]  # address in each GPU slot (-1: free)
    free: list[int]  # GPU free stack, bottom to top (the top is handed out first)
    round: int  # G_ROUND: rounds started by prepare
    ring: list[tuple[int, bool]] | None  # exact LRU: (slot, used this round), oldest first
    stamp: list[int] | None  # PB-LRU: round each slot was last used
    new: int = 0  # a prepare's new tokens (``NewRows``), the selection's first elements


def snapshot_plan(
    state, group: int, selection: torch.Tensor, *, write: bool, new: torch.Tensor | None = None
) -> PlanSnapshot:
    """Copy the group's residency and recency to the host, for :func:`check_plan`. Call this right
    before the plan kernels of a prepare (``write=False``) or a write of ``selection`` run; a
    prepare's ``new`` addresses (``NewRows``) lead its elements, as its plan orders them."""
    sel = selection.reshape(-1).to(torch.int64).cpu().tolist()
    n_new = 0
    if new is not None:
        n_new = new.numel()
        sel = new.reshape(-1).to(torch.int64).cpu().tolist() + sel
    N = state.num_addresses
    held = sorted({a for a in sel if 0 <= a < N})
    homes = {}
    if held:
        at = torch.tensor(held, dtype=torch.int64, device=state.mapping.device)
        homes = dict(zip(held, state.mapping[group, at].tolist(), strict=True))
    gctl = state.gctl[group].tolist()
    lru = state.policy == K.EXACT_LRU
    ring = None
    if lru:
        slots, recent = _ring_pairs(state, group)
        ring = list(zip(slots.tolist(), recent.tolist(), strict=True))
    return PlanSnapshot(
        group=group,
        write=write,
        selection=sel,
        homes=homes,
        owner=state.owner[group].tolist(),
        free=state.gpu_free[group, : gctl[int(K.G_GPU_FREE)]].tolist(),
        round=gctl[int(K.G_ROUND)],
        ring=ring,
        stamp=None if lru else state.stamp[group].tolist(),
        new=n_new,
    )


def check_plan(state, plan, snap: PlanSnapshot) -> None:
    """Check the decisions of ``plan`` (a finished ``TransferPlan`` over ``state``) against ``snap``,
    and raise InvariantError naming the invariant that is broken. The plan's scratch and control
    words must still be the plan's own, which is the case until the pool plans its next call. The
    expectations come from the snapshot and the plain policy rules, not from the kernels or their
    references. A refused call decided nothing and passes.

    Decisions (the plan's hits, misses and victim slots, against the state before it):

    * 1: the victim slots are distinct GPU slots. The first ``k_free`` of them come off the top of
      the free stack and were free; the rest were occupied.
    * Hits and misses are exactly the selected addresses that were GPU-resident and not resident
      before the call. For a write, the misses are the addresses that had no home. This is
      invariant 7 under exact LRU and invariant 3 under PB-LRU (a misclassified hit loses data).
    * 4: no evicted slot held an address of this selection, or an entry used earlier in the current
      round. Under exact LRU that means ring pairs past ``round_tail`` in a write; under PB-LRU,
      slots stamped with the current round. A slot in flight belongs to the pending plan,
      and the pool finishes that plan before it plans again, so the slots a call protects are the
      only pinned ones.
    * The free slots go first: ``min(misses, free)`` of them. This is invariant 7 under exact LRU
      and invariant 5 under PB-LRU.
    * 3: a prepare gives every miss a GPU slot.
    * 5 (PB-LRU): count a slot's age in buckets (0 for the current round, up to ``num_buckets`` for
      cold). No victim is younger than an occupied, unprotected slot left in place, and the
      victims' ages do not increase along the victim list (cold, then the ring oldest first). A
      write sends an entry to the CPU only when nothing is left to evict.
    * 7 (exact LRU): run ``ExactLRUModel``, started from the snapshot's ring order, on the same
      selection. Its victims (the oldest unprotected entries, in order, after the free slots) and
      the misses it homes on the GPU must equal the plan's.

    The state after the plan:

    * 3: each element of a prepare maps to the GPU slot the plan returned for it (-1 for padding;
      a prepare's new tokens, which return none, to a GPU slot). Whether that slot holds the right
      data is not checked here.
    * 7 (exact LRU): the ring's valid pairs, oldest first, are the model's order, and exactly the
      model's current-round entries lie past ``round_tail``.
    * 5 (PB-LRU): every slot this call used (hits and filled victims) is stamped with the current
      round, and every other occupied slot keeps its stamp.
    """
    g, G = snap.group, state.gpu_slots
    lru = state.policy == K.EXACT_LRU
    ctl = plan.ctl.cpu().tolist()
    if ctl[int(K.E_LAST_STATUS)]:
        return
    k_free, V = ctl[int(K.E_KFREE)], ctl[int(K.E_VICTIMS)]
    sel, T = snap.selection, len(snap.selection)
    flags = plan.scratch.flags[:T].cpu().tolist()
    home = plan.scratch.home[:T].cpu().tolist()
    moves = plan.describe()
    misses = moves["address"].tolist()
    victims = moves["gpu_slot"].tolist()[:V]
    M = len(misses)
    owner, free = snap.owner, snap.free
    policy_inv = 7 if lru else 5  # the invariant a policy-specific decision falls under
    lookup_inv = 7 if lru else 3  # the invariant a misclassified hit or miss breaks

    # -- 1: the slots handed out ---------------------------------------------------------------
    if not 0 <= k_free <= V <= M:
        _fail(g, f"invariant 1: {k_free} free slots and {V} victims for {M} misses")
    if len(set(victims)) != V or not all(0 <= s < G for s in victims):
        _fail(g, f"invariant 1: the victim slots {victims} are not distinct GPU slots")
    if sorted(victims[:k_free]) != sorted(free[len(free) - k_free :]):
        _fail(g, f"invariant 1: free slots {victims[:k_free]} are not the top {k_free} of the free stack")
    evicted = victims[k_free:]
    for s in evicted:
        if owner[s] < 0:
            _fail(g, f"invariant 1: slot {s} counts as evicted but was free")

    # -- hits and misses -----------------------------------------------------------------------
    selected = distinct(sel)
    resident = {a for a in selected if 0 <= snap.homes[a] < G}
    hits = [(sel[p], home[p]) for p in range(T) if flags[p] & int(K.F_FIRST) and flags[p] & int(K.F_GPU)]
    expected_hits = [(a, snap.homes[a]) for a in selected if a in resident]
    if hits != expected_hits:
        _fail(g, f"invariant {lookup_inv}: hits (address, slot) {hits[:8]}, expected {expected_hits[:8]}")
    if snap.write:
        expected_misses = [a for a in selected if snap.homes[a] == UNHOMED]
    else:
        expected_misses = [a for a in selected if a not in resident]
    if misses != expected_misses:
        _fail(g, f"invariant {lookup_inv}: misses {misses[:8]}, expected {expected_misses[:8]}")

    # -- 4: nothing selected, protected or used this round is evicted ---------------------------
    if lru:
        used_now = {owner[s] for s, recent in snap.ring if recent} if snap.write else set()
    else:
        cur = snap.round if snap.write else snap.round + 1
        used_now = {owner[s] for s in range(G) if owner[s] >= 0 and snap.stamp[s] == cur}
    chosen = set(selected)
    for s in evicted:
        if owner[s] in chosen:
            _fail(g, f"invariant 4: slot {s} was evicted, but its address {owner[s]} is selected now")
        if owner[s] in used_now:
            _fail(g, f"invariant 4: slot {s} was evicted, but its address {owner[s]} was used this round")

    # -- free slots first; a prepare homes every miss on the GPU ------------------------------
    if k_free != min(M, len(free)):
        _fail(g, f"invariant {policy_inv}: {k_free} free slots taken for {M} misses, {len(free)} were free")
    if not snap.write and V != M:
        _fail(g, f"invariant 3: only {V} of {M} misses got a GPU slot")

    if lru:
        model = _check_lru_decisions(g, G, snap, misses, V, [owner[s] for s in evicted])
    else:
        _check_pblru_decisions(g, state.num_buckets, snap, hits, evicted, M, V, k_free)

    # -- the state the plan left ---------------------------------------------------------------
    if not snap.write:
        slots = [None] * snap.new + plan.slots[: T - snap.new].cpu().tolist()
        at = torch.tensor(list(snap.homes), dtype=torch.int64, device=state.mapping.device)
        maps = dict(zip(snap.homes, state.mapping[g, at].tolist(), strict=True))
        for p, a in enumerate(sel):
            want = -1 if a == -1 else maps[a]
            if p < snap.new:  # a new token: no slot out, but a home on the GPU
                slots[p] = want if a == -1 or 0 <= want < G else slots[p]
            if slots[p] != want or (a != -1 and not 0 <= want < G):
                _fail(g, f"invariant 3: element {p} (address {a}) got slot {slots[p]}, its home is {want}")
    if lru:
        after, recent = _ring_pairs(state, g)
        now = state.owner[g].tolist()
        order = [now[s] for s in after.tolist()]
        if order != list(model.order):
            _fail(g, f"invariant 7: LRU order after the call {order[-8:]}, model {list(model.order)[-8:]}")
        this_round = [now[s] for s, r in zip(after.tolist(), recent.tolist(), strict=True) if r]
        if this_round != [a for a, used in model.order.items() if used == model.round]:
            _fail(g, "invariant 7: the entries past round_tail are not the ones used in the current round")
    else:
        cur = snap.round if snap.write else snap.round + 1
        stamp, now = state.stamp[g].tolist(), state.owner[g].tolist()
        used = {s for _, s in hits} | set(victims)
        for s in range(G):
            if now[s] < 0:
                continue
            want = cur if s in used else snap.stamp[s]
            if stamp[s] != want:
                _fail(g, f"invariant 5: slot {s} is stamped round {stamp[s]} after the call, expected {want}")


def _check_lru_decisions(
    g: int, G: int, snap: PlanSnapshot, misses: list[int], V: int, evicted: list[int]
) -> ExactLRUModel:
    """Invariant 7: ExactLRUModel, started from the snapshot's ring order, takes the plan's step.
    Returns the model after the step."""
    model = ExactLRUModel(G, protocol=False)
    model.round = 1  # entries past round_tail were used in round 1, the rest before it
    model.order = OrderedDict((snap.owner[s], int(recent)) for s, recent in snap.ring)
    if len(model.order) + len(snap.free) != G:
        _fail(g, f"invariant 1: {len(model.order)} entries in the LRU order, {len(snap.free)} free slots")
    if snap.write:
        on_gpu, victims = model.write(snap.selection, set(misses))
    else:
        _, on_gpu, victims = model.prepare(snap.selection)
    if evicted != victims:
        _fail(
            g,
            f"invariant 7: evicted {evicted[:8]}, but the oldest unprotected entries are {victims[:8]}",
        )
    if misses[:V] != on_gpu:
        _fail(g, f"invariant 7: misses homed on the GPU {misses[:V][:8]}, model {on_gpu[:8]}")
    return model


def _check_pblru_decisions(
    g: int,
    R: int,
    snap: PlanSnapshot,
    hits: list[tuple[int, int]],
    evicted: list[int],
    M: int,
    V: int,
    k_free: int,
) -> None:
    """Invariant 5: no victim is newer than an unprotected slot left in place, and victims come
    cold first, then the ring's oldest bucket first."""
    stamp, owner = snap.stamp, snap.owner
    cur = snap.round if snap.write else snap.round + 1
    ref = snap.round + 1  # between rounds: rounds before ref - R + 1 were merged into cold

    def age(s: int) -> int:
        return R if ref - stamp[s] >= R else cur - stamp[s]

    protected = {s for _, s in hits} | {s for s in range(len(owner)) if owner[s] >= 0 and age(s) == 0}
    gone = protected | set(evicted)
    kept = [s for s in range(len(owner)) if owner[s] >= 0 and s not in gone]
    ages = [age(s) for s in evicted]
    if ages and kept:
        oldest_kept = max(kept, key=age)
        newest = min(range(len(ages)), key=ages.__getitem__)
        if ages[newest] < age(oldest_kept):
            _fail(
                g,
                f"invariant 5: slot {evicted[newest]} (bucket age {ages[newest]}) evicted while slot "
                f"{oldest_kept} (age {age(oldest_kept)}, unprotected) stays",
            )
    for i in range(len(ages) - 1):
        if ages[i] < ages[i + 1]:
            _fail(
                g,
                f"invariant 5: victim slot {evicted[i + 1]} (bucket age {ages[i + 1]}) taken after slot "
                f"{evicted[i]} (age {ages[i]}): not oldest bucket first",
            )
    if snap.write and V < M and (kept or k_free < len(snap.free)):
        _fail(g, f"invariant 5: {M - V} new entries went to the CPU while a GPU slot could take them")
