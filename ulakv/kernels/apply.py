"""Apply: carry out the plan. One program per chunk of the selection, no atomics.

Per chunk, in this order (the ordering rule of DESIGN section 3):

1. **Data.** For every miss of the chunk and every layer of the group: the victim's row leaves the
   GPU for its CPU home, the missing row comes in (from its CPU slot, or zeros for an entry that
   has none yet). A swap writes the victim into the CPU slot the miss vacated, so both rows are
   loaded before either is stored. A write also stores the new rows of its layer here.
2. **Mapping.** Only then do the mapping table and the slot owners change.
3. **Recency.** Every distinct GPU-resident address of the call is appended to the LRU queue with
   a new version; older pairs of the same slot turn stale.
4. **Output.** ``slots`` for every element (a duplicate finds its first occurrence's slot through
   the victim list, which the plan wrote before this launch), or the rows of a write for entries
   that were already homed.

A call whose status is not clean does nothing but write ``-1`` slots.
"""

from __future__ import annotations

from . import common as K
from ._triton import tl, triton

ROWS = 16  # rows moved per tile: 16 x 256 int32 words = 16 KiB in flight per program


@triton.jit
def apply_kernel(
    sel_ptr,
    T,
    G,
    home_ptr,
    flags_ptr,
    counts_ptr,
    miss_pos_ptr,
    miss_rank_ptr,
    first_pos_ptr,
    ctl_ptr,
    map_ptr,
    owner_ptr,
    ver_ptr,
    q_slot_ptr,
    q_ver_ptr,
    Qcap,
    cpu_free_ptr,
    victims_ptr,
    popped_ptr,
    chunk_off_ptr,
    gpu_ptr,
    cpu_ptr,
    L,
    gpu_layer_stride,
    cpu_layer_stride,
    W,
    rows_ptr,
    write_layer,
    slots_ptr,
    WRITE: tl.constexpr,
    CHUNK: tl.constexpr,
    ROWS: tl.constexpr,
    WORDS: tl.constexpr,
):
    pid = tl.program_id(0)
    base = pid.to(tl.int64) * CHUNK
    pos = base + tl.arange(0, CHUNK)
    inb = pos < T
    status = tl.load(ctl_ptr + K.E_LAST_STATUS)
    if status != 0:
        if not WRITE:
            tl.store(slots_ptr + pos, tl.full((CHUNK,), -1, tl.int32), mask=inb)
    else:
        m_off = tl.load(chunk_off_ptr + pid * 4 + 0)
        q_off = tl.load(chunk_off_ptr + pid * 4 + 1)
        pop_run = tl.load(chunk_off_ptr + pid * 4 + 2)
        push_run = tl.load(chunk_off_ptr + pid * 4 + 3)
        n_miss = tl.load(counts_ptr + pid * K.COUNT_WORDS + K.C_NEED)
        k_free = tl.load(ctl_ptr + K.E_KFREE)
        V = tl.load(ctl_ptr + K.E_VICTIMS)
        push_base = tl.load(ctl_ptr + K.E_PUSH_BASE)
        w = tl.arange(0, WORDS)
        wm = w < W

        # -- 1 + 2: misses of this chunk: data, then mapping -------------------------------------
        for r0 in range(0, n_miss, ROWS):
            r = r0 + tl.arange(0, ROWS)
            mm = r < n_miss
            p = tl.load(miss_pos_ptr + base + r, mask=mm, other=0)
            a = tl.load(sel_ptr + p, mask=mm, other=0).to(tl.int64)
            src = tl.load(home_ptr + p, mask=mm, other=0)
            j = m_off + r
            from_cpu = mm & (src >= G)
            has_slot = mm & (j < V)
            v = tl.load(victims_ptr + j, mask=has_slot, other=0)
            old = tl.load(owner_ptr + v, mask=has_slot & (j >= k_free), other=-1)
            evict = has_slot & (old >= 0)
            pops = mm & ~from_cpu & (j >= k_free)
            pushes = from_cpu & (j < k_free)
            pop_rank = pop_run + tl.cumsum(pops.to(tl.int64), axis=0) - 1
            push_rank = push_run + tl.cumsum(pushes.to(tl.int64), axis=0) - 1
            pop_run += tl.sum(pops.to(tl.int64), axis=0)
            push_run += tl.sum(pushes.to(tl.int64), axis=0)
            cpu_slot = tl.load(popped_ptr + pop_rank, mask=pops, other=0)
            dest = tl.where(from_cpu, src - G, cpu_slot)  # CPU home of the evicted entry
            new_home = tl.where(has_slot, v, G + cpu_slot)
            tl.store(cpu_free_ptr + push_base + push_rank, src - G, mask=pushes)

            v2 = v.to(tl.int64)[:, None] * W + w[None, :]
            src2 = (src - G).to(tl.int64)[:, None] * W + w[None, :]
            dest2 = dest.to(tl.int64)[:, None] * W + w[None, :]
            own2 = cpu_slot.to(tl.int64)[:, None] * W + w[None, :]
            if WRITE:
                new_row = tl.load(
                    rows_ptr + p.to(tl.int64)[:, None] * W + w[None, :],
                    mask=mm[:, None] & wm[None, :],
                    other=0,
                )
            for layer in range(L):
                g_row = gpu_ptr + layer * gpu_layer_stride
                c_row = cpu_ptr + layer * cpu_layer_stride
                out_row = tl.load(g_row + v2, mask=evict[:, None] & wm[None, :], other=0)
                in_row = tl.load(c_row + src2, mask=from_cpu[:, None] & wm[None, :], other=0)
                if WRITE:
                    # A new entry: the written layer gets its row, the others start as zeros.
                    is_written = (tl.zeros((ROWS, WORDS), tl.int32) + layer) == write_layer
                    in_row = tl.where(is_written, new_row, in_row)
                tl.debug_barrier()  # a swap stores into the slot it loaded from
                tl.store(c_row + dest2, out_row, mask=evict[:, None] & wm[None, :])
                tl.store(g_row + v2, in_row, mask=has_slot[:, None] & wm[None, :])
                tl.store(c_row + own2, in_row, mask=(mm & ~has_slot)[:, None] & wm[None, :])
            tl.debug_barrier()  # data before mapping
            tl.store(map_ptr + a, new_home, mask=mm)
            tl.store(map_ptr + old, G + dest, mask=evict)
            tl.store(owner_ptr + v, a.to(tl.int32), mask=has_slot)

        # -- 3: recency ------------------------------------------------------------------------
        flags = tl.load(flags_ptr + pos, mask=inb, other=0)
        home = tl.load(home_ptr + pos, mask=inb, other=-1)
        first = (flags & K.F_FIRST) != 0
        on_gpu = (flags & K.F_GPU) != 0
        moved = (flags & K.F_MOVED) != 0
        p0 = tl.load(first_pos_ptr + pos, mask=moved, other=0)
        j0 = tl.load(chunk_off_ptr + (p0 // CHUNK) * 4, mask=moved, other=0) + tl.load(
            miss_rank_ptr + p0, mask=moved, other=0
        )
        moved_slot = moved & (j0 < V)
        slot = tl.where(on_gpu, home, tl.load(victims_ptr + j0, mask=moved_slot, other=-1))
        slot = tl.where(on_gpu | moved_slot, slot, -1)
        appended = first & (on_gpu | moved_slot)
        q_pos = (q_off + tl.cumsum(appended.to(tl.int64), axis=0) - 1) % Qcap
        version = tl.load(ver_ptr + slot, mask=appended, other=0) + 1
        tl.store(ver_ptr + slot, version, mask=appended)
        tl.store(q_slot_ptr + q_pos, slot, mask=appended)
        tl.store(q_ver_ptr + q_pos, version, mask=appended)

        # -- 4: output ---------------------------------------------------------------------------
        if WRITE:
            # Entries homed before this call: the layer's row goes where they live (padding rows
            # go to the dummy slot G, so the store needs no branch).
            g_row = gpu_ptr + write_layer * gpu_layer_stride
            c_row = cpu_ptr + write_layer * cpu_layer_stride
            n_here = tl.minimum(T - base, CHUNK)
            for e0 in range(0, n_here, ROWS):
                e = base + e0 + tl.arange(0, ROWS)
                em = e < T
                f = tl.load(flags_ptr + e, mask=em, other=0)
                h = tl.load(home_ptr + e, mask=em, other=0)
                to_gpu = em & (((f & K.F_GPU) != 0) | ((f & K.F_PAD) != 0))
                to_cpu = em & ((f & K.F_CPU) != 0)
                h = tl.where((f & K.F_PAD) != 0, G, h)
                row = tl.load(rows_ptr + e[:, None] * W + w[None, :], mask=em[:, None] & wm[None, :], other=0)
                h2 = h.to(tl.int64)[:, None] * W + w[None, :]
                tl.store(g_row + h2, row, mask=to_gpu[:, None] & wm[None, :])
                tl.store(
                    c_row + (h - G).to(tl.int64)[:, None] * W + w[None, :],
                    row,
                    mask=to_cpu[:, None] & wm[None, :],
                )
        else:
            tl.store(slots_ptr + pos, slot, mask=inb)
