"""The fetch's bookkeeping on the device: which gathered row each buffer miss reads, which slice
rows this rank sends, and the slots a fetch-mode prepare returns.

A buffer plan lists its misses chunk by chunk (``CallScratch.miss_pos``, ``counts[:, C_NEED]``); miss
``j`` homed on ``h`` as the ``i``-th of that home's misses, in miss order, is gathered row
``h x width + i`` (``ulakv.layouts.row_exchange``). ``i`` decides which row every rank reads, so it
must be the same on every rank: it is a count, never the order atomics land in.

1. ``homes_kernel``, a program a chunk: the chunk's misses per home (a histogram), stored as row
   ``c`` of ``[chunks, LANES]`` int32. The last program to arrive (an acquire-release ticket, as
   ``ulakv.kernels.segments``) takes the exclusive prefix over chunks for every home, ``SCAN_ROWS``
   chunks a step (256 at 8 ranks: a quarter of a million elements), and the totals: the misses
   homed here, and those homed elsewhere (``bytes_needed``).
2. ``place_kernel``, a program a chunk: each miss's index within its home is the misses of its home
   before its chunk plus those before it in the chunk (a ``tl.cumsum`` over the chunk's lanes a
   home: ``world`` scans of ``CHUNK`` lanes). It stores ``fetch_rows[j]`` and, for misses homed here,
   the slice slot to send at that index; the programs pad the rest of ``send_slots`` with the
   dummy row.
3. ``slots_kernel``, after the buffer's apply: each element's slot, the slice's when homed here,
   else the buffer's (offset past the slice's rows), -1 for padding or a refused call.

Per program: ``CHUNK`` elements and ``world`` scans (the last program of step 1: the chunks'
counts, ``SCAN_ROWS`` a step). No read-back, fixed shapes; before, a one-hot ``[chunks x CHUNK,
world]`` cumsum promoted to int64 and some twenty small kernels.
"""

from __future__ import annotations

import torch

from . import common as K
from ._triton import tl, triton
from .census import lanes

# The exchange's words (int64): programs arrived at the scan, the misses homed on this rank and on
# the others (the last before ``bytes_needed`` masks a refused call's).
X_ARRIVED = tl.constexpr(0)
X_HERE = tl.constexpr(1)
X_REMOTE = tl.constexpr(2)
X_WORDS = 4

# Per-home counts a scan step loads at once: 2,048 (8 KiB of int32, 16 a thread of 4 warps; at 4,096
# the last program held homes_kernel at 147 registers, 12 resident warps on sm_90).
SCAN_COUNTS = 2048


def scan_rows(lanes: int) -> int:
    """Chunks a scan step covers: 1,024 at 2 ranks (a million elements), 256 at 8, 32 at 64."""
    return max(1, SCAN_COUNTS // lanes)


@triton.jit
def _miss_homes(sel_ptr, counts_ptr, miss_pos_ptr, c, chunks, WORLD: tl.constexpr, CHUNK: tl.constexpr):
    """Chunk ``c``'s misses (lanes below its count): whether a lane holds one, its position, and
    its home."""
    lane = tl.arange(0, CHUNK)
    n = tl.load(counts_ptr + tl.minimum(c, chunks - 1) * K.COUNT_WORDS + K.C_NEED)
    is_miss = lane < tl.where(c < chunks, n, 0)  # a program past the chunks pads send_slots only
    p = tl.load(miss_pos_ptr + c * CHUNK + lane, mask=is_miss, other=0).to(tl.int64)
    a = tl.load(sel_ptr + p, mask=is_miss, other=0).to(tl.int64)
    return is_miss, p, (a % WORLD).to(tl.int32)


# Not specialised: T, the caller's selection (its alignment varies); the rest is the pool's scratch,
# allocated whole, and constexprs fixed per pool.
@triton.jit(do_not_specialize=["chunks", "rank"], do_not_specialize_on_alignment=["sel_ptr"])
def homes_kernel(
    sel_ptr,
    counts_ptr,
    miss_pos_ptr,
    chunks,
    home_counts_ptr,
    home_before_ptr,
    words_ptr,
    rank,
    WORLD: tl.constexpr,
    LANES: tl.constexpr,
    SCAN_ROWS: tl.constexpr,
    CHUNK: tl.constexpr,
):
    c = tl.program_id(0).to(tl.int64)
    is_miss, _, home = _miss_homes(sel_ptr, counts_ptr, miss_pos_ptr, c, chunks, WORLD, CHUNK)
    h = tl.arange(0, LANES)
    tl.store(home_counts_ptr + c * LANES + h, tl.histogram(home, LANES, mask=is_miss))
    tl.debug_barrier()  # every thread's stores of this program precede the release below
    ticket = tl.atomic_add(words_ptr + X_ARRIVED, 1, sem="acq_rel")
    if ticket == tl.num_programs(0) - 1:
        tl.debug_barrier()  # the acquire above before any thread loads the others' counts
        _scan(home_counts_ptr, home_before_ptr, words_ptr, chunks, rank, WORLD, LANES, SCAN_ROWS)


@triton.jit
def _scan(
    home_counts_ptr,
    home_before_ptr,
    words_ptr,
    chunks,
    rank,
    WORLD: tl.constexpr,
    LANES: tl.constexpr,
    SCAN_ROWS: tl.constexpr,
):
    """The last program's part: each chunk's misses per home before it, the totals, the ticket."""
    h = tl.arange(0, LANES)[None, :]
    r = tl.arange(0, SCAN_ROWS)[:, None]
    run = tl.zeros((LANES,), tl.int32)
    for c0 in range(0, chunks, SCAN_ROWS):
        at = (c0 + r) * LANES + h
        rows = (c0 + r < chunks) & (h < LANES)
        n = tl.load(home_counts_ptr + at, mask=rows, other=0)
        tl.store(home_before_ptr + at, run[None, :] + tl.cumsum(n, axis=0) - n, mask=rows)
        run += tl.sum(n, axis=0)
    lane = tl.arange(0, LANES)
    here = tl.sum(tl.where(lane == rank, run, 0), axis=0).to(tl.int64)
    remote = tl.sum(tl.where((lane != rank) & (lane < WORLD), run, 0), axis=0).to(tl.int64)
    w = tl.arange(0, 4)  # X_WORDS
    tl.store(words_ptr + w, tl.where(w == X_HERE, here, tl.where(w == X_REMOTE, remote, 0)))


@triton.jit(
    do_not_specialize=["chunks", "rank", "width", "dummy"], do_not_specialize_on_alignment=["sel_ptr"]
)
def place_kernel(
    sel_ptr,
    counts_ptr,
    miss_pos_ptr,
    chunks,
    home_before_ptr,
    words_ptr,
    inner_slots_ptr,
    fetch_rows_ptr,
    send_slots_ptr,
    rank,
    width,
    dummy,
    WORLD: tl.constexpr,
    LANES: tl.constexpr,
    CHUNK: tl.constexpr,
):
    c = tl.program_id(0).to(tl.int64)
    is_miss, p, home = _miss_homes(sel_ptr, counts_ptr, miss_pos_ptr, c, chunks, WORLD, CHUNK)
    h = tl.arange(0, LANES)
    before = tl.load(home_before_ptr + c * LANES + h, mask=h < tl.where(c < chunks, LANES, 0), other=0)
    j0 = tl.sum(before, axis=0).to(tl.int64)  # misses before this chunk, every home
    index = tl.zeros_like(home)
    for k in range(0, WORLD):
        of_k = is_miss & (home == k)
        start = tl.sum(tl.where(h == k, before, 0), axis=0)
        index = tl.where(of_k, start + tl.cumsum(of_k.to(tl.int32), axis=0) - 1, index)
    fits = is_miss & (index < width)  # a refused call may have more; it moves nothing
    lane = tl.arange(0, CHUNK)
    tl.store(fetch_rows_ptr + j0 + lane, tl.where(fits, home * width + index, 0), mask=is_miss)
    sent = fits & (home == rank)
    slot = tl.load(inner_slots_ptr + p, mask=sent, other=-1)
    tl.store(send_slots_ptr + index, tl.where(slot >= 0, slot, dummy).to(tl.int64), mask=sent)
    # The rest of send_slots, past this rank's misses: the dummy row, CHUNK indices a program.
    s = c * CHUNK + lane
    pad = (s >= tl.load(words_ptr + X_HERE)) & (s < width)
    tl.store(send_slots_ptr + s, tl.zeros_like(s) + dummy, mask=pad)


@triton.jit(do_not_specialize=["T", "offset"], do_not_specialize_on_alignment=["out_ptr"])
def slots_kernel(local_ptr, buffer_slots_ptr, out_ptr, T, offset, CHUNK: tl.constexpr):
    pos = tl.program_id(0).to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
    inb = pos < T
    mine = tl.load(local_ptr + pos, mask=inb, other=-1) >= 0
    inner = tl.load(out_ptr + pos, mask=inb & mine, other=-1)
    buffered = tl.load(buffer_slots_ptr + pos, mask=inb & ~mine, other=-1)
    tl.store(out_ptr + pos, tl.where(mine, inner, tl.where(buffered >= 0, offset + buffered, -1)), mask=inb)


def plan_fetch(
    flat: torch.Tensor,
    scratch,
    inner_slots: torch.Tensor,
    *,
    world: int,
    rank: int,
    width: int,
    dummy: int,
    home_counts: torch.Tensor,
    home_before: torch.Tensor,
    words: torch.Tensor,
    fetch_rows: torch.Tensor,
    send_slots: torch.Tensor,
) -> int:
    """For a buffer plan's misses (``scratch``: its ``CallScratch``) over the selection ``flat``
    (int32 or int64 ``[T]``, packed): ``fetch_rows`` (int32, ``[T]`` at least: miss ``j``'s
    gathered row; entries past the misses are not written), ``send_slots`` (int64 ``[width]``: the
    slice slot of this rank's ``i``-th miss, ``inner_slots`` int32 by position; ``dummy`` for
    padding and a refused call), ``words`` (int64 ``[X_WORDS]``: misses homed here and elsewhere;
    the ticket is left zero). ``home_counts``, ``home_before``: int32 ``[chunks, lanes(world)]`` at
    least. Returns launches (2). No host sync."""
    chunks = K.cdiv(flat.numel(), K.CHUNK)
    common = dict(
        sel_ptr=flat,
        counts_ptr=scratch.counts,
        miss_pos_ptr=scratch.miss_pos,
        chunks=chunks,
        home_before_ptr=home_before,
        words_ptr=words,
        rank=rank,
        WORLD=world,
        LANES=lanes(world),
        CHUNK=K.CHUNK,
    )
    homes_kernel[(chunks,)](home_counts_ptr=home_counts, SCAN_ROWS=scan_rows(lanes(world)), **common)
    place_kernel[(max(chunks, K.cdiv(width, K.CHUNK)),)](
        inner_slots_ptr=inner_slots,
        fetch_rows_ptr=fetch_rows,
        send_slots_ptr=send_slots,
        width=width,
        dummy=dummy,
        **common,
    )
    return 2


def merge_slots(local: torch.Tensor, buffer_slots: torch.Tensor, out: torch.Tensor, offset: int) -> int:
    """A fetch-mode prepare's slots, in place in ``out`` (int32 ``[T]``, packed, holding the slice's
    slots): the slice's where ``local`` (int32) says the element is homed here, else the buffer's
    (``buffer_slots``, int32) plus ``offset``, -1 where the buffer gave none. Returns launches (1)."""
    T = out.numel()
    slots_kernel[(K.cdiv(T, K.CHUNK),)](
        local_ptr=local, buffer_slots_ptr=buffer_slots, out_ptr=out, T=T, offset=offset, CHUNK=K.CHUNK
    )
    return 1


# -- host twins -------------------------------------------------------------------------------------


def miss_order(flat: torch.Tensor, scratch) -> torch.Tensor:
    """The buffer plan's misses' positions (int64), in miss order: chunk by chunk."""
    chunks = K.cdiv(flat.numel(), K.CHUNK)
    need = scratch.counts[:chunks, int(K.C_NEED)].tolist()
    parts = [scratch.miss_pos[c * K.CHUNK : c * K.CHUNK + n] for c, n in enumerate(need)]
    return torch.cat(parts).long() if parts else torch.zeros(0, dtype=torch.int64)


def plan_fetch_reference(
    flat: torch.Tensor,
    scratch,
    inner_slots: torch.Tensor,
    *,
    world: int,
    rank: int,
    width: int,
    dummy: int,
    home_counts: torch.Tensor,
    home_before: torch.Tensor,
    words: torch.Tensor,
    fetch_rows: torch.Tensor,
    send_slots: torch.Tensor,
) -> int:
    """Plain-Python twin of :func:`plan_fetch`: miss by miss, a running count per home."""
    chunks, L = K.cdiv(flat.numel(), K.CHUNK), lanes(world)
    need = scratch.counts[:chunks, int(K.C_NEED)].tolist()
    seen = [0] * L
    send_slots.fill_(dummy)
    j = 0
    for c in range(chunks):
        before = list(seen)
        for p in scratch.miss_pos[c * K.CHUNK : c * K.CHUNK + need[c]].tolist():
            h = int(flat[p]) % world
            i = seen[h]
            seen[h] += 1
            fetch_rows[j] = h * width + i if i < width else 0
            if h == rank and i < width:
                slot = int(inner_slots[p])
                send_slots[i] = slot if slot >= 0 else dummy
            j += 1
        home_before[c * L : c * L + L] = torch.tensor(before, dtype=home_before.dtype)
        home_counts[c * L : c * L + L] = torch.tensor(
            [n - b for n, b in zip(seen, before, strict=True)], dtype=home_counts.dtype
        )
    words.zero_()
    words[int(X_HERE)] = seen[rank]
    words[int(X_REMOTE)] = sum(seen) - seen[rank]
    return 2


def merge_slots_reference(
    local: torch.Tensor, buffer_slots: torch.Tensor, out: torch.Tensor, offset: int
) -> int:
    """Plain-torch twin of :func:`merge_slots`."""
    T = out.numel()
    b = buffer_slots[:T]
    out.copy_(torch.where(local[:T] >= 0, out, torch.where(b >= 0, offset + b, -1)))
    return 1
