"""Engine-owned addresses: make addresses an engine chose live, or check the ones it gives back.

An engine that allocates token slots itself (SGLang's ``loc``, vLLM's slot ids) uses them as ulakv's
logical addresses. Each decode step it makes its new tokens' addresses live, from a device tensor it
never reads back, so the check runs on the device and a refusal is a status word, as for ``prepare``
(``ulakv.deferred``): nothing changes unless every address passes.

The check is one program walking the addresses in blocks, two passes with a barrier between them:

1. range and liveness: an address out of ``[0, N)`` (``-1`` is padding), one already live (admit) or
   not live (release) fails the call; each address stamps its position into ``claim[address]``;
2. duplicates: an address whose stamp is not its own position appears twice (the later stamp won);

then, only if all passed, it adds the addresses to the live count (admit) or subtracts them
(release), and writes the status. What the verdict allows runs in a second launch that reads the
status back on the device: for an admit ``mark_live_kernel``, a program per group and block of
addresses marking them live (``UNHOMED``); for a release ``ulakv.kernels.release`` in ``checked``
mode, which frees their homes.

One program for the check because its passes must see each other's stores (a barrier orders one
program's threads only) and the work is small: a decode step admits ``batch`` addresses (<= 256:
one block of 1024), a prefill chunk some thousands (a few blocks per pass). The marking is apart
because it is the work that grows with the groups: done in the check's program, a 16K-token admit
into 61 one-layer groups (DSA's indexer per layer) was 2,037 memory operations in a row
(``benchmarks/release_path.py``); a program per group and block stores one block.

The status, the refusal count and the report are the engine's own words (``EngineAddresses``: a
control-word row and a report word), shared with no call context, whose planning programs
read-modify-write theirs on the adapter's streams. The stamps go into the lookup's ``claim`` array
(int64 per address), so an engine-owned pool needs no scratch of its own: pass 2 reads only stamps
pass 1 wrote in the same call, and a stamp (a position, below 2**31) carries epoch 0, which no
lookup's claim key (``epoch << 32 | ...``, epoch >= 1) mistakes for one of its own. That array is
shared with the calls of context 0, so an engine call runs only after every call context's work
in flight (``TieredPool`` joins the adapter's streams first: ``order_after``).
"""

from __future__ import annotations

import torch

from . import common as K
from ._triton import tl, triton


@triton.jit
def _block(addr_ptr, i0, n, N, BLOCK: tl.constexpr):
    """Positions ``i0 .. i0 + BLOCK`` of the call: position, in-call mask, address (int64; -1 past the
    end) and whether it lies in ``[0, N)``."""
    i = i0 + tl.arange(0, BLOCK)
    im = i < n
    a = tl.load(addr_ptr + i, mask=im, other=-1).to(tl.int64)
    return i, im, a, im & (a >= 0) & (a < N)


# Not specialised: n (varies per call), N, capacity (pool constants feeding no vectorised access)
# and the caller's address alignment. ADMIT, BLOCK: constexprs (two variants in all).
@triton.jit(do_not_specialize=["n", "N", "capacity"], do_not_specialize_on_alignment=["addr_ptr"])
def engine_addresses_kernel(
    addr_ptr,
    n,
    map_ptr,
    N,
    claim_ptr,
    live_ptr,
    capacity,
    ctl_ptr,
    report_ptr,
    ADMIT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    bad = tl.zeros((), tl.int32)
    count = tl.zeros((), tl.int64)
    for i0 in range(0, n, BLOCK):
        i, im, a, inr = _block(addr_ptr, i0, n, N, BLOCK)
        h = tl.load(map_ptr + a, mask=inr, other=K.M_FREE)
        if ADMIT:
            wrong = inr & (h != K.M_FREE)
        else:
            wrong = inr & (h == K.M_FREE)
        outside = im & (a != -1) & ~inr
        bad += tl.sum((wrong | outside).to(tl.int32), axis=0)
        tl.store(claim_ptr + a, i, mask=inr)
        count += tl.sum(inr.to(tl.int64), axis=0)
    tl.debug_barrier()
    dup = tl.zeros((), tl.int32)
    for i0 in range(0, n, BLOCK):
        i, im, a, inr = _block(addr_ptr, i0, n, N, BLOCK)
        stamp = tl.load(claim_ptr + a, mask=inr, other=-1)
        dup += tl.sum((inr & (stamp != i)).to(tl.int32), axis=0)
    live = tl.load(live_ptr)
    status = tl.where(bad > 0, K.ST_BAD_ADDRESS, 0) | tl.where(dup > 0, K.ST_DUPLICATE, 0)
    if ADMIT:
        status = status | tl.where(live + count > capacity, K.ST_FULL, 0)
    status = status.to(tl.int64)
    tl.debug_barrier()
    if status == 0:
        if ADMIT:
            tl.store(live_ptr, live + count)
        else:
            tl.store(live_ptr, live - count)
    tl.store(ctl_ptr + K.E_LAST_STATUS, status)
    tl.store(ctl_ptr + K.E_PENDING, tl.load(ctl_ptr + K.E_PENDING) | status)
    if ADMIT:
        K.report_refusal(ctl_ptr, report_ptr, status, K.CALL_ADMIT)
    else:
        K.report_refusal(ctl_ptr, report_ptr, status, K.CALL_RELEASE)


# Not specialised: n, N, as above, and the caller's address alignment (map_ptr is the whole
# [groups, N] mapping: the group's row is added here). BLOCK: a constexpr (one variant).
@triton.jit(do_not_specialize=["n", "N"], do_not_specialize_on_alignment=["addr_ptr"])
def mark_live_kernel(addr_ptr, n, map_ptr, N, ctl_ptr, BLOCK: tl.constexpr):
    """Program (b, g): block b of an admit's addresses live in group g, if the check passed."""
    i0 = tl.program_id(0).to(tl.int64) * BLOCK
    g = tl.program_id(1).to(tl.int64)
    n = tl.where(tl.load(ctl_ptr + K.E_LAST_STATUS) == 0, n, 0)  # a refused admit marks nothing
    _, _, a, inr = _block(addr_ptr, i0, n, N, BLOCK)
    tl.store(map_ptr + g * N + a, tl.full((BLOCK,), K.M_UNHOMED, tl.int32), mask=inr)


def engine_addresses(addrs: torch.Tensor, state, books, admit: bool) -> int:
    """Check ``addrs`` (packed int32/int64 ``[n]``, -1 padding) against ``state`` (its ``mapping``,
    ``claim`` for the stamps, ``num_addresses`` and ``num_groups``) and, if they pass, make them live
    (``admit``; at most ``books.capacity`` live at once) or count them out (release, whose homes
    ``ulakv.kernels.release`` frees after). The status goes to ``books.ctl`` and a refusal's report to
    ``books.report``: the engine's own words (``EngineAddresses``), never a call context's, which a
    prepare planning on another stream read-modify-writes. ``books.live`` is int64 ``[1]``. Returns
    launches (2 for an admit, 1 for a release)."""
    n = addrs.numel()
    engine_addresses_kernel[(1,)](
        addr_ptr=addrs,
        n=n,
        map_ptr=state.mapping,
        N=state.num_addresses,
        claim_ptr=state.claim,
        live_ptr=books.live,
        capacity=books.capacity,
        ctl_ptr=books.ctl,
        report_ptr=books.report,
        ADMIT=admit,
        BLOCK=K.BLOCK,
    )
    if not admit:
        return 1
    # Blocks on the grid's first axis (up to 2**31 - 1 programs), groups on the second (65,535).
    mark_live_kernel[(K.cdiv(n, K.BLOCK), state.num_groups)](
        addr_ptr=addrs, n=n, map_ptr=state.mapping, N=state.num_addresses, ctl_ptr=books.ctl, BLOCK=K.BLOCK
    )
    return 2


def engine_addresses_reference(addrs: torch.Tensor, state, books, admit: bool) -> None:
    """Plain-Python twin of :func:`engine_addresses` (a set finds the duplicates; no stamps)."""
    N = state.num_addresses
    given = [a for a in addrs.tolist() if a != -1]
    bad = any(not 0 <= a < N for a in given)
    inside = [a for a in given if 0 <= a < N]
    is_free = [int(state.mapping[0, a]) == int(K.M_FREE) for a in inside]
    bad = bad or any(f != admit for f in is_free)  # admit wants free addresses, release live ones
    status = int(K.ST_BAD_ADDRESS) if bad else 0
    if len(set(inside)) != len(inside):
        status |= int(K.ST_DUPLICATE)
    if admit and int(books.live[0]) + len(inside) > books.capacity:
        status |= int(K.ST_FULL)
    if status == 0:
        if admit:
            for a in inside:
                state.mapping[:, a] = int(K.M_UNHOMED)
        books.live[0] += len(inside) if admit else -len(inside)
    books.ctl[int(K.E_LAST_STATUS)] = status
    books.ctl[int(K.E_PENDING)] |= status
    K.report_refusal_reference(
        books.ctl, books.report, status, int(K.CALL_ADMIT if admit else K.CALL_RELEASE)
    )
