"""PB-LRU's bucket bitmaps on the device: the ``@triton.jit`` helpers the fused kernels call, and
``PBLRUBits``, their plain-Python twin for the kernels' references.

Every GPU slot used in a round gets that round's bit. A group keeps a ring of ``num_buckets``
bucket bitmaps (the current round's and the ``num_buckets - 1`` before it) plus one cold bitmap. A
slot's bucket follows from the round it was last used (``stamp``): within the ring, bucket
``stamp % num_buckets``; older, cold. So advancing a round moves no bit: at the end of a round the
bucket about to be reused is OR-ed into cold (cost: its non-empty words) and cleared.

Each bitmap carries summary levels (one bit per 32-bit word below, recursively, up to one word), so
finding the first ``k`` set bits reads about ``k x levels`` words however large the pool (16 K slots:
3 levels, 4 M slots: 5). Victims: free slots, then cold, then the ring oldest first; never the current
round's bucket, where this round's hits already sit (they are moved there before victims are sought).

The policy's meaning, as a plain model over addresses, is ``ulakv.policies.pblru.PBLRUModel``;
``search`` runs the victim search alone, for benchmarks.
"""

from __future__ import annotations

import torch

from . import common as K
from ._triton import tl, triton


def level_offsets(gpu_slots: int) -> list[int]:
    """Word offsets of each level of one bucket, leaf first, plus the bucket's total word count."""
    offsets, words = [0], -(-gpu_slots // 32)
    while True:
        offsets.append(offsets[-1] + words)
        if words == 1:
            return offsets
        words = -(-words // 32)


# Atomics on the bitmaps are relaxed: within a launch a word only needs its read-modify-writes not
# to be lost (sets go to the current round's bucket, clears come from the others, so no word sees
# both), and whoever reads the bits next is past a launch boundary or the classify ticket's
# acquire-release.


@triton.jit
def set_path(bits_ptr, base, lvl_ptr, n_levels, first_level, idx, mask):
    """Set bit ``idx`` of level ``first_level`` and, where its word was empty, the summary bit above
    it, and so on (idempotent). A summary word is touched only when a word below turns non-empty:
    the round's hits all share the bucket's one top word, and an OR of every level on every touch
    made it the most contended word of the step (about 690 K same-address atomics a group-step
    at batch 256 x 3 x 2048)."""
    for level in range(first_level, n_levels):
        word = idx // 32
        old = tl.atomic_or(
            bits_ptr + base + tl.load(lvl_ptr + level) + word,
            (1 << (idx % 32)).to(tl.int32),
            mask=mask,
            sem="relaxed",
        )
        mask = mask & (old == 0)
        idx = word


@triton.jit
def clear_path(bits_ptr, base, lvl_ptr, n_levels, idx, mask):
    """Clear leaf bit ``idx``; a word that becomes empty clears its bit one level up, and so on.
    Atomics make the last clearer of a word, and only it, go up."""
    for level in range(0, n_levels):
        word = idx // 32
        bit = (1 << (idx % 32)).to(tl.int32)
        old = tl.atomic_and(bits_ptr + base + tl.load(lvl_ptr + level) + word, ~bit, mask=mask, sem="relaxed")
        mask = mask & ((old & ~bit) == 0)
        idx = word


@triton.jit
def bucket_of(stamp, ref, R):
    """Physical bucket of a slot last used in round ``stamp``. ``ref`` is one past the last round
    whose end was processed: rounds up to ``ref - R`` have been merged into cold (index ``R``).
    During a prepare of round r (before its end) ``ref = r``; between rounds r and r+1, ``r + 1``."""
    return tl.where(ref - stamp < R, stamp % R, R)


@triton.jit
def touch(bits_ptr, BW, lvl_ptr, n_levels, stamp_ptr, R, cur, ref, slot, mask):
    """Move ``slot`` to round ``cur``'s bucket (no-op if it is there already)."""
    stamp = tl.load(stamp_ptr + slot, mask=mask, other=0)
    move = mask & (stamp != cur)
    bucket = tl.where(ref - stamp < R, stamp % R, R)  # bucket_of, inlined: nested calls are slow to interpret
    clear_path(bits_ptr, bucket.to(tl.int64) * BW, lvl_ptr, n_levels, slot, move)
    set_path(bits_ptr, (cur % R).to(tl.int64) * BW, lvl_ptr, n_levels, 0, slot, move)
    tl.store(stamp_ptr + slot, cur.to(tl.int32), mask=move)


@triton.jit
def place(bits_ptr, BW, lvl_ptr, n_levels, stamp_ptr, cur, cur_bucket, slot, mask):
    """A slot that just got a new entry (its old bits, if any, are already cleared), into round
    ``cur``'s bucket ``cur_bucket`` (``cur % R``, taken once by the caller)."""
    set_path(bits_ptr, cur_bucket.to(tl.int64) * BW, lvl_ptr, n_levels, 0, slot, mask)
    tl.store(stamp_ptr + slot, cur.to(tl.int32), mask=mask)


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


class PBLRUBits:
    """Plain-Python twin of the device bitmaps of one group, for the kernels' references.

    Holds one set of slots per bucket; ``store`` writes leaf words *and recomputes every summary
    level from the leaves*, so a kernel that maintains summaries incrementally must agree with a
    from-scratch rebuild. Searches count words read exactly as the device does (32 words a step).
    """

    FB = 32  # words a search step reads: the kernels' BLOCK (1024 lanes) / 32 bits

    def __init__(self, st, g: int) -> None:
        self.st, self.g = st, g
        self.R = st.num_buckets
        self.offsets = level_offsets(st.gpu_slots)
        self.BW = self.offsets[-1]
        words = st.bits[g].tolist()
        self.sets: list[set[int]] = []
        for b in range(self.R + 1):
            leaf = words[b * self.BW : b * self.BW + self.offsets[1]]
            self.sets.append({w * 32 + i for w, x in enumerate(leaf) for i in range(32) if (x >> i) & 1})
        self.stamp = st.stamp[g]

    def bucket_of(self, stamp: int, ref: int) -> int:
        return stamp % self.R if ref - stamp < self.R else self.R

    def touch(self, slot: int, cur: int, ref: int) -> None:
        stamp = int(self.stamp[slot])
        if stamp != cur:
            self.sets[self.bucket_of(stamp, ref)].discard(slot)
            self.sets[cur % self.R].add(slot)
            self.stamp[slot] = cur

    def place(self, slot: int, cur: int) -> None:
        self.sets[cur % self.R].add(slot)
        self.stamp[slot] = cur

    def clear(self, slot: int, ref: int) -> None:
        self.sets[self.bucket_of(int(self.stamp[slot]), ref)].discard(slot)

    def _levels(self, bucket: int) -> list[list[int]]:
        """Words of every level of a bucket, leaf first, rebuilt from its set."""
        leaf = [0] * self.offsets[1]
        for s in self.sets[bucket]:
            leaf[s // 32] |= 1 << (s % 32)
        levels = [leaf]
        for lo, hi in zip(self.offsets[1:-1], self.offsets[2:], strict=True):
            words = [0] * (hi - lo)
            for i, x in enumerate(levels[-1]):
                if x:
                    words[i // 32] |= 1 << (i % 32)
            levels.append(words)
        return levels

    def _leaf_words(self, levels: list[list[int]], limit: int) -> tuple[list[int], int]:
        frontier, reads = [0], 0
        for words in reversed(levels[1:]):
            nxt, f0 = [], 0
            while f0 < len(frontier) and len(nxt) < limit:
                chunk = frontier[f0 : f0 + self.FB]
                for w in chunk:
                    nxt += [w * 32 + i for i in range(32) if (words[w] >> i) & 1]
                reads += len(chunk)
                f0 += self.FB
            frontier = nxt[:limit]
        return frontier, reads

    def take(self, bucket: int, limit: int) -> tuple[list[int], int]:
        """The first ``limit`` slots of ``bucket`` (removed from it) and the words read."""
        levels = self._levels(bucket)
        leaf_words, reads = self._leaf_words(levels, limit)
        got, f0 = [], 0
        while f0 < len(leaf_words) and len(got) < limit:
            chunk = leaf_words[f0 : f0 + self.FB]
            for w in chunk:
                got += [w * 32 + i for i in range(32) if (levels[0][w] >> i) & 1]
            reads += len(chunk)
            f0 += self.FB
        got = got[:limit]
        self.sets[bucket] -= set(got)
        return got, reads

    def retire(self, cur: int) -> int:
        """End of round ``cur``: next round's bucket joins cold. Returns words read, as the round
        end's programs read them (``ulakv.kernels.round_end``): every level-1 summary word, and the
        leaf words they name (every leaf word when there is no summary level)."""
        bucket = (cur + 1) % self.R
        levels = self._levels(bucket)
        if len(levels) > 1:
            reads = len(levels[1]) + sum(1 for word in levels[0] if word)
        else:
            reads = len(levels[0])
        self.sets[self.R] |= self.sets[bucket]
        self.sets[bucket] = set()
        return reads

    def packed(self) -> torch.Tensor:
        """The group's int32 words as the sets say: leaves, and summaries rebuilt from them."""
        out = [w for b in range(self.R + 1) for words in self._levels(b) for w in words]
        wide = torch.tensor(out, dtype=torch.int64)
        return torch.where(wide >= 2**31, wide - 2**32, wide).to(torch.int32)

    def store(self) -> None:
        self.st.bits[self.g] = self.packed().to(self.st.bits.device)


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
    the same device search the pool uses. Returns the slots and the words read; for benchmarks."""
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
