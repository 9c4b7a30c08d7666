"""Victims: decide, on the device, where every miss goes and what leaves the GPU for it (the
planning step of a call, after ``ulakv.kernels.lookup``).

The last program of the lookup's ``classify`` launch to finish runs ``victims_program``, so planning
costs no launch of its own (see ``ulakv.kernels.lookup``). Everything that grows with the misses was
done before it, by every classify program side by side; what it does itself steps over the count
rows (``BLOCK`` = 256 rows a step: one step up to 16 M elements), the blocks of candidate segments
(256 blocks a step: one step up to 16,384 segments) and, compacting, the ring's blocks (256 blocks
of ``CHUNK`` pairs a step: 8 steps at a million slots), not over the misses, the chunks or the
segments.

1. Totals from the lookup's count rows (``block_counts``: the classify programs added their
   chunks' counts, ``COUNT_BLOCK`` chunks a row); a prepare with more distinct addresses than the
   layout's ``max_selection`` (GPU slots, or staging rows) fails here, before anything changed.
2. Victims: free GPU slots first (the top of a stack, copied by the classify programs), then the
   policy's eviction candidates, which the classify programs listed in *segments* (``cand`` and
   ``seg`` in the call scratch):

   * exact LRU: a ring of ``(slot, version)`` pairs in recency order; touching a slot bumps its
     version and appends it, so older pairs turn stale (lazy deletion). Program p lists the live
     pairs of unprotected slots among ring positions ``head + p * CHUNK ..`` (``_ring_candidates``);
     entries of the current round lie past ``round_tail`` and are never listed. Here: running
     totals of the lists' blocks, more segments one after another in the rare case they fall
     short, and the new head (the position of the last victim, found in its segment). When stale
     pairs could overflow the ring, the call compacts it across the grid (``ring_compaction_due``,
     below).
   * PB-LRU: cold, then the ring buckets oldest first, lower slots first, never the current round's
     bucket; segment (bucket, range of CHUNK slots) is listed by the program of that range. Here:
     running totals of the lists' blocks. Taken slots leave their bucket at commit
     (``ulakv.kernels.apply``); the round's end is a launch of its own (``round_end``).

   The lists' blocks were sealed by their last listers (``ulakv.kernels.segments``). Victim ``j``
   is then the ``j - k_free``-th candidate: ``victim_slot`` finds its segment by a binary search
   over the blocks' running totals, then one within its block.
3. Clean victims. Each candidate in ``cand`` carries whether its eviction is clean (its entry's
   copy, a free CPU row that still holds its bytes, lies deeper in the free list than the call can
   pop) and how many clean candidates precede it in its segment; the segments' and blocks' words
   keep running totals of both, so ``victim_slot`` gives every victim the number of clean victims
   before it. A prepare whose misses all come from the CPU *fills*: its clean victims pop no CPU
   row (the others pop the top rows in order, victim ``i`` the ``i - clean_before(i)``-th) and the
   row each clean victim's miss leaves takes its copy's place in the free list. Otherwise every
   miss past the free GPU slots pops a row (for its victim, or for itself in a write that found no
   slot). Either way a victim never lands in a row someone still lives in. A write then gives its
   new entries with a GPU slot a copy each: one in a clean victim's slot in the row that victim
   popped (which takes the victim's copy's place in the list), the others in miss order
   (``E_COPIES`` of them) in the plain rows right below its pops (``G_CPU_PLAIN``: the run on top
   of the free list that holds no copy), rows that go to the bottom of the list, so a victim
   counted clean still finds its copy intact. A prepare with new rows (``NewRows``) does the same
   for its new tokens, which lead the selection (its first ``E_NEW_MISSES`` misses); its other
   misses' rows join the bottom after those copies.
4. Exact LRU, a compacting call: running totals of the ring blocks' live pairs, and the compacted
   ring's tail and round tail (apply's workers copy the pairs into place).
5. Where the call's LRU appends start (``E_QUEUE_AT``). Each chunk's offsets (where its misses
   start in the victim list, where its touches are appended, its rank among the CPU rows freed)
   are the next launch's, ``ulakv.kernels.decide``, one program a chunk, with each miss's moves.
6. Counters, round and epoch bookkeeping; the call's status is published for the host and apply.
"""

from __future__ import annotations

import torch

from . import common as K
from . import segments as S
from ._triton import tl, triton
from .buckets import PBLRUBits
from .segments import (
    find_last_segment,
    find_segment,
    find_segment_reference,
    seal_listed_here,
    seal_listed_here_reference,
    segment_blocks,
    store_segment,
    store_segment_reference,
    sum_blocks,
    sum_blocks_reference,
)


@triton.jit
def ring_live(head, off, end, q_slot_ptr, q_ver_ptr, Qcap, ver_ptr):
    """Which ring positions ``head + off`` (below ``end``, at most the ring's tail) hold a live
    pair: its version is still its slot's. Returns (live mask, slot, version)."""
    qm = head + off < end
    at = K.wrap(head % Qcap + off, Qcap)  # off < tail - head <= Qcap where qm holds
    s = tl.load(q_slot_ptr + at, mask=qm, other=0)
    qv = tl.load(q_ver_ptr + at, mask=qm, other=0)
    return qm & (qv == tl.load(ver_ptr + s, mask=qm, other=-1)), s, qv


@triton.jit
def _ring_candidates(head, off, limit, q_slot_ptr, q_ver_ptr, Qcap, ver_ptr, mark_ptr, epoch):
    """Which ring positions ``head + off`` (below ``limit``) hold a live pair of an unprotected
    slot: an eviction candidate. Returns (candidate mask, slot)."""
    live, s, _ = ring_live(head, off, limit, q_slot_ptr, q_ver_ptr, Qcap, ver_ptr)
    return live & (tl.load(mark_ptr + s, mask=live, other=0) != epoch), s


# -- ring compaction ----------------------------------------------------------------------------
# Stale pairs are dropped from the ring by three launches' programs side by side, never by one
# program walking it: each classify program scans one block of CHUNK ring positions from the head
# and packs its live pairs into the call scratch (``ring_block_scan``); the planning program turns
# the blocks' counts into running totals (one BLOCK step per million ring pairs) and the new tail;
# apply's workers copy each block's pairs to their places (``ring_block_copy``). The
# ring holds 2G pairs and at most G are live (one a slot that holds an entry), and a call appends
# at most min(T, G) (a pair a distinct slot it hits or fills): the classify programs scan when a
# call's elements could overflow the ring as it began, and the call compacts when the appends it
# does make would (``ring_compaction_due`` of both), which leaves at least G positions free after
# it, so the ring never overflows and calls of a appends compact at most once every (G - a) / a + 1.


@triton.jit
def ring_compaction_due(head, tail, T, G, Qcap):
    """Whether a call of ``T`` elements compacts the ring ``head .. tail`` first."""
    return tail - head + tl.minimum(T, G) > Qcap


def ring_compaction_due_reference(head: int, tail: int, T: int, G: int, Qcap: int) -> bool:
    return tail - head + min(T, G) > Qcap


@triton.jit
def ring_block_scan(b, live, s, qv, ring_ptr, ring_blocks_ptr, CHUNK: tl.constexpr):
    """Ring block ``b``'s live pairs, packed (slot in the high word, version in the low) and in
    ring order at ``ring[b * CHUNK:]``, and their count at ``ring_blocks[2b]``."""
    rank = tl.cumsum(live.to(tl.int32), axis=0) - 1
    packed = (s.to(tl.int64) << 32) | (qv.to(tl.int64) & 0xFFFFFFFF)
    tl.store(ring_ptr + b.to(tl.int64) * CHUNK + rank, packed, mask=live)
    tl.store(ring_blocks_ptr + 2 * b, tl.sum(live.to(tl.int64), axis=0))


@triton.jit
def _live_before(x, head, tail, ring_blocks_ptr, q_slot_ptr, q_ver_ptr, Qcap, ver_ptr, CHUNK: tl.constexpr):
    """Live pairs at ring positions ``head .. x`` (``x <= tail``): the running total of ``x``'s
    block (``ring_blocks[2b + 1]``, one past the last block included) plus its block's below ``x``."""
    b = (x - head) // CHUNK
    live, _, _ = ring_live(head, b * CHUNK + tl.arange(0, CHUNK), x, q_slot_ptr, q_ver_ptr, Qcap, ver_ptr)
    return tl.load(ring_blocks_ptr + 2 * b + 1) + tl.sum(live.to(tl.int64), axis=0)


@triton.jit
def ring_block_copy(
    b, ring_at, dropped, ring_ptr, ring_blocks_ptr, q_slot_ptr, q_ver_ptr, Qcap, CHUNK: tl.constexpr
):
    """Ring block ``b``'s live pairs (packed by ``ring_block_scan``) to ring indices ``ring_at +
    (live pairs before them) ..``, the first ``dropped`` live pairs of the ring (before the new head:
    taken as victims, or hits that this call appends again) left out."""
    w = tl.arange(0, 2)
    words = tl.load(ring_blocks_ptr + 2 * b + w)
    n = tl.sum(tl.where(w == 0, words, 0), axis=0)
    before = tl.sum(tl.where(w == 1, words, 0), axis=0)
    j = tl.arange(0, CHUNK)
    packed = tl.load(ring_ptr + b.to(tl.int64) * CHUNK + j, mask=j < n, other=0)
    keep = (j < n) & (before + j >= dropped)
    at = K.wrap(ring_at + before + j, Qcap)  # before + j < Qcap: live pairs never outnumber the ring
    tl.store(q_slot_ptr + at, (packed >> 32).to(tl.int32), mask=keep)
    tl.store(q_ver_ptr + at, (packed & 0xFFFFFFFF).to(tl.int32), mask=keep)


def ring_live_reference(st, g: int, lo: int, hi: int) -> list[tuple[int, int]]:
    """Plain-Python twin of ``ring_live`` over ring positions ``lo .. hi``: the live (slot, version)
    pairs, in ring order."""
    Qcap, out = st.q_slot.shape[1], []
    for qi in range(lo, hi):
        s, v = int(st.q_slot[g, qi % Qcap]), int(st.q_ver[g, qi % Qcap])
        if v == int(st.ver[g, s]):
            out.append((s, v))
    return out


def ring_candidates_reference(st, g: int, lo: int, hi: int) -> list[int]:
    """Plain-Python twin of ``_ring_candidates`` over ring positions ``lo .. hi``: the slots listed."""
    Qcap, epoch = st.q_slot.shape[1], int(st.ctl[int(K.E_EPOCH)])
    out = []
    for qi in range(lo, hi):
        s = int(st.q_slot[g, qi % Qcap])
        if int(st.q_ver[g, qi % Qcap]) == int(st.ver[g, s]) and int(st.mark[s]) != epoch:
            out.append(s)
    return out


@triton.jit
def control_word(words, i):
    """Word ``i`` of control words loaded at once (one load for all: each separate scalar load is
    a dependent step)."""
    return tl.sum(tl.where(tl.arange(0, words.shape[0]) == i, words, 0), axis=0)


@triton.jit
def _count_rows(counts_ptr, c, P):
    """The per-chunk count rows of chunks ``c`` (below ``P``), int64 ``[len(c), 4]``, in one load."""
    w = tl.arange(0, 4)[None, :]  # COUNT_WORDS
    return tl.load(counts_ptr + c[:, None] * K.COUNT_WORDS + w, mask=(c < P)[:, None], other=0).to(tl.int64)


@triton.jit
def _column(counts, word):
    """Column ``word`` of count rows."""
    return tl.sum(tl.where(tl.arange(0, 4)[None, :] == word, counts, 0), axis=1)


# A candidate as ``cand`` holds it (int64): its GPU slot in the low 32 bits, then whether its
# eviction is clean (bit 32), then how many candidates before it in its segment are clean. Apply needs
# the count to place pops and pushes once clean victims stop popping rows (``K.E_FILL``).
CAND_CLEAN_BIT = tl.constexpr(32)
CAND_BEFORE_SHIFT = tl.constexpr(33)
CAND_SLOT_MASK = tl.constexpr(0xFFFFFFFF)
# Lanes of a step of the planning program's rare listing of more ring segments (victims_program).
EXTEND_LANES = tl.constexpr(256)


@triton.jit
def _clean_candidates(s, listed, copy_row_ptr, copy_slot_ptr, cpu_pos_ptr, copy_depth_ptr, top, C, pops):
    """Which listed candidate slots ``s`` would be evicted clean: the copy their entry left in a CPU
    row is intact and lies ``pops`` rows or more below the top of the free list as the call began
    (``pops``: one row per miss past the free GPU slots, the most this call can pop), so no pop of
    this call takes it, however apply places its pops. Each copy's depth is kept (``copy_depth``)
    for apply, which sends back to its copy every victim whose copy the call's actual pops miss:
    taken here because apply's hole filling moves rows in the list while its programs decide."""
    copy = tl.load(copy_row_ptr + s, mask=listed, other=-1)
    has = listed & (copy >= 0)
    intact = has & (tl.load(copy_slot_ptr + copy, mask=has, other=-1) == s)
    # (top is one below the bottom at the least, a lap past it at the most: -C <= top - pos < 2C)
    depth = K.wrap(top - tl.load(cpu_pos_ptr + copy, mask=has, other=0), C)
    tl.store(copy_depth_ptr + s, depth.to(tl.int32), mask=has)
    return intact & (depth >= pops)


@triton.jit
def writes_through(slot, mask, copy_row_ptr, copy_slot_ptr, cpu_pos_ptr, top, C, pops):
    """Which entries of a write homed in GPU slots ``slot`` (``mask``) have an intact copy ``pops``
    rows or more below the free list's top as the call began, so no pop of the call takes it: their
    written layer goes to the copy too and the copy stays intact (a shallower copy is popped by
    the call, to become a home: it ends)."""
    copy = tl.load(copy_row_ptr + slot, mask=mask, other=-1)
    has = mask & (copy >= 0)
    intact = has & (tl.load(copy_slot_ptr + copy, mask=has, other=-1) == slot)
    # (top is one below the bottom at the least, a lap past it at the most: -C <= top - pos < 2C)
    depth = K.wrap(top - tl.load(cpu_pos_ptr + copy, mask=intact, other=0), C)
    return intact & (depth >= pops)


def writes_through_reference(st, g: int, slot: int) -> bool:
    """Plain-Python twin of ``writes_through`` for one slot (the pool's state as the call began)."""
    copy = int(st.copy_row[g, slot])
    if copy < 0 or int(st.copy_slot[g, copy]) != slot:
        return False
    top = int(st.gctl[g, int(K.G_CPU_BOT)]) + int(st.gctl[g, int(K.G_CPU_FREE)]) - 1
    return (top - int(st.cpu_pos[g, copy])) % st.cpu_stack_size >= need_pops(st, g)


def clean_candidates_reference(st, g: int, slots: list[int], pops: int, scratch=None) -> list[bool]:
    """Plain-Python twin of ``_clean_candidates`` (the pool's state as the call began); stores the
    depths in ``scratch.copy_depth`` when given."""
    cap, count = st.cpu_stack_size, int(st.gctl[g, int(K.G_CPU_FREE)])
    top = int(st.gctl[g, int(K.G_CPU_BOT)]) + count - 1
    out = []
    for s in slots:
        copy = int(st.copy_row[g, s])
        if copy < 0:
            out.append(False)
            continue
        depth = (top - int(st.cpu_pos[g, copy])) % cap
        if scratch is not None:
            scratch.copy_depth[s] = depth
        out.append(int(st.copy_slot[g, copy]) == s and depth >= pops)
    return out


@triton.jit
def _packed_candidates(s, clean, listed, clean_before=0):
    """Listed candidates as ``cand`` holds them (``clean_before`` clean ones of their segment listed
    before them), and how many of them are clean."""
    c = (clean & listed).to(tl.int64)
    before = clean_before + tl.cumsum(c, axis=0) - c
    return s.to(tl.int64) | (c << CAND_CLEAN_BIT) | (before << CAND_BEFORE_SHIFT), tl.sum(c, axis=0)


@triton.jit
def _unpacked_clean(packed):
    """A packed candidate's clean bit, and the clean candidates before it in its segment."""
    return (packed >> CAND_CLEAN_BIT) & 1, packed >> CAND_BEFORE_SHIFT


def packed_candidates_reference(slots: list[int], clean: list[bool]) -> list[int]:
    """Plain-Python twin of ``_packed_candidates`` (the list only)."""
    out, before = [], 0
    for s, c in zip(slots, clean, strict=True):
        out.append(s | (int(c) << int(CAND_CLEAN_BIT)) | (before << int(CAND_BEFORE_SHIFT)))
        before += c
    return out


def need_pops(st, g: int) -> int:
    """The most CPU rows a call can pop: one per miss past the free GPU slots (the claim counted
    the misses), as ``classify`` computes it."""
    need = int(st.ctl[int(K.E_NEED)])
    return need - min(need, int(st.gctl[g, int(K.G_GPU_FREE)]))


def pop_index(j, k_free, before, fill):
    """Which of the call's popped CPU rows (the free list's top, in order) miss ``j`` takes, if it
    pops one: one a miss past the ``k_free`` free GPU slots, but none for the ``before`` clean
    victims ahead of it when the plan fills (``fill`` 1). Python ints, tensors, or (``pop_index_jit``)
    a kernel's values."""
    return j - k_free - before * fill


pop_index_jit = triton.jit(pop_index)


@triton.jit
def victim_slot(j, mask, k_free, victims_ptr, cand_ptr, seg_ptr, seg_blocks_ptr, blocks):
    """Victim ``j`` (a miss's index in the call's miss order): the free-stack copy for ``j < k_free``,
    else candidate ``j - k_free`` of the segmented lists (``segments.find_segment``: ceil(log2(blocks))
    + 6 loads, 13 at a million PB-LRU slots, whatever the misses). Returns its GPU slot, whether its
    eviction is clean, and how many victims before it are."""
    free = mask & (j < k_free)
    taken = mask & (j >= k_free)
    r = (j - k_free).to(tl.int64)
    _, start, clean_base, at = find_segment(r, taken, seg_ptr, seg_blocks_ptr, blocks)
    packed = tl.load(cand_ptr + at + (r - start), mask=taken, other=0)
    listed = (packed & CAND_SLOT_MASK).to(tl.int32)
    slot = tl.where(free, tl.load(victims_ptr + j, mask=free, other=0), listed)
    bit, in_segment = _unpacked_clean(packed)
    return slot, taken & (bit != 0), tl.where(taken, clean_base + in_segment, 0)


def _victim_entries(scratch, ctl: list[int], j: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Host twin of ``victim_slot``'s search for victim indices ``j`` past the free slots (int64,
    CPU): each one's packed candidate word and its segment's clean count before it."""
    k_free, blocks = ctl[int(K.E_KFREE)], ctl[int(K.E_SEG_BLOCKS)]
    if blocks == 0:  # no victim past the free slots: the plan summed no segment
        return torch.zeros_like(j), torch.zeros_like(j)
    r = (j - k_free).clamp(min=0)
    _, start, clean_before, at = find_segment_reference(scratch, blocks, r)
    cand = scratch.cand.cpu()
    return cand[(at + r - start).clamp(min=0, max=cand.numel() - 1)], clean_before


def victim_location(scratch, ctl: list[int], j: int) -> tuple[torch.Tensor, int]:
    """The scratch tensor and index that hold victim ``j``'s slot (for tests that plant a victim:
    a candidate's word also holds its clean bit and count, see ``plant_victim``)."""
    if j < ctl[int(K.E_KFREE)]:
        return scratch.victims, j
    r = torch.tensor([j - ctl[int(K.E_KFREE)]])
    _, start, _, at = find_segment_reference(scratch, ctl[int(K.E_SEG_BLOCKS)], r)
    return scratch.cand, int(at + r - start)


def plant_victim(scratch, ctl: list[int], j: int, slot: int) -> int:
    """Make victim ``j`` the slot ``slot`` (keeping a candidate's clean bit and count). Returns the
    slot it replaces."""
    where, i = victim_location(scratch, ctl, j)
    old = int(where[i])
    if where is scratch.cand:
        if (old >> int(CAND_CLEAN_BIT)) & 1:
            raise ValueError(f"victim {j} is evicted clean: plant a victim in place of a dirty one")
        where[i] = (old & ~int(CAND_SLOT_MASK)) | slot
        return old & int(CAND_SLOT_MASK)
    where[i] = slot
    return old


def victim_slots(scratch, ctl: list[int], j: torch.Tensor) -> torch.Tensor:
    """Host twin of ``victim_slot`` for victim indices ``j`` (int64, CPU): their GPU slots."""
    k_free = ctl[int(K.E_KFREE)]
    free = scratch.victims.cpu().to(torch.int64)[j.clamp(max=scratch.victims.numel() - 1)]
    packed, _ = _victim_entries(scratch, ctl, j)
    return torch.where(j < k_free, free, packed & int(CAND_SLOT_MASK))


def victim_cleans(scratch, ctl: list[int], j: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Host twin of ``victim_slot``'s other results for victim indices ``j``: whether each eviction
    is clean, and how many victims before it are."""
    taken = j >= ctl[int(K.E_KFREE)]
    packed, clean_base = _victim_entries(scratch, ctl, j)
    clean = taken & (((packed >> int(CAND_CLEAN_BIT)) & 1) != 0)
    before = torch.where(taken, clean_base + (packed >> int(CAND_BEFORE_SHIFT)), 0)
    return clean, before


# Lanes of the planning program's steps over chunks, segments and ring blocks, by policy (the
# classify launch's ``BLOCK``; why these, ``lookup.CLASSIFY_WARPS``).
PLAN_LANES = {K.EXACT_LRU: 256, K.PBLRU: 256}


@triton.jit
def victims_program(
    block_counts_ptr,
    P,
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
    WRITE: tl.constexpr,
    POLICY: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    CACHE: tl.constexpr,
):
    ar = tl.arange(0, BLOCK)
    # The call's and the group's control words, one load each: every scalar load or store here is
    # a dependent step of the one program that plans (the critical path).
    cw = tl.arange(0, K.CTL_BLOCK)
    ctl = tl.load(ctl_ptr + cw, mask=cw < K.CTL_WORDS, other=0)
    gw = tl.arange(0, K.GCTL_WORDS)
    gctl = tl.load(gctl_ptr + gw)
    status = control_word(ctl, K.E_STATUS)
    epoch = control_word(ctl, K.E_EPOCH)
    D = control_word(ctl, K.E_DISTINCT)  # counted by the claim
    H = tl.zeros((), dtype=tl.int64)
    M = tl.zeros((), dtype=tl.int64)
    MC = tl.zeros((), dtype=tl.int64)
    CF = tl.zeros((), dtype=tl.int64)
    # The chunks' counts, COUNT_BLOCK chunks a row (the classify programs added them): BLOCK rows
    # a step, one step up to 16,384 chunks.
    blocks = (P + K.COUNT_BLOCK - 1) // K.COUNT_BLOCK
    for b0 in range(0, blocks, BLOCK):
        counts = _count_rows(block_counts_ptr, b0 + ar, blocks)
        H += tl.sum(_column(counts, K.C_HITS), axis=0)
        M += tl.sum(_column(counts, K.C_NEED), axis=0)
        MC += tl.sum(_column(counts, K.C_NEED_CPU), axis=0)
        CF += tl.sum(_column(counts, K.C_CPU_FIRST), axis=0)
    if not WRITE:
        # Only when nothing refused the call before: an owner's refusal (a striped pool's census
        # over a home's share) is what its report must say, not the bound it implies here.
        if (status == 0) & (control_word(ctl, K.E_MAX_SELECTION) < D):
            status = status | K.ST_TOO_LARGE
    if status == 0:
        head = control_word(gctl, K.G_HEAD)
        head0 = head  # where the classify programs' ring blocks start
        tail = control_word(gctl, K.G_TAIL)
        round_tail = control_word(gctl, K.G_ROUND_TAIL)
        # Kept in a register: a scalar store is one thread's, and re-loading the word right after
        # it could give other warps the old round.
        rnd = control_word(gctl, K.G_ROUND)
        if not WRITE:
            # A new round: everything appended so far is older than this round's touches.
            round_tail = tail
            rnd += 1
            tl.store(gctl_ptr + K.G_ROUND, rnd)

        # -- victims: free GPU slots first (every classify program copied its share of the stack's
        # top into the victim list) ---------------------------------------------------------------
        n_free = control_word(gctl, K.G_GPU_FREE)
        k_free = tl.minimum(M, n_free)
        n_free = n_free - k_free

        want = M - k_free
        got = tl.zeros((), dtype=tl.int64)
        scanned = tl.zeros((), dtype=tl.int64)
        round_reads = tl.zeros((), dtype=tl.int64)
        # -- then the policy's candidates, listed segment by segment by the classify programs,
        # whose last lister of each block of SEG_BLOCK segments sealed it: running totals of the
        # blocks, one step up to 16,384 segments, and only as far as the victims reach (victims
        # are found among these blocks alone: E_SEG_BLOCKS) --------------------------------------
        if POLICY == K.EXACT_LRU:
            cand_blocks = (P + S.SEG_BLOCK - 1) // S.SEG_BLOCK  # one ring segment a chunk of the call
        else:  # every bucket's slot ranges, SEG_BLOCK ranges a block
            cand_blocks = R * ((G + CHUNK * S.SEG_BLOCK - 1) // (CHUNK * S.SEG_BLOCK))
        cand_blocks, run, clean_run = sum_blocks(seg_blocks_ptr, cand_blocks.to(tl.int64), want, BLOCK)
        if POLICY == K.EXACT_LRU:
            # Rarely (stale or protected pairs crowd the ring's head) the lists fall short: list more
            # segments of the ring here, one after another, EXTEND_LANES positions a step (a
            # segment's CHUNK lanes at once took this rare path to the register ceiling, and with
            # it every program of the launch: exact LRU's classify 254 -> 122 registers a thread),
            # in blocks of their own after the sealed ones, each block's start kept as it begins.
            extra = tl.zeros((), dtype=tl.int64)  # segments listed here, after ring segment P - 1
            while (run < want) & (head + (P + extra) * CHUNK < round_tail):
                ring_seg = P + extra
                n = tl.zeros((), dtype=tl.int64)
                n_clean = tl.zeros((), dtype=tl.int64)
                for sub in range(0, CHUNK, EXTEND_LANES):
                    off = ring_seg * CHUNK + sub + tl.arange(0, EXTEND_LANES)
                    eligible, s = _ring_candidates(
                        head, off, round_tail, q_slot_ptr, q_ver_ptr, Qcap, ver_ptr, mark_ptr, epoch
                    )
                    clean = eligible & (tl.zeros_like(s) != 0)
                    if not CACHE:
                        top = control_word(gctl, K.G_CPU_BOT) + control_word(gctl, K.G_CPU_FREE) - 1
                        clean = _clean_candidates(
                            s,
                            eligible,
                            copy_row_ptr,
                            copy_slot_ptr,
                            cpu_pos_ptr,
                            copy_depth_ptr,
                            top,
                            C,
                            want,
                        )
                    packed, step_clean = _packed_candidates(s, clean, eligible, n_clean)
                    rank = n + tl.cumsum(eligible.to(tl.int64), axis=0) - 1
                    tl.store(cand_ptr + ring_seg * CHUNK + rank, packed, mask=eligible)
                    n += tl.sum(eligible.to(tl.int64), axis=0)
                    n_clean += step_clean
                store_segment(seg_ptr, cand_blocks * S.SEG_BLOCK + extra, ring_seg * CHUNK, n, n_clean, True)
                run += n
                clean_run += n_clean
                extra += 1
            if extra > 0:
                # Sealed after the loop, where little else is live (sealing each segment in the
                # loop took the planning program past 128 registers and spilled).
                tl.debug_barrier()  # the segments' words stored above, before other lanes load them
                seal_listed_here(seg_ptr, seg_blocks_ptr, cand_blocks, extra)
            cand_blocks += (extra + S.SEG_BLOCK - 1) // S.SEG_BLOCK
        got = tl.minimum(run, want)
        # Every lane's running totals (sum_blocks' and the extension's stores) before any lane
        # reads another's below: the search for the last victim's segment.
        tl.debug_barrier()
        last_start = tl.zeros((), dtype=tl.int64)  # the last victim's segment: candidates before it,
        last_clean = tl.zeros((), dtype=tl.int64)  # clean ones before it, its list's place in cand
        last_at = tl.zeros((), dtype=tl.int64)
        if got > 0:
            _, last_start, last_clean, last_at = find_last_segment(
                got - 1, seg_ptr, seg_blocks_ptr, cand_blocks, BLOCK
            )
        # New entries (a write's misses, a prepare's new tokens: the first misses) whose slots
        # are victims' past the free slots, and how many of those are clean.
        NM = M
        if not WRITE:
            NM = control_word(ctl, K.E_NEW_MISSES)
        new_got = tl.minimum(tl.maximum(NM - k_free, 0), got)
        # The victims counted clean (their copies lie below every pop of the call). A prepare whose
        # misses all come from the CPU fills: a clean victim pops no row, and the row its miss
        # leaves takes its copy's place in the free list (apply). Otherwise (a write, or a prepare
        # of an entry never written: a miss with no row to leave) every victim pops one; in a
        # write, the row a clean victim pops takes its copy's place holding its new entry's copy.
        # A prepare's new tokens (its first misses) are a write's entries: it fills when its other
        # misses all come from the CPU, and only their clean victims pop nothing.
        fill = tl.zeros((), dtype=tl.int64)
        n_clean = tl.zeros((), dtype=tl.int64)
        if not CACHE:
            if not WRITE:  # (a prepare's new tokens, its first misses, leave no row: they never fill)
                fill = (MC + control_word(ctl, K.E_NEW_MISSES) == M).to(tl.int64)
            if got > 0:
                bit, in_segment = _unpacked_clean(tl.load(cand_ptr + last_at + (got - 1 - last_start)))
                n_clean = last_clean + in_segment + bit
        new_clean = n_clean
        if not CACHE:
            if (new_got > 0) & (new_got < got):  # a prepare's new tokens, then its selection's misses
                _, start, clean_before, at = find_last_segment(
                    new_got - 1, seg_ptr, seg_blocks_ptr, cand_blocks, BLOCK
                )
                bit, in_segment = _unpacked_clean(tl.load(cand_ptr + at + (new_got - 1 - start)))
                new_clean = clean_before + in_segment + bit
            new_clean = tl.where(new_got > 0, new_clean, 0)
        if POLICY == K.EXACT_LRU:
            new_head = head
            if want > 0:
                new_head = round_tail
                if run >= want:
                    # The last victim's ring position, in its segment.
                    # (an exact LRU segment's list starts at its ring segment's offset in cand)
                    qi = head + last_at + tl.arange(0, CHUNK)
                    eligible, s = _ring_candidates(
                        head, qi - head, round_tail, q_slot_ptr, q_ver_ptr, Qcap, ver_ptr, mark_ptr, epoch
                    )
                    rank = last_start + tl.cumsum(eligible.to(tl.int64), axis=0)
                    new_head = tl.max(tl.where(eligible & (rank == want), qi, -1), axis=0) + 1
            scanned = new_head - head
            head = new_head
        else:
            # PB-LRU's victims stay in their buckets until commit clears them (apply).
            # leaf words the lists were made from (none when no victim was wanted: nothing listed)
            scanned = tl.where(want > 0, R * ((G + CHUNK - 1) // CHUNK) * (CHUNK // 32), 0)
        V = k_free + got
        # (PB-LRU: every slot that receives an entry joins the current round's bucket at commit;
        # a prepare's round end runs across the grid in the launch after this one: round_end.)

        # -- make room for this call's appends: the live pairs past the new head, compacted -------
        # (the classify programs packed each block's; apply's workers copy them into place)
        ring_blocks = tl.zeros((), dtype=tl.int64)
        ring_at = tl.zeros((), dtype=tl.int64)
        dropped = tl.zeros((), dtype=tl.int64)
        if POLICY == K.EXACT_LRU:
            # The classify programs scanned the blocks when the call's elements could overflow the
            # ring; it compacts only when the pairs it does append would (a call of padding never).
            appends = H + tl.minimum(V, M)
            if ring_compaction_due(head0, tail, T, G, Qcap) & ring_compaction_due(
                head0, tail, appends, G, Qcap
            ):
                ring_blocks = (tail - head0 + CHUNK - 1) // CHUNK
                # Running totals of the blocks' live pairs, one past the last block included.
                live = tl.zeros((), dtype=tl.int64)
                for c0 in range(0, (ring_blocks + 1).to(tl.int32), BLOCK):
                    c = c0 + ar
                    n = tl.load(ring_blocks_ptr + 2 * c, mask=c < ring_blocks, other=0)
                    tl.store(
                        ring_blocks_ptr + 2 * c + 1, live + tl.cumsum(n, axis=0) - n, mask=c <= ring_blocks
                    )
                    live += tl.sum(n, axis=0)
                tl.debug_barrier()  # the running totals stored above, before two lanes' loads below
                # (Each a block read, skipped where it is known: no victim moved the head, or a
                # prepare's new round began at the tail.)
                if head > head0:
                    dropped = _live_before(
                        head, head0, tail, ring_blocks_ptr, q_slot_ptr, q_ver_ptr, Qcap, ver_ptr, CHUNK
                    )
                in_round = live
                if round_tail < tail:
                    in_round = _live_before(
                        round_tail, head0, tail, ring_blocks_ptr, q_slot_ptr, q_ver_ptr, Qcap, ver_ptr, CHUNK
                    )
                # (a ring index once here, so that apply's workers take no remainder)
                ring_at = (head - dropped) % Qcap
                round_reads = tail - head0  # the policy's upkeep: ring pairs the blocks scanned
                tail = head + live - dropped
                round_tail = head + in_round - dropped

        # -- the call's appends: its hits and the misses that take a slot, after the tail (each
        # chunk's offsets are decide's: its programs' prefixes over the chunks' counts). The first
        # as a ring index, so that apply takes no remainder: the call's appends (at most
        # G <= Qcap / 2) wrap once at most.
        queue_at = tail % Qcap
        q_run = tail + H + tl.minimum(V, M)
        push_run = MC

        # -- CPU rows: every miss past the free GPU slots pops one off the free list's top (for the
        # entry it evicts, or for itself when a write finds no slot), but a clean victim when the
        # call fills; every miss that came from the CPU leaves its row, which still holds its bytes,
        # at the bottom after its mapping moved, or, filling, in its clean victim's copy's place.
        # The classify programs copied the top to scratch, so the bottom may wrap over the popped
        # region without racing apply's readers of the pops.
        # (filling, the clean victims of the selection's misses alone: a new token's pops its row)
        pops = M - k_free - (n_clean - new_clean) * fill
        pushes = push_run - (n_clean - new_clean) * fill
        if CACHE:  # a buffer drops its victims (their home is on another rank): no CPU rows
            pops = pops * 0
        # New entries with a GPU slot (a write's, a prepare's new tokens) get a copy each: one in a
        # clean victim's slot in the row that victim popped (``new_clean`` of them), the others, in
        # miss order, in the plain rows right below the pops (never a row that holds a copy, nor
        # one the call pops), which go to the bottom before the call's swapped-in rows: the free
        # count is unchanged, the plain run shrinks by the pops and those copies.
        plain = tl.maximum(control_word(gctl, K.G_CPU_PLAIN) - pops, 0)
        copies = tl.zeros((), dtype=tl.int64)
        clean_copies = tl.zeros((), dtype=tl.int64)
        if not CACHE:
            if control_word(ctl, K.E_WRITE_COPIES) != 0:
                copies = tl.minimum(tl.minimum(V, NM) - new_clean, plain)
                clean_copies = new_clean
        plain -= copies
        # (pushes + copies <= C: rows that exist; a call pushes, or a write copies, never both)
        bottom = K.wrap(control_word(gctl, K.G_CPU_BOT) - pushes - copies, C)
        n_cpu = control_word(gctl, K.G_CPU_FREE) - pops + pushes

        # The group's words G_HEAD .. G_CPU_BOT, and the plan's words apply reads, one store each.
        g_new = tl.where(gw == K.G_HEAD, head, tl.where(gw == K.G_TAIL, q_run, round_tail))
        g_new = tl.where(gw == K.G_GPU_FREE, n_free, tl.where(gw == K.G_CPU_FREE, n_cpu, g_new))
        g_new = tl.where(gw == K.G_CPU_BOT, bottom, tl.where(gw == K.G_CPU_PLAIN, plain, g_new))
        tl.store(gctl_ptr + gw, g_new, mask=(gw >= K.G_HEAD) & (gw <= K.G_CPU_PLAIN))
        plan = tl.where(cw == K.E_KFREE, k_free, tl.where(cw == K.E_VICTIMS, V, bottom))
        plan = tl.where(cw == K.E_SEG_BLOCKS, cand_blocks, tl.where(cw == K.E_FILL, fill, plan))
        plan = tl.where(cw == K.E_POPS, pops, plan)
        plan = tl.where(cw == K.E_RING_BLOCKS, ring_blocks, tl.where(cw == K.E_RING_AT, ring_at, plan))
        plan = tl.where(cw == K.E_RING_DROPPED, dropped, plan)
        round_bucket = tl.zeros((), dtype=tl.int64)
        if POLICY == K.PBLRU:
            round_bucket = rnd % R
        plan = tl.where(cw == K.E_ROUND_BUCKET, round_bucket, plan)
        plan = tl.where(cw == K.E_MISSES, M, tl.where(cw == K.E_QUEUE_AT, queue_at, plan))
        plan = tl.where(cw == K.E_COPIES, copies, tl.where(cw == K.E_CLEAN_COPIES, clean_copies, plan))
        plan = tl.where(cw == K.E_NEW_CLEAN, new_clean, plan)
        planned = (cw == K.E_KFREE) | (cw == K.E_VICTIMS) | (cw == K.E_PUSH_BASE) | (cw == K.E_COPIES)
        planned = planned | (cw == K.E_CLEAN_COPIES) | (cw == K.E_NEW_CLEAN)
        planned = planned | (cw == K.E_SEG_BLOCKS) | (cw == K.E_FILL) | (cw == K.E_POPS)
        planned = planned | (cw == K.E_RING_BLOCKS) | (cw == K.E_RING_AT) | (cw == K.E_RING_DROPPED)
        planned = planned | (cw == K.E_ROUND_BUCKET) | (cw == K.E_MISSES) | (cw == K.E_QUEUE_AT)
        tl.store(ctl_ptr + cw, plan, mask=planned)

        # Counters, in one load and one store of the words that change. Evictions' bytes out are
        # counted by apply, which knows which were clean.
        sw = tl.arange(0, K.STATS_WORDS)
        delta = tl.where(sw == K.S_VICTIMS, V - k_free, tl.where(sw == K.S_SEARCH_READS, scanned, 0))
        delta = tl.where(sw == K.S_ROUND_READS, round_reads, delta)
        # New entries' copies, every layer of the group (the written row, zeros for the others)
        copied = (copies + clean_copies) * group_row_bytes
        if WRITE:
            cpu_rows = CF + (M - V)  # written in place on the CPU, or new entries homed there
            delta = tl.where(sw == K.S_BYTES_OUT, cpu_rows * layer_row_bytes + copied, delta)
        else:
            fetched = MC  # a tier swaps in its CPU-resident misses
            if CACHE:  # a buffer fetches every miss and drops its victims
                fetched = M
            # (a prepare's new tokens are written, not missed)
            delta = tl.where(sw == K.S_HITS, H, tl.where(sw == K.S_MISSES, M - NM, delta))
            delta = tl.where(sw == K.S_BYTES_IN, fetched * group_row_bytes, delta)
            delta = tl.where(sw == K.S_BYTES_OUT, copied, delta)
        tl.store(stats_ptr + sw, tl.load(stats_ptr + sw) + delta, mask=delta != 0)

    # -- always: publish the status, clear the accumulators, advance the epoch (one store) ------
    wrap = epoch + 1 >= K.EPOCH_LIMIT
    if wrap:
        # Claim keys are (epoch << 32 | ~pos): before the epoch would overflow them, clear the
        # scratch that epochs tag and restart. Once in 2**31 calls; O(addresses + slots).
        for i0 in range(0, N, BLOCK):
            tl.store(claim_ptr + i0 + ar, tl.zeros((BLOCK,), tl.int64), mask=i0 + ar < N)
        for i0 in range(0, G, BLOCK):
            tl.store(mark_ptr + i0 + ar, tl.zeros((BLOCK,), tl.int64), mask=i0 + ar < G)
    done = tl.where(
        cw == K.E_LAST_STATUS, status, tl.where(cw == K.E_PENDING, control_word(ctl, K.E_PENDING) | status, 0)
    )
    done = tl.where(cw == K.E_EPOCH, tl.where(wrap, 1, epoch + 1), done)
    cleared = (cw == K.E_STATUS) | (cw == K.E_DISTINCT) | (cw == K.E_NEED) | (cw == K.E_NEW_MISSES)
    published = (cw == K.E_LAST_STATUS) | (cw == K.E_PENDING) | (cw == K.E_EPOCH)
    tl.store(ctl_ptr + cw, done, mask=cleared | published)
    # The host learns of a refusal from its report, in host memory: no copy, no event (``deferred``).
    if WRITE:
        K.report_refusal(ctl_ptr, report_ptr, status, K.CALL_WRITE)
    else:
        K.report_refusal(ctl_ptr, report_ptr, status, K.CALL_PREPARE)


def victims_reference(
    st,
    g: int,
    scratch,
    T: int,
    write: bool,
    group_row_bytes: int,
    layer_row_bytes: int,
) -> None:
    """Plain-Python twin of :func:`victims_program` (run by the last ``classify`` program): walks
    misses and queue entries one at a time."""
    Qcap, C = st.q_slot.shape[1], K.CHUNK
    P = -(-T // C)
    ctl, gctl, stats = st.ctl, st.gctl[g], st.stats
    counts = scratch.counts[:P].tolist()
    total = [sum(row[i] for row in counts) for i in range(K.COUNT_WORDS)]
    D, H, M = int(ctl[int(K.E_DISTINCT)]), total[int(K.C_HITS)], total[int(K.C_NEED)]
    MC, CF = total[int(K.C_NEED_CPU)], total[int(K.C_CPU_FIRST)]
    status, epoch = int(ctl[int(K.E_STATUS)]), int(ctl[int(K.E_EPOCH)])
    if not write and status == 0 and int(ctl[int(K.E_MAX_SELECTION)]) < D:
        status |= int(K.ST_TOO_LARGE)
    if status == 0:
        head, tail = int(gctl[int(K.G_HEAD)]), int(gctl[int(K.G_TAIL)])
        round_tail = int(gctl[int(K.G_ROUND_TAIL)])
        if not write:
            round_tail = tail
            gctl[int(K.G_ROUND)] += 1
        n_free = int(gctl[int(K.G_GPU_FREE)])
        k_free = min(M, n_free)
        victims = [int(st.gpu_free[g, n_free - 1 - j]) for j in range(k_free)]
        n_free -= k_free
        scanned, round_reads = 0, 0
        bitmaps = PBLRUBits(st, g) if st.policy == K.PBLRU else None
        # The candidate lists the classify made and sealed, summed block by block (see segments).
        ranges = -(-st.gpu_slots // C)
        blocks = segment_blocks(P) if bitmaps is None else bitmaps.R * segment_blocks(ranges)
        blocks, run, clean_run = sum_blocks_reference(scratch, blocks, M - k_free, PLAN_LANES[st.policy])
        head0 = head  # where the classify's ring blocks start
        if bitmaps is None:
            scanned_from = head
            while len(victims) < M and head < round_tail:
                s = int(st.q_slot[g, head % Qcap])
                live = int(st.q_ver[g, head % Qcap]) == int(st.ver[g, s])
                if live and int(st.mark[s]) != epoch:
                    victims.append(s)
                head += 1
            scanned = head - scanned_from
            # ... and more segments of the ring while they fall short, in blocks of their own.
            extra = 0
            while run < M - k_free and scanned_from + (P + extra) * C < round_tail:
                lo = scanned_from + (P + extra) * C
                slots = ring_candidates_reference(st, g, lo, min(round_tail, lo + C))
                clean = [False] * len(slots)
                if not st.CACHE:
                    clean = clean_candidates_reference(st, g, slots, M - k_free, scratch)
                at = (P + extra) * C
                packed = packed_candidates_reference(slots, clean)
                scratch.cand[at : at + len(slots)] = torch.tensor(packed, dtype=torch.int64)
                store_segment_reference(
                    scratch, blocks * int(S.SEG_BLOCK) + extra, at, len(slots), sum(clean)
                )
                run += len(slots)
                clean_run += sum(clean)
                extra += 1
            if extra:
                seal_listed_here_reference(scratch, blocks, extra)
            blocks += segment_blocks(extra)
        else:
            # Victims: cold, then the ring oldest first, lower slots first, never the current round;
            # they leave their buckets at commit (apply).
            rnd = int(gctl[int(K.G_ROUND)])
            for i in range(bitmaps.R):
                bucket = bitmaps.R if i == 0 else (rnd + i) % bitmaps.R
                victims += sorted(bitmaps.sets[bucket])[: M - len(victims)]
            scanned = bitmaps.R * ranges * (C // 32) if k_free < M else 0
            bitmaps.store()
        V = len(victims)
        ring_blocks = ring_at = dropped = 0
        appends = H + min(V, M)
        if (
            bitmaps is None
            and ring_compaction_due_reference(head0, tail, T, st.gpu_slots, Qcap)
            and ring_compaction_due_reference(head0, tail, appends, st.gpu_slots, Qcap)
        ):
            # The live pairs past the new head, compacted from it (apply copies them into place).
            ring_blocks = -(-(tail - head0) // C)
            live = 0
            for b in range(ring_blocks + 1):
                scratch.ring_blocks[b, 1] = live
                live += int(scratch.ring_blocks[b, 0]) if b < ring_blocks else 0
            dropped = len(ring_live_reference(st, g, head0, head))
            in_round = len(ring_live_reference(st, g, head0, round_tail))
            ring_at = (head - dropped) % Qcap
            round_reads = tail - head0
            tail = head + live - dropped
            round_tail = head + in_round - dropped
        # The call's appends (its hits, and its misses that take a slot) go after the tail; each
        # chunk's offsets are decide's. Misses past the free GPU slots pop a CPU row each.
        queue_at, q_run, push_run = tail % Qcap, tail + H + min(V, M), MC
        # Which victims go back to their copies, decided here from the state as the call began.
        clean = [False] * (V - k_free)
        if not st.CACHE:
            clean = clean_candidates_reference(st, g, victims[k_free:], M - k_free)
        # New entries: a write's misses, or a prepare's new tokens (its first misses, which never
        # fill: the selection's misses past them fill when all come from the CPU).
        NM = M if write else int(ctl[int(K.E_NEW_MISSES)])
        new_clean = sum(clean[: max(0, min(NM - k_free, V - k_free))])
        fill = not write and not st.CACHE and MC == M - NM
        n_clean = sum(clean)
        pops = 0 if st.CACHE else M - k_free - (n_clean - new_clean) * fill  # the classify copied them
        pushes = push_run - (n_clean - new_clean) * fill
        plain = max(int(gctl[int(K.G_CPU_PLAIN)]) - pops, 0)
        # A new entry's copy: in the row its clean victim popped, else in a plain row below the
        # pops while they last.
        copying = not st.CACHE and int(ctl[int(K.E_WRITE_COPIES)])
        copies = min(min(V, NM) - new_clean, plain) if copying else 0
        clean_copies = new_clean if copying else 0
        plain -= copies
        bottom = (int(gctl[int(K.G_CPU_BOT)]) - pushes - copies) % st.cpu_stack_size
        gctl[int(K.G_HEAD)] = head
        gctl[int(K.G_TAIL)] = q_run
        gctl[int(K.G_ROUND_TAIL)] = round_tail
        gctl[int(K.G_GPU_FREE)] = n_free
        gctl[int(K.G_CPU_FREE)] += pushes - pops
        gctl[int(K.G_CPU_BOT)] = bottom
        gctl[int(K.G_CPU_PLAIN)] = plain
        ctl[int(K.E_COPIES)] = copies
        ctl[int(K.E_CLEAN_COPIES)] = clean_copies
        ctl[int(K.E_NEW_CLEAN)] = new_clean
        ctl[int(K.E_FILL)] = int(fill)
        ctl[int(K.E_POPS)] = pops
        ctl[int(K.E_KFREE)] = k_free
        ctl[int(K.E_VICTIMS)] = V
        ctl[int(K.E_SEG_BLOCKS)] = blocks
        ctl[int(K.E_RING_BLOCKS)] = ring_blocks
        ctl[int(K.E_RING_AT)] = ring_at
        ctl[int(K.E_RING_DROPPED)] = dropped
        ctl[int(K.E_ROUND_BUCKET)] = int(gctl[int(K.G_ROUND)]) % bitmaps.R if bitmaps is not None else 0
        ctl[int(K.E_MISSES)] = M
        ctl[int(K.E_QUEUE_AT)] = queue_at
        # The lists, read as the kernels read them, give the policy's victims in its order.
        listed = victim_slots(scratch, ctl.tolist(), torch.arange(k_free, V)).tolist()
        assert listed == victims[k_free:], (
            f"candidate lists give {listed[:8]}, the policy {victims[k_free:8]}"
        )
        listed_clean, before = victim_cleans(scratch, ctl.tolist(), torch.arange(k_free, V))
        assert listed_clean.tolist() == clean, "the candidate lists' clean bits disagree"
        assert before.tolist() == [sum(clean[:i]) for i in range(len(clean))]
        ctl[int(K.E_PUSH_BASE)] = bottom
        evicted = V - k_free
        stats[int(K.S_BYTES_OUT)] += (copies + clean_copies) * group_row_bytes
        if write:
            stats[int(K.S_BYTES_OUT)] += (CF + M - V) * layer_row_bytes
        else:
            stats[int(K.S_HITS)] += H
            stats[int(K.S_MISSES)] += M - NM
            stats[int(K.S_BYTES_IN)] += (M if st.CACHE else MC) * group_row_bytes
        stats[int(K.S_VICTIMS)] += evicted
        stats[int(K.S_SEARCH_READS)] += scanned
        stats[int(K.S_ROUND_READS)] += round_reads
    ctl[int(K.E_LAST_STATUS)] = status
    ctl[int(K.E_STATUS)] = 0
    ctl[int(K.E_DISTINCT)] = ctl[int(K.E_NEED)] = ctl[int(K.E_NEW_MISSES)] = 0
    ctl[int(K.E_PENDING)] |= status
    call = K.CALL_WRITE if write else K.CALL_PREPARE
    K.report_refusal_reference(ctl, st.group_reports[g], status, int(call))
    if epoch + 1 >= K.EPOCH_LIMIT:
        st.claim.zero_()
        st.mark.zero_()
        ctl[int(K.E_EPOCH)] = 1
    else:
        ctl[int(K.E_EPOCH)] = epoch + 1
