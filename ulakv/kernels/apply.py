"""Apply: carry out a plan. Element programs write each element's slot and recency; a persistent
grid of workers, as many as the GPU holds at once, strides over the plan's misses ``ROWS`` at a time
(the count read on the device), so the grid follows the work the plan found, not the call's size.
Apply decides nothing: each miss's slot, CPU rows and whether its victim's bytes stay are the
plan's (``ulakv.kernels.decide``), read as one column of ``moves`` a miss.

A swap never overwrites a live home: each victim's rows first go to a *free* CPU row (the pool keeps
``staging_slots`` spare rows so one exists even when every admitted row is taken), then its mapping
moves there, then the miss's rows come into the vacated GPU slot, then the miss's mapping moves and
its old CPU row is freed. Data first, then mapping, twice (``K.PH_OUT`` .. ``K.PH_COMMIT``): after
every phase each entry is readable at the home its mapping names, so a plan stopped between phases
loses nothing and finishes by running the phases left. A launch runs the phases
``[first_phase, last_phase]``; the ``in`` phase moves the layers ``[in_lo, in_hi)`` of the group, so
an engine can bring the first layer in at once and the others on a side stream.

Programs never touch each other's rows: a victim slot, a popped CPU row and a miss's source row each
belong to exactly one miss, and victims are never selected in the same call.

A clean victim copies nothing: its mapping moves to its copy, a free row that still holds its bytes,
and that row leaves the free list. The victims the plan counted clean pop no row when it fills
(``ulakv.kernels.victims``): commit puts the row each one's miss leaves in its copy's place (until
then the list still names the copy: no call pops while a plan is pending, since every call finishes
it first). Every other victim popped a row and goes back to its copy all the same when no pop of the
call took it; the row it popped goes in the copy's place at once.

Recency (exact LRU): every distinct GPU-resident address of the call is appended to the LRU queue
with a new version; older pairs of the same slot turn stale. PB-LRU moved hits to the current
bucket in the lookup; commit puts each slot that receives an entry there (atomics: bits of one word
belong to several programs' slots).

``slots`` for every element (a duplicate finds its first occurrence's slot through the victim list)
are written with the ``evict`` phase; a call whose status is not clean writes ``-1`` there and
changes nothing.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import buckets
from . import common as K
from ._triton import INTERPRETED, tl, triton
from .buckets import PBLRUBits
from .grid import learn, program_slots
from .rows import aligned_to, load_units, store_units, unit_offsets, vectors_per_row
from .victims import control_word, ring_block_copy


class Tiling(NamedTuple):
    """How apply splits its work: ``rows`` rows a worker's step (misses, or a write's homed rows),
    and ``elements`` elements an element program (a prepare's slots, the LRU appends)."""

    rows: int
    elements: int


# On a GPU at 8 warps a tile of 8 rows x 64 vectors of 16 B (8 KiB) is 8 words a thread, and 256
# elements one a thread: 104-120 registers (sm_90 cubins, ``compile_check``), 16 resident warps an
# SM. 16-row tiles, with one program serving a chunk's 1,024 elements, took 125-186 (8 resident).
# The interpreter pays per operation, not per element: 8x taller row tiles, 1,024 elements a
# program. The launcher reads ``TILING`` at each launch: tests set it to ``GPU_TILING`` so CI also
# runs the GPU's tiling.
GPU_TILING = Tiling(rows=8, elements=256)
INTERPRETER_TILING = Tiling(rows=64, elements=K.CHUNK)
TILING = INTERPRETER_TILING if INTERPRETED else GPU_TILING
APPLY_WARPS = 8
# No register bound: ptxas gives the tier's variants 64-80 registers (24-32 resident warps an SM)
# and the buffer's 32-40 (48-64), no spill (sm_90, ``compile_check``). While apply still searched
# each miss's chunk and victim, it traded registers for occupancy and spilled 16-40 B, so it ran
# under maxnreg=128 (16 resident warps); with the moves read from the plan that bound only costs:
# 80 spills 8-32 B and 64 spills 16-40 B. The compile test holds every variant to no spill.

ALL_PHASES = (int(K.PH_OUT), int(K.PH_COMMIT))


class Rows(NamedTuple):
    """A group's rows as apply moves them: the pool's GPU and CPU rows from the group's first layer,
    a layer's stride in each (int64), vectors a row, the group's layers."""

    gpu: tl.tensor
    cpu: tl.tensor
    gpu_stride: tl.tensor
    cpu_stride: tl.tensor
    n_vec: tl.tensor
    layers: tl.tensor


class Homes(NamedTuple):
    """Group g's words that a miss's move rewrites: the mapping, each GPU slot's owner, the CPU
    free list (ring and each row's place in it), each CPU row's GPU slot and each slot's CPU row
    (copies), and the tiers' sizes."""

    mapping: tl.tensor
    owner: tl.tensor
    cpu_free: tl.tensor
    cpu_pos: tl.tensor
    copy_slot: tl.tensor
    copy_row: tl.tensor
    gpu_slots: tl.tensor
    cpu_rows: tl.tensor


class Buckets(NamedTuple):
    """PB-LRU's bitmaps for group g: words, words a bucket, level starts, levels, slot stamps,
    buckets."""

    bits: tl.tensor
    words: tl.tensor
    levels: tl.tensor
    n_levels: tl.tensor
    stamp: tl.tensor
    R: tl.tensor


class MissTile(NamedTuple):
    """``ROWS`` of the call's misses and what the plan decided for each (``ulakv.kernels.decide``):
    index ``j`` among the misses (``live``: it exists), position and address, source home, GPU slot
    ``v`` (``has_slot``), whether it is past the free slots (``popping``), the CPU row it pops
    (``cpu_row``), the row that becomes a home at evict (``dest``), where its own CPU row joins the
    free list (``push``; a write's copy row's place), whether its victim's bytes stay (``clean``),
    whether its popped row takes its victim's copy's place (``refill``), and the CPU row a write's
    miss's rows go to (``copy``: its copy's plain row, or its home when it has no slot; -1: none)."""

    j: tl.tensor
    live: tl.tensor
    pos: tl.tensor
    address: tl.tensor
    src: tl.tensor
    has_slot: tl.tensor
    v: tl.tensor
    popping: tl.tensor
    cpu_row: tl.tensor
    dest: tl.tensor
    push: tl.tensor
    clean: tl.tensor
    refill: tl.tensor
    copy: tl.tensor


@triton.jit
def _miss_tile(
    j, live, k_free, moves_ptr, cap, sel_ptr, new_ptr, n_new, home_ptr, NEW: tl.constexpr, SPLIT: tl.constexpr
):
    """The call's misses ``j`` (``live``: those that exist) with the moves the plan decided for
    them (``k_free``: the misses into free slots): one load a word, all independent, then the
    address and source home by position. Only a call with new entries (``NEW``: a write, or a
    prepare with new rows) has copies to make (otherwise ``copy`` is -1, known to the compiler:
    the plain prepare variants keep their registers). ``SPLIT``: a prepare with new rows, whose
    first ``n_new`` elements are read through ``new_ptr``."""
    moves = moves_ptr + j
    p = tl.load(moves + K.MV_POS * cap, mask=live, other=0)
    v = tl.load(moves + K.MV_SLOT * cap, mask=live, other=-1)
    cpu_row = tl.load(moves + K.MV_ROW * cap, mask=live, other=-1)
    dest = tl.load(moves + K.MV_DEST * cap, mask=live, other=-1)
    push = tl.load(moves + K.MV_PUSH * cap, mask=live, other=-1)
    flags = tl.load(moves + K.MV_FLAGS * cap, mask=live, other=0)
    copy = tl.full(j.shape, -1, tl.int32)
    if NEW:
        copy = tl.load(moves + K.MV_COPY * cap, mask=live, other=-1)
    if SPLIT:
        a = K.element_addresses(sel_ptr, new_ptr, n_new, p, live, 0)
    else:
        a = tl.load(sel_ptr + p, mask=live, other=0).to(tl.int64)
    src = tl.load(home_ptr + p, mask=live, other=0)
    has_slot = live & (v >= 0)
    popping = live & (j >= k_free)
    clean = (flags & K.MF_CLEAN) != 0
    refill = (flags & K.MF_REFILL) != 0
    return MissTile(j, live, p, a, src, has_slot, v, popping, cpu_row, dest, push, clean, refill, copy)


@triton.jit
def _out(t, rows, owner_ptr, VECS: tl.constexpr, UNIT: tl.constexpr, UNIT_BYTES: tl.constexpr):
    """Phase ``out`` (data): each victim's rows, every layer of the group, to the CPU row it popped,
    unless it is clean."""
    vm = (tl.arange(0, VECS) < rows.n_vec)[None, :, None]  # a row's vectors (a power-of-two axis)
    old = tl.load(owner_ptr + t.v, mask=t.has_slot & t.popping, other=-1)
    evict = (t.has_slot & t.popping & (old >= 0) & ~t.clean)[:, None, None] & vm
    v2, _ = unit_offsets(t.v.to(tl.int64), rows.n_vec, VECS, UNIT)
    dest2, _ = unit_offsets(t.cpu_row.to(tl.int64), rows.n_vec, VECS, UNIT)
    for layer in range(rows.layers):
        row = load_units(rows.gpu + layer * rows.gpu_stride, v2, evict, UNIT, UNIT_BYTES)
        store_units(rows.cpu + layer * rows.cpu_stride, dest2, row, evict, UNIT, UNIT_BYTES)


@triton.jit
def _claim_homes(t, claims_ptr, G, tag, ctl_ptr, NEW: tl.constexpr):
    """ULAKV_DEBUG: claim each GPU slot and CPU row the tile's moves write (its slot, the row it
    pops, its copy's row) by an atomic exchange of the call's tag (the epoch its plan advanced to:
    a group's calls run in one context, whose epoch only grows until it wraps, when the pool clears
    the group's claims first); a
    claim that finds the tag already there (two misses of the call given one home) is counted in
    ``E_HOME_CLAIMS``, which the pool raises. Off the hot path: only its variants claim."""
    old = tl.atomic_xchg(claims_ptr + t.v, tag, mask=t.has_slot, sem="relaxed")
    twice = (t.has_slot & (old == tag)).to(tl.int64)
    pops = t.live & (t.cpu_row >= 0)
    old = tl.atomic_xchg(claims_ptr + G + t.cpu_row, tag, mask=pops, sem="relaxed")
    twice += (pops & (old == tag)).to(tl.int64)
    if NEW:  # (a new token may keep its copy in the very row its clean victim popped)
        copies = t.live & (t.copy >= 0) & (t.copy != t.cpu_row)
        old = tl.atomic_xchg(claims_ptr + G + t.copy, tag, mask=copies, sem="relaxed")
        twice += (copies & (old == tag)).to(tl.int64)
    n = tl.sum(twice, axis=0)
    tl.atomic_add(ctl_ptr + K.E_HOME_CLAIMS, n, mask=n > 0, sem="relaxed")


@triton.jit
def _evict(t, homes, stats_ptr, group_row_bytes, CACHE: tl.constexpr):
    """Phase ``evict`` (mapping): victims now live in their CPU rows (a buffer's: back on their
    home rank), their slots are unowned, bytes out and clean evictions counted."""
    old = tl.load(homes.owner + t.v, mask=t.has_slot & t.popping, other=-1)
    evict = t.has_slot & t.popping & (old >= 0)
    if CACHE:  # dropped: the entry lives on its home rank, not here
        tl.store(homes.mapping + old, tl.full(t.j.shape, K.M_UNHOMED, tl.int32), mask=evict)
    else:
        tl.store(homes.mapping + old, homes.gpu_slots + t.dest, mask=evict)
        # A row that becomes a home copies nothing (the slot's own word is rewritten at commit,
        # before any other call can read it).
        tl.store(homes.copy_slot + t.dest, tl.full(t.j.shape, -1, tl.int32), mask=t.popping)
        # A clean victim's row (its copy: ``dest``) leaves the free list from wherever it sat. When
        # it popped a row, that row, unused, takes its place (when it fills, commit puts its miss's
        # row there).
        refill = evict & t.refill
        hole = tl.load(homes.cpu_pos + t.dest, mask=refill, other=0)
        tl.store(homes.cpu_free + hole, t.cpu_row, mask=refill)
        tl.store(homes.cpu_pos + t.cpu_row, hole, mask=refill)
        # Bytes out (the copies) and clean evictions, in one two-lane atomic.
        pair = tl.arange(0, 2)
        n_clean = tl.sum((evict & t.clean).to(tl.int64), axis=0)
        n_dirty = tl.sum((evict & ~t.clean).to(tl.int64), axis=0)
        added = tl.where(pair == 0, n_dirty * group_row_bytes, n_clean)
        word = tl.where(pair == 0, K.S_BYTES_OUT, K.S_CLEAN)
        tl.atomic_add(stats_ptr + word, added, mask=added > 0, sem="relaxed")
    tl.store(homes.owner + t.v, tl.full(t.j.shape, -1, tl.int32), mask=evict)


@triton.jit
def _bring_in(
    t,
    rows,
    G,
    in_lo,
    in_hi,
    new_rows_ptr,
    n_new,
    write_layer,
    fetched_ptr,
    fetch_row_ptr,
    WRITE: tl.constexpr,
    NEW: tl.constexpr,
    CACHE: tl.constexpr,
    VECS: tl.constexpr,
    UNIT: tl.constexpr,
    UNIT_BYTES: tl.constexpr,
):
    """Phase ``in`` (data): each miss's rows, layers ``[in_lo, in_hi)`` of the group, into its GPU
    slot (or, a written entry with no slot, its CPU row): from its CPU home, a buffer's fetched
    rows, or zeros (never written); a new entry's written layer (a write's, or a prepare's new
    token: positions below ``n_new``) from the caller's rows. A new entry given a copy stores the
    same rows, zeros included, in its copy's row."""
    vm = (tl.arange(0, VECS) < rows.n_vec)[None, :, None]
    from_cpu = (t.live & (t.src >= G))[:, None, None] & vm
    src2, _ = unit_offsets((t.src - G).to(tl.int64), rows.n_vec, VECS, UNIT)
    to_gpu = t.has_slot[:, None, None] & vm
    # Only a new entry's rows go to a CPU row at ``in`` (a prepare gives every miss a slot): the
    # row the plan named (``copy``), its home when it has no slot, else its copy's row.
    to_cpu = (t.copy >= 0)[:, None, None] & vm
    g2, _ = unit_offsets(t.v.to(tl.int64), rows.n_vec, VECS, UNIT)
    c2, _ = unit_offsets(t.copy.to(tl.int64), rows.n_vec, VECS, UNIT)
    if NEW:
        # (a write's misses are all new: testing the position too cost its exact LRU variant 16 B of
        # spill, sm_90)
        if WRITE:
            is_new = t.live[:, None, None]
        else:
            is_new = (t.live & (t.pos < n_new))[:, None, None]
        p2, _ = unit_offsets(t.pos.to(tl.int64), rows.n_vec, VECS, UNIT)
        new_row = load_units(new_rows_ptr, p2, is_new & (to_gpu | to_cpu), UNIT, UNIT_BYTES)
    if CACHE:  # rows fetched from their home ranks, every layer of the group: miss j's is row
        # fetch_row[j] (an all-gather's output is in home order, not miss order)
        f_row = tl.load(fetch_row_ptr + t.j, mask=t.has_slot, other=0).to(tl.int64)
    for layer in range(in_lo, in_hi):
        if CACHE:
            f2, _ = unit_offsets(f_row * rows.layers + layer, rows.n_vec, VECS, UNIT)
            row = load_units(fetched_ptr, f2, to_gpu, UNIT, UNIT_BYTES)
        else:
            row = load_units(rows.cpu + layer * rows.cpu_stride, src2, from_cpu, UNIT, UNIT_BYTES)
        if NEW:
            is_written = is_new & ((tl.zeros(new_row.shape, tl.int32) + layer) == write_layer)
            row = tl.where(is_written, new_row, row)
        store_units(rows.gpu + layer * rows.gpu_stride, g2, row, to_gpu, UNIT, UNIT_BYTES)
        if NEW:
            store_units(rows.cpu + layer * rows.cpu_stride, c2, row, to_cpu, UNIT, UNIT_BYTES)


@triton.jit
def _commit(t, homes, CACHE: tl.constexpr, WRITE: tl.constexpr, NEW: tl.constexpr):
    """Phase ``commit`` (mapping): misses live where their rows are; each miss from the CPU leaves
    its row, now its copy, where the plan put it in the free list (``push``), and so does a new
    entry its copy's row (a new entry never comes from the CPU)."""
    G = homes.gpu_slots
    tl.store(homes.mapping + t.address, tl.where(t.has_slot, t.v, G + t.cpu_row), mask=t.live)
    tl.store(homes.owner + t.v, t.address.to(tl.int32), mask=t.has_slot)
    if not CACHE:
        # the row that rejoins the list holding its entry's bytes (the plan placed it: ``push``)
        joins = t.live & (t.push >= 0)
        row = t.src - G
        if WRITE:
            row = t.copy
        elif NEW:
            row = tl.where(t.src >= G, row, t.copy)
        tl.store(homes.cpu_free + t.push, row, mask=joins)
        tl.store(homes.cpu_pos + row, t.push, mask=joins)
        tl.store(homes.copy_slot + row, t.v, mask=joins & t.has_slot)
        tl.store(homes.copy_row + t.v, tl.where(joins, row, -1), mask=t.has_slot)


@triton.jit
def _commit_buckets(t, buckets_of, rnd, rnd_bucket):
    """Commit under PB-LRU: a slot taken from a bucket leaves it (the round's end is processed: ref
    is rnd + 1), and every slot that receives an entry joins the current round's bucket (the plan
    took the round's bucket: a 64-bit remainder is a called routine, whose calling convention
    spilled live registers here)."""
    b = buckets_of
    taken = t.has_slot & t.popping
    stamp = tl.load(b.stamp + t.v, mask=taken, other=0)
    bucket = tl.where(rnd + 1 - stamp < b.R, stamp % b.R, b.R).to(tl.int64)
    buckets.clear_path(b.bits, bucket * b.words, b.levels, b.n_levels, t.v, taken)
    buckets.place(b.bits, b.words, b.levels, b.n_levels, b.stamp, rnd, rnd_bucket, t.v, t.has_slot)


# Not specialised: T, G, Qcap, L (short last group), write_layer, phase and in-layer bounds, layer0 (all
# vary per call or feed no vectorisable access), the plan's moves' capacity (grows with the scratch); the
# alignment of the caller's selection, rows and slots (any view) and of group g's rows of [groups, ...]
# state. Specialised: n_vec (vectors a row) and the layer strides (fixed per pool; rows move in
# UNIT-element vectors, 16 bytes where the launcher found them aligned), gpu_ptr/cpu_ptr (the whole
# pool's rows, offset by layer0 in the kernel so alignment never changes), scratch and fetched rows
# (whole allocations), constexprs. (Before: up to 30 apply variants in tests/test_compile_variants.py's
# serving loop; now 2.)
@triton.jit(
    do_not_specialize=[
        "T",
        "n_new",
        "G",
        "Qcap",
        "L",
        "write_layer",
        "first_phase",
        "last_phase",
        "in_lo",
        "in_hi",
        "layer0",
        "BW",
        "n_levels",
        "R",
        "C",
        "group_row_bytes",
        "cap",
        "homed_programs",
    ],
    do_not_specialize_on_alignment=[
        "sel_ptr",
        "new_ptr",
        "claims_ptr",  # (ULAKV_DEBUG: row g of [groups, G + C + 1] words, 8 or 16 B aligned by g)
        "map_ptr",
        "owner_ptr",
        "ver_ptr",
        "q_slot_ptr",
        "q_ver_ptr",
        "cpu_free_ptr",
        "cpu_pos_ptr",
        "copy_slot_ptr",
        "copy_row_ptr",
        "rows_ptr",
        "slots_ptr",
        "gctl_ptr",
        "bits_ptr",
        "stamp_ptr",
    ],
)
def apply_kernel(
    sel_ptr,
    new_ptr,
    T,
    n_new,
    G,
    home_ptr,
    flags_ptr,
    miss_rank_ptr,
    hit_rank_ptr,
    first_pos_ptr,
    ctl_ptr,
    map_ptr,
    owner_ptr,
    ver_ptr,
    q_slot_ptr,
    q_ver_ptr,
    Qcap,
    cpu_free_ptr,
    chunk_off_ptr,
    gpu_ptr,
    cpu_ptr,
    L,
    gpu_layer_stride,
    cpu_layer_stride,
    n_vec,
    rows_ptr,
    write_layer,
    slots_ptr,
    first_phase,
    last_phase,
    in_lo,
    in_hi,
    fetched_ptr,
    fetch_row_ptr,
    layer0,
    gctl_ptr,
    bits_ptr,
    BW,
    lvl_ptr,
    n_levels,
    stamp_ptr,
    R,
    cpu_pos_ptr,
    copy_slot_ptr,
    copy_row_ptr,
    slot_of_ptr,
    moves_ptr,
    cap,
    C,
    stats_ptr,
    group_row_bytes,
    ring_ptr,
    ring_blocks_ptr,
    homed_programs,
    claims_ptr,
    WRITE: tl.constexpr,
    NEW: tl.constexpr,
    POLICY: tl.constexpr,
    CHUNK: tl.constexpr,
    ROWS: tl.constexpr,
    ELEMS: tl.constexpr,
    VECS: tl.constexpr,
    UNIT: tl.constexpr,
    UNIT_BYTES: tl.constexpr,
    CACHE: tl.constexpr,
    DEBUG: tl.constexpr,
):
    # Three kinds of program. The first ``workers`` are a persistent grid, no more than the SMs
    # hold at once: each strides over the work the plan counted (read here, on the device), ROWS
    # misses a step, then the ring blocks of a compacting call. They come first because a GPU
    # starts a launch's programs in order, and the misses' rows over PCIe are the launch's longest
    # work: behind 6,144 element programs (batch 256 x 3 x 2048) they started 15 waves late (396
    # apply programs resident on an H200, ``grid.FOOTPRINTS``). The next
    # ``element_programs`` serve ELEMS elements each: their slots (a prepare) and LRU appends (exact
    # LRU), work the call's size sets. In a write, the last ``homed_programs`` store the rows of
    # entries homed before it, ROWS rows a step. (A grid sized by the call launched a worker per
    # ROWS elements, 196,608 at batch 256 x 3 x 2048, most with no miss to move; the write's homed
    # rows have programs of their own: in the workers' loop their hoisted addresses spilled 24 B
    # at 128 registers.)
    pid = tl.program_id(0)
    # Layer offsets in int64: 4 layers x 5 M CPU rows x 164 words already passes 2**31.
    gpu_layer_stride = gpu_layer_stride.to(tl.int64)
    cpu_layer_stride = cpu_layer_stride.to(tl.int64)
    # The group's first layer, here rather than in a view: a view's alignment would change with the
    # group (layer0 x (G + 1) x W words) and compile a variant each; this keeps the pool's alignment.
    gpu_ptr += layer0.to(tl.int64) * gpu_layer_stride
    cpu_ptr += layer0.to(tl.int64) * cpu_layer_stride
    # The plan's control words, in one load: each separate scalar load is a dependent step.
    ctl = tl.load(ctl_ptr + tl.arange(0, K.CTL_BLOCK), mask=tl.arange(0, K.CTL_BLOCK) < K.CTL_WORDS, other=0)
    status = control_word(ctl, K.E_LAST_STATUS)
    run_out = (first_phase <= K.PH_OUT) & (last_phase >= K.PH_OUT)
    run_evict = (first_phase <= K.PH_EVICT) & (last_phase >= K.PH_EVICT)
    run_in = (first_phase <= K.PH_IN) & (last_phase >= K.PH_IN)
    run_commit = (first_phase <= K.PH_COMMIT) & (last_phase >= K.PH_COMMIT)
    k_free = control_word(ctl, K.E_KFREE)
    V = control_word(ctl, K.E_VICTIMS)
    element_programs = 0
    if (not WRITE) or (POLICY == K.EXACT_LRU):
        element_programs = (T + ELEMS - 1) // ELEMS
    # Workers first in launch order: program w < workers is worker w; the others follow as the
    # element and homed-row programs, in that order.
    workers = tl.num_programs(0) - element_programs - homed_programs
    pid = tl.where(pid < workers, pid + element_programs + homed_programs, pid - workers)
    if pid < element_programs:
        e0 = pid.to(tl.int64) * ELEMS
        pos = e0 + tl.arange(0, ELEMS)
        inb = pos < T
        if status != 0:
            if not WRITE:
                if run_evict:  # (a prepare's new tokens, its first n_new elements, have no slot out)
                    out = inb & (pos >= n_new)
                    tl.store(slots_ptr + pos - n_new, tl.full((ELEMS,), -1, tl.int32), mask=out)
        else:
            _serve_elements(
                pos,
                inb,
                n_new,
                e0 // CHUNK,
                run_evict,
                run_commit,
                V,
                flags_ptr,
                home_ptr,
                first_pos_ptr,
                chunk_off_ptr,
                miss_rank_ptr,
                hit_rank_ptr,
                moves_ptr,
                cap,
                slots_ptr,
                slot_of_ptr,
                ver_ptr,
                q_slot_ptr,
                q_ver_ptr,
                Qcap,
                WRITE,
                POLICY,
                CHUNK,
            )
    elif pid < element_programs + homed_programs:
        if WRITE & (status == 0) & run_in:  # a write's rows of entries homed before it, where they live
            tile = (pid - element_programs).to(tl.int64)
            layer_bytes = group_row_bytes // L
            while tile < (T + ROWS - 1) // ROWS:
                _write_homed(
                    tile * ROWS,
                    T,
                    G,
                    flags_ptr,
                    home_ptr,
                    copy_row_ptr,
                    rows_ptr,
                    gpu_ptr,
                    cpu_ptr,
                    write_layer,
                    gpu_layer_stride,
                    cpu_layer_stride,
                    n_vec,
                    stats_ptr,
                    layer_bytes,
                    VECS,
                    UNIT,
                    UNIT_BYTES,
                    ROWS,
                )
                tile += homed_programs
    elif status == 0:
        worker = pid - element_programs - homed_programs
        M = control_word(ctl, K.E_MISSES)
        miss_tiles = (M + ROWS - 1) // ROWS
        rows = Rows(gpu_ptr, cpu_ptr, gpu_layer_stride, cpu_layer_stride, n_vec, L)
        homes = Homes(map_ptr, owner_ptr, cpu_free_ptr, cpu_pos_ptr, copy_slot_ptr, copy_row_ptr, G, C)
        rnd = tl.load(gctl_ptr + K.G_ROUND)  # PB-LRU's round (the plan started it)
        rnd_bucket = control_word(ctl, K.E_ROUND_BUCKET)
        ring_blocks = control_word(ctl, K.E_RING_BLOCKS)  # exact LRU's compaction (after the loop)
        ring_at = control_word(ctl, K.E_RING_AT)
        ring_dropped = control_word(ctl, K.E_RING_DROPPED)
        # Worker w moves the misses' tiles w, w + workers, ...: each tile's moves are a column of
        # the plan (``decide``), so a tile needs nothing from the one before it.
        tile = worker.to(tl.int64)
        while tile < miss_tiles:
            j = tile * ROWS + tl.arange(0, ROWS)
            t = _miss_tile(
                j, j < M, k_free, moves_ptr, cap, sel_ptr, new_ptr, n_new, home_ptr, NEW, NEW and not WRITE
            )
            # Data, mapping, data, mapping (a buffer drops its victims: no out phase).
            if run_out and not CACHE:
                _out(t, rows, owner_ptr, VECS, UNIT, UNIT_BYTES)
            tl.debug_barrier()  # the victims' rows out before their mapping moves
            if run_evict:
                if DEBUG:
                    _claim_homes(t, claims_ptr, G, control_word(ctl, K.E_EPOCH), ctl_ptr, NEW)
                _evict(t, homes, stats_ptr, group_row_bytes, CACHE)
            tl.debug_barrier()  # the slots unowned before the misses' rows come in
            if run_in:
                _bring_in(
                    t,
                    rows,
                    G,
                    in_lo,
                    in_hi,
                    rows_ptr,
                    n_new,
                    write_layer,
                    fetched_ptr,
                    fetch_row_ptr,
                    WRITE,
                    NEW,
                    CACHE,
                    VECS,
                    UNIT,
                    UNIT_BYTES,
                )
            tl.debug_barrier()  # the misses' rows in before their mapping moves
            if run_commit:
                _commit(t, homes, CACHE, WRITE, NEW)
                if POLICY == K.PBLRU:
                    bitmaps = Buckets(bits_ptr, BW, lvl_ptr, n_levels, stamp_ptr, R)
                    _commit_buckets(t, bitmaps, rnd, rnd_bucket)
            tile += workers
        if POLICY == K.EXACT_LRU:
            if run_commit:
                # Ring blocks of a compacting call (commit): a block's live pairs land before any
                # append (the plan put the new tail after them), and no other program reads or
                # writes those positions.
                b = worker.to(tl.int64)
                while b < ring_blocks:
                    ring_block_copy(
                        b,
                        ring_at,
                        ring_dropped,
                        ring_ptr,
                        ring_blocks_ptr,
                        q_slot_ptr,
                        q_ver_ptr,
                        Qcap,
                        CHUNK,
                    )
                    b += workers


@triton.jit
def _serve_elements(
    pos,
    inb,
    n_new,
    chunk,
    run_evict,
    run_commit,
    V,
    flags_ptr,
    home_ptr,
    first_pos_ptr,
    chunk_off_ptr,
    miss_rank_ptr,
    hit_rank_ptr,
    moves_ptr,
    cap,
    slots_ptr,
    slot_of_ptr,
    ver_ptr,
    q_slot_ptr,
    q_ver_ptr,
    Qcap,
    WRITE: tl.constexpr,
    POLICY: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Elements ``pos`` (of chunk ``chunk``): their GPU slots at ``evict`` (a prepare's output, but
    for its first ``n_new``, new tokens; exact LRU keeps them for commit), and under exact LRU their
    appends to the LRU ring at ``commit``."""
    if run_evict:
        slot = _slot_of(
            pos, inb, CHUNK, flags_ptr, home_ptr, first_pos_ptr, chunk_off_ptr, miss_rank_ptr, moves_ptr, cap
        )
        if not WRITE:
            tl.store(slots_ptr + pos - n_new, slot, mask=inb & (pos >= n_new))
        if POLICY == K.EXACT_LRU:
            tl.store(slot_of_ptr + pos, slot, mask=inb)  # for commit's recency
    tl.debug_barrier()  # the slots stored above, before commit's loads of them
    if (POLICY == K.EXACT_LRU) & run_commit:  # PB-LRU recorded recency in lookup and in commit
        # The evict phase found them (this program, in this or an earlier launch).
        slot = tl.load(slot_of_ptr + pos, mask=inb, other=-1)
        flags = tl.load(flags_ptr + pos, mask=inb, other=0)
        appended = ((flags & K.F_FIRST) != 0) & (slot >= 0)
        # The chunk appends its first occurrences that end on the GPU, in order: its hits, and its
        # misses up to the last that took a slot (misses m_off + r with r < V - m_off). An
        # element's place among them: the hits before it, and the misses before it that took a slot.
        off = chunk_off_ptr + chunk * K.OFF_WORDS
        with_slot = tl.maximum(V - tl.load(off + K.O_MISS), 0)
        ahead = tl.load(hit_rank_ptr + pos, mask=appended, other=0)
        ahead += tl.minimum(tl.load(miss_rank_ptr + pos, mask=appended, other=0), with_slot)
        # (the chunk's first ring index; a call appends at most G <= Qcap / 2 pairs)
        q_pos = K.wrap(tl.load(off + K.O_QUEUE) + ahead, Qcap)
        version = tl.load(ver_ptr + slot, mask=appended, other=0) + 1
        tl.store(ver_ptr + slot, version, mask=appended)
        tl.store(q_slot_ptr + q_pos, slot, mask=appended)
        tl.store(q_ver_ptr + q_pos, version, mask=appended)


@triton.jit
def _slot_of(
    pos,
    inb,
    CHUNK: tl.constexpr,
    flags_ptr,
    home_ptr,
    first_pos_ptr,
    chunk_off_ptr,
    miss_rank_ptr,
    moves_ptr,
    cap,
):
    """GPU slot of each element after this call: its home (a hit), the slot the plan gave its first
    occurrence (a miss: ``j``, its index among the call's misses, is its chunk's first plus its rank
    in the chunk), or -1 (padding, or a write's entry that stays on the CPU)."""
    flags = tl.load(flags_ptr + pos, mask=inb, other=0)
    home = tl.load(home_ptr + pos, mask=inb, other=-1)
    on_gpu = (flags & K.F_GPU) != 0
    moved = (flags & K.F_MOVED) != 0
    p0 = tl.load(first_pos_ptr + pos, mask=moved, other=0)
    j0 = tl.load(chunk_off_ptr + (p0 // CHUNK) * K.OFF_WORDS + K.O_MISS, mask=moved, other=0)
    j0 += tl.load(miss_rank_ptr + p0, mask=moved, other=0)
    given = tl.load(moves_ptr + K.MV_SLOT * cap + j0, mask=moved, other=-1)
    return tl.where(on_gpu, home, tl.where(moved, given, -1))


@triton.jit
def _write_homed(
    e0,
    T,
    G,
    flags_ptr,
    home_ptr,
    copy_row_ptr,
    rows_ptr,
    gpu_ptr,
    cpu_ptr,
    write_layer,
    gpu_layer_stride,
    cpu_layer_stride,
    n_vec,
    stats_ptr,
    layer_bytes,
    VECS: tl.constexpr,
    UNIT: tl.constexpr,
    UNIT_BYTES: tl.constexpr,
    ROWS: tl.constexpr,
):
    """A write's rows for the elements ``e0 .. e0 + ROWS`` whose entries were homed before the call,
    stored where they live (padding rows go to the dummy GPU slot ``G``, so the store needs no branch).
    An entry on the GPU whose copy no pop of the call takes (``F_THROUGH``, the classify's) writes
    through to the copy, which stays intact; any other copy it had no longer matches and ends.
    Rows written through count a layer's row out each: one atomic a tile that has any (a count
    carried over the program's tiles spilled 16 B in exact LRU's write variant, sm_90)."""
    g_row = gpu_ptr + write_layer * gpu_layer_stride
    c_row = cpu_ptr + write_layer * cpu_layer_stride
    e = e0 + tl.arange(0, ROWS)
    em = e < T
    f = tl.load(flags_ptr + e, mask=em, other=0)
    h = tl.load(home_ptr + e, mask=em, other=0)
    to_gpu = em & (((f & K.F_GPU) != 0) | ((f & K.F_PAD) != 0))
    to_cpu = em & ((f & K.F_CPU) != 0)
    h = tl.where((f & K.F_PAD) != 0, G, h)
    vm = (tl.arange(0, VECS) < n_vec)[None, :, None]
    e2, _ = unit_offsets(e, n_vec, VECS, UNIT)
    row = load_units(rows_ptr, e2, em[:, None, None] & vm, UNIT, UNIT_BYTES)
    h2, _ = unit_offsets(h.to(tl.int64), n_vec, VECS, UNIT)
    store_units(g_row, h2, row, to_gpu[:, None, None] & vm, UNIT, UNIT_BYTES)
    on_gpu = em & ((f & K.F_GPU) != 0)
    through = on_gpu & ((f & K.F_THROUGH) != 0)
    copy = tl.load(copy_row_ptr + h, mask=through, other=0)
    tl.store(copy_row_ptr + h, tl.full((ROWS,), -1, tl.int32), mask=on_gpu & ~through)
    # A CPU home or a copy: one store (an element is one or the other, or neither)
    h = tl.where(through, G + copy, h)
    hc2, _ = unit_offsets((h - G).to(tl.int64), n_vec, VECS, UNIT)
    store_units(c_row, hc2, row, (to_cpu | through)[:, None, None] & vm, UNIT, UNIT_BYTES)
    n = tl.sum(through.to(tl.int64), axis=0)
    tl.atomic_add(stats_ptr + K.S_BYTES_OUT, n * layer_bytes, mask=n > 0, sem="relaxed")


def apply_grid(st, T: int, write: bool, tiling: Tiling) -> tuple[tuple[int], int]:
    """Apply's grid and how many of its programs store a write's homed rows. First the persistent
    workers for the misses and the ring's blocks; then one program per ``tiling.elements``
    elements when there is element work (a prepare's slots, exact LRU's appends); in a write, last,
    programs for its T rows, ``tiling.rows`` a step. Each persistent kind is as many programs as
    the SMs hold of apply at once (``grid.program_slots``), or fewer when the call cannot have that
    much work. Sized on the host from the call's shape alone: no read-back."""
    slots = program_slots(st.ctl.device, "apply_kernel")
    element_programs = K.cdiv(T, tiling.elements) if (not write or st.policy == K.EXACT_LRU) else 0
    homed_programs = min(K.cdiv(T, tiling.rows), slots) if write else 0
    work = K.cdiv(T, tiling.rows)  # a call moves at most T misses
    if st.policy == K.EXACT_LRU:  # and, compacting, the ring's blocks
        work += K.cdiv(st.q_slot.shape[1], K.CHUNK)
    return (element_programs + homed_programs + min(work, slots),), homed_programs


def apply(
    st,
    g: int,
    scratch,
    flat,
    layers: range,
    rows,
    write_layer: int,
    slots,
    phases: tuple[int, int] = ALL_PHASES,
    in_layers: range | None = None,
    fetched: torch.Tensor | None = None,
    fetch_rows: torch.Tensor | None = None,
    new: torch.Tensor | None = None,
) -> int:
    """Launch apply for group ``g`` (layers ``layers``): the phases ``phases`` (first, last), moving
    the group's layers ``in_layers`` (default all) in the ``in`` phase. ``flat`` is the call's
    addresses: a write's, or a prepare's selection, after its ``new`` tokens (``NewRows``, flat
    addresses, read through their own pointer). A write has ``rows`` (packed ``[T, W]``); a
    prepare has ``slots`` (int32, packed) for its selection and the new tokens' ``rows``
    (``[n_new, W]``; otherwise no ``rows``). A buffer (``st.CACHE``)
    takes its misses' rows from ``fetched`` (packed ``[rows, layers, W]``; miss ``j``'s is row
    ``fetch_rows[j]``, int64) and drops its victims. Rows are in the unit ``as_words`` gives the
    pool's own rows (words when the width is a multiple of 4, else bytes); ``ulakv.kernels.operands``
    brings a caller's tensors to it. Returns launches."""
    if st.CACHE and (fetched is None or fetch_rows is None) and rows is None:
        raise ValueError("a buffer's apply needs the fetched rows and where each miss's is")
    tokens = new  # (``new`` below: whether the call has new entries' rows)
    n_new = 0 if tokens is None else tokens.numel()
    T = n_new + flat.numel()
    # The whole pool's rows (the kernel adds the group's layer offset), moved in the widest vectors
    # they allow (16 B for 656-byte rows); a state's own, worked out once.
    gpu, cpu, unit = st.row_words
    write = rows is not None and n_new == 0
    new = rows is not None  # new entries, whose rows the caller gives: a write's, or n_new of them
    W = gpu.shape[-1]
    in_layers = in_layers if in_layers is not None else layers
    # One pointer type for fetched rows whatever the call: a stand-in (int32 scratch, never read: the
    # plan fetches nothing or was refused) in the pool's row unit, so a byte-row buffer compiles no
    # variant of its own for a step without misses.
    fetched = (fetched if fetched is not None else scratch.victims).view(gpu.dtype)
    fetch_rows = fetch_rows if fetch_rows is not None else scratch.victims
    tiling = TILING
    rows_per_tile = tiling.rows
    # A caller's rows or fetched rows that sit off the vectors' alignment (a view at an odd
    # offset) are copied once, so that the pool keeps one variant.
    if new and not aligned_to(rows, unit):
        rows = rows.clone()
    if st.CACHE and not aligned_to(fetched, unit):
        fetched = fetched.clone()
    vectors, vecs = vectors_per_row(W, unit)
    grid, homed_programs = apply_grid(st, T, write, tiling)
    compiled = apply_kernel[grid](
        sel_ptr=flat,
        new_ptr=flat if tokens is None else tokens,
        T=T,
        n_new=T if write else n_new,
        owner_ptr=st.owner[g],
        gpu_ptr=gpu,
        cpu_ptr=cpu,
        L=len(layers),
        gpu_layer_stride=gpu.stride(0),
        cpu_layer_stride=cpu.stride(0),
        n_vec=vectors,
        rows_ptr=rows if new else scratch.victims,
        write_layer=write_layer - layers.start,
        slots_ptr=scratch.victims if write else slots,
        first_phase=phases[0],
        last_phase=phases[1],
        in_lo=in_layers.start - layers.start,
        in_hi=in_layers.stop - layers.start,
        fetched_ptr=fetched,
        fetch_row_ptr=fetch_rows,
        layer0=layers.start,
        slot_of_ptr=scratch.slot_of,
        group_row_bytes=len(layers) * st.gpu_data.shape[-1],
        homed_programs=homed_programs,
        **st.group_kwargs(g),
        home_ptr=scratch.home,
        flags_ptr=scratch.flags,
        first_pos_ptr=scratch.first_pos,
        miss_rank_ptr=scratch.miss_rank,
        hit_rank_ptr=scratch.hit_rank,
        chunk_off_ptr=scratch.chunk_off,
        moves_ptr=scratch.moves,
        cap=scratch.capacity,
        ring_ptr=scratch.ring,
        ring_blocks_ptr=scratch.ring_blocks,
        claims_ptr=st.home_claims[g if st.claims_homes else 0],
        WRITE=write,
        NEW=new,
        POLICY=st.policy,
        CHUNK=K.CHUNK,
        ROWS=rows_per_tile,
        ELEMS=tiling.elements,
        VECS=vecs,
        UNIT=unit,
        UNIT_BYTES=unit * gpu.element_size(),
        CACHE=st.CACHE,
        DEBUG=st.claims_homes,
        num_warps=APPLY_WARPS,
    )
    if gpu.device.type == "cuda":
        learn("apply_kernel", compiled)  # its workers follow the registers this Triton gave it
    return 1


def apply_reference(
    st,
    g: int,
    scratch,
    flat,
    layers: range,
    rows,
    write_layer: int,
    slots,
    phases: tuple[int, int] = ALL_PHASES,
    in_layers: range | None = None,
    fetched: torch.Tensor | None = None,
    fetch_rows: torch.Tensor | None = None,
    new: torch.Tensor | None = None,
) -> None:
    """Plain-Python twin of :func:`apply`: one phase, one miss, one row, one element at a time
    (over one list of elements: the new tokens, then the selection)."""
    n_new = 0 if new is None else new.numel()
    flat = flat if new is None else torch.cat([new.long(), flat.long()])
    T, G, C, Qcap = flat.numel(), st.gpu_slots, K.CHUNK, st.q_slot.shape[1]
    write = rows is not None and n_new == 0
    new = T if write else n_new  # the leading elements whose rows the caller gives
    runs = lambda phase: phases[0] <= int(phase) <= phases[1]
    if int(st.ctl[int(K.E_LAST_STATUS)]) != 0:
        if not write and runs(K.PH_EVICT):
            slots[: T - n_new] = -1
        return
    k_free = int(st.ctl[int(K.E_KFREE)])
    gpu, cpu = st.gpu_data[layers.start : layers.stop], st.cpu_data[layers.start : layers.stop]
    in_layers = in_layers if in_layers is not None else layers
    local = write_layer - layers.start
    new_rows = rows.view(torch.uint8).reshape(rows.shape[0], -1) if rows is not None else None
    stats, group_row_bytes = st.stats, len(layers) * st.gpu_data.shape[-1]
    moves = scratch.moves[:, : int(st.ctl[int(K.E_MISSES)])].cpu().tolist()
    maybe = lambda x: None if x < 0 else x

    def misses(c: int):
        """Chunk ``c``'s misses with what the plan decided for each: index, position, address,
        source home, GPU slot, CPU row popped, row that becomes a home at evict (None: none), where
        its CPU row joins the free list, whether its victim's bytes stay, whether its popped row
        takes the copy's place."""
        m_off = int(scratch.chunk_off[c, int(K.O_MISS)])
        for j in range(m_off, m_off + int(scratch.counts[c, int(K.C_NEED)])):
            p, v, row, dest, push, flags, copy = (moves[w][j] for w in range(K.MOVE_WORDS))
            clean, refill = bool(flags & int(K.MF_CLEAN)), bool(flags & int(K.MF_REFILL))
            yield (
                j,
                p,
                int(flat[p]),
                int(scratch.home[p]),
                maybe(v),
                maybe(row),
                maybe(dest),
                push,
                clean,
                refill,
                maybe(copy),
            )

    def slot_of(pos: int) -> int:
        flags, home = int(scratch.flags[pos]), int(scratch.home[pos])
        if flags & int(K.F_GPU):
            return home
        if flags & int(K.F_MOVED):
            p0 = int(scratch.first_pos[pos])
            j0 = int(scratch.chunk_off[p0 // C, int(K.O_MISS)]) + int(scratch.miss_rank[p0])
            return moves[int(K.MV_SLOT)][j0]
        return -1

    chunks = range(-(-T // C))
    for c in chunks:
        chunk = range(c * C, min(T, (c + 1) * C))
        if runs(K.PH_OUT) and not st.CACHE:
            for j, _, _, _, v, row, _, _, clean, _, _ in misses(c):
                if v is not None and j >= k_free and int(st.owner[g, v]) >= 0 and not clean:
                    cpu[:, row] = gpu[:, v]
        if runs(K.PH_EVICT):
            if st.claims_homes:  # ULAKV_DEBUG: the homes the moves write, each claimed once
                tag = int(st.ctl[int(K.E_EPOCH)])
                for _, _, _, _, v, row, _, _, _, _, copy in misses(c):
                    homes = [v] if v is not None else []
                    homes += [G + row] if row is not None else []
                    homes += [G + copy] if new and copy is not None and copy != row else []
                    for h in homes:
                        if int(st.home_claims[g, h]) == tag:
                            st.ctl[int(K.E_HOME_CLAIMS)] += 1
                        st.home_claims[g, h] = tag
            for j, _, _, _, v, row, dest, _, clean, refill, _ in misses(c):
                evicting = v is not None and j >= k_free
                old = int(st.owner[g, v]) if evicting else -1
                if st.CACHE:
                    if old >= 0:
                        st.mapping[g, old] = int(K.M_UNHOMED)
                        st.owner[g, v] = -1
                    continue
                if j < k_free:
                    continue
                st.copy_slot[g, dest] = -1
                if old >= 0:
                    st.mapping[g, old] = G + dest
                    st.owner[g, v] = -1
                    stats[int(K.S_CLEAN if clean else K.S_BYTES_OUT)] += 1 if clean else group_row_bytes
                    if refill:  # the popped row, unused, takes the copy's (dest's) place
                        hole = int(st.cpu_pos[g, dest])
                        st.cpu_free[g, hole] = row
                        st.cpu_pos[g, row] = hole
            for pos in chunk:
                if not write and pos >= n_new:
                    slots[pos - n_new] = slot_of(pos)
                if st.policy == K.EXACT_LRU:
                    scratch.slot_of[pos] = slot_of(pos)
        if runs(K.PH_IN):
            for j, p, _, src, v, row_popped, _, _, _, _, copy in misses(c):
                for layer in range(in_layers.start - layers.start, in_layers.stop - layers.start):
                    if st.CACHE:
                        row = (
                            fetched.view(torch.uint8)
                            .reshape(-1, len(layers), gpu.shape[-1])[int(fetch_rows[j]), layer]
                            .clone()
                        )
                    elif src >= G:
                        row = cpu[layer, src - G].clone()
                    else:
                        row = torch.zeros_like(cpu[layer, 0])
                    if p < new and layer == local:
                        row = new_rows[p].clone()
                    if v is not None:
                        gpu[layer, v] = row
                        if copy is not None:
                            cpu[layer, copy] = row
                    else:
                        cpu[layer, row_popped] = row
            if write:
                for pos in chunk:
                    flags, home = int(scratch.flags[pos]), int(scratch.home[pos])
                    if flags & int(K.F_PAD):
                        gpu[local, G] = new_rows[pos]
                    elif flags & int(K.F_GPU):
                        gpu[local, home] = new_rows[pos]
                        if flags & int(K.F_THROUGH):
                            cpu[local, int(st.copy_row[g, home])] = new_rows[pos]
                            stats[int(K.S_BYTES_OUT)] += group_row_bytes // len(layers)
                        else:
                            st.copy_row[g, home] = -1
                    elif flags & int(K.F_CPU):
                        cpu[local, home - G] = new_rows[pos]
        if runs(K.PH_COMMIT):
            bitmaps = PBLRUBits(st, g) if st.policy == K.PBLRU else None
            rnd = int(st.gctl[g, int(K.G_ROUND)])
            for j, _, a, src, v, row, _, push, _, _, copy in misses(c):
                # its row, now a copy, where the plan put it; or a new entry's copy row
                kept = src - G if src >= G and not st.CACHE else (copy if v is not None else None)
                if kept is not None:
                    st.cpu_free[g, push] = kept
                    st.cpu_pos[g, kept] = push
                    if v is not None:
                        st.copy_slot[g, kept] = v
                st.mapping[g, a] = v if v is not None else G + row
                if v is not None:
                    st.owner[g, v] = a
                    if not st.CACHE:
                        st.copy_row[g, v] = kept if kept is not None else -1
                    if bitmaps is not None:
                        if j >= k_free:  # taken from a bucket (not a free slot)
                            bitmaps.clear(v, ref=rnd + 1)
                        bitmaps.place(v, rnd)
            if bitmaps is not None:
                bitmaps.store()
            if st.policy == K.EXACT_LRU:
                q = int(scratch.chunk_off[c, int(K.O_QUEUE)])
                for pos in chunk:
                    slot = slot_of(pos)
                    if int(scratch.flags[pos]) & int(K.F_FIRST) and slot >= 0:
                        st.ver[g, slot] += 1
                        st.q_slot[g, q % Qcap] = slot
                        st.q_ver[g, q % Qcap] = st.ver[g, slot]
                        q += 1
    if runs(K.PH_COMMIT) and st.policy == K.EXACT_LRU:
        # A compacting call's live ring pairs, packed block by block by the classify, into place.
        at, dropped = int(st.ctl[int(K.E_RING_AT)]), int(st.ctl[int(K.E_RING_DROPPED)])
        for b in range(int(st.ctl[int(K.E_RING_BLOCKS)])):
            n, before = (int(x) for x in scratch.ring_blocks[b])
            for j in range(n):
                if before + j >= dropped:
                    packed = int(scratch.ring[b * C + j])
                    version = packed & 0xFFFFFFFF
                    st.q_slot[g, (at + before + j) % Qcap] = packed >> 32
                    st.q_ver[g, (at + before + j) % Qcap] = version - (version >> 31 << 32)
