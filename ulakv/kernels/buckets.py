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

The policy's meaning, as a plain model over addresses, is ``ulakv.policies.pblru.PBLRUModel``.
The pool's victims come from the classify programs' candidate lists (``ulakv.kernels.victims``),
which read every bucket's leaf words; the serial summary-guided search it ran before lives in
``benchmarks/serial_search.py``, for the table in ``benchmarks/RESULTS.md`` that measured it.
"""

from __future__ import annotations

import torch

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


class PBLRUBits:
    """Plain-Python twin of the device bitmaps of one group, for the kernels' references.

    Holds one set of slots per bucket; ``store`` writes leaf words *and recomputes every summary
    level from the leaves*, so a kernel that maintains summaries incrementally must agree with a
    from-scratch rebuild; ``retire`` counts the words the round end reads.
    """

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
