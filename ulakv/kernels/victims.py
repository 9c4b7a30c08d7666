"""Victims: decide, on the device, where every miss goes and what leaves the GPU for it (the
planning step of a call, after ``ulakv.kernels.lookup``).

The last program of the lookup's ``classify`` launch to finish runs ``victims_program``, so planning
costs no launch of its own (see ``ulakv.kernels.lookup``). Everything that grows with the misses was
done before it, by every classify program side by side; what it does itself grows with the number
of chunks and candidate segments over ``BLOCK`` (one step up to a million elements), not with the
misses. Measured by ``benchmarks/critical_path.py``: a prepare's busiest programs add up to about
250 memory operations at batch 16 and 64 x 3 x top-2048 alike.

1. Totals from the lookup's per-chunk counts; a prepare with more distinct addresses than the
   layout's ``max_selection`` (GPU slots, or staging rows) fails here, before anything changed.
2. Victims: free GPU slots first (the top of a stack, copied by the classify programs), then the
   policy's eviction candidates, which the classify programs listed in *segments* (``cand`` and
   ``seg`` in the call scratch):

   * exact LRU: a ring of ``(slot, version)`` pairs in recency order; touching a slot bumps its
     version and appends it, so older pairs turn stale (lazy deletion). Program p lists the live
     pairs of unprotected slots among ring positions ``head + p * CHUNK ..`` (``_ring_candidates``);
     entries of the current round lie past ``round_tail`` and are never listed. Here: running
     totals of the lists, more segments one after another in the rare case they fall short, and
     the new head (the position of the last victim, found in its segment). When stale pairs would
     overflow the ring it is compacted in place (amortised O(1) a touch).
   * PB-LRU: cold, then the ring buckets oldest first, lower slots first, never the current round's
     bucket; segment (bucket, range of CHUNK slots) is listed by the program of that range. Here:
     running totals, and the round's end (the bucket about to be reused joins cold). Taken slots
     leave their bucket at commit (``ulakv.kernels.apply``).

   Victim ``j`` is then the ``j - k_free``-th candidate: ``victim_slot`` finds its segment by a
   binary search over the running totals.
3. Offsets per chunk so the apply kernel can work in parallel without atomics and still
   deterministically: where each chunk's misses start in the victim list, where its touches are
   appended to the queue, and its rank among the CPU rows freed by misses that came from the CPU.
   Every miss past the free GPU slots pops a free CPU row (for its victim, or for itself in a write
   that found no slot): a victim never lands in a row someone still lives in.
4. Counters, round and epoch bookkeeping; the call's status is published for the host and apply.
"""

from __future__ import annotations

import torch

from . import buckets
from . import common as K
from ._triton import tl, triton
from .buckets import PBLRUBits

BLOCK = 1024


@triton.jit
def _ring_candidates(qi, limit, q_slot_ptr, q_ver_ptr, Qcap, ver_ptr, mark_ptr, epoch):
    """Which ring positions ``qi`` (below ``limit``) hold a live pair of an unprotected slot: an
    eviction candidate. Returns (candidate mask, slot)."""
    qm = qi < limit
    s = tl.load(q_slot_ptr + qi % Qcap, mask=qm, other=0)
    qv = tl.load(q_ver_ptr + qi % Qcap, mask=qm, other=0)
    live = qm & (qv == tl.load(ver_ptr + s, mask=qm, other=-1))
    return live & (tl.load(mark_ptr + s, mask=qm, other=0) != epoch), s


def ring_candidates_reference(st, g: int, lo: int, hi: int) -> list[int]:
    """Plain-Python twin of ``_ring_candidates`` over ring positions ``lo .. hi``: the slots listed."""
    Qcap, epoch = st.q_slot.shape[1], int(st.ctl[int(K.E_EPOCH)])
    out = []
    for qi in range(lo, hi):
        s = int(st.q_slot[g, qi % Qcap])
        if int(st.q_ver[g, qi % Qcap]) == int(st.ver[g, s]) and int(st.mark[s]) != epoch:
            out.append(s)
    return out


@triton.jit
def _count_rows(counts_ptr, c, P):
    """The per-chunk count rows of chunks ``c`` (below ``P``), int64 ``[len(c), 4]``, in one load."""
    w = tl.arange(0, 4)[None, :]  # COUNT_WORDS
    return tl.load(counts_ptr + c[:, None] * K.COUNT_WORDS + w, mask=(c < P)[:, None], other=0).to(tl.int64)


@triton.jit
def _column(counts, word):
    """Column ``word`` of count rows."""
    return tl.sum(tl.where(tl.arange(0, 4)[None, :] == word, counts, 0), axis=1)


@triton.jit
def _list_copy_depths(s, listed, copy_row_ptr, cpu_pos_ptr, copy_depth_ptr, top, C):
    """For listed candidate slots ``s``: how deep below the top of the CPU free list, as the call
    began, sits the row their copy names (junk where the copy is not intact: apply checks that).
    Taken now because apply moves rows in the list while it decides which evictions are clean."""
    copy = tl.load(copy_row_ptr + s, mask=listed, other=-1)
    has = listed & (copy >= 0)
    at = tl.load(cpu_pos_ptr + copy, mask=has, other=0)
    tl.store(copy_depth_ptr + s, (((top - at) % C + C) % C).to(tl.int32), mask=has)


def list_copy_depths_reference(st, g: int, slots: list[int], scratch) -> None:
    """Plain-Python twin of ``_list_copy_depths``."""
    cap, count = st.cpu_stack_size, int(st.gctl[g, int(K.G_CPU_FREE)])
    top = int(st.gctl[g, int(K.G_CPU_BOT)]) + count - 1
    for s in slots:
        copy = int(st.copy_row[g, s])
        if copy >= 0:
            scratch.copy_depth[s] = (top - int(st.cpu_pos[g, copy])) % cap


@triton.jit
def victim_slot(j, mask, k_free, victims_ptr, cand_ptr, seg_ptr, segments, CHUNK: tl.constexpr):
    """GPU slot of victim ``j`` (a miss's index in the call's miss order): the free-stack copy for
    ``j < k_free``, else candidate ``j - k_free`` of the segmented list (segment ``s`` holds
    candidates ``seg[2s] .. seg[2s + 2]``, listed from ``cand[seg[2s + 1]]`` on), found by a binary
    search over the segment starts: ceil(log2(segments)) loads (9 at batch 64 x 3 x 2048 under exact
    LRU), whatever the misses."""
    free = mask & (j < k_free)
    taken = mask & (j >= k_free)
    r = (j - k_free).to(tl.int64)
    base = tl.zeros_like(r)
    size = segments + 0
    while size > 1:
        half = size // 2
        below = tl.load(seg_ptr + 2 * (base + half), mask=taken, other=0) <= r
        base = tl.where(below, base + half, base)
        size -= half
    start = tl.load(seg_ptr + 2 * base, mask=taken, other=0)
    at = tl.load(seg_ptr + 2 * base + 1, mask=taken, other=0)
    from_list = tl.load(cand_ptr + at + (r - start), mask=taken, other=0)
    return tl.where(free, tl.load(victims_ptr + j, mask=free, other=0), from_list)


def victim_location(scratch, ctl: list[int], j: int) -> tuple[torch.Tensor, int]:
    """The scratch tensor and index that hold victim ``j``'s slot (for tests that plant a victim)."""
    if j < ctl[int(K.E_KFREE)]:
        return scratch.victims, j
    r = j - ctl[int(K.E_KFREE)]
    seg = scratch.seg[: 2 * ctl[int(K.E_SEGMENTS)]].tolist()
    s = max(i for i, start in enumerate(seg[0::2]) if start <= r)
    return scratch.cand, seg[2 * s + 1] + r - seg[2 * s]


def victim_slots(scratch, ctl: list[int], j: torch.Tensor) -> torch.Tensor:
    """Host twin of ``victim_slot`` for victim indices ``j`` (int64, CPU): their GPU slots."""
    k_free, segments = ctl[int(K.E_KFREE)], ctl[int(K.E_SEGMENTS)]
    free = scratch.victims.cpu().to(torch.int64)[j.clamp(max=scratch.victims.numel() - 1)]
    seg = scratch.seg.cpu()
    starts, at = seg[0 : 2 * segments : 2].contiguous(), seg[1 : 2 * segments : 2]
    r = (j - k_free).clamp(min=0)
    s = torch.searchsorted(starts, r, right=True) - 1
    cand = scratch.cand.cpu().to(torch.int64)
    listed = cand[(at[s] + r - starts[s]).clamp(min=0, max=cand.numel() - 1)]
    return torch.where(j < k_free, free, listed)


@triton.jit
def victims_program(
    counts_ptr,
    P,
    G,
    N,
    ctl_ptr,
    gctl_ptr,
    stats_ptr,
    ver_ptr,
    q_slot_ptr,
    q_ver_ptr,
    Qcap,
    C,
    copy_row_ptr,
    cpu_pos_ptr,
    copy_depth_ptr,
    mark_ptr,
    claim_ptr,
    cand_ptr,
    seg_ptr,
    chunk_off_ptr,
    group_row_bytes,
    layer_row_bytes,
    bits_ptr,
    BW,
    lvl_ptr,
    n_levels,
    R,
    frontier_ptr,
    frontier_size,
    WRITE: tl.constexpr,
    POLICY: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    CACHE: tl.constexpr,
):
    ar = tl.arange(0, BLOCK)
    status = tl.load(ctl_ptr + K.E_STATUS)
    epoch = tl.load(ctl_ptr + K.E_EPOCH)
    D = tl.load(ctl_ptr + K.E_DISTINCT)  # counted by the claim
    H = tl.zeros((), dtype=tl.int64)
    M = tl.zeros((), dtype=tl.int64)
    MC = tl.zeros((), dtype=tl.int64)
    CF = tl.zeros((), dtype=tl.int64)
    for c0 in range(0, P, BLOCK):
        counts = _count_rows(counts_ptr, c0 + ar, P)
        H += tl.sum(_column(counts, K.C_HITS), axis=0)
        M += tl.sum(_column(counts, K.C_NEED), axis=0)
        MC += tl.sum(_column(counts, K.C_NEED_CPU), axis=0)
        CF += tl.sum(_column(counts, K.C_CPU_FIRST), axis=0)
    if not WRITE:
        if tl.load(ctl_ptr + K.E_MAX_SELECTION) < D:
            status = status | K.ST_TOO_LARGE
    if status == 0:
        head = tl.load(gctl_ptr + K.G_HEAD)
        tail = tl.load(gctl_ptr + K.G_TAIL)
        round_tail = tl.load(gctl_ptr + K.G_ROUND_TAIL)
        # Kept in a register: a scalar store is one thread's, and re-loading the word right after
        # it could give other warps the old round.
        rnd = tl.load(gctl_ptr + K.G_ROUND)
        if not WRITE:
            # A new round: everything appended so far is older than this round's touches.
            round_tail = tail
            rnd += 1
            tl.store(gctl_ptr + K.G_ROUND, rnd)

        # -- victims: free GPU slots first (every classify program copied its share of the stack's
        # top into the victim list) ---------------------------------------------------------------
        n_free = tl.load(gctl_ptr + K.G_GPU_FREE)
        k_free = tl.minimum(M, n_free)
        n_free = n_free - k_free

        want = M - k_free
        got = tl.zeros((), dtype=tl.int64)
        scanned = tl.zeros((), dtype=tl.int64)
        round_reads = tl.zeros((), dtype=tl.int64)
        # -- then the policy's candidates, listed segment by segment by the classify programs:
        # running totals of the lists' lengths (seg[2s] = candidates before segment s) ------------
        if POLICY == K.EXACT_LRU:
            segments = P.to(tl.int64)  # one segment of the ring a program
        else:
            segments = (R * ((G + CHUNK - 1) // CHUNK)).to(tl.int64)  # every bucket, every slot range
        tl.store(seg_ptr, tl.zeros((), tl.int64))
        run = tl.zeros((), dtype=tl.int64)
        for c0 in range(0, segments.to(tl.int32), BLOCK):
            c = c0 + ar
            cm = c < segments
            count = tl.load(seg_ptr + 2 * c + 2, mask=cm, other=0)
            tl.store(seg_ptr + 2 * c + 2, run + tl.cumsum(count, axis=0), mask=cm)
            run += tl.sum(count, axis=0)
        if POLICY == K.EXACT_LRU:
            # Rarely (stale or protected pairs crowd the ring's head) the lists fall short: list more
            # segments here, one after another.
            while (run < want) & (head + segments * CHUNK < round_tail):
                qi = head + segments * CHUNK + tl.arange(0, CHUNK)
                eligible, s = _ring_candidates(
                    qi, round_tail, q_slot_ptr, q_ver_ptr, Qcap, ver_ptr, mark_ptr, epoch
                )
                rank = tl.cumsum(eligible.to(tl.int32), axis=0) - 1
                tl.store(cand_ptr + segments * CHUNK + rank, s, mask=eligible)
                if not CACHE:
                    top = tl.load(gctl_ptr + K.G_CPU_BOT) + tl.load(gctl_ptr + K.G_CPU_FREE) - 1
                    _list_copy_depths(s, eligible, copy_row_ptr, cpu_pos_ptr, copy_depth_ptr, top, C)
                run += tl.sum(eligible.to(tl.int64), axis=0)
                tl.store(seg_ptr + 2 * segments + 1, segments * CHUNK)
                tl.store(seg_ptr + 2 * segments + 2, run)
                segments += 1
            got = tl.minimum(run, want)
            new_head = head
            if want > 0:
                new_head = round_tail
                if run >= want:
                    # The segment of the last victim: the first whose running total reaches want.
                    last_seg = segments
                    for c0 in range(0, segments.to(tl.int32), BLOCK):
                        c = c0 + ar
                        total = tl.load(seg_ptr + 2 * c + 2, mask=c < segments, other=0)
                        last_seg = tl.minimum(
                            last_seg, tl.min(tl.where((c < segments) & (total >= want), c, segments), axis=0)
                        )
                    qi = head + last_seg * CHUNK + tl.arange(0, CHUNK)
                    eligible, s = _ring_candidates(
                        qi, round_tail, q_slot_ptr, q_ver_ptr, Qcap, ver_ptr, mark_ptr, epoch
                    )
                    rank = tl.load(seg_ptr + 2 * last_seg) + tl.cumsum(eligible.to(tl.int64), axis=0)
                    new_head = tl.max(tl.where(eligible & (rank == want), qi, -1), axis=0) + 1
            scanned = new_head - head
            head = new_head
        else:
            # PB-LRU's victims stay in their buckets until commit clears them (apply).
            got = tl.minimum(run, want)
            scanned = segments * (CHUNK // 32)  # leaf words the lists were made from
        V = k_free + got
        if POLICY == K.PBLRU:
            # (Every slot that receives an entry joins the current round's bucket at commit.)
            if not WRITE:
                tl.debug_barrier()
                round_reads = buckets.retire_bucket(
                    bits_ptr, BW, lvl_ptr, n_levels, R, rnd, frontier_ptr, frontier_size, BLOCK
                )

        # -- make room for this call's appends: compact stale pairs out of the ring --------------
        appends = H + V
        if POLICY == K.EXACT_LRU:
            if tail + appends - head > Qcap:
                w = head
                new_round_tail = head
                r = head
                while r < tail:
                    qi = r + ar
                    qm = qi < tail
                    s = tl.load(q_slot_ptr + qi % Qcap, mask=qm, other=0)
                    qv = tl.load(q_ver_ptr + qi % Qcap, mask=qm, other=0)
                    keep = qm & (qv == tl.load(ver_ptr + s, mask=qm, other=-1))
                    dst = (w + tl.cumsum(keep.to(tl.int64), axis=0) - 1) % Qcap
                    tl.debug_barrier()  # every lane has read its pair before any lane overwrites one
                    tl.store(q_slot_ptr + dst, s, mask=keep)
                    tl.store(q_ver_ptr + dst, qv, mask=keep)
                    new_round_tail += tl.sum((keep & (qi < round_tail)).to(tl.int64), axis=0)
                    w += tl.sum(keep.to(tl.int64), axis=0)
                    r += BLOCK
                tail = w
                round_tail = new_round_tail

        # -- per-chunk offsets: victim list, queue appends, CPU rows freed ---------------------------
        m_run = tl.zeros((), dtype=tl.int64)
        q_run = tail
        push_run = tl.zeros((), dtype=tl.int64)
        for c0 in range(0, P, BLOCK):
            c = c0 + ar
            cm = c < P
            counts = _count_rows(counts_ptr, c, P)
            need = _column(counts, K.C_NEED)
            need_cpu = _column(counts, K.C_NEED_CPU)
            hits = _column(counts, K.C_HITS)
            m_off = m_run + tl.cumsum(need, axis=0) - need
            with_victim = tl.minimum(tl.maximum(V - m_off, 0), need)
            appended = hits + with_victim
            q_off = q_run + tl.cumsum(appended, axis=0) - appended
            push_off = push_run + tl.cumsum(need_cpu, axis=0) - need_cpu
            # One store of the three offsets a chunk (its O_MISS, O_QUEUE, O_PUSH words).
            w = tl.arange(0, 4)[None, :]
            offsets = tl.where(
                w == K.O_MISS, m_off[:, None], tl.where(w == K.O_QUEUE, q_off[:, None], push_off[:, None])
            )
            tl.store(
                chunk_off_ptr + c[:, None] * K.OFF_WORDS + w, offsets, mask=cm[:, None] & (w < K.OFF_WORDS)
            )
            m_run += tl.sum(need, axis=0)
            q_run += tl.sum(appended, axis=0)
            push_run += tl.sum(need_cpu, axis=0)

        # -- CPU rows: every miss past the free GPU slots pops one off the free list's top (for the
        # entry it evicts, or for itself when a write finds no slot); every miss that came from the
        # CPU leaves its row, which still holds its bytes, at the bottom, after its mapping moved.
        # The classify programs copied the top to scratch, so the bottom may wrap over the popped
        # region without racing apply's readers of the pops.
        pops = M - k_free
        if CACHE:  # a buffer drops its victims (their home is on another rank): no CPU rows
            pops = pops * 0
        n_cpu = tl.load(gctl_ptr + K.G_CPU_FREE)
        bottom = (tl.load(gctl_ptr + K.G_CPU_BOT) - push_run + C) % C

        tl.store(gctl_ptr + K.G_HEAD, head)
        tl.store(gctl_ptr + K.G_TAIL, q_run)
        tl.store(gctl_ptr + K.G_ROUND_TAIL, round_tail)
        tl.store(gctl_ptr + K.G_GPU_FREE, n_free)
        tl.store(gctl_ptr + K.G_CPU_FREE, n_cpu - pops + push_run)
        tl.store(gctl_ptr + K.G_CPU_BOT, bottom)
        tl.store(ctl_ptr + K.E_KFREE, k_free)
        tl.store(ctl_ptr + K.E_VICTIMS, V)
        tl.store(ctl_ptr + K.E_SEGMENTS, segments)
        tl.store(ctl_ptr + K.E_PUSH_BASE, bottom)
        tl.store(ctl_ptr + K.E_POPS, pops)

        # Evictions' bytes out are counted by apply, which knows which were clean.
        if WRITE:
            cpu_rows = CF + (M - V)  # written in place on the CPU, or new entries homed there
            tl.store(
                stats_ptr + K.S_BYTES_OUT,
                tl.load(stats_ptr + K.S_BYTES_OUT) + cpu_rows * layer_row_bytes,
            )
        else:
            tl.store(stats_ptr + K.S_HITS, tl.load(stats_ptr + K.S_HITS) + H)
            tl.store(stats_ptr + K.S_MISSES, tl.load(stats_ptr + K.S_MISSES) + M)
            fetched = MC  # a tier swaps in its CPU-resident misses
            if CACHE:  # a buffer fetches every miss and drops its victims
                fetched = M
            tl.store(stats_ptr + K.S_BYTES_IN, tl.load(stats_ptr + K.S_BYTES_IN) + fetched * group_row_bytes)
        evicted = V - k_free
        tl.store(stats_ptr + K.S_VICTIMS, tl.load(stats_ptr + K.S_VICTIMS) + evicted)
        tl.store(stats_ptr + K.S_SEARCH_READS, tl.load(stats_ptr + K.S_SEARCH_READS) + scanned)
        tl.store(stats_ptr + K.S_ROUND_READS, tl.load(stats_ptr + K.S_ROUND_READS) + round_reads)

    # -- always: publish the status, clear the accumulator, advance the epoch ---------------------
    tl.store(ctl_ptr + K.E_LAST_STATUS, status)
    tl.store(ctl_ptr + K.E_STATUS, 0)
    tl.store(ctl_ptr + K.E_DISTINCT, 0)
    tl.store(ctl_ptr + K.E_PENDING, tl.load(ctl_ptr + K.E_PENDING) | status)
    if epoch + 1 >= K.EPOCH_LIMIT:
        # Claim keys are (epoch << 32 | ~pos): before the epoch would overflow them, clear the
        # scratch that epochs tag and restart. Once in 2**31 calls; O(addresses + slots).
        for i0 in range(0, N, BLOCK):
            tl.store(claim_ptr + i0 + ar, tl.zeros((BLOCK,), tl.int64), mask=i0 + ar < N)
        for i0 in range(0, G, BLOCK):
            tl.store(mark_ptr + i0 + ar, tl.zeros((BLOCK,), tl.int64), mask=i0 + ar < G)
        tl.store(ctl_ptr + K.E_EPOCH, 1)
    else:
        tl.store(ctl_ptr + K.E_EPOCH, epoch + 1)


def victims_reference(
    st,
    g: int,
    scratch,
    T: int,
    write: bool,
    group_row_bytes: int,
    layer_row_bytes: int,
) -> None:
    """Plain-Python twin of :func:`victims_program` (run by the last ``classify`` program): walks
    misses and queue entries one at a time."""
    Qcap, C = st.q_slot.shape[1], K.CHUNK
    P = -(-T // C)
    ctl, gctl, stats = st.ctl, st.gctl[g], st.stats
    counts = scratch.counts[:P].tolist()
    total = [sum(row[i] for row in counts) for i in range(K.COUNT_WORDS)]
    D, H, M = int(ctl[int(K.E_DISTINCT)]), total[int(K.C_HITS)], total[int(K.C_NEED)]
    MC, CF = total[int(K.C_NEED_CPU)], total[int(K.C_CPU_FIRST)]
    status, epoch = int(ctl[int(K.E_STATUS)]), int(ctl[int(K.E_EPOCH)])
    if not write and int(ctl[int(K.E_MAX_SELECTION)]) < D:
        status |= int(K.ST_TOO_LARGE)
    if status == 0:
        head, tail = int(gctl[int(K.G_HEAD)]), int(gctl[int(K.G_TAIL)])
        round_tail = int(gctl[int(K.G_ROUND_TAIL)])
        if not write:
            round_tail = tail
            gctl[int(K.G_ROUND)] += 1
        n_free = int(gctl[int(K.G_GPU_FREE)])
        k_free = min(M, n_free)
        victims = [int(st.gpu_free[g, n_free - 1 - j]) for j in range(k_free)]
        n_free -= k_free
        scanned, round_reads = 0, 0
        bitmaps = PBLRUBits(st, g) if st.policy == K.PBLRU else None
        # The candidate lists the classify made, as running totals (see victim_slot).
        segments = P if bitmaps is None else bitmaps.R * -(-st.gpu_slots // C)
        scratch.seg[0] = 0
        run = 0
        for k in range(segments):
            run += int(scratch.seg[2 * k + 2])
            scratch.seg[2 * k + 2] = run
        if bitmaps is None:
            scanned_from = head
            while len(victims) < M and head < round_tail:
                s = int(st.q_slot[g, head % Qcap])
                live = int(st.q_ver[g, head % Qcap]) == int(st.ver[g, s])
                if live and int(st.mark[s]) != epoch:
                    victims.append(s)
                head += 1
            scanned = head - scanned_from
            # ... and more segments of the ring while they fall short.
            while run < M - k_free and scanned_from + segments * C < round_tail:
                lo = scanned_from + segments * C
                slots = ring_candidates_reference(st, g, lo, min(round_tail, lo + C))
                if not st.CACHE:
                    list_copy_depths_reference(st, g, slots, scratch)
                at = segments * C
                scratch.cand[at : at + len(slots)] = torch.tensor(slots, dtype=torch.int32)
                run += len(slots)
                scratch.seg[2 * segments + 1] = at
                scratch.seg[2 * segments + 2] = run
                segments += 1
        else:
            # Victims: cold, then the ring oldest first, lower slots first, never the current round;
            # they leave their buckets at commit (apply).
            rnd = int(gctl[int(K.G_ROUND)])
            for i in range(bitmaps.R):
                bucket = bitmaps.R if i == 0 else (rnd + i) % bitmaps.R
                victims += sorted(bitmaps.sets[bucket])[: M - len(victims)]
            scanned = segments * (C // 32)
            if not write:
                round_reads = bitmaps.retire(rnd)
            bitmaps.store()
        V = len(victims)
        if bitmaps is None and tail + H + V - head > Qcap:
            kept = [
                (int(st.q_slot[g, i % Qcap]), int(st.q_ver[g, i % Qcap]), i)
                for i in range(head, tail)
                if int(st.q_ver[g, i % Qcap]) == int(st.ver[g, int(st.q_slot[g, i % Qcap])])
            ]
            for k, (s, v, _) in enumerate(kept):
                st.q_slot[g, (head + k) % Qcap] = s
                st.q_ver[g, (head + k) % Qcap] = v
            round_tail = head + sum(1 for *_, i in kept if i < round_tail)
            tail = head + len(kept)
        # Per chunk: where its misses start, where its touches are appended, its rank among the
        # CPU rows freed. Misses past the free GPU slots pop a CPU row each.
        j, q_run, push_run = 0, tail, 0
        for c in range(P):
            need, hits = counts[c][int(K.C_NEED)], counts[c][int(K.C_HITS)]
            scratch.chunk_off[c] = torch.tensor([j, q_run, push_run])
            q_run += hits + max(0, min(V - j, need))
            push_run += counts[c][int(K.C_NEED_CPU)]
            j += need
        pops = 0 if st.CACHE else M - k_free  # copied to scratch.popped by the classify
        bottom = (int(gctl[int(K.G_CPU_BOT)]) - push_run) % st.cpu_stack_size
        gctl[int(K.G_HEAD)] = head
        gctl[int(K.G_TAIL)] = q_run
        gctl[int(K.G_ROUND_TAIL)] = round_tail
        gctl[int(K.G_GPU_FREE)] = n_free
        gctl[int(K.G_CPU_FREE)] += push_run - pops
        gctl[int(K.G_CPU_BOT)] = bottom
        ctl[int(K.E_POPS)] = pops
        ctl[int(K.E_KFREE)] = k_free
        ctl[int(K.E_VICTIMS)] = V
        ctl[int(K.E_SEGMENTS)] = segments
        # The lists, read as the kernels read them, give the policy's victims in its order.
        listed = victim_slots(scratch, ctl.tolist(), torch.arange(k_free, V)).tolist()
        assert listed == victims[k_free:], (
            f"candidate lists give {listed[:8]}, the policy {victims[k_free:8]}"
        )
        ctl[int(K.E_PUSH_BASE)] = bottom
        evicted = V - k_free
        if write:
            stats[int(K.S_BYTES_OUT)] += (CF + M - V) * layer_row_bytes
        else:
            stats[int(K.S_HITS)] += H
            stats[int(K.S_MISSES)] += M
            stats[int(K.S_BYTES_IN)] += (M if st.CACHE else MC) * group_row_bytes
        stats[int(K.S_VICTIMS)] += evicted
        stats[int(K.S_SEARCH_READS)] += scanned
        stats[int(K.S_ROUND_READS)] += round_reads
    ctl[int(K.E_LAST_STATUS)] = status
    ctl[int(K.E_STATUS)] = 0
    ctl[int(K.E_DISTINCT)] = 0
    ctl[int(K.E_PENDING)] |= status
    if epoch + 1 >= K.EPOCH_LIMIT:
        st.claim.zero_()
        st.mark.zero_()
        ctl[int(K.E_EPOCH)] = 1
    else:
        ctl[int(K.E_EPOCH)] = epoch + 1
