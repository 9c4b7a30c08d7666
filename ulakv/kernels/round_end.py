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

from . import common as K
from ._triton import tl, triton
from .buckets import PBLRUBits
from .victims import control_word

# Leaf words a program merges: 32 summary words of level 1, one word of level 2.
LEAVES = 1024
# A power of two above the levels a bucket has (leaf included): 7 reach 32**7 slots.
LEVELS = 8


# Not specialised: the ints (bitmap sizes, fixed per pool, feed no vectorisable access) and the
# group's bitmaps' alignment (a row of [groups, ...] state). LEAVES, LEVELS: constexprs.
@triton.jit(do_not_specialize=["BW", "n_levels", "R"], do_not_specialize_on_alignment=["bits_ptr"])
def round_end_kernel(
    ctl_ptr, bits_ptr, BW, lvl_ptr, n_levels, R, stats_ptr, LEAVES: tl.constexpr, LEVELS: tl.constexpr
):
    p = tl.program_id(0)
    cw = tl.arange(0, K.CTL_BLOCK)
    ctl = tl.load(ctl_ptr + cw, mask=cw < K.CTL_WORDS, other=0)
    if control_word(ctl, K.E_LAST_STATUS) == 0:
        # The bucket after the round's own: the plan took the round's (round % R).
        old_base = K.wrap(control_word(ctl, K.E_ROUND_BUCKET) + 1, R) * BW
        cold_base = R.to(tl.int64) * BW
        # Every level's first word in one load (leaf first; word n_levels is the bucket's size):
        # each separate load is one more step of the program.
        lv = tl.arange(0, LEVELS)
        starts = tl.load(lvl_ptr + lv, mask=lv <= n_levels, other=0)
        leaf_count = control_word(starts, 1)
        w = p.to(tl.int64) * LEAVES + tl.arange(0, LEAVES)
        wm = w < leaf_count
        if n_levels > 1:
            # Only the words a summary bit names are read (a pool of one leaf word has no summary).
            above = tl.load(bits_ptr + old_base + leaf_count + w // 32, mask=wm, other=0)
            full = wm & (((above >> (w % 32).to(tl.int32)) & 1) != 0)
        else:
            full = wm
        word = tl.load(bits_ptr + old_base + w, mask=full, other=0)
        prev = tl.atomic_or(bits_ptr + cold_base + w, word, mask=full, sem="relaxed")
        # A cold word that turns non-empty sets its bit one level up, and so on (``set_path``, with
        # the levels' starts at hand).
        idx = w
        up = full & (prev == 0) & (word != 0)
        for level in range(1, n_levels):
            above_idx = idx // 32
            old = tl.atomic_or(
                bits_ptr + cold_base + control_word(starts, level) + above_idx,
                (1 << (idx % 32)).to(tl.int32),
                mask=up,
                sem="relaxed",
            )
            up = up & (old == 0)
            idx = above_idx
        tl.store(bits_ptr + old_base + w, tl.zeros((LEAVES,), tl.int32), mask=full)
        tl.debug_barrier()  # every lane's summary load above before other lanes zero those words
        # The summary words above the program's leaves, in one store: lanes 0 .. 31 the 32 of level
        # 1, lane 30 + l the one of level l >= 2 (word p >> 5 (l - 2), cleared by the first program
        # under it). Nothing sets a bit in this bucket while its round is not current.
        SUMMARY: tl.constexpr = LEAVES // 32
        z = tl.arange(0, 2 * SUMMARY)
        level = tl.minimum(tl.maximum(z - (SUMMARY - 2), 1), LEVELS - 1)
        shift = 5 * tl.maximum(level - 2, 0)
        first = tl.zeros((2 * SUMMARY,), tl.int64)
        for lvl in tl.static_range(1, LEVELS):
            first = tl.where(level == lvl, control_word(starts, lvl), first)
        level_one = p.to(tl.int64) * SUMMARY + z
        at = tl.where(z < SUMMARY, first + level_one, first + (p >> shift))
        clear = tl.where(
            z < SUMMARY,
            level_one < control_word(starts, 2) - leaf_count,
            (z - (SUMMARY - 2) < n_levels) & ((p & ((1 << shift) - 1)) == 0),
        )
        if n_levels > 1:
            tl.store(bits_ptr + old_base + at, tl.zeros((2 * SUMMARY,), tl.int32), mask=clear)
        reads = tl.sum(full.to(tl.int64), axis=0)
        if n_levels > 1:
            reads += tl.sum(((z < SUMMARY) & clear).to(tl.int64), axis=0)
        tl.atomic_add(stats_ptr + K.S_ROUND_READS, reads, mask=reads > 0, sem="relaxed")


def end_round(st, g: int) -> int:
    """Launch the round end of group ``g`` of ``st`` (a TieredState under PB-LRU) after a
    prepare's plan; returns launches (1)."""
    kw = st.group_kwargs(g)
    if kw["n_levels"] >= LEVELS:
        raise ValueError(
            f"{st.gpu_slots} GPU slots need {kw['n_levels']} bitmap levels; the round end takes {LEVELS - 1}"
        )
    leaves = K.cdiv(st.gpu_slots, 32)  # a bucket's leaf words (st.levels[1], kept on the device)
    round_end_kernel[(K.cdiv(leaves, LEAVES),)](
        ctl_ptr=st.ctl,
        bits_ptr=kw["bits_ptr"],
        BW=kw["BW"],
        lvl_ptr=kw["lvl_ptr"],
        n_levels=kw["n_levels"],
        R=kw["R"],
        stats_ptr=kw["stats_ptr"],
        LEAVES=LEAVES,
        LEVELS=LEVELS,
    )
    return 1


def end_round_reference(st, g: int) -> None:
    """Plain-Python twin of :func:`end_round`."""
    if int(st.ctl[int(K.E_LAST_STATUS)]) != 0:
        return
    bitmaps = PBLRUBits(st, g)
    st.stats[int(K.S_ROUND_READS)] += bitmaps.retire(int(st.gctl[g, int(K.G_ROUND)]))
    bitmaps.store()
