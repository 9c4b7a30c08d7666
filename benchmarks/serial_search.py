"""The serial, summary-guided PB-LRU victim search the pool ran before its candidate lists: one
program follows a bucket's summary levels down to the leaf words that hold set bits and takes the
first ``count`` slots. The pool no longer runs it (``ulakv.kernels.victims`` lists candidates from
every bucket's leaf words); it is kept here for the tables in ``benchmarks/RESULTS.md`` that measured
its words read as the pool grows (``policy_suite.py``, ``test_victim_search.py``).
"""

from __future__ import annotations

import torch

from ulakv.kernels import common as K
from ulakv.kernels._triton import tl, triton
from ulakv.kernels.buckets import clear_path, level_offsets


@triton.jit
def leaf_words(bits_ptr, base, lvl_ptr, n_levels, limit, buf_ptr, buf_size, BLOCK: tl.constexpr):
    """Indices of the first ``limit`` non-empty leaf words of a bucket, ascending, descending the
    summaries level by level. Each non-empty word holds at least one set bit, so keeping ``limit``
    words a level is enough. Returns (count, location of the list, words read)."""
    FB: tl.constexpr = BLOCK // 32
    lane = tl.arange(0, BLOCK)
    row, sub = lane // 32, lane % 32
    tl.store(buf_ptr, 0)  # the top level is one word, word 0
    tl.debug_barrier()
    n = tl.full((), 1, tl.int64)
    reads = tl.zeros((), dtype=tl.int64)
    for i in range(0, n_levels - 1):
        level = n_levels - 1 - i
        src = buf_ptr + (i % 2) * buf_size
        dst = buf_ptr + ((i + 1) % 2) * buf_size
        off = tl.load(lvl_ptr + level)
        m = tl.zeros((), dtype=tl.int64)
        f0 = tl.zeros((), dtype=tl.int64)
        while (f0 < n) & (m < limit):
            fi = f0 + row
            fm = fi < n
            widx = tl.load(src + fi, mask=fm, other=0)
            word = tl.load(bits_ptr + base + off + widx, mask=fm, other=0)
            hit = fm & (((word >> sub) & 1) != 0)
            rank = m + tl.cumsum(hit.to(tl.int64), axis=0) - 1
            keep = hit & (rank < limit)
            tl.store(dst + rank, widx * 32 + sub, mask=keep)
            m += tl.sum(keep.to(tl.int64), axis=0)
            reads += tl.minimum(n - f0, FB)
            f0 += FB
        tl.debug_barrier()
        n = m
    return n, buf_ptr + ((n_levels - 1) % 2) * buf_size, reads


@triton.jit
def take_victims(bits_ptr, base, lvl_ptr, n_levels, limit, buf_ptr, buf_size, out_ptr, BLOCK: tl.constexpr):
    """The first ``limit`` set slots of a bucket, ascending, written to ``out_ptr`` and cleared from
    the bucket. Returns (count, words read)."""
    FB: tl.constexpr = BLOCK // 32
    lane = tl.arange(0, BLOCK)
    row, sub = lane // 32, lane % 32
    n, words_ptr, reads = leaf_words(bits_ptr, base, lvl_ptr, n_levels, limit, buf_ptr, buf_size, BLOCK)
    got = tl.zeros((), dtype=tl.int64)
    f0 = tl.zeros((), dtype=tl.int64)
    while (f0 < n) & (got < limit):
        fi = f0 + row
        fm = fi < n
        widx = tl.load(words_ptr + fi, mask=fm, other=0)
        word = tl.load(bits_ptr + base + widx, mask=fm, other=0)
        hit = fm & (((word >> sub) & 1) != 0)
        rank = got + tl.cumsum(hit.to(tl.int64), axis=0) - 1
        keep = hit & (rank < limit)
        slot = widx * 32 + sub
        tl.store(out_ptr + rank, slot, mask=keep)
        tl.debug_barrier()  # every lane has read its word before any bit of it is cleared
        clear_path(bits_ptr, base, lvl_ptr, n_levels, slot, keep)
        got += tl.sum(keep.to(tl.int64), axis=0)
        reads += tl.minimum(n - f0, FB)
        f0 += FB
    return got, reads


# Not specialised: the ints (limit varies per call; the rest size the bitmap, no vectorisable access) and
# the caller's bucket's alignment. The other pointers are allocated by ``search``. BLOCK: constexpr.
@triton.jit(do_not_specialize=["n_levels", "limit", "buf_size"], do_not_specialize_on_alignment=["bits_ptr"])
def _search_kernel(
    bits_ptr, lvl_ptr, n_levels, limit, buf_ptr, buf_size, out_ptr, stats_ptr, BLOCK: tl.constexpr
):
    got, reads = take_victims(bits_ptr, 0, lvl_ptr, n_levels, limit, buf_ptr, buf_size, out_ptr, BLOCK)
    tl.store(stats_ptr, got)
    tl.store(stats_ptr + 1, reads)


def bucket_bits(occupied: torch.Tensor) -> torch.Tensor:
    """One bucket's words (leaf and every summary level) for a boolean ``[slots]`` occupancy."""
    levels = []
    bits = occupied.to(torch.bool)
    while True:
        padded = torch.nn.functional.pad(bits, (0, (-bits.numel()) % 32)).view(-1, 32).to(torch.int64)
        words = (padded << torch.arange(32)).sum(1)
        levels.append(torch.where(words >= 2**31, words - 2**32, words).to(torch.int32))
        if words.numel() == 1:
            return torch.cat(levels)
        bits = words != 0


def search(bucket: torch.Tensor, gpu_slots: int, count: int) -> tuple[torch.Tensor, int]:
    """Take the first ``count`` slots of one bucket (``bucket_bits`` layout, cleared in place) with
    the serial search. Returns the slots and the words read."""
    offsets = level_offsets(gpu_slots)
    device = bucket.device
    levels = torch.tensor(offsets, dtype=torch.int64, device=device)
    frontier = torch.empty(2 * offsets[1], dtype=torch.int32, device=device)
    out = torch.full((max(count, 1),), -1, dtype=torch.int32, device=device)
    stats = torch.zeros(2, dtype=torch.int64, device=device)
    _search_kernel[(1,)](
        bits_ptr=bucket,
        lvl_ptr=levels,
        n_levels=len(offsets) - 1,
        limit=count,
        buf_ptr=frontier,
        buf_size=offsets[1],
        out_ptr=out,
        stats_ptr=stats,
        BLOCK=K.BLOCK,
    )
    got, reads = stats.tolist()
    return out[:got], reads
