"""Constants shared by the kernels and their references: control words, status bits, element flags.

Control words live in small int64 device tensors so a step never needs the host to know a count:
``ctl`` (one per pool, call-scoped scratch) and ``gctl`` (one row per layer group, policy state).
"""

from __future__ import annotations

from ._triton import tl, triton

# Elements of a selection are processed in chunks of this many per program: a block size, so one
# compilation serves every batch size. 1024 int64 addresses keep a program at 8 KiB of loads.
CHUNK = 1024

# Lanes of one step of a program that loops: running totals over chunks, candidate segments or ring
# blocks (one step covers a million elements, ring pairs or slots: 1024 x CHUNK), a release's or an
# admission's addresses, a bitmap's words. 1024 int64 lanes are 8 KiB a load, 8 a thread of 4 warps.
BLOCK = 1024

# ctl: pool-wide, one call at a time.
E_EPOCH = tl.constexpr(0)  # increments every call; tags claims and protection marks
E_STATUS = tl.constexpr(1)  # status bits of the call in flight (OR-ed by programs)
E_LAST_STATUS = tl.constexpr(2)  # final status of the last call (what validate mode reads)
# Sticky OR of refused calls' status: for inspection only (``deferred`` raises from the reports).
E_PENDING = tl.constexpr(3)
E_KFREE = tl.constexpr(4)  # misses served from free GPU slots this call
E_VICTIMS = tl.constexpr(5)  # misses that got a GPU slot this call (free or evicted)
E_PUSH_BASE = tl.constexpr(6)  # ring index where this call's swapped-in rows join the CPU free list
E_DISTINCT = tl.constexpr(7)  # distinct addresses of the call in flight (counted by the claim)
E_NEED = tl.constexpr(8)  # ... of which need a GPU slot (misses; a write's new entries): the next word
E_MAX_SELECTION = tl.constexpr(9)  # most distinct addresses a prepare may select (set at build)
E_ARRIVED = tl.constexpr(10)  # classify programs done this call; the last one plans, then clears it
E_SEG_BLOCKS = tl.constexpr(
    11
)  # blocks of candidate segments the plan summed: those holding victims past free slots
E_FILL = tl.constexpr(12)  # 1: clean victims pop no CPU row; their copies' places take their misses' rows
E_POPS = tl.constexpr(13)  # CPU rows this call pops off the top of the free list
E_RING_BLOCKS = tl.constexpr(14)  # exact LRU: ring blocks this call compacts (0: none; see victims)
E_RING_AT = tl.constexpr(15)  # ... the ring index where block 0's first live pair would land
E_RING_DROPPED = tl.constexpr(16)  # ... live pairs before the new head (victims, hits appended again)
E_ROUND_BUCKET = tl.constexpr(17)  # PB-LRU: the bucket of the group's current round (round % R)
E_MISSES = tl.constexpr(18)  # misses the plan moves (the chunks' summed): apply's workers stride over them
E_QUEUE_AT = tl.constexpr(19)  # exact LRU: the ring index of the call's first append (decide's offsets)
E_REFUSALS = tl.constexpr(20)  # calls refused so far (mod 2**32): the count each report carries
E_COPIES = tl.constexpr(21)  # a write: its new entries given a clean copy in a plain free CPU row
E_WRITE_COPIES = tl.constexpr(22)  # 1: writes make copies and write through (``Tiered.write_copies``)
E_CLEAN_COPIES = tl.constexpr(23)  # a write: its new entries whose copy is the row their clean victim popped
# A prepare with new rows (``NewRows``): its new tokens that are not padding, counted by the claim
# (the planning program reads and clears it; a write's new entries are its misses).
E_NEW_MISSES = tl.constexpr(24)
# ... and the victims counted clean among its new tokens' (they pop a row even when the call fills:
# it holds the new token's copy), so that the selection's misses past them may fill.
E_NEW_CLEAN = tl.constexpr(25)
# ULAKV_DEBUG: GPU slots and CPU rows that apply found claimed already by another miss of the same
# call (a plan that gives one home to two misses); the pool raises if it is not 0.
E_HOME_CLAIMS = tl.constexpr(26)
CTL_WORDS = 27
CTL_BLOCK = tl.constexpr(32)  # a power of two >= CTL_WORDS: apply loads the words it needs at once

# gctl: one row per layer group.
G_ROUND = tl.constexpr(0)  # rounds started by prepare
G_HEAD = tl.constexpr(1)  # LRU queue head (oldest entry), monotonically increasing
G_TAIL = tl.constexpr(2)  # LRU queue tail
G_ROUND_TAIL = tl.constexpr(3)  # tail when the current round began: entries past it are protected
G_GPU_FREE = tl.constexpr(4)  # entries on the GPU free-slot stack
G_CPU_FREE = tl.constexpr(5)  # rows on the CPU free list
G_CPU_BOT = tl.constexpr(6)  # index of the free list's bottom row in its ring (``cpu_free``)
# Rows on top of the free list known to hold no copy (released homes, never-used rows): a write takes
# its new entries' copies from these alone, so it never trades an older entry's copy for a new one.
# Kept exactly by pops (minus), releases (plus) and a write's copies (minus); rows a call pushes go
# to the bottom and never join this run.
G_CPU_PLAIN = tl.constexpr(7)
GCTL_WORDS = 8

# stats: cumulative counters.
S_HITS = tl.constexpr(0)
S_MISSES = tl.constexpr(1)
S_BYTES_IN = tl.constexpr(2)
S_BYTES_OUT = tl.constexpr(3)
S_VICTIMS = tl.constexpr(4)
S_SEARCH_READS = tl.constexpr(5)  # LRU: ring entries the head passed; PB-LRU: leaf words listed
S_ROUND_READS = tl.constexpr(6)  # policy upkeep: PB-LRU's cold merge (words), exact LRU's compaction (pairs)
S_CLEAN = tl.constexpr(7)  # evictions to a free CPU row that still held the entry's bytes: no copy
STATS_WORDS = 8
STAT_NAMES = (
    "hits",
    "misses",
    "bytes_in",
    "bytes_out",
    "victims",
    "victim_search_reads",
    "round_upkeep_reads",
    "clean_evictions",
)

# Policies, as the kernels' POLICY constexpr.
EXACT_LRU = 0
PBLRU = 1

# Status bits of one call.
ST_BAD_ADDRESS = tl.constexpr(1)
ST_DUPLICATE = tl.constexpr(2)
ST_TOO_LARGE = tl.constexpr(4)
# Set by a striped pool's census (``kernels/census.py``) before planning, never by a tiered pool's
# kernels: one home's share of the selection is more than its slice may bring in, or more of it
# misses the buffer than a fetch carries from a rank.
ST_HOME_LIMIT = tl.constexpr(8)
# Set by ``admit_addresses`` (engine-owned addresses): more addresses would be live than the pool holds.
ST_FULL = tl.constexpr(16)
# A prepare's new token (``NewRows``) that already has a home, or appears twice among the new ones.
ST_NOT_NEW = tl.constexpr(32)

# The refusal report: one int64 word in host memory the device writes and the host reads without a
# copy or a wait (``ulakv.deferred``). A refused call stores ``E_REFUSALS << 32 | call << 8 |
# status`` in one aligned 8-byte store, which the host reads whole; nothing else writes it.
CALL_PREPARE = tl.constexpr(1)  # a prepare or plan
CALL_WRITE = tl.constexpr(2)
CALL_ADMIT = tl.constexpr(3)  # admit_addresses
CALL_RELEASE = tl.constexpr(4)  # release_addresses
CALL_NAMES = {1: "prepare", 2: "write", 3: "admit_addresses", 4: "release_addresses"}


@triton.jit
def report_refusal(ctl_ptr, report_ptr, status, CALL: tl.constexpr):
    """Count a call's refusal (``status`` nonzero) in ``E_REFUSALS`` and store its report for the
    host; nothing for a call that went through. One program runs it, once a call."""
    if status != 0:
        refusals = (tl.load(ctl_ptr + E_REFUSALS) + 1) & 0xFFFFFFFF
        tl.store(ctl_ptr + E_REFUSALS, refusals)
        tl.store(report_ptr, (refusals << 32) | (CALL << 8) | status)


@triton.jit
def element_addresses(sel_ptr, new_ptr, n_new, pos, mask, other):
    """Addresses (int64; ``other`` where ``mask`` is off) of a call's elements ``pos``: a prepare's
    first ``n_new`` are its new tokens, read through ``new_ptr``, the rest its selection, through
    ``sel_ptr`` at ``pos - n_new``. Two pointers, so that neither is first copied into one buffer
    (two copies a one-plan call). One load where none of ``pos`` is a new token: a call without
    new tokens, and every block of a one-plan call past its first new tokens (the second load,
    masked off there, would still be an issued instruction; at batch 256 it was one operation more
    in each of apply's 10,656 miss tiles)."""
    a = tl.load(sel_ptr + (pos - n_new), mask=mask & (pos >= n_new), other=other).to(tl.int64)
    if n_new > 0:
        if tl.min(tl.where(mask, pos, n_new), axis=0) < n_new:
            fresh = tl.load(new_ptr + pos, mask=mask & (pos < n_new), other=other).to(tl.int64)
            a = tl.where(pos < n_new, fresh, a)
    return a


def report_refusal_reference(ctl, report, status: int, call: int) -> None:
    """Plain twin of :func:`report_refusal`."""
    if status:
        refusals = (int(ctl[int(E_REFUSALS)]) + 1) & 0xFFFFFFFF
        ctl[int(E_REFUSALS)] = refusals
        report[0] = (refusals << 32) | (call << 8) | status


# Per-element flags written by the lookup.
F_FIRST = tl.constexpr(1)  # first occurrence of its address in the call (the one that acts)
F_GPU = tl.constexpr(2)  # home on the GPU at lookup time
F_CPU = tl.constexpr(4)  # home on the CPU at lookup time
F_MOVED = tl.constexpr(8)  # final home comes from this call's plan (a miss, or a new entry)
F_PAD = tl.constexpr(16)
F_BAD = tl.constexpr(32)
# A write's entry homed on the GPU whose copy is intact and deeper than the call pops: the written
# layer goes to the copy too (write-through), so the copy stays intact.
F_THROUGH = tl.constexpr(64)

# Per-chunk counters written by the lookup (distinct addresses are counted once, by the claim).
C_HITS = tl.constexpr(0)
C_NEED = tl.constexpr(1)  # distinct addresses that need a GPU slot
C_NEED_CPU = tl.constexpr(2)  # ... of which are on the CPU now (a swap-in)
C_CPU_FIRST = tl.constexpr(3)  # distinct addresses written in place on the CPU (write mode)
COUNT_WORDS = 4

# Chunks whose counts the classify programs add into one row of ``block_counts`` (the claim zeroes
# it): the planning program sums the rows, 256 a step (one step up to 16,384 chunks: 16 M
# elements), and each decide program finds its chunk's offsets from the rows before its block and
# the counts before it in the block (at most 63 rows), so no program steps over every chunk.
COUNT_BLOCK = tl.constexpr(64)

# Per-chunk offsets the plan hands to apply (``chunk_off`` rows, written by decide).
O_MISS = tl.constexpr(0)  # where the chunk's misses start in the victim list
O_QUEUE = tl.constexpr(1)  # where its touches are appended to the LRU queue
O_PUSH = tl.constexpr(2)  # its rank among the CPU rows freed by this call
OFF_WORDS = tl.constexpr(3)

# What the plan decided for each miss: rows of the call scratch's ``moves`` (``ulakv.kernels.decide``).
MV_POS = tl.constexpr(0)  # its position in the selection
MV_SLOT = tl.constexpr(1)  # the GPU slot it receives (-1: none)
MV_ROW = tl.constexpr(2)  # the CPU row it pops (-1: none)
MV_DEST = tl.constexpr(3)  # the CPU row that becomes a home at evict: its victim's, or its own (-1: none)
MV_PUSH = tl.constexpr(4)  # where its own CPU row (or its copy's) joins the free list at commit (-1: none)
MV_FLAGS = tl.constexpr(5)  # MF_* bits
# The CPU row a write's miss's rows go to at ``in`` (-1: none): a new entry with a GPU slot, the plain
# free row that receives its copy (MV_PUSH is then where that row rejoins the free list: a write has
# no miss from the CPU); one without a slot, its home (MV_ROW).
MV_COPY = tl.constexpr(6)
MOVE_WORDS = 7
MF_CLEAN = tl.constexpr(1)  # its victim's bytes stay where they are: no copy out
MF_REFILL = tl.constexpr(2)  # the row it popped, unused, takes its victim's copy's place in the free list

# The phases of applying a plan, in order (data, then mapping; the signal follows the last). After
# every phase each entry is readable at the home its mapping names, so a plan stopped between any
# two phases loses nothing and finishes by running the rest.
#   out:    data. Each victim's rows, every layer of the group, go to a free CPU row.
#   evict:  mapping. Victims live in those rows; their GPU slots are unowned. Slots are output.
#   in:     data. Each miss's rows come into its GPU slot (a write that found none: a CPU row).
#   commit: mapping. Misses live where their rows are; their old CPU rows are freed; recency.
PH_OUT = tl.constexpr(1)
PH_EVICT = tl.constexpr(2)
PH_IN = tl.constexpr(3)
PH_COMMIT = tl.constexpr(4)

# Mapping encoding (see ulakv.address_space).
M_FREE = tl.constexpr(-1)
M_UNHOMED = tl.constexpr(-2)

# The claim key packs (epoch, position) so atomic_max keeps the lowest position of the newest
# epoch; epochs must stay below 2**31 to keep the key positive, after which scratch is reset.
EPOCH_LIMIT = 2**31 - 1
POS_MASK = 0xFFFFFFFF


@triton.jit
def wrap(i, n):
    """``i`` modulo ``n`` for ``-n <= i < 2n`` (a ring index one lap off at most): a compare and an
    add or subtract, where a 64-bit remainder by a runtime value is a software routine of tens of
    instructions on a GPU."""
    i = tl.where(i >= n, i - n, i)
    return tl.where(i < 0, i + n, i)


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for host code: ``triton.cdiv`` is a constexpr function that unwraps its
    arguments on every call (about 5 us of host time; a pool call sized its grids 8 times)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
