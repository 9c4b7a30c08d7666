"""Apply: carry out the plan. One program per chunk of the selection, no atomics.

Per chunk, in this order (the ordering rule of DESIGN section 3):

1. **Data.** For every miss of the chunk and every layer of the group: the victim's row leaves the
   GPU for its CPU home, the missing row comes in (from its CPU slot, or zeros for an entry that
   has none yet). A swap writes the victim into the CPU slot the miss vacated, so both rows are
   loaded before either is stored. A write also stores the new rows of its layer here.
2. **Mapping.** Only then do the mapping table and the slot owners change.
3. **Recency** (exact LRU). Every distinct GPU-resident address of the call is appended to the LRU
   queue with a new version; older pairs of the same slot turn stale. (PB-LRU moved hits to the
   current bucket in the lookup and new entries in the plan.)
4. **Output.** ``slots`` for every element (a duplicate finds its first occurrence's slot through
   the victim list, which the plan wrote before this launch), or the rows of a write for entries
   that were already homed.

A call whose status is not clean does nothing but write ``-1`` slots.
"""

from __future__ import annotations

import torch

from . import common as K
from ._triton import INTERPRETED, tl, triton

# Rows moved per tile. On a GPU 16 rows x 256 int32 words (16 KiB) keep two tiles in registers; the
# interpreter pays per operation, not per element, so it takes 4x larger tiles.
ROWS = 64 if INTERPRETED else 16


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
    POLICY: tl.constexpr,
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
        if POLICY == K.EXACT_LRU:  # PB-LRU recorded recency in lookup and plan
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


def apply(st, g: int, scratch, flat, layers: range, rows, write_layer: int, slots) -> int:
    """Launch apply for group ``g``. ``rows`` (int32/uint8 words ``[T, W]``) only for a write,
    ``slots`` (int32 ``[T]``) only for a prepare. Returns launches."""
    T = flat.numel()
    gpu = K.as_words(st.gpu_data[layers.start : layers.stop])
    cpu = K.as_words(st.cpu_data[layers.start : layers.stop])
    write = rows is not None
    W = gpu.shape[-1]
    apply_kernel[(triton.cdiv(T, K.CHUNK),)](
        flat,
        T,
        st.gpu_slots,
        scratch.home,
        scratch.flags,
        scratch.counts,
        scratch.miss_pos,
        scratch.miss_rank,
        scratch.first_pos,
        st.ctl,
        st.mapping[g],
        st.owner[g],
        st.ver[g],
        st.q_slot[g],
        st.q_ver[g],
        st.q_slot.shape[1],
        st.cpu_free[g],
        scratch.victims,
        scratch.popped,
        scratch.chunk_off,
        gpu,
        cpu,
        len(layers),
        gpu.stride(0),
        cpu.stride(0),
        W,
        rows if write else scratch.victims,
        write_layer - layers.start,
        scratch.victims if write else slots,
        WRITE=write,
        POLICY=st.policy,
        CHUNK=K.CHUNK,
        ROWS=ROWS,
        WORDS=K.next_pow2(W),
    )
    return 1


def apply_reference(st, g: int, scratch, flat, layers: range, rows, write_layer: int, slots) -> None:
    """Plain-Python twin of :func:`apply`: one miss, one row, one element at a time."""
    T, G, C, Qcap = flat.numel(), st.gpu_slots, K.CHUNK, st.q_slot.shape[1]
    write = rows is not None
    if int(st.ctl[int(K.E_LAST_STATUS)]) != 0:
        if not write:
            slots[:T] = -1
        return
    k_free, V = int(st.ctl[int(K.E_KFREE)]), int(st.ctl[int(K.E_VICTIMS)])
    push_base = int(st.ctl[int(K.E_PUSH_BASE)])
    gpu, cpu = st.gpu_data[layers.start : layers.stop], st.cpu_data[layers.start : layers.stop]
    local = write_layer - layers.start
    new_rows = rows.view(torch.uint8).reshape(T, -1) if write else None
    for c in range(-(-T // C)):
        m_off, q_off, pop_run, push_run = scratch.chunk_off[c].tolist()
        for r in range(int(scratch.counts[c, int(K.C_NEED)])):
            p = int(scratch.miss_pos[c * C + r])
            a, src, j = int(flat[p]), int(scratch.home[p]), m_off + r
            from_cpu = src >= G
            v = int(scratch.victims[j]) if j < V else None
            old = int(st.owner[g, v]) if v is not None and j >= k_free else -1
            cpu_slot = None
            if not from_cpu and j >= k_free:
                cpu_slot = int(scratch.popped[pop_run])
                pop_run += 1
            if from_cpu and j < k_free:
                st.cpu_free[g, push_base + push_run] = src - G
                push_run += 1
            dest = src - G if from_cpu else cpu_slot
            for layer in range(len(layers)):
                incoming = cpu[layer, src - G].clone() if from_cpu else torch.zeros_like(cpu[layer, 0])
                if write and layer == local:
                    incoming = new_rows[p].clone()
                if old >= 0:
                    cpu[layer, dest] = gpu[layer, v]
                if v is not None:
                    gpu[layer, v] = incoming
                else:
                    cpu[layer, cpu_slot] = incoming
            st.mapping[g, a] = v if v is not None else G + cpu_slot
            if old >= 0:
                st.mapping[g, old] = G + dest
            if v is not None:
                st.owner[g, v] = a
        appended = 0
        for pos in range(c * C, min(T, (c + 1) * C)):
            flags, home = int(scratch.flags[pos]), int(scratch.home[pos])
            slot = -1
            if flags & int(K.F_GPU):
                slot = home
            elif flags & int(K.F_MOVED):
                p0 = int(scratch.first_pos[pos])
                j0 = int(scratch.chunk_off[p0 // C, 0]) + int(scratch.miss_rank[p0])
                slot = int(scratch.victims[j0]) if j0 < V else -1
            if flags & int(K.F_FIRST) and slot >= 0 and st.policy == K.EXACT_LRU:
                q = (q_off + appended) % Qcap
                appended += 1
                st.ver[g, slot] += 1
                st.q_slot[g, q] = slot
                st.q_ver[g, q] = st.ver[g, slot]
            if not write:
                slots[pos] = slot
            elif flags & int(K.F_PAD):
                gpu[local, G] = new_rows[pos]
            elif flags & int(K.F_GPU):
                gpu[local, home] = new_rows[pos]
            elif flags & int(K.F_CPU):
                cpu[local, home - G] = new_rows[pos]
