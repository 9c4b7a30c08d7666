"""The census of a striped call: what a selection asks of each home, in one launch and no sort.

Every rank of a striped pool takes the census of the whole selection (``ulakv.layouts.census``
says why); this is its kernel, a program a ``CHUNK`` of elements:

1. Each element checks its address (in range, live) and, if in range, *claims* it: an
   ``atomic_xchg`` of the call's epoch into the address's word of a per-pool stamp table (int32 a
   global address, allocated with the pool). The one element that finds another epoch there is
   the address's first occurrence; every other one is a repeat (a duplicate, in a write). The
   epoch advances every call, so the table is never cleared (but once in 2**31 calls).
2. Firsts are counted per home (``address mod world``), and in a fetch-mode prepare those the
   buffer does not hold, into ``[world]`` accumulators: a histogram of the chunk, then one atomic
   add a home. Counts do not depend on which element claimed first, so every rank reaches the same
   ones. Each element also stores its local address on this rank (``address // world``; -1 when
   homed elsewhere, padding or out of range): what the slice's plan reads.
3. The last program to arrive (an acquire-release ticket, as ``ulakv.kernels.segments``) turns the
   counts into the status word and the result (status, distinct and missing per home), clears the
   accumulators and the ticket, and advances the epoch.

Per program: ``CHUNK`` elements and ``WORLD`` atomics, whatever the batch or the pool. Nothing is
read back and the shapes depend only on the selection's: a step can be captured. Before, a census
sorted the selection's int64 keys and built ten temporaries of its size (about 0.65 GB at batch 256
x 3 x 2048 on 8 ranks).
"""

from __future__ import annotations

import torch

from . import common as K
from ._triton import tl, triton

# The census's words (int64 ``[WORDS + 2 * LANES]``): the epoch of the call in flight, the programs
# arrived, the status bits the programs found (bad addresses, duplicates), then the accumulators of
# distinct addresses per home and of those missing the buffer, ``LANES`` each.
W_EPOCH = tl.constexpr(0)
W_ARRIVED = tl.constexpr(1)
W_STATUS = tl.constexpr(2)
WORDS = 4  # a spare word keeps the accumulators 32-byte aligned
W_DISTINCT = tl.constexpr(WORDS)


def lanes(world: int) -> int:
    """Lanes of a per-home vector: ``world`` rounded up to a power of two, 2 at least."""
    return max(2, K.next_pow2(world))


def words_size(world: int) -> int:
    return WORDS + 2 * lanes(world)


# Not specialised: every int (T varies each call; N, B, rank and the limits are pool constants that
# feed no vectorisable access: specialising them only splits binaries by rank or pool size); the
# caller's selection and the buffer mapping's row, whose alignment varies. WORLD, LANES (the pool's),
# UNIQUE (a write), FETCH (a fetch-mode prepare), CHUNK: constexprs. A pool compiles one variant a
# mode (a write's, a local prepare's or a read's, a fetch-mode prepare's) and selection dtype.
@triton.jit(
    do_not_specialize=["T", "N", "B", "rank", "per_home", "most", "fetch_width"],
    do_not_specialize_on_alignment=["sel_ptr", "map_ptr"],
)
def census_kernel(
    sel_ptr,
    T,
    N,
    live_ptr,
    stamp_ptr,
    words_ptr,
    result_ptr,
    local_ptr,
    map_ptr,
    B,
    rank,
    per_home,
    most,
    fetch_width,
    WORLD: tl.constexpr,
    LANES: tl.constexpr,
    UNIQUE: tl.constexpr,
    FETCH: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pos = tl.program_id(0).to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
    inb = pos < T
    a = tl.load(sel_ptr + pos, mask=inb, other=-1).to(tl.int64)
    in_range = inb & (a >= 0) & (a < N)
    live = tl.load(live_ptr + a, mask=in_range, other=0) != 0
    bad = inb & (a != -1) & ~(in_range & live)
    epoch = tl.load(words_ptr + W_EPOCH).to(tl.int32)
    # Relaxed: only the exchanges themselves must not be lost; nothing reads a stamp this call.
    previous = tl.atomic_xchg(
        stamp_ptr + a, tl.zeros_like(pos).to(tl.int32) + epoch, mask=in_range, sem="relaxed"
    )
    first = in_range & (previous != epoch)
    home = (a % WORLD).to(tl.int32)  # a >= 0 where it counts: first, or homed here
    mine = in_range & (home == rank)
    tl.store(local_ptr + pos, tl.where(mine, a // WORLD, -1).to(tl.int32), mask=inb)
    h = tl.arange(0, LANES)
    distinct = tl.histogram(home, LANES, mask=first).to(tl.int64)
    tl.atomic_add(words_ptr + W_DISTINCT + h, distinct, mask=distinct != 0, sem="relaxed")
    if FETCH:  # a buffer holds an address in one of its GPU slots [0, B)
        held = tl.load(map_ptr + a, mask=first, other=-1)
        absent = first & ((held < 0) | (held >= B))
        missing = tl.histogram(home, LANES, mask=absent).to(tl.int64)
        tl.atomic_add(words_ptr + W_DISTINCT + LANES + h, missing, mask=missing != 0, sem="relaxed")
    found = tl.where(tl.sum(bad.to(tl.int32), axis=0) > 0, K.ST_BAD_ADDRESS, 0)
    if UNIQUE:
        found = found | tl.where(tl.sum((in_range & ~first).to(tl.int32), axis=0) > 0, K.ST_DUPLICATE, 0)
    if found != 0:
        tl.atomic_or(words_ptr + W_STATUS, found.to(tl.int64), sem="relaxed")
    tl.debug_barrier()  # every thread's adds of this program precede the release below
    ticket = tl.atomic_add(words_ptr + W_ARRIVED, 1, sem="acq_rel")
    if ticket == tl.num_programs(0) - 1:
        tl.debug_barrier()  # the acquire above before any thread loads the others' counts
        _close(words_ptr, result_ptr, stamp_ptr, N, per_home, most, fetch_width, WORLD, LANES, FETCH, BLOCK)


@triton.jit
def _close(
    words_ptr,
    result_ptr,
    stamp_ptr,
    N,
    per_home,
    most,
    fetch_width,
    WORLD: tl.constexpr,
    LANES: tl.constexpr,
    FETCH: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """The last program's part: the status and the result (``[1 + 2 * WORLD]``: status, distinct
    and missing per home), then the words as the next call needs them (accumulators, ticket and
    status zero, the epoch advanced)."""
    h = tl.arange(0, LANES)
    homes = h < WORLD
    distinct = tl.load(words_ptr + W_DISTINCT + h, mask=homes, other=0)
    missing = tl.load(words_ptr + W_DISTINCT + LANES + h, mask=homes, other=0)
    over = homes & (per_home >= 0) & (distinct > per_home)
    if FETCH:
        over = over | (homes & (missing > fetch_width))
    status = tl.load(words_ptr + W_STATUS)
    status = status | tl.where(tl.sum(over.to(tl.int32), axis=0) > 0, K.ST_HOME_LIMIT, 0)
    status = status | tl.where((most >= 0) & (tl.sum(distinct, axis=0) > most), K.ST_TOO_LARGE, 0)
    tl.store(result_ptr, status)
    tl.store(result_ptr + 1 + h, distinct, mask=homes)
    tl.store(result_ptr + 1 + WORLD + h, missing, mask=homes)
    zero = tl.zeros((LANES,), tl.int64)
    tl.store(words_ptr + W_DISTINCT + h, zero)
    tl.store(words_ptr + W_DISTINCT + LANES + h, zero)
    epoch = tl.load(words_ptr + W_EPOCH)
    if epoch + 1 >= K.EPOCH_LIMIT:
        # Stamps hold an int32 epoch: before it would overflow, clear them and restart. Once in
        # 2**31 calls; O(addresses), as the claim's scratch (``ulakv.kernels.victims``).
        ar = tl.arange(0, BLOCK)
        for i0 in range(0, N, BLOCK):
            tl.store(stamp_ptr + i0 + ar, tl.zeros((BLOCK,), tl.int32), mask=i0 + ar < N)
        epoch = epoch * 0
    w = tl.arange(0, 4)  # WORDS
    tl.store(words_ptr + w, tl.where(w == W_EPOCH, epoch + 1, 0))


def census(
    flat: torch.Tensor,
    *,
    world: int,
    rank: int,
    live: torch.Tensor,
    stamp: torch.Tensor,
    words: torch.Tensor,
    result: torch.Tensor,
    local: torch.Tensor,
    per_home: int = -1,
    most: int = -1,
    unique: bool = False,
    buffer_map: torch.Tensor | None = None,
    buffer_slots: int = 0,
    fetch_width: int = 0,
) -> int:
    """Take the census of ``flat`` (int32 or int64 ``[T]``, packed, -1 padding) over the global
    addresses ``[0, live.numel())`` (``live``: bool, which are admitted); returns launches (1).

    Writes ``result`` (int64 ``[1 + 2 * world]``: the status, ``ST_*`` bits, then distinct
    addresses and those missing the buffer per home) and ``local`` (int32, ``[T]`` at least: each
    element's local address on ``rank``, -1 elsewhere). ``stamp`` (int32 ``[addresses]``) and
    ``words`` (int64 ``[words_size(world)]``, epoch >= 1) are the pool's, carried between calls.
    ``per_home``, ``most``: limits (-1: none); ``buffer_map`` (int32 ``[addresses]``: a group's row of
    a buffer's mapping, ``buffer_slots`` GPU slots) makes it a fetch-mode prepare's, with
    ``fetch_width``. No host sync."""
    T = flat.numel()
    census_kernel[(max(1, K.cdiv(T, K.CHUNK)),)](
        sel_ptr=flat,
        T=T,
        N=live.numel(),
        live_ptr=live.view(torch.uint8),
        stamp_ptr=stamp,
        words_ptr=words,
        result_ptr=result,
        local_ptr=local,
        map_ptr=buffer_map if buffer_map is not None else stamp,  # a stand-in, never read
        B=buffer_slots,
        rank=rank,
        per_home=per_home,
        most=most,
        fetch_width=fetch_width,
        WORLD=world,
        LANES=lanes(world),
        UNIQUE=unique,
        FETCH=buffer_map is not None,
        CHUNK=K.CHUNK,
        BLOCK=K.BLOCK,
    )
    return 1


def census_reference(
    flat: torch.Tensor,
    *,
    world: int,
    rank: int,
    live: torch.Tensor,
    stamp: torch.Tensor,
    words: torch.Tensor,
    result: torch.Tensor,
    local: torch.Tensor,
    per_home: int = -1,
    most: int = -1,
    unique: bool = False,
    buffer_map: torch.Tensor | None = None,
    buffer_slots: int = 0,
    fetch_width: int = 0,
) -> int:
    """Plain-torch twin of :func:`census`: the same result, local addresses, stamps and words,
    address by address through ``unique`` instead of claims."""
    N, T = live.numel(), flat.numel()
    a = flat.long()
    in_range = (a >= 0) & (a < N)
    bad = (a != -1) & ~(in_range & live[torch.where(in_range, a, 0)])
    addresses, seen = torch.unique(a[in_range], return_counts=True)
    epoch = int(words[int(W_EPOCH)])
    stamp[addresses] = epoch
    mine = in_range & (a % world == rank)
    local[:T] = torch.where(mine, a // world, -1).to(local.dtype)
    home = addresses % world
    distinct = torch.bincount(home, minlength=world)[:world]
    missing = torch.zeros(world, dtype=torch.int64, device=flat.device)
    over = (distinct > per_home) if per_home >= 0 else torch.zeros_like(distinct, dtype=torch.bool)
    if buffer_map is not None:
        held = buffer_map[addresses]
        absent = (held < 0) | (held >= buffer_slots)
        missing = torch.bincount(home[absent], minlength=world)[:world]
        over = over | (missing > fetch_width)
    status = int(K.ST_BAD_ADDRESS) if bool(bad.any()) else 0
    if unique and bool((seen > 1).any()):
        status |= int(K.ST_DUPLICATE)
    if bool(over.any()):
        status |= int(K.ST_HOME_LIMIT)
    if most >= 0 and int(distinct.sum()) > most:
        status |= int(K.ST_TOO_LARGE)
    result[0] = status
    result[1 : 1 + world] = distinct
    result[1 + world : 1 + 2 * world] = missing
    words[int(W_DISTINCT) :] = 0
    if epoch + 1 >= K.EPOCH_LIMIT:
        stamp.zero_()
        epoch = 0
    words[: int(W_DISTINCT)] = 0
    words[int(W_EPOCH)] = epoch + 1
    return 1
