"""Lookup and plan: logical address -> home, with validation, dedup, hit mask and protection, and
the plan of every move, fused into two launches over the flattened selection (``CHUNK`` elements a
program):

1. ``claim``: validate every address (in range, live) and claim it: ``atomic_max`` of
   ``(epoch << 32) | ~position`` into a per-address word, so the lowest position of this call wins.
   The element that finds no claim of this epoch counts one distinct address (and one miss, if it
   needs a GPU slot: classify bounds the call's CPU pops with it); in a write, one that
   finds one is a duplicate. Every hit marks its GPU slot as protected for this call. After this
   launch the call's status is complete (bad addresses, duplicates, and whether the distinct
   addresses fit the GPU tier) and so are the marks.
2. ``classify``: an element is the address's *first* occurrence when its key survived. Firsts
   count hits and misses and list the misses of their chunk in order. Duplicates (speculative query
   positions, layers' repeats) only read. Every program also copies its share of the free stacks'
   tops and lists its share of the policy's eviction candidates (``ulakv.kernels.victims``): a
   ring segment under exact LRU; under PB-LRU a range of slots in every bucket, the launch having
   at least one program per range.

3. victims (``ulakv.kernels.victims``): the last ``classify`` program to finish runs it. Each program
   ends with a barrier and an acquire-release ``atomic_add`` on an arrival counter; the program that
   draws ticket ``P - 1`` has seen every other program's stores (each released them, the chain of
   read-modify-writes carries them, its acquire takes them), so it plans without a launch of its
   own. One launch fewer a call: 3 per ``prepare`` instead of 4, and room for the engine's
   cross-layer split within 4. (The same release/acquire handshake PyTorch Inductor's grid barrier
   uses; Triton runs a scalar atomic once per program.)

Dedup needs every claim to land before any program reads one, and the candidate lists every mark,
and no program may wait for another (they need not all be resident): that is why this is two
launches. Claims and marks are
epoch-tagged scratch; the only pool state ``classify`` changes is a policy's recency (PB-LRU moves
hits to the current bucket), and only when the status says the call will go through, so a refused
call changes nothing.
"""

from __future__ import annotations

import torch

from . import buckets, decide, round_end
from . import common as K
from . import segments as S
from ._triton import tl, triton
from .buckets import PBLRUBits
from .grid import learn, program_slots
from .segments import (
    arrive,
    seal_reference,
    segment_blocks,
    store_segment,
    store_segment_reference,
)
from .victims import (
    PLAN_LANES,
    _clean_candidates,
    _packed_candidates,
    clean_candidates_reference,
    need_pops,
    packed_candidates_reference,
    ring_block_scan,
    ring_candidates_reference,
    ring_compaction_due,
    ring_compaction_due_reference,
    ring_live,
    ring_live_reference,
    victims_program,
    victims_reference,
    writes_through,
    writes_through_reference,
)


# Not specialised: T (batch size), N (capacity: a bounds check only, so pools of any size share the
# binary); sel_ptr and map_ptr alignment (the caller's view; row g of mapping). claim_ptr and ctl_ptr
# are whole-pool tensors, allocated once: their alignment never changes. WRITE, CHUNK: constexprs.
# (Before: 10 claim variants in tests/test_compile_variants.py's serving loop, about 4 s each on a GPU.)
@triton.jit(
    do_not_specialize=["T", "N", "G", "n_new"],
    do_not_specialize_on_alignment=["sel_ptr", "new_ptr", "map_ptr"],
)
def claim_kernel(
    sel_ptr,
    new_ptr,
    T,
    N,
    G,
    n_new,
    map_ptr,
    claim_ptr,
    mark_ptr,
    ctl_ptr,
    block_counts_ptr,
    WRITE: tl.constexpr,
    CHUNK: tl.constexpr,
):
    pid = tl.program_id(0)
    # The first chunk of each COUNT_BLOCK zeroes the row the classify programs add their counts
    # into (a launch boundary orders it before them).
    if pid % K.COUNT_BLOCK == 0:
        word = tl.arange(0, 4)  # COUNT_WORDS
        tl.store(block_counts_ptr + (pid // K.COUNT_BLOCK) * K.COUNT_WORDS + word, word * 0)
    pos = pid.to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
    inb = pos < T
    a = K.element_addresses(sel_ptr, new_ptr, n_new, pos, inb, -1)
    in_range = (a >= 0) & (a < N)
    home = tl.load(map_ptr + a, mask=inb & in_range, other=K.M_FREE)
    ok = inb & in_range & (home != K.M_FREE)
    bad = inb & (a != -1) & ~ok
    epoch = tl.load(ctl_ptr + K.E_EPOCH)
    # Protect the call's hits from eviction before any classify program looks for victims.
    tl.store(mark_ptr + home, epoch, mask=ok & (home >= 0) & (home < G))
    key = (epoch << 32) | (K.POS_MASK - pos)
    # Relaxed: only the read-modify-writes themselves must not be lost; the classify launch that
    # reads claims, counts and status comes after a launch boundary.
    previous = tl.atomic_max(claim_ptr + a, key, mask=ok, sem="relaxed")
    arrived_first = ok & ((previous >> 32) != epoch)
    if WRITE:  # a write's entries that need a slot are new ones; a prepare's, those not on the GPU
        needs = home == K.M_UNHOMED
    else:
        needs = (home < 0) | (home >= G)
    # Distinct addresses, and those that need a GPU slot, in one two-lane atomic (E_DISTINCT, E_NEED):
    # classify bounds this call's CPU pops with the second before it knows the victims.
    pair = tl.arange(0, 2)
    distinct = tl.sum(arrived_first.to(tl.int64), axis=0)
    need = tl.sum((arrived_first & needs).to(tl.int64), axis=0)
    tl.atomic_add(ctl_ptr + K.E_DISTINCT + pair, tl.where(pair == 0, distinct, need), sem="relaxed")
    if tl.sum(bad.to(tl.int32), axis=0) > 0:
        tl.atomic_or(ctl_ptr + K.E_STATUS, K.ST_BAD_ADDRESS, sem="relaxed")
    if WRITE:
        if tl.sum((ok & ~arrived_first).to(tl.int32), axis=0) > 0:
            tl.atomic_or(ctl_ptr + K.E_STATUS, K.ST_DUPLICATE, sem="relaxed")
    elif n_new > 0:
        # A prepare's new tokens (positions below n_new) must have no home and appear once among
        # themselves (the selection may repeat them). Of two new positions with one address, the
        # later to claim finds the other's key or a higher one, which is a new position's too.
        new = ok & (pos < n_new)
        repeated = ((previous >> 32) == epoch) & (K.POS_MASK - (previous & K.POS_MASK) < n_new)
        if tl.sum((new & ((home != K.M_UNHOMED) | repeated)).to(tl.int32), axis=0) > 0:
            tl.atomic_or(ctl_ptr + K.E_STATUS, K.ST_NOT_NEW, sem="relaxed")
        n = tl.sum(new.to(tl.int64), axis=0)
        tl.atomic_add(ctl_ptr + K.E_NEW_MISSES, n, mask=n > 0, sem="relaxed")


# Not specialised: every int (T varies each call, group_row_bytes with the short last group, the rest
# are pool constants that feed no vectorisable access: specialising them only splits binaries by pool
# size); the alignment of the caller's selection, of every group's row of a [groups, ...] tensor and
# of the group's report word (8 bytes apart: odd groups' words are not 16-byte aligned).
# Specialised: whole-pool tensors and the call scratch (allocated whole: alignment fixed), constexprs.
# (Before: up to 15 classify variants in that loop; now 2, a prepare's and a write's.)
@triton.jit(
    do_not_specialize=[
        "T",
        "N",
        "G",
        "n_new",
        "BW",
        "n_levels",
        "R",
        "Qcap",
        "C",
        "group_row_bytes",
        "layer_row_bytes",
    ],
    do_not_specialize_on_alignment=[
        "sel_ptr",
        "new_ptr",
        "report_ptr",
        "map_ptr",
        "gctl_ptr",
        "bits_ptr",
        "stamp_ptr",
        "ver_ptr",
        "q_slot_ptr",
        "q_ver_ptr",
        "gpu_free_ptr",
        "cpu_free_ptr",
        "cpu_pos_ptr",
        "copy_row_ptr",
        "copy_slot_ptr",
    ],
)
def classify_kernel(
    sel_ptr,
    new_ptr,
    T,
    N,
    G,
    n_new,
    map_ptr,
    claim_ptr,
    mark_ptr,
    ctl_ptr,
    home_ptr,
    flags_ptr,
    counts_ptr,
    miss_pos_ptr,
    miss_rank_ptr,
    hit_rank_ptr,
    cpu_rank_ptr,
    first_pos_ptr,
    gctl_ptr,
    bits_ptr,
    BW,
    lvl_ptr,
    n_levels,
    stamp_ptr,
    R,
    stats_ptr,
    ver_ptr,
    q_slot_ptr,
    q_ver_ptr,
    Qcap,
    gpu_free_ptr,
    cpu_free_ptr,
    C,
    cpu_pos_ptr,
    copy_row_ptr,
    copy_slot_ptr,
    copy_depth_ptr,
    victims_ptr,
    popped_ptr,
    cand_ptr,
    seg_ptr,
    seg_blocks_ptr,
    seg_arrivals_ptr,
    block_counts_ptr,
    ring_ptr,
    ring_blocks_ptr,
    report_ptr,
    group_row_bytes,
    layer_row_bytes,
    WRITE: tl.constexpr,
    POLICY: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    CACHE: tl.constexpr,
):
    pid = tl.program_id(0)
    pos = pid.to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
    inb = pos < T
    a = K.element_addresses(sel_ptr, new_ptr, n_new, pos, inb, -1)
    pad = inb & (a == -1)
    in_range = (a >= 0) & (a < N)
    home = tl.load(map_ptr + a, mask=inb & in_range, other=K.M_FREE)
    ok = inb & in_range & (home != K.M_FREE)
    epoch = tl.load(ctl_ptr + K.E_EPOCH)
    key = (epoch << 32) | (K.POS_MASK - pos)
    claimed = tl.load(claim_ptr + a, mask=ok, other=0)
    first = ok & (claimed == key)
    tl.store(first_pos_ptr + pos, (K.POS_MASK - (claimed & K.POS_MASK)).to(tl.int32), mask=ok)
    on_gpu = ok & (home >= 0) & (home < G)
    on_cpu = ok & (home >= G)
    if WRITE:
        # A write keeps CPU-resident entries where they are; only entries without a home need one.
        moved = ok & (home == K.M_UNHOMED)
    else:
        moved = ok & ~on_gpu
    need = first & moved
    hit = first & on_gpu
    if POLICY == K.PBLRU:
        # Hits join the current round's bucket now, so the victim search never meets them. The
        # claim already settled the status, so a call that will be refused touches nothing.
        go = tl.load(ctl_ptr + K.E_STATUS) == 0
        if not WRITE:
            go = go & (tl.load(ctl_ptr + K.E_DISTINCT) <= tl.load(ctl_ptr + K.E_MAX_SELECTION))
        if go:
            rnd = tl.load(gctl_ptr + K.G_ROUND)
            cur = rnd if WRITE else rnd + 1
            buckets.touch(bits_ptr, BW, lvl_ptr, n_levels, stamp_ptr, R, cur, rnd + 1, home, hit)
    # The free stacks as the call began, and the most CPU rows it can pop (a row per miss past the
    # free slots): a copy below them is safe from every pop of the call.
    n_free = tl.load(gctl_ptr + K.G_GPU_FREE)
    n_cpu = tl.load(gctl_ptr + K.G_CPU_FREE)
    top = tl.load(gctl_ptr + K.G_CPU_BOT) + n_cpu - 1  # the CPU free list's top, as a ring index
    n_need = tl.load(ctl_ptr + K.E_NEED)
    pops = n_need - tl.minimum(n_need, n_free)
    through = first & (pos < 0)
    if WRITE:
        if not CACHE:  # a rewrite on the GPU goes to its entry's copy too, where no pop takes it
            if tl.load(ctl_ptr + K.E_WRITE_COPIES) != 0:
                rewritten = first & on_gpu
                through = writes_through(
                    home, rewritten, copy_row_ptr, copy_slot_ptr, cpu_pos_ptr, top, C, pops
                )
    flags = (
        first.to(tl.int8) * K.F_FIRST
        + on_gpu.to(tl.int8) * K.F_GPU
        + on_cpu.to(tl.int8) * K.F_CPU
        + moved.to(tl.int8) * K.F_MOVED
        + pad.to(tl.int8) * K.F_PAD
        + (inb & ~pad & ~ok).to(tl.int8) * K.F_BAD
        + through.to(tl.int8) * K.F_THROUGH
    )
    tl.store(home_ptr + pos, home, mask=inb)
    tl.store(flags_ptr + pos, flags, mask=inb)
    rank = tl.cumsum(need.to(tl.int32), axis=0) - 1
    tl.store(miss_pos_ptr + pid.to(tl.int64) * CHUNK + rank, pos.to(tl.int32), mask=need)
    # Every first occurrence's misses and hits before it in the chunk: apply places a miss by the
    # first and each tile's LRU appends by both, without a running count over the chunk.
    tl.store(miss_rank_ptr + pos, rank + 1 - need.to(tl.int32), mask=first)
    tl.store(hit_rank_ptr + pos, tl.cumsum(hit.to(tl.int32), axis=0) - hit.to(tl.int32), mask=first)
    from_cpu = need & on_cpu  # frees its CPU row at commit: its rank places the push
    tl.store(cpu_rank_ptr + pos, tl.cumsum(from_cpu.to(tl.int32), axis=0) - 1, mask=from_cpu)
    chunks = (T + CHUNK - 1) // CHUNK  # the launch may have more programs than chunks (below)
    if pid < chunks:
        # The chunk's counts, one store, and added to its block's row (the planning program sums
        # the rows: the acquire-release ticket below makes these adds visible to it).
        word = tl.arange(0, 4)  # COUNT_WORDS
        n_hits = tl.sum(hit.to(tl.int32), axis=0)
        n_missed = tl.sum(need.to(tl.int32), axis=0)
        n_from_cpu = tl.sum((need & on_cpu).to(tl.int32), axis=0)
        n_cpu_first = tl.sum((first & on_cpu).to(tl.int32), axis=0)
        row = tl.where(word == K.C_HITS, n_hits, tl.where(word == K.C_NEED, n_missed, 0))
        row = tl.where(word == K.C_NEED_CPU, n_from_cpu, tl.where(word == K.C_CPU_FIRST, n_cpu_first, row))
        tl.store(counts_ptr + pid * K.COUNT_WORDS + word, row)
        at = block_counts_ptr + (pid // K.COUNT_BLOCK) * K.COUNT_WORDS + word
        tl.atomic_add(at, row, sem="relaxed")

    # -- the tops of the free stacks, this program's share ---------------------------------------
    # A call pops at most T GPU slots and T CPU rows (one per miss), so the programs copy the top T
    # entries of each stack, CHUNK each, before the plan knows how many it takes: a copy the size of
    # the selection instead of a loop over every pop in the planning program. Apply reads the pops
    # here while commit pushes freed CPU rows over the same stack positions.
    j = pos
    gm = inb & (j < n_free)
    tl.store(victims_ptr + j, tl.load(gpu_free_ptr + (n_free - 1 - j), mask=gm, other=0), mask=gm)
    if not CACHE:  # a buffer drops its victims: no CPU rows
        cm = inb & (j < n_cpu)
        # (top - j lies in [bottom, top] for the rows copied: one lap of the ring at most)
        tl.store(popped_ptr + j, tl.load(cpu_free_ptr + K.wrap(top - j, C), mask=cm, other=0), mask=cm)
        # New entries' copies come from the rows below the pops, at most one a new entry: a write's
        # T (2T rows in all), a prepare's n_new new tokens.
        extra = n_new
        if WRITE:
            extra = T
        cm = inb & (j < extra) & (T + j < n_cpu)
        row = tl.load(cpu_free_ptr + K.wrap(top - T - j, C), mask=cm, other=0)
        tl.store(popped_ptr + T + j, row, mask=cm)
    # A candidate's copy below the call's pops (above) is safe from every pop, so its eviction is
    # clean whatever apply pops.

    if POLICY == K.EXACT_LRU:
        # -- candidates: this program's segment of the LRU ring ---------------------------------
        # Victims past the free slots are the oldest live, unprotected ring pairs. Program p lists
        # those among ring positions head + p * CHUNK .. + CHUNK (the hits' marks are all in since
        # the claim); the planning program only sums the lists and finds where the victims end.
        # When the call compacts the ring, the programs also pack the ring's blocks' live pairs, a
        # block each in turn, for apply to copy into place (``ulakv.kernels.victims``).
        head = tl.load(gctl_ptr + K.G_HEAD)
        tail = tl.load(gctl_ptr + K.G_TAIL)
        if WRITE:
            limit = tl.load(gctl_ptr + K.G_ROUND_TAIL)  # a write never evicts this round's entries
        else:
            limit = tail  # a prepare starts a round: everything before is older
        compacting = ring_compaction_due(head, tail, T, G, Qcap)
        # Program p lists segment p while p < chunks: limit moved to head for the rest, who scan
        # (up to tail) only when compacting.
        limit = tl.where(pid < chunks, limit, head)
        live, s, qv = ring_live(
            head, pos, tl.where(compacting, tail, limit), q_slot_ptr, q_ver_ptr, Qcap, ver_ptr
        )
        eligible = live & (head + pos < limit)
        eligible = eligible & (tl.load(mark_ptr + s, mask=eligible, other=0) != epoch)
        clean = eligible & (tl.zeros_like(s) != 0)
        if not CACHE:
            clean = _clean_candidates(
                s, eligible, copy_row_ptr, copy_slot_ptr, cpu_pos_ptr, copy_depth_ptr, top, C, pops
            )
        packed, n_clean = _packed_candidates(s, clean, eligible)
        cand_rank = tl.cumsum(eligible.to(tl.int32), axis=0) - 1
        tl.store(cand_ptr + pid.to(tl.int64) * CHUNK + cand_rank, packed, mask=eligible)
        n = tl.sum(eligible.to(tl.int64), axis=0)
        store_segment(seg_ptr, pid, pid.to(tl.int64) * CHUNK, n, n_clean, pid < chunks)
        if compacting:
            # Ring blocks pid, pid + P, ... up to the tail: the launch has the GPU's program slots
            # at most, not a program a block (2,048 at a million slots).
            blocks = (tail - head + CHUNK - 1) // CHUNK
            if pid < blocks:
                ring_block_scan(pid, live, s, qv, ring_ptr, ring_blocks_ptr, CHUNK)
            b = pid.to(tl.int64) + tl.num_programs(0)
            while b < blocks:
                live, s, qv = ring_live(
                    head, b * CHUNK + tl.arange(0, CHUNK), tail, q_slot_ptr, q_ver_ptr, Qcap, ver_ptr
                )
                ring_block_scan(b, live, s, qv, ring_ptr, ring_blocks_ptr, CHUNK)
                b += tl.num_programs(0)
    else:
        # -- candidates: this program's ranges of CHUNK slots, in every bucket a victim may come from
        # Victims past the free slots are the cold bucket's slots, then each ring bucket's oldest
        # first, lower slots first, never the current round's; never a hit of this call (marked
        # by the claim: a hit's touch below may not have left its old bucket yet). Segment
        # (bucket order i, range q) is listed at cand[q * CHUNK + (range q's candidates in buckets
        # before i)]: a range holds at most CHUNK slots whatever their buckets.
        if WRITE:
            cur = tl.load(gctl_ptr + K.G_ROUND)
        else:
            cur = tl.load(gctl_ptr + K.G_ROUND) + 1
        # A call whose misses all fit the free slots takes no victim: nothing to list (a write of
        # new tokens while the GPU tier fills), so the programs past the chunks stop here.
        ranges = (G + CHUNK - 1) // CHUNK
        range_blocks = (ranges + S.SEG_BLOCK - 1) // S.SEG_BLOCK
        listed_ranges = tl.where(pops > 0, ranges, 0)
        cur_bucket = cur % R  # one remainder: the buckets below step from it
        for q in range(pid, listed_ranges, tl.num_programs(0)):
            at = (tl.zeros((), tl.int64) + q) * CHUNK  # the range's first slot, and its list in cand
            slot = at + tl.arange(0, CHUNK)
            valid = slot < G
            clean = valid & (slot < 0)
            if not CACHE:  # whatever their bucket: one pass over the range
                clean = _clean_candidates(
                    slot, valid, copy_row_ptr, copy_slot_ptr, cpu_pos_ptr, copy_depth_ptr, top, C, pops
                )
            unprotected = valid & (tl.load(mark_ptr + slot, mask=valid, other=0) != epoch)
            listed = tl.zeros((), dtype=tl.int64)
            # Candidate order: bucket by bucket, ranges in order; SEG_BLOCK ranges of a bucket
            # make a block, and the last lister of a range block seals its R blocks.
            qb = (tl.zeros((), tl.int64) + q) // S.SEG_BLOCK
            for i in range(0, R):
                bucket = tl.where(i == 0, R, K.wrap(cur_bucket + i, R)).to(tl.int64)
                word = tl.load(bits_ptr + bucket * BW + slot // 32, mask=valid, other=0)
                eligible = unprotected & (((word >> (slot % 32).to(tl.int32)) & 1) != 0)
                list_rank = tl.cumsum(eligible.to(tl.int64), axis=0) - 1
                packed, n_clean = _packed_candidates(slot, clean, eligible)
                tl.store(cand_ptr + at + listed + list_rank, packed, mask=eligible)
                k = ((tl.zeros((), tl.int64) + i) * range_blocks + qb) * S.SEG_BLOCK + (q - qb * S.SEG_BLOCK)
                n = tl.sum(eligible.to(tl.int64), axis=0)
                store_segment(seg_ptr, k, at + listed, n, n_clean, True)
                listed += n

    # -- the blocks of segments this program listed in: their last lister seals them --------------
    # (here, at the end, where little else is live: sealing beside the listing's vectors took exact
    # LRU's classify from 110 to 128 registers and a spill)
    if POLICY == K.EXACT_LRU:
        if pid < chunks:  # segment p, in block p // SEG_BLOCK
            seg_block = pid // S.SEG_BLOCK
            size = tl.minimum(S.SEG_BLOCK, chunks - seg_block * S.SEG_BLOCK)
            arrive(seg_ptr, seg_blocks_ptr, seg_arrivals_ptr, seg_block, seg_block, 1, 1, size, 1)
    else:
        for q in range(pid, listed_ranges, tl.num_programs(0)):  # range q's R segments
            qb = (tl.zeros((), tl.int64) + q) // S.SEG_BLOCK
            size = tl.minimum(S.SEG_BLOCK, ranges - qb * S.SEG_BLOCK)
            arrive(seg_ptr, seg_blocks_ptr, seg_arrivals_ptr, qb, qb, range_blocks, R, size, S.SEAL_ROWS)

    # -- the last program to arrive plans the call --------------------------------------------------
    P = tl.num_programs(0)
    tl.debug_barrier()  # every thread's stores precede the release below
    ticket = tl.atomic_add(ctl_ptr + K.E_ARRIVED, 1, sem="acq_rel")
    if ticket == P - 1:
        tl.debug_barrier()
        tl.store(ctl_ptr + K.E_ARRIVED, 0)
        victims_program(
            block_counts_ptr,
            chunks,
            T,
            G,
            N,
            ctl_ptr,
            gctl_ptr,
            stats_ptr,
            ver_ptr,
            q_slot_ptr,
            q_ver_ptr,
            Qcap,
            C,
            copy_row_ptr,
            copy_slot_ptr,
            cpu_pos_ptr,
            copy_depth_ptr,
            mark_ptr,
            claim_ptr,
            cand_ptr,
            seg_ptr,
            seg_blocks_ptr,
            group_row_bytes,
            layer_row_bytes,
            R,
            ring_blocks_ptr,
            report_ptr,
            WRITE,
            POLICY,
            CHUNK,
            BLOCK,
            CACHE,
        )


# The classify launch's shape, read from the sm_90 cubins (``python -m ulakv.kernels.compile_check``):
# a thread's registers are the most any path of the kernel needs, and the planning program (one
# program of the launch) needed the most, with the rare listing of more ring segments (exact LRU)
# the heaviest part of it. Both policies run 16 warps a program (2 elements of a CHUNK a thread):
# 85-128 registers, the most a 512-thread program may hold, with no spill, 16 resident warps an
# SM. Exact LRU ran 8 warps (92-110 registers, 16 warps) until its planning program summed
# blocks of candidate segments: then ptxas held 8-warp variants at 128 registers and spilled
# 8-16 B (4 warps and 1,024 lanes: 240-255, 8 warps). PB-LRU at 8 warps and 1,024 lanes: 164-200,
# 8 warps; 16 warps and 1,024 lanes spill 32-48 B. Both planning programs sum the candidate
# segments' blocks, 256 a step (one step up to 16,384 segments, ``segments``). Neither policy
# takes a 64-bit remainder by a runtime value over a block or in a loop (see ``common.wrap``):
# sm_90 has no such instruction, and the routine ptxas calls spills the caller's live registers
# around it.
CLASSIFY_WARPS = {K.EXACT_LRU: 16, K.PBLRU: 16}


def classify_programs(st, T: int) -> int:
    """The classify launch's programs: one a chunk of the selection, and as many as the GPU holds
    at once (or fewer, when there are fewer) for the pool-wide lists: ring blocks (exact LRU: a
    compacting call scans the ring up to its tail) or ranges of CHUNK slots (PB-LRU), each program
    taking every P-th."""
    blocks = st.gpu_slots if st.policy == K.PBLRU else st.q_slot.shape[1]
    resident = program_slots(st.ctl.device, "classify_kernel")  # one an SM: 132 on an H200
    return max(K.cdiv(T, K.CHUNK), min(K.cdiv(blocks, K.CHUNK), resident))


def lookup_and_plan(
    st,
    g: int,
    sel,
    scratch,
    write: bool,
    group_row_bytes: int,
    layer_row_bytes: int,
    new: torch.Tensor | None = None,
) -> int:
    """Launch claim, then classify + plan, over the flat selection ``sel`` for group ``g`` of
    ``st`` (a TieredState); a prepare's ``new`` tokens (``NewRows``: flat addresses) are its first
    elements, each read through its own pointer. ``group_row_bytes`` and ``layer_row_bytes`` price
    the moves in the stats; under PB-LRU a prepare then ends its round (``round_end``); last,
    ``decide`` writes each miss's moves. Returns the number of launches (3, or 4 with a round end)."""
    n_new = 0 if new is None else new.numel()
    T = n_new + sel.numel()
    grid = (K.cdiv(T, K.CHUNK),)
    mapping, claim, mark, ctl, gpu_slots = st.mapping[g], st.claim, st.mark, st.ctl, st.gpu_slots
    N = mapping.numel()
    claim_kernel[grid](
        sel_ptr=sel,
        new_ptr=sel if new is None else new,
        T=T,
        N=N,
        G=gpu_slots,
        n_new=n_new,
        map_ptr=mapping,
        claim_ptr=claim,
        mark_ptr=mark,
        ctl_ptr=ctl,
        block_counts_ptr=scratch.block_counts,
        WRITE=write,
        CHUNK=K.CHUNK,
    )
    programs = classify_programs(st, T)
    compiled = classify_kernel[(programs,)](
        sel_ptr=sel,
        new_ptr=sel if new is None else new,
        T=T,
        N=N,
        n_new=n_new,
        claim_ptr=claim,
        mark_ptr=mark,
        gpu_free_ptr=st.gpu_free[g],
        report_ptr=st.group_reports[g],
        **st.group_kwargs(g),
        **scratch.kernel_kwargs(),
        group_row_bytes=group_row_bytes,
        layer_row_bytes=layer_row_bytes,
        WRITE=write,
        POLICY=st.policy,
        CHUNK=K.CHUNK,
        BLOCK=PLAN_LANES[st.policy],
        CACHE=st.CACHE,
        num_warps=CLASSIFY_WARPS[st.policy],
    )
    if ctl.device.type == "cuda":
        learn("classify_kernel", compiled)  # its pool-wide lists follow this Triton's registers
    launches = 2
    if st.policy == K.PBLRU and not write:  # a prepare ended its round: the bucket to reuse goes cold
        launches += round_end.end_round(st, g)
    return launches + decide.decide(st, g, scratch, T, T if write else n_new)


def lookup_and_plan_reference(
    st,
    g: int,
    sel,
    scratch,
    write: bool,
    group_row_bytes: int,
    layer_row_bytes: int,
    new: torch.Tensor | None = None,
) -> None:
    """Plain-Python twin of :func:`lookup_and_plan`: the two launches, then the victims program
    (and PB-LRU's round end after a prepare), then each miss's moves (over one list of elements:
    the new tokens, then the selection)."""
    n_new = 0 if new is None else new.numel()
    sel = sel if new is None else torch.cat([new.long(), sel.long()])
    claim_and_classify_reference(st, g, sel, scratch, write, n_new)
    victims_reference(st, g, scratch, sel.numel(), write, group_row_bytes, layer_row_bytes)
    if st.policy == K.PBLRU and not write:
        round_end.end_round_reference(st, g)
    decide.decide_reference(st, g, scratch, sel.numel(), sel.numel() if write else n_new)


def claim_and_classify_reference(st, g: int, sel, scratch, write: bool, n_new: int = 0) -> None:
    """Plain-Python twin of the ``claim_kernel`` and ``classify_kernel`` launches (victims aside):
    same inputs, same state and scratch out, element by element."""
    mapping, claim, mark, ctl = st.mapping[g], st.claim, st.mark, st.ctl
    T, N, G, C = sel.numel(), mapping.numel(), st.gpu_slots, K.CHUNK
    epoch = int(ctl[int(K.E_EPOCH)])
    addrs = sel.tolist()
    homes = mapping.tolist()
    status = 0
    first_pos: dict[int, int] = {}
    for pos, a in enumerate(addrs):
        if a == -1:
            continue
        if not (0 <= a < N) or homes[a] == int(K.M_FREE):
            status |= int(K.ST_BAD_ADDRESS)
            continue
        if 0 <= homes[a] < G:
            mark[homes[a]] = epoch
        if a in first_pos and write:
            status |= int(K.ST_DUPLICATE)
        if pos < n_new and not write:  # a new token: no home yet, once among the new ones
            if homes[a] != int(K.M_UNHOMED) or first_pos.get(a, n_new) < n_new:
                status |= int(K.ST_NOT_NEW)
            ctl[int(K.E_NEW_MISSES)] += 1
        first_pos.setdefault(a, pos)
        claim[a] = max(int(claim[a]), (epoch << 32) | (K.POS_MASK - pos))
    ctl[int(K.E_DISTINCT)] += len(first_pos)
    if write:
        ctl[int(K.E_NEED)] += sum(1 for a in first_pos if homes[a] == int(K.M_UNHOMED))
    else:
        ctl[int(K.E_NEED)] += sum(1 for a in first_pos if not 0 <= homes[a] < G)
    for chunk in range(-(-T // C)):
        counts = [0] * K.COUNT_WORDS
        for pos in range(chunk * C, min(T, (chunk + 1) * C)):
            a = addrs[pos]
            ok = a != -1 and 0 <= a < N and homes[a] != int(K.M_FREE)
            home = homes[a] if 0 <= a < N else int(K.M_FREE)
            first = ok and first_pos[a] == pos
            on_gpu = ok and 0 <= home < G
            on_cpu = ok and home >= G
            moved = ok and (home == int(K.M_UNHOMED) if write else not on_gpu)
            need = first and moved
            through = write and not st.CACHE and first and on_gpu and int(ctl[int(K.E_WRITE_COPIES)]) != 0
            through = through and writes_through_reference(st, g, home)
            flags = (
                int(through) * int(K.F_THROUGH)
                + int(first) * int(K.F_FIRST)
                + int(on_gpu) * int(K.F_GPU)
                + int(on_cpu) * int(K.F_CPU)
                + int(moved) * int(K.F_MOVED)
                + int(a == -1) * int(K.F_PAD)
                + int(a != -1 and not ok) * int(K.F_BAD)
            )
            scratch.home[pos] = home
            if ok:
                scratch.first_pos[pos] = first_pos[a]
            scratch.flags[pos] = flags
            if first:
                scratch.miss_rank[pos] = counts[int(K.C_NEED)]
                scratch.hit_rank[pos] = counts[int(K.C_HITS)]
            if need:
                scratch.miss_pos[chunk * C + counts[int(K.C_NEED)]] = pos
            if need and on_cpu:
                scratch.cpu_rank[pos] = counts[int(K.C_NEED_CPU)]
            counts[int(K.C_HITS)] += first and on_gpu
            counts[int(K.C_NEED)] += need
            counts[int(K.C_NEED_CPU)] += need and on_cpu
            counts[int(K.C_CPU_FIRST)] += first and on_cpu
        scratch.counts[chunk] = torch.tensor(counts, dtype=scratch.counts.dtype)
    chunks = -(-T // C)
    for b in range(-(-chunks // int(K.COUNT_BLOCK))):  # the counts, COUNT_BLOCK chunks a row
        rows = scratch.counts[b * int(K.COUNT_BLOCK) : min(chunks, (b + 1) * int(K.COUNT_BLOCK))]
        scratch.block_counts[b] = rows.sum(dim=0).to(scratch.block_counts.dtype)
    # The tops of the free stacks, copied for the plan (at most one pop per element).
    n_free, n_cpu = int(st.gctl[g, int(K.G_GPU_FREE)]), int(st.gctl[g, int(K.G_CPU_FREE)])
    k = min(T, n_free)
    scratch.victims[:k] = st.gpu_free[g, :n_free].flip(0)[:k]
    if not st.CACHE:
        rows = T + (T if write else n_new)  # the pops, and the rows for new entries' copies below
        free_rows = st.free_cpu_rows(g).flip(0)[: min(rows, n_cpu)]  # top first
        scratch.popped[: free_rows.numel()] = free_rows.to(scratch.popped.device)
    pops = need_pops(st, g)

    def list_segment(k: int, at: int, slots: list[int]) -> None:
        """Segment slot ``k``: its candidates at ``cand[at:]``, and its words."""
        clean = [False] * len(slots)
        if not st.CACHE:
            clean = clean_candidates_reference(st, g, slots, pops, scratch)
        packed = packed_candidates_reference(slots, clean)
        scratch.cand[at : at + len(slots)] = torch.tensor(packed, dtype=torch.int64)
        store_segment_reference(scratch, k, at, len(slots), sum(clean))

    n = int(S.SEG_BLOCK)
    if st.policy == K.EXACT_LRU:
        gctl = st.gctl[g]
        head = int(gctl[int(K.G_HEAD)])
        limit = int(gctl[int(K.G_ROUND_TAIL)] if write else gctl[int(K.G_TAIL)])
        for chunk in range(chunks):
            slots = ring_candidates_reference(st, g, head + chunk * C, min(limit, head + (chunk + 1) * C))
            list_segment(chunk, chunk * C, slots)
        for b in range(segment_blocks(chunks)):  # what each block's last lister seals
            seal_reference(scratch, b, 1, 1, min(n, chunks - b * n))
        tail = int(gctl[int(K.G_TAIL)])
        if ring_compaction_due_reference(head, tail, T, G, st.q_slot.shape[1]):
            for b in range(-(-(tail - head) // C)):  # the ring's blocks up to its tail, packed
                pairs = ring_live_reference(st, g, head + b * C, min(tail, head + (b + 1) * C))
                packed = [(s << 32) | (v & 0xFFFFFFFF) for s, v in pairs]
                scratch.ring[b * C : b * C + len(packed)] = torch.tensor(packed, dtype=torch.int64)
                scratch.ring_blocks[b, 0] = len(packed)
    else:
        bitmaps = PBLRUBits(st, g)
        cur = int(st.gctl[g, int(K.G_ROUND)]) + (0 if write else 1)
        ranges = -(-G // C)
        range_blocks = segment_blocks(ranges)
        listed_ranges = ranges if pops > 0 else 0  # no victim to take: nothing listed
        if not st.CACHE and listed_ranges:  # each range's copies, whatever their bucket: one pass
            clean_candidates_reference(st, g, list(range(G)), pops, scratch)
        for q in range(listed_ranges):
            listed = 0
            for i in range(bitmaps.R):
                bucket = bitmaps.R if i == 0 else (cur + i) % bitmaps.R
                held = sorted(s for s in bitmaps.sets[bucket] if q * C <= s < (q + 1) * C)
                slots = [s for s in held if int(mark[s]) != epoch]
                list_segment((i * range_blocks + q // n) * n + q % n, q * C + listed, slots)
                listed += len(slots)
        for qb in range(segment_blocks(listed_ranges)):  # each range block's last lister seals
            seal_reference(scratch, qb, range_blocks, bitmaps.R, min(n, ranges - qb * n))
    ctl[int(K.E_STATUS)] |= status
    go = status == 0 and (write or int(ctl[int(K.E_DISTINCT)]) <= int(ctl[int(K.E_MAX_SELECTION)]))
    if st.policy == K.PBLRU and go:
        rnd = int(st.gctl[g, int(K.G_ROUND)])
        hits = [
            int(scratch.home[p])
            for p in range(T)
            if int(scratch.flags[p]) & int(K.F_FIRST) and int(scratch.flags[p]) & int(K.F_GPU)
        ]
        bitmaps = PBLRUBits(st, g)
        for slot in hits:
            bitmaps.touch(slot, cur=rnd if write else rnd + 1, ref=rnd + 1)
        bitmaps.store()
