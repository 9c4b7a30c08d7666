"""Release: return a request's addresses and slots, in every layer group, in one launch.

A program per group walks the addresses in blocks; freed GPU slots get a new version (their LRU pairs
turn stale) and go on the group's GPU free stack (a CPU copy of their entry is forgotten), freed CPU
rows on top of its CPU free list (handed out before rows that hold copies, and counted among its plain
rows, ``G_CPU_PLAIN``), in address order, so the
result is deterministic. Groups share no state, so they run side by side: a request leaves between two
decode steps, on the same stream, and its release delays the next step by the busiest program. With
one program for every group, releasing a 131,072-token request in a pool of 61 one-layer groups (DSA's
per-layer indexer) walked 61 x 128 blocks in a row; now each program walks 128.
"""

from __future__ import annotations

import torch

from . import buckets
from . import common as K
from ._triton import tl, triton
from .buckets import PBLRUBits

# A block of 1,024 addresses at 8 warps is 4 a thread: 98-106 registers on sm_90 (compile_check), 16
# resident warps an SM; at 4 warps PB-LRU's bucket clearing took 140 (12 resident).
RELEASE_WARPS = 8


# Not specialised: every int (n varies with the request; the rest are pool constants that feed no
# vectorisable access) and addr_ptr's alignment (the caller's addresses). Every other pointer is a
# whole-pool tensor, allocated once: its alignment never changes. POLICY, BLOCK: constexprs.
@triton.jit(
    do_not_specialize=["n", "N", "G", "C", "BW", "n_levels", "R"],
    do_not_specialize_on_alignment=["addr_ptr"],
)
def release_kernel(
    addr_ptr,
    n,
    map_ptr,
    N,
    owner_ptr,
    ver_ptr,
    gpu_free_ptr,
    cpu_free_ptr,
    cpu_pos_ptr,
    copy_row_ptr,
    gctl_ptr,
    G,
    C,
    bits_ptr,
    BW,
    lvl_ptr,
    n_levels,
    stamp_ptr,
    R,
    ctl_ptr,
    POLICY: tl.constexpr,
    CHECKED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    ar = tl.arange(0, BLOCK)
    if CHECKED:  # engine-owned addresses: a call the check refused frees nothing
        n = tl.where(tl.load(ctl_ptr + K.E_LAST_STATUS) == 0, n, 0)
    g = tl.program_id(0).to(tl.int64)
    row = gctl_ptr + g * K.GCTL_WORDS
    gpu_top = tl.load(row + K.G_GPU_FREE)
    cpu_free = tl.load(row + K.G_CPU_FREE)
    cpu_top = tl.load(row + K.G_CPU_BOT) + cpu_free  # past the free list's top
    cpu_count = cpu_free
    ref = tl.load(row + K.G_ROUND) + 1 if POLICY == K.PBLRU else 0  # PB-LRU's round: fixed for the call
    for i0 in range(0, n, BLOCK):
        a = tl.load(addr_ptr + i0 + ar, mask=i0 + ar < n, other=-1).to(tl.int64)
        im = (i0 + ar < n) & (a >= 0)  # -1: padding (engine-owned addresses)
        h = tl.load(map_ptr + g * N + a, mask=im, other=K.M_UNHOMED)
        on_gpu = im & (h >= 0) & (h < G)
        on_cpu = im & (h >= G)
        g_rank = gpu_top + tl.cumsum(on_gpu.to(tl.int64), axis=0) - 1
        c_rank = K.wrap(cpu_top + tl.cumsum(on_cpu.to(tl.int64), axis=0) - 1, C)  # cpu_top < 2C
        tl.store(gpu_free_ptr + g * G + g_rank, h, mask=on_gpu)
        tl.store(cpu_free_ptr + g * C + c_rank, h - G, mask=on_cpu)
        tl.store(cpu_pos_ptr + g * C + h - G, c_rank.to(tl.int32), mask=on_cpu)
        slot = g * G + h
        tl.store(copy_row_ptr + slot, tl.full((BLOCK,), -1, tl.int32), mask=on_gpu)
        if POLICY == K.PBLRU:
            stamp = tl.load(stamp_ptr + slot, mask=on_gpu, other=0)
            bucket = buckets.bucket_of(stamp, ref, R).to(tl.int64)
            group_bits = bits_ptr + g * (R + 1) * BW
            buckets.clear_path(group_bits, bucket * BW, lvl_ptr, n_levels, h, on_gpu)
        tl.store(owner_ptr + slot, tl.full((BLOCK,), -1, tl.int32), mask=on_gpu)
        tl.store(ver_ptr + slot, tl.load(ver_ptr + slot, mask=on_gpu, other=0) + 1, mask=on_gpu)
        tl.store(map_ptr + g * N + a, tl.full((BLOCK,), -1, tl.int32), mask=im)
        gpu_top += tl.sum(on_gpu.to(tl.int64), axis=0)
        cpu_top += tl.sum(on_cpu.to(tl.int64), axis=0)
        cpu_count += tl.sum(on_cpu.to(tl.int64), axis=0)
    tl.store(row + K.G_GPU_FREE, gpu_top)
    # the released rows went on top: plain rows (a home never holds a copy)
    tl.store(row + K.G_CPU_PLAIN, tl.load(row + K.G_CPU_PLAIN) + cpu_count - cpu_free)
    tl.store(row + K.G_CPU_FREE, cpu_count)


def release(addrs, state, checked_by: torch.Tensor | None = None) -> int:
    """Free ``addrs`` in every group of ``state`` (a ``TieredState``; ``-1``: padding); returns
    launches. ``checked_by``: the control words of the check just before (engine-owned addresses,
    ``ulakv.kernels.engine_addresses``): free only if its last status is 0."""
    n = addrs.numel()
    if n == 0:
        return 0
    release_kernel[(state.num_groups,)](
        addr_ptr=addrs,
        n=n,
        map_ptr=state.mapping,
        N=state.num_addresses,
        owner_ptr=state.owner,
        ver_ptr=state.ver,
        gpu_free_ptr=state.gpu_free,
        cpu_free_ptr=state.cpu_free,
        cpu_pos_ptr=state.cpu_pos,
        copy_row_ptr=state.copy_row,
        gctl_ptr=state.gctl,
        G=state.gpu_slots,
        C=state.cpu_stack_size,
        bits_ptr=state.bits,
        BW=state.bucket_words,
        lvl_ptr=state.levels,
        n_levels=state.levels.numel() - 1,
        stamp_ptr=state.stamp,
        R=state.num_buckets,
        ctl_ptr=state.ctl if checked_by is None else checked_by,
        POLICY=state.policy,
        CHECKED=checked_by is not None,
        BLOCK=K.BLOCK,
        num_warps=RELEASE_WARPS,
    )
    return 1


def release_reference(addrs, state, checked_by: torch.Tensor | None = None) -> None:
    """Plain-Python twin of :func:`release`: address by address, group by group, the same stacks."""
    if checked_by is not None and int(checked_by[int(K.E_LAST_STATUS)]) != 0:
        return
    G = state.gpu_slots
    for g in range(state.num_groups):
        bitmaps = PBLRUBits(state, g) if state.policy == K.PBLRU else None
        ref = int(state.gctl[g, int(K.G_ROUND)]) + 1
        gpu_top = int(state.gctl[g, int(K.G_GPU_FREE)])
        cpu_count = int(state.gctl[g, int(K.G_CPU_FREE)])
        cpu_top = int(state.gctl[g, int(K.G_CPU_BOT)]) + cpu_count
        for a in addrs.tolist():
            if a == -1:
                continue
            h = int(state.mapping[g, a])
            if 0 <= h < G:
                state.gpu_free[g, gpu_top] = h
                gpu_top += 1
                state.owner[g, h] = -1
                state.ver[g, h] += 1
                state.copy_row[g, h] = -1
                if bitmaps is not None:
                    bitmaps.clear(h, ref)
            elif h >= G:
                at = cpu_top % state.cpu_stack_size
                state.cpu_free[g, at] = h - G
                state.cpu_pos[g, h - G] = at
                cpu_top += 1
                cpu_count += 1
            state.mapping[g, a] = -1
        state.gctl[g, int(K.G_GPU_FREE)] = gpu_top
        state.gctl[g, int(K.G_CPU_PLAIN)] += cpu_count - int(state.gctl[g, int(K.G_CPU_FREE)])
        state.gctl[g, int(K.G_CPU_FREE)] = cpu_count
        if bitmaps is not None:
            bitmaps.store()
