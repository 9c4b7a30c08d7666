"""Candidate segments: how the classify programs' lists of eviction candidates are summed and
searched without one program stepping over every list.

A call's eviction candidates come in *segments*, each listed by one classify program (exact LRU:
the live pairs of one ring segment of ``CHUNK`` positions; PB-LRU: one bucket's slots in one range
of ``CHUNK`` slots). Victim ``r`` past the free slots is the ``r``-th candidate in segment order, so
finding it needs the candidates before each segment. Segments come in blocks of ``SEG_BLOCK``:

1. A lister stores its segment's place in ``cand`` and its length and clean count
   (``store_segment``), then arrives at its block (``arrive``: an acquire-release ticket a block,
   the handshake the whole launch uses for its planning program), at the end of its program
   where little else is live. The last to arrive *seals* the block: each segment's candidates
   (and clean ones) before it in the block, and the block's totals. A PB-LRU slot range's program
   arrives once for its range block and seals that range block in every bucket (``SEAL_ROWS``
   blocks a step). The ticket counts (``seg_arrivals``) are the one part of the call scratch a
   call leaves for the next: the last lister sets its block's back to zero.
2. The planning program sums the blocks' totals (``sum_blocks``): 256 blocks a step, one step up
   to 16,384 segments (PB-LRU's 8 buckets x 1,024 slot ranges at a million slots; exact LRU's
   ring segments of a 16 M-element call), and only as far as the victims reach. When exact LRU's
   lists fall short, the planning program lists more ring segments in blocks of their own after
   the sealed ones, then seals and sums those (``seal_listed_here``).
3. A victim's segment is then a binary search over the blocks' starts (ceil(log2(blocks)) loads,
   7 at a million PB-LRU slots) and one within its block (6 loads), whatever the pool or the batch.

A block is ``SEG_BLOCK`` consecutive segment slots; a block with fewer segments (the last of a
call's ring segments, the last slot range of each bucket) is padded with empty segments whose
count before them is the block's total, so no search ever stops on one.
"""

from __future__ import annotations

import torch

from ._triton import tl, triton

# Segments a block: 64 keeps a PB-LRU seal one [8, 64] tile (one element a thread of a 16-warp
# program) and the search within a block 6 loads.
SEG_BLOCK = tl.constexpr(64)
LOG2_SEG_BLOCK = tl.constexpr(6)
# Blocks a PB-LRU sealing step takes at once: the 8 buckets a slot range lists in (the default).
SEAL_ROWS = tl.constexpr(8)
# A segment's words in ``seg``: candidates before it in its block, where its list starts in cand,
# clean candidates before it in its block, and its length and clean count as listed (packed).
SEG_WORDS = tl.constexpr(4)
W_BEFORE = tl.constexpr(0)
W_AT = tl.constexpr(1)
W_CLEAN_BEFORE = tl.constexpr(2)
W_LISTED = tl.constexpr(3)
# A block's words in ``seg_blocks``: its candidates and clean ones (sealed), then the candidates
# and clean ones before it (summed by the plan).
BLOCK_WORDS = tl.constexpr(4)
B_TOTAL = tl.constexpr(0)
B_CLEAN_TOTAL = tl.constexpr(1)
B_BEFORE = tl.constexpr(2)
B_CLEAN_BEFORE = tl.constexpr(3)
# A segment's length (at most CHUNK) in the low word of its packed counts, its clean ones above.
LENGTH_MASK = tl.constexpr(0xFFFFFFFF)
CLEAN_SHIFT = tl.constexpr(32)


def segment_blocks(segments: int) -> int:
    """Blocks that hold ``segments`` segments."""
    return -(-segments // int(SEG_BLOCK))


@triton.jit
def store_segment(seg_ptr, k, start, length, clean, listed):
    """Segment slot ``k``'s list: where it starts in ``cand``, and its length and clean count, in
    one store. Nothing when ``listed`` is false (a launch may have programs past its segments)."""
    w = tl.arange(0, 2)
    words = tl.where(w == 0, start, length.to(tl.int64) | (clean.to(tl.int64) << CLEAN_SHIFT))
    tl.store(seg_ptr + SEG_WORDS * k + W_AT + 2 * w, words, mask=w < tl.where(listed, 2, 0))


@triton.jit
def _seal(seg_ptr, seg_blocks_ptr, first, stride, n_blocks, size, ROWS: tl.constexpr):
    """Seal blocks ``first, first + stride, ..`` (``n_blocks`` of them, ``size`` segments listed in
    each): every segment slot's candidates and clean ones before it in its block (the padding's:
    the block's totals), and each block's totals. ROWS blocks a step."""
    t = tl.arange(0, SEG_BLOCK)[None, :]
    w = tl.arange(0, 2)[None, :]
    for i0 in range(0, n_blocks, ROWS):
        i = i0 + tl.arange(0, ROWS)[:, None]
        rows = i < n_blocks
        b = first + i.to(tl.int64) * stride
        k = b * SEG_BLOCK + t
        listed = tl.load(seg_ptr + SEG_WORDS * k + W_LISTED, mask=rows & (t < size), other=0)
        length = listed & LENGTH_MASK
        clean = listed >> CLEAN_SHIFT
        every = rows & (t >= 0)
        tl.store(seg_ptr + SEG_WORDS * k + W_BEFORE, tl.cumsum(length, axis=1) - length, mask=every)
        tl.store(seg_ptr + SEG_WORDS * k + W_CLEAN_BEFORE, tl.cumsum(clean, axis=1) - clean, mask=every)
        totals = tl.where(w == 0, tl.sum(length, axis=1)[:, None], tl.sum(clean, axis=1)[:, None])
        tl.store(seg_blocks_ptr + BLOCK_WORDS * b + B_TOTAL + w, totals, mask=rows & (w < 2))


@triton.jit
def arrive(seg_ptr, seg_blocks_ptr, arrivals_ptr, a, first, stride, n_blocks, size, ROWS: tl.constexpr):
    """A lister's arrival at arrival block ``a``, which ``size`` listers share (each listed one
    segment in each of blocks ``first, first + stride, ..``, ``n_blocks`` of them): the last to
    arrive seals those blocks, ROWS a step, and clears the ticket for the next call."""
    tl.debug_barrier()  # every thread's stores of this program's segments precede the release
    ticket = tl.atomic_add(arrivals_ptr + a, 1, sem="acq_rel")
    if ticket == size - 1:
        tl.debug_barrier()  # the acquire above before any thread loads the other listers' words
        tl.store(arrivals_ptr + a, 0)
        _seal(seg_ptr, seg_blocks_ptr, first, stride, n_blocks, size, ROWS)


@triton.jit
def seal_listed_here(seg_ptr, seg_blocks_ptr, first, segments):
    """Seal and sum the blocks of the ``segments`` segments the planning program listed itself
    (in slots from block ``first`` on, after every sealed block, all summed), one block a step:
    each segment's counts before it in its block, and each block's start, from the running totals
    through block ``first - 1``."""
    w = tl.arange(0, 4)
    prior = tl.load(seg_blocks_ptr + BLOCK_WORDS * (first - 1) + w)
    run = tl.sum(tl.where((w == B_BEFORE) | (w == B_TOTAL), prior, 0), axis=0)
    clean_run = tl.sum(tl.where((w == B_CLEAN_BEFORE) | (w == B_CLEAN_TOTAL), prior, 0), axis=0)
    t = tl.arange(0, SEG_BLOCK)
    for i in range(0, (segments + SEG_BLOCK - 1) // SEG_BLOCK):
        b = first + i
        k = b * SEG_BLOCK + t
        listed = tl.load(seg_ptr + SEG_WORDS * k + W_LISTED, mask=t < segments - i * SEG_BLOCK, other=0)
        length = listed & LENGTH_MASK
        clean = listed >> CLEAN_SHIFT
        tl.store(seg_ptr + SEG_WORDS * k + W_BEFORE, tl.cumsum(length, axis=0) - length)
        tl.store(seg_ptr + SEG_WORDS * k + W_CLEAN_BEFORE, tl.cumsum(clean, axis=0) - clean)
        n = tl.sum(length, axis=0)
        n_clean = tl.sum(clean, axis=0)
        row = tl.where(
            w == B_TOTAL, n, tl.where(w == B_CLEAN_TOTAL, n_clean, tl.where(w == B_BEFORE, run, clean_run))
        )
        tl.store(seg_blocks_ptr + BLOCK_WORDS * b + w, row)
        run += n
        clean_run += n_clean


@triton.jit
def sum_blocks(seg_blocks_ptr, blocks, want, LANES: tl.constexpr):
    """The planning program's running totals over the sealed blocks (candidates and clean ones
    before each), LANES blocks a step, as far as ``want`` candidates reach. Returns the blocks
    summed and the candidates and clean ones in them."""
    ar = tl.arange(0, LANES)[:, None]
    pair = tl.arange(0, 2)[None, :]
    run = tl.zeros((), dtype=tl.int64)
    clean_run = tl.zeros((), dtype=tl.int64)
    b0 = tl.zeros((), dtype=tl.int64)
    while (b0 < blocks) & (run < want):
        b = b0 + ar
        m = (b < blocks) & (pair < 2)
        at = seg_blocks_ptr + BLOCK_WORDS * b + pair
        totals = tl.load(at + B_TOTAL, mask=m, other=0)
        before = tl.where(pair == 0, run, clean_run) + tl.cumsum(totals, axis=0) - totals
        tl.store(at + B_BEFORE, before, mask=m)
        step = tl.sum(totals, axis=0)  # [candidates, clean] of this step's blocks
        run += tl.sum(tl.where(tl.arange(0, 2) == 0, step, 0), axis=0)
        clean_run += tl.sum(tl.where(tl.arange(0, 2) == 1, step, 0), axis=0)
        b0 += LANES
    return tl.minimum(blocks, b0), run, clean_run


@triton.jit
def find_segment(r, mask, seg_ptr, seg_blocks_ptr, blocks):
    """The segment that holds candidate ``r`` (lanes where ``mask`` holds; ``r`` below the blocks'
    total): a binary search over the blocks' starts, then one within the block. Returns its slot,
    the candidates and clean ones before it, and where its list starts in ``cand``."""
    b = tl.zeros_like(r)
    size = blocks + 0
    while size > 1:
        half = size // 2
        start = tl.load(seg_blocks_ptr + BLOCK_WORDS * (b + half) + B_BEFORE, mask=mask, other=0)
        b = tl.where(start <= r, b + half, b)
        size -= half
    pair = tl.arange(0, 2)[None, :]  # the block's start, both counts in one load
    start = tl.load(
        seg_blocks_ptr + BLOCK_WORDS * b[:, None] + B_BEFORE + pair, mask=mask[:, None] & (pair < 2), other=0
    )
    block_before = tl.sum(tl.where(pair == 0, start, 0), axis=1)
    block_clean = tl.sum(tl.where(pair == 1, start, 0), axis=1)
    r_in = r - block_before
    t = tl.zeros_like(r)
    for step in tl.static_range(LOG2_SEG_BLOCK):
        half = SEG_BLOCK >> (step + 1)
        start = tl.load(seg_ptr + SEG_WORDS * (b * SEG_BLOCK + t + half) + W_BEFORE, mask=mask, other=0)
        t = tl.where(start <= r_in, t + half, t)
    k = b * SEG_BLOCK + t
    w = tl.arange(0, 4)[None, :]
    words = tl.load(seg_ptr + SEG_WORDS * k[:, None] + w, mask=mask[:, None] & (w < 3), other=0)
    before = block_before + tl.sum(tl.where(w == W_BEFORE, words, 0), axis=1)
    clean_before = block_clean + tl.sum(tl.where(w == W_CLEAN_BEFORE, words, 0), axis=1)
    return k, before, clean_before, tl.sum(tl.where(w == W_AT, words, 0), axis=1)


@triton.jit
def find_last_segment(r, seg_ptr, seg_blocks_ptr, blocks, LANES: tl.constexpr):
    """``find_segment`` for one candidate ``r``, as the planning program needs it: LANES blocks'
    starts a step (one step up to 16,384 segments), then the block's segments in one load."""
    ar = tl.arange(0, LANES)
    b = tl.zeros((), dtype=tl.int64)
    for b0 in range(0, blocks.to(tl.int32), LANES):
        c = b0 + ar
        start = tl.load(seg_blocks_ptr + BLOCK_WORDS * c + B_BEFORE, mask=c < blocks, other=0)
        b = tl.maximum(b, tl.max(tl.where((c < blocks) & (start <= r), c, 0), axis=0).to(tl.int64))
    w = tl.arange(0, 4)
    block = tl.load(seg_blocks_ptr + BLOCK_WORDS * b + w)
    block_before = tl.sum(tl.where(w == B_BEFORE, block, 0), axis=0)
    t = tl.arange(0, SEG_BLOCK)
    start = tl.load(seg_ptr + SEG_WORDS * (b * SEG_BLOCK + t) + W_BEFORE)
    k = b * SEG_BLOCK + tl.max(tl.where(block_before + start <= r, t, 0), axis=0)
    words = tl.load(seg_ptr + SEG_WORDS * k + w, mask=w < 3, other=0)
    before = block_before + tl.sum(tl.where(w == W_BEFORE, words, 0), axis=0)
    clean_before = tl.sum(tl.where(w == B_CLEAN_BEFORE, block, 0), axis=0)
    clean_before += tl.sum(tl.where(w == W_CLEAN_BEFORE, words, 0), axis=0)
    return k, before, clean_before, tl.sum(tl.where(w == W_AT, words, 0), axis=0)


# -- host twins -------------------------------------------------------------------------------------


def store_segment_reference(scratch, k: int, start: int, length: int, clean: int) -> None:
    """Plain-Python twin of ``store_segment``."""
    scratch.seg[k, int(W_AT)] = start
    scratch.seg[k, int(W_LISTED)] = length | (clean << int(CLEAN_SHIFT))


def seal_reference(scratch, first: int, stride: int, n_blocks: int, size: int) -> None:
    """Plain-Python twin of the sealing that the last lister to ``arrive`` does."""
    n = int(SEG_BLOCK)
    for i in range(n_blocks):
        b = first + i * stride
        listed = scratch.seg[b * n : b * n + n, int(W_LISTED)].clone()
        listed[size:] = 0
        length, clean = listed & int(LENGTH_MASK), listed >> int(CLEAN_SHIFT)
        scratch.seg[b * n : b * n + n, int(W_BEFORE)] = torch.cumsum(length, 0) - length
        scratch.seg[b * n : b * n + n, int(W_CLEAN_BEFORE)] = torch.cumsum(clean, 0) - clean
        scratch.seg_blocks[b, int(B_TOTAL)] = int(length.sum())
        scratch.seg_blocks[b, int(B_CLEAN_TOTAL)] = int(clean.sum())


def seal_listed_here_reference(scratch, first: int, segments: int) -> None:
    """Plain-Python twin of ``seal_listed_here``."""
    run = int(scratch.seg_blocks[first - 1, int(B_BEFORE)] + scratch.seg_blocks[first - 1, int(B_TOTAL)])
    clean_run = int(
        scratch.seg_blocks[first - 1, int(B_CLEAN_BEFORE)] + scratch.seg_blocks[first - 1, int(B_CLEAN_TOTAL)]
    )
    n = int(SEG_BLOCK)
    for i in range(-(-segments // n)):
        seal_reference(scratch, first + i, 1, 1, min(n, segments - i * n))
        scratch.seg_blocks[first + i, int(B_BEFORE)] = run
        scratch.seg_blocks[first + i, int(B_CLEAN_BEFORE)] = clean_run
        run += int(scratch.seg_blocks[first + i, int(B_TOTAL)])
        clean_run += int(scratch.seg_blocks[first + i, int(B_CLEAN_TOTAL)])


def sum_blocks_reference(scratch, blocks: int, want: int, lanes: int) -> tuple[int, int, int]:
    """Plain-Python twin of ``sum_blocks``."""
    run = clean_run = summed = 0
    while summed < blocks and run < want:
        for b in range(summed, min(blocks, summed + lanes)):
            scratch.seg_blocks[b, int(B_BEFORE)] = run
            scratch.seg_blocks[b, int(B_CLEAN_BEFORE)] = clean_run
            run += int(scratch.seg_blocks[b, int(B_TOTAL)])
            clean_run += int(scratch.seg_blocks[b, int(B_CLEAN_TOTAL)])
        summed = min(blocks, summed + lanes)
    return summed, run, clean_run


def find_segment_reference(scratch, blocks: int, r: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Host twin of ``find_segment`` for candidates ``r`` (int64, CPU): each one's segment slot,
    the candidates and clean ones before it, and where its list starts in ``cand``."""
    seg, sb = scratch.seg.cpu(), scratch.seg_blocks.cpu()
    starts = sb[:blocks, int(B_BEFORE)].contiguous()
    b = (torch.searchsorted(starts, r, right=True) - 1).clamp(min=0)
    r_in = r - starts[b]
    rows = b[:, None] * int(SEG_BLOCK) + torch.arange(int(SEG_BLOCK))
    t = (seg[rows, int(W_BEFORE)] <= r_in[:, None]).sum(dim=1) - 1  # in-block starts never decrease
    k = b * int(SEG_BLOCK) + t.clamp(min=0)
    before = starts[b] + seg[k, int(W_BEFORE)]
    clean_before = sb[b, int(B_CLEAN_BEFORE)] + seg[k, int(W_CLEAN_BEFORE)]
    return k, before, clean_before, seg[k, int(W_AT)]
