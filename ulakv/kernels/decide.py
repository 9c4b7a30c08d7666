"""Decide: the last step of planning. Every move of every miss, as data in the call scratch.

The planning program (``ulakv.kernels.victims``) decides the call's totals: how many misses take a
free GPU slot, how many evict, where the victims' list lies, how many CPU rows are popped, whether
clean victims fill. From those, this launch decides each miss ``j`` (its index in the call's miss
order) and writes one column of ``moves`` (``K.MV_*`` words):

- ``MV_POS``: its position in the selection;
- ``MV_SLOT``: the GPU slot it receives (a free one, or a victim's), ``-1``: none (a write past the
  GPU's room, whose entry gets a CPU row of its own);
- ``MV_ROW``: the CPU row it pops off the top of the free list (for its victim's bytes, or its own
  entry when it has no slot), ``-1``: none (a free slot, or a victim that goes back to its copy when
  the plan fills);
- ``MV_DEST``: the CPU row that becomes a home at ``evict``: its victim's copy when the eviction is
  clean, else the row it popped; ``-1``: none (a free slot; a buffer drops its victims);
- ``MV_PUSH``: where its own CPU row joins the free list at ``commit`` (a miss from the CPU: in its
  clean victim's copy's place when the plan fills, else the list's bottom, in miss order), ``-1``:
  not from the CPU;
- ``MV_FLAGS``: ``MF_CLEAN`` (its victim's bytes stay: no copy out) and ``MF_REFILL`` (the row it
  popped, unused, takes its victim's copy's place in the free list);
- ``MV_COPY``: the CPU row a new entry's rows go to at ``in``, every layer (a write's misses, or a
  prepare's new tokens: ``NewRows``, the selection's first ``n_new`` positions): for a new entry in
  a clean victim's slot, the row that victim popped, which takes the victim's copy's place in the
  free list (``MV_PUSH`` is that place); for another new entry with a slot, ``k``-th of those in
  miss order (``k = j - clean_before(j)``) with ``k < E_COPIES``, the plain free row right below
  the call's pops (``popped[pops + k]``) that receives its copy (``MV_PUSH`` is then where that
  row rejoins the free list, the bottom, in that order); for one without a slot, its home
  (``MV_ROW``); ``-1``: none (write copies off, or plain rows ran out). A prepare's misses from the
  CPU leave their rows at the bottom after those copies.

Apply (``ulakv.kernels.apply``) only carries these out, in every launch of the plan, and
``TransferPlan.describe`` reads them back: what the plan shows is what the run does.

A victim goes back to its copy (a free CPU row that still holds its bytes) with no bytes moved
when the plan counted it clean and fills, or, popping a row all the same, when the copy is intact
and no pop of the call takes it: it lies deeper than the call's pops (its depth as the call began,
taken by the classify), or it is the very row the victim popped. The words read here change only
at commit, or by a pop of that very copy, which rules it out anyway.

One program a chunk of the selection first writes its chunk's offsets (from the count rows of the
blocks before its own and the counts before it in its block), then decides that chunk's misses,
``TILE`` at a time: no search for a miss's chunk, at most ``CHUNK / TILE`` steps a program whatever
the batch or the pool; a chunk without misses costs its program its offsets' loads and one store.
"""

from __future__ import annotations

import torch

from . import common as K
from ._triton import INTERPRETED, tl, triton
from .victims import (
    _count_rows,
    control_word,
    pop_index,
    pop_index_jit,
    victim_cleans,
    victim_slot,
    victim_slots,
)

# Misses a program decides a step. On a GPU at 4 warps 256 lanes are 2 a thread (the victim search
# holds a few int64 words a lane); the interpreter pays per operation, so it takes a chunk at once.
GPU_TILE = 256
TILE = K.CHUNK if INTERPRETED else GPU_TILE
DECIDE_WARPS = 4
# Rows of ``block_counts`` a decide program sums a step (COUNT_BLOCK chunks a row).
BLOCK_ROWS = tl.constexpr(256)


# Not specialised: T and the sizes (vary per call or per pool, feed no vectorisable access), the
# moves' capacity, and the alignment of group g's rows of [groups, ...] state.
@triton.jit(
    do_not_specialize=["T", "n_new", "G", "C", "Qcap", "cap"],
    do_not_specialize_on_alignment=["cpu_pos_ptr", "copy_row_ptr", "copy_slot_ptr"],
)
def decide_kernel(
    ctl_ptr,
    T,
    n_new,
    G,
    C,
    Qcap,
    home_ptr,
    counts_ptr,
    block_counts_ptr,
    miss_pos_ptr,
    cpu_rank_ptr,
    chunk_off_ptr,
    victims_ptr,
    popped_ptr,
    cand_ptr,
    seg_ptr,
    seg_blocks_ptr,
    copy_depth_ptr,
    cpu_pos_ptr,
    copy_row_ptr,
    copy_slot_ptr,
    moves_ptr,
    cap,
    CHUNK: tl.constexpr,
    TILE: tl.constexpr,
    POLICY: tl.constexpr,
    CACHE: tl.constexpr,
):
    c = tl.program_id(0)
    cw = tl.arange(0, K.CTL_BLOCK)
    ctl = tl.load(ctl_ptr + cw, mask=cw < K.CTL_WORDS, other=0)
    if control_word(ctl, K.E_LAST_STATUS) == 0:
        k_free = control_word(ctl, K.E_KFREE)
        V = control_word(ctl, K.E_VICTIMS)
        seg_blocks = control_word(ctl, K.E_SEG_BLOCKS)
        fill = control_word(ctl, K.E_FILL)
        pops = control_word(ctl, K.E_POPS)
        push_base = control_word(ctl, K.E_PUSH_BASE)
        copies = control_word(ctl, K.E_COPIES)
        # The chunk's offsets: the counts of the chunks before it, from the rows of the blocks
        # before its block (BLOCK_ROWS a step: one step up to 16 M elements) and the counts before
        # it in its block (fewer than COUNT_BLOCK).
        block = c // K.COUNT_BLOCK
        prior = tl.zeros((4,), tl.int64)  # COUNT_WORDS
        for b0 in range(0, block, BLOCK_ROWS):
            rows = _count_rows(block_counts_ptr, b0 + tl.arange(0, BLOCK_ROWS), block)
            prior += tl.sum(rows, axis=0)
        in_block = block * K.COUNT_BLOCK + tl.arange(0, K.COUNT_BLOCK)
        prior += tl.sum(_count_rows(counts_ptr, in_block, c), axis=0)
        m_off = control_word(prior, K.C_NEED)  # misses before the chunk: its first miss's index
        push_off = control_word(prior, K.C_NEED_CPU)  # misses from the CPU before it
        q_off = m_off * 0  # PB-LRU keeps no ring
        if POLICY == K.EXACT_LRU:
            # Its first append's ring index: the hits before it and the misses before it that took
            # a slot (victims go to misses in order) are appended before its own.
            appended = control_word(prior, K.C_HITS) + tl.minimum(V, m_off)
            q_off = K.wrap(control_word(ctl, K.E_QUEUE_AT) + appended, Qcap)  # appends <= G <= Qcap / 2
        w = tl.arange(0, 4)
        offsets = tl.where(w == K.O_MISS, m_off, tl.where(w == K.O_QUEUE, q_off, push_off))
        tl.store(chunk_off_ptr + c * K.OFF_WORDS + w, offsets, mask=w < K.OFF_WORDS)
        n = tl.load(counts_ptr + c * K.COUNT_WORDS + K.C_NEED)
        for r0 in range(0, n, TILE):
            r = r0 + tl.arange(0, TILE)
            live = r < n
            j = m_off + r
            p = tl.load(miss_pos_ptr + c * CHUNK + r, mask=live, other=0)
            src = tl.load(home_ptr + p, mask=live, other=0)
            has_slot = live & (j < V)
            v, counted_clean, before = victim_slot(
                j, has_slot, k_free, victims_ptr, cand_ptr, seg_ptr, seg_blocks_ptr, seg_blocks
            )
            popping = live & (j >= k_free)  # past the free slots: evicts, or takes a CPU row itself
            # Filling, the plan's clean victims pop nothing, but a new token's (its row holds the
            # token's copy): a prepare's new tokens are its first misses, so the clean victims
            # before a miss of the selection that fill are those before it less the new tokens'.
            is_new = p < n_new
            fills = (tl.where(counted_clean, fill, 0) != 0) & ~is_new
            before_fill = tl.where(is_new, 0, before - control_word(ctl, K.E_NEW_CLEAN))
            cpu_row = tl.full((TILE,), -1, tl.int32)
            dest = tl.full((TILE,), -1, tl.int32)
            push = tl.full((TILE,), -1, tl.int32)
            clean = fills
            refill = tl.zeros((TILE,), tl.int1)
            copy_to = tl.full((TILE,), -1, tl.int32)
            if not CACHE:  # a buffer drops its victims: no CPU rows, no copies
                takes_row = popping & ~fills
                at = pop_index_jit(j, k_free, before_fill, fill)
                cpu_row = tl.load(popped_ptr + at, mask=takes_row, other=-1)
                copy = tl.load(copy_row_ptr + v, mask=has_slot & popping, other=-1)
                back = takes_row & has_slot & (copy >= 0)
                back = back & (tl.load(copy_slot_ptr + copy, mask=back, other=-1) == v)
                deep = tl.load(copy_depth_ptr + v, mask=back, other=0) >= pops
                back = back & (deep | (copy == cpu_row))
                clean = fills | back
                refill = back & (copy != cpu_row)
                dest = tl.where(has_slot & clean, copy, cpu_row)
                dest = tl.where(popping, dest, -1)
                # A miss from the CPU leaves its row at the free list's bottom, after the call's
                # earlier such misses that do not fill (the classify ranked them in the chunk);
                # filling, in its clean victim's copy's place.
                pushes = live & (src >= G)
                bottom = push_base + copies - before_fill * fill + push_off
                bottom = K.wrap(bottom + tl.load(cpu_rank_ptr + p, mask=pushes, other=0), C)  # < 2C
                # A new entry (a write's, or a prepare's new token: positions below n_new) in a
                # clean victim's slot keeps its copy in the row the victim popped, in the copy's
                # place (evict puts it there); the others with a slot, the first ``copies`` in miss
                # order, in the plain rows below the call's pops, which rejoin the list at the
                # bottom, in that order, before the rows of misses from the CPU (above).
                paired = refill & is_new & ((j * 0 + control_word(ctl, K.E_CLEAN_COPIES)) != 0)
                place = tl.load(cpu_pos_ptr + copy, mask=(pushes & fills) | paired, other=0)
                push = tl.where(pushes, tl.where(fills, place, bottom), -1)
                k = j - before
                plain_copy = has_slot & is_new & ~counted_clean & (k < copies)
                copy_to = tl.load(popped_ptr + pops + k, mask=plain_copy, other=-1)
                copy_to = tl.where(paired, cpu_row, copy_to)
                push = tl.where(plain_copy, K.wrap(push_base + k, C), push)
                push = tl.where(paired, place, push).to(tl.int32)
                # (a written entry with no slot gets its rows in the row it popped, its home)
                copy_to = tl.where(live & ~has_slot, cpu_row, copy_to)
            flags = clean.to(tl.int32) * K.MF_CLEAN + refill.to(tl.int32) * K.MF_REFILL
            out = moves_ptr + j
            tl.store(out + K.MV_POS * cap, p, mask=live)
            tl.store(out + K.MV_SLOT * cap, tl.where(has_slot, v, -1), mask=live)
            tl.store(out + K.MV_ROW * cap, cpu_row, mask=live)
            tl.store(out + K.MV_DEST * cap, dest, mask=live)
            tl.store(out + K.MV_PUSH * cap, push, mask=live)
            tl.store(out + K.MV_FLAGS * cap, flags, mask=live)
            tl.store(out + K.MV_COPY * cap, copy_to, mask=live)


def decide(st, g: int, scratch, T: int, n_new: int) -> int:
    """Launch decide for group ``g``'s plan of ``T`` selection elements, whose first ``n_new`` are
    new entries (a write's ``T``; a prepare's new tokens, else 0): one program a chunk. Returns
    launches (1)."""
    decide_kernel[(K.cdiv(T, K.CHUNK),)](
        ctl_ptr=st.ctl,
        T=T,
        n_new=n_new,
        G=st.gpu_slots,
        C=st.cpu_stack_size,
        Qcap=st.q_slot.shape[1],
        home_ptr=scratch.home,
        counts_ptr=scratch.counts,
        block_counts_ptr=scratch.block_counts,
        miss_pos_ptr=scratch.miss_pos,
        cpu_rank_ptr=scratch.cpu_rank,
        chunk_off_ptr=scratch.chunk_off,
        victims_ptr=scratch.victims,
        popped_ptr=scratch.popped,
        cand_ptr=scratch.cand,
        seg_ptr=scratch.seg,
        seg_blocks_ptr=scratch.seg_blocks,
        copy_depth_ptr=scratch.copy_depth,
        cpu_pos_ptr=st.cpu_pos[g],
        copy_row_ptr=st.copy_row[g],
        copy_slot_ptr=st.copy_slot[g],
        moves_ptr=scratch.moves,
        cap=scratch.capacity,
        CHUNK=K.CHUNK,
        TILE=TILE,
        POLICY=st.policy,
        CACHE=st.CACHE,
        num_warps=DECIDE_WARPS,
    )
    return 1


def decide_reference(st, g: int, scratch, T: int, n_new: int) -> None:
    """Plain-Python twin of :func:`decide`: the same columns of ``scratch.moves``, from the same
    scratch and state, with tensor operations over every miss at once."""
    ctl = st.ctl.tolist()
    if ctl[int(K.E_LAST_STATUS)] != 0:
        return
    chunks = -(-T // K.CHUNK)
    # Each chunk's offsets: where its misses start, where its first append goes in the LRU ring,
    # its misses from the CPU before it.
    rows = scratch.counts[:chunks].cpu().to(torch.int64)
    prior = torch.cumsum(rows, dim=0) - rows
    m_off = prior[:, int(K.C_NEED)]
    q_off = torch.zeros_like(m_off)
    if st.policy == K.EXACT_LRU:
        appended = prior[:, int(K.C_HITS)] + m_off.clamp(max=ctl[int(K.E_VICTIMS)])
        q_off = (ctl[int(K.E_QUEUE_AT)] + appended) % st.q_slot.shape[1]
    offsets = torch.stack([m_off, q_off, prior[:, int(K.C_NEED_CPU)]], dim=1)
    scratch.chunk_off[:chunks] = offsets.to(scratch.chunk_off.device)
    counts = rows[:, int(K.C_NEED)]
    chunk = torch.repeat_interleave(torch.arange(chunks), counts)
    j = torch.arange(int(counts.sum()))
    r = j - offsets[chunk, int(K.O_MISS)]
    pos = scratch.miss_pos.cpu().to(torch.int64)[chunk * K.CHUNK + r]
    src = scratch.home.cpu().to(torch.int64)[pos]
    k_free, V, G = ctl[int(K.E_KFREE)], ctl[int(K.E_VICTIMS)], st.gpu_slots
    fill, pops = ctl[int(K.E_FILL)], ctl[int(K.E_POPS)]
    has_slot = j < V
    slot = torch.where(has_slot, victim_slots(scratch, ctl, j), -1)
    counted_clean, before = victim_cleans(scratch, ctl, j)
    counted_clean &= has_slot
    before = torch.where(has_slot, before, 0)
    popping = j >= k_free
    is_new = pos < n_new  # a prepare's new tokens never fill (their popped rows hold their copies)
    fills = counted_clean & bool(fill) & ~is_new
    before_fill = torch.where(is_new, 0, before - ctl[int(K.E_NEW_CLEAN)])
    none = torch.full_like(j, -1)
    cpu_row, dest, push, clean, refill = none, none, none, fills, torch.zeros_like(fills)
    copy_to = none
    if not st.CACHE:
        takes_row = popping & ~fills
        popped = scratch.popped.cpu().to(torch.int64)
        at = pop_index(j, k_free, before_fill, fill).clamp(min=0, max=popped.numel() - 1)
        cpu_row = torch.where(takes_row, popped[at], -1)
        copy_row, copy_slot = st.copy_row[g].cpu().to(torch.int64), st.copy_slot[g].cpu().to(torch.int64)
        copy = torch.where(has_slot & popping, copy_row[slot.clamp(min=0)], -1)
        intact = (copy >= 0) & (copy_slot[copy.clamp(min=0)] == slot)
        depth = scratch.copy_depth.cpu().to(torch.int64)[slot.clamp(min=0)]
        back = takes_row & has_slot & intact & ((depth >= pops) | (copy == cpu_row))
        clean = fills | back
        refill = back & (copy != cpu_row)
        dest = torch.where(popping, torch.where(has_slot & clean, copy, cpu_row), -1)
        pushes = src >= G
        rank = scratch.cpu_rank.cpu().to(torch.int64)[pos]
        C = st.cpu_stack_size
        copies = ctl[int(K.E_COPIES)]
        bottom = ctl[int(K.E_PUSH_BASE)] + copies - before_fill * fill + offsets[chunk, int(K.O_PUSH)] + rank
        bottom = bottom % C
        filled = st.cpu_pos[g].cpu().to(torch.int64)[copy.clamp(min=0)]
        push = torch.where(pushes, torch.where(fills, filled, bottom), -1)
        paired = refill & is_new & bool(ctl[int(K.E_CLEAN_COPIES)])
        k = j - before
        copied = has_slot & is_new & ~counted_clean & (k < copies)
        copy_to = torch.where(copied, popped[(pops + k).clamp(max=popped.numel() - 1)], -1)
        copy_to = torch.where(paired, cpu_row, copy_to)
        copy_to = torch.where(has_slot, copy_to, cpu_row)
        push = torch.where(copied, (ctl[int(K.E_PUSH_BASE)] + k) % C, push)
        push = torch.where(paired, filled, push)
    flags = clean.to(torch.int64) * int(K.MF_CLEAN) + refill.to(torch.int64) * int(K.MF_REFILL)
    words = torch.stack([pos, slot, cpu_row, dest, push, flags, copy_to]).to(torch.int32)
    scratch.moves[:, : j.numel()] = words.to(scratch.moves.device)
