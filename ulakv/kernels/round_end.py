"""PB-LRU's round end, across the grid: the bucket about to be reused joins cold.

A prepare starts a round. Its end (after the plan, before apply commits) ORs the bucket of round
``round - num_buckets + 1`` into the cold bitmap and clears it, so that the next round can reuse it
(``ulakv.kernels.buckets``). The planning program did this alone, reading the bucket's non-empty
words a block of lanes at a time: about 68 dependent steps at 1 M slots, on every prepare of every
group, growing with the pool. Here program ``p`` merges leaf words ``p * LEAVES ..`` (1,024 words:
32 K slots) and the summary words above them, so the busiest program does a fixed number of
steps however large the pool (one more a summary level, as ``set_path``): 32 programs at 1 M slots.

It runs as its own launch between the classify and apply launches: a merge racing with the
touches of a classify launch or the clears of an apply launch could put a bit back in cold after
its slot left (a word read, then cleared by another program, then OR-ed in), and a launch
boundary orders them. A call whose plan was refused merges nothing.
"""

from __future__ import annotations

from . import buckets
from . import common as K
from ._triton import tl, triton
from .buckets import PBLRUBits
from .victims import control_word

# Leaf words a program merges: 32 summary words of level 1, one word of level 2.
LEAVES = 1024


# Not specialised: the ints (bitmap sizes, fixed per pool, feed no vectorisable access) and the
# group's bitmaps' alignment (a row of [groups, ...] state). LEAVES: constexpr.
@triton.jit(do_not_specialize=["BW", "n_levels", "R"], do_not_specialize_on_alignment=["bits_ptr"])
def round_end_kernel(ctl_ptr, bits_ptr, BW, lvl_ptr, n_levels, R, stats_ptr, LEAVES: tl.constexpr):
    p = tl.program_id(0)
    cw = tl.arange(0, K.CTL_BLOCK)
    ctl = tl.load(ctl_ptr + cw, mask=cw < K.CTL_WORDS, other=0)
    if control_word(ctl, K.E_LAST_STATUS) == 0:
        # The bucket after the round's own: the plan took the round's (round % R).
        old_base = K.wrap(control_word(ctl, K.E_ROUND_BUCKET) + 1, R) * BW
        cold_base = R.to(tl.int64) * BW
        leaf_count = tl.load(lvl_ptr + 1)
        w = p.to(tl.int64) * LEAVES + tl.arange(0, LEAVES)
        wm = w < leaf_count
        SUMMARY: tl.constexpr = LEAVES // 32
        s = p.to(tl.int64) * SUMMARY + tl.arange(0, SUMMARY)  # the level-1 words above them
        sm = s < 0
        if n_levels > 1:
            # Only the words a summary bit names are read (a pool of one leaf word has no summary).
            sm = s < tl.load(lvl_ptr + 2) - leaf_count
            above = tl.load(bits_ptr + old_base + leaf_count + w // 32, mask=wm, other=0)
            full = wm & (((above >> (w % 32).to(tl.int32)) & 1) != 0)
            reads = tl.sum(sm.to(tl.int64), axis=0)
        else:
            full = wm
            reads = tl.zeros((), dtype=tl.int64)
        word = tl.load(bits_ptr + old_base + w, mask=full, other=0)
        prev = tl.atomic_or(bits_ptr + cold_base + w, word, mask=full, sem="relaxed")
        buckets.set_path(bits_ptr, cold_base, lvl_ptr, n_levels, 1, w, full & (prev == 0) & (word != 0))
        tl.store(bits_ptr + old_base + w, tl.zeros((LEAVES,), tl.int32), mask=full)
        tl.debug_barrier()  # every lane's summary load above before other lanes zero those words
        if n_levels > 1:
            tl.store(bits_ptr + old_base + leaf_count + s, tl.zeros((SUMMARY,), tl.int32), mask=sm)
        # Level 2 and up: program p's word of level l is p >> 5 (l - 2); the first program under it
        # clears it (nothing sets a bit in this bucket while its round is not current).
        for level in range(2, n_levels):
            shift = 5 * (level - 2)
            if (p & ((1 << shift) - 1)) == 0:
                tl.store(bits_ptr + old_base + tl.load(lvl_ptr + level) + (p >> shift), 0)
        reads += tl.sum(full.to(tl.int64), axis=0)
        tl.atomic_add(stats_ptr + K.S_ROUND_READS, reads, mask=reads > 0, sem="relaxed")


def end_round(st, g: int) -> int:
    """Launch the round end of group ``g`` of ``st`` (a TieredState under PB-LRU) after a
    prepare's plan; returns launches (1)."""
    kw = st.group_kwargs(g)
    leaves = triton.cdiv(st.gpu_slots, 32)  # a bucket's leaf words (st.levels[1], kept on the device)
    round_end_kernel[(triton.cdiv(leaves, LEAVES),)](
        ctl_ptr=st.ctl,
        bits_ptr=kw["bits_ptr"],
        BW=kw["BW"],
        lvl_ptr=kw["lvl_ptr"],
        n_levels=kw["n_levels"],
        R=kw["R"],
        stats_ptr=kw["stats_ptr"],
        LEAVES=LEAVES,
    )
    return 1


def end_round_reference(st, g: int) -> None:
    """Plain-Python twin of :func:`end_round`."""
    if int(st.ctl[int(K.E_LAST_STATUS)]) != 0:
        return
    bitmaps = PBLRUBits(st, g)
    st.stats[int(K.S_ROUND_READS)] += bitmaps.retire(int(st.gctl[g, int(K.G_ROUND)]))
    bitmaps.store()
