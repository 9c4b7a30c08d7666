"""The exclusive tiered layout: every entry on the GPU or on the CPU, never both.

``TieredState`` holds every device tensor of a tiered pool; ``TieredRunner`` runs the kernels of one
``prepare`` or ``write`` in order (claim, classify + plan, apply: three launches) and of ``release`` and
``read``. Nothing here reads a device value on the host but ``miss_positions`` (a buffer sizes its
fetch with it; striped and offload pools synchronise by design).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import ClassVar

import torch

from .. import host_memory
from ..config import ExactLRU, PoolConfig
from ..errors import InvalidInputError, UlakvError
from ..frame import NewRows
from ..kernels import apply as apply_mod
from ..kernels import common as K
from ..kernels import gather as gather_mod
from ..kernels import lookup as lookup_mod
from ..kernels import operands, segments
from ..kernels import release as release_mod
from ..kernels.buckets import level_offsets
from ..kernels.rows import vector_unit
from ..transfer import Phase, TransferPlan


def _fill_stack(stack: torch.Tensor, count: int, position: torch.Tensor | None = None) -> None:
    """Free-slot stack whose top (highest index) is slot 0, so a fresh pool hands out 0, 1, 2...;
    ``position`` (if given) gets each slot's index in the stack."""
    stack.zero_()
    if count:
        stack[:, :count] = torch.arange(count - 1, -1, -1, dtype=stack.dtype, device=stack.device)
    if position is not None:
        position.zero_()
        if count:
            position[:, :count] = torch.arange(
                count - 1, -1, -1, dtype=position.dtype, device=position.device
            )


class _Tensors:
    """A dataclass whose every field is a tensor: list them, copy them."""

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def clone(self):
        return type(self)(**{k: v.clone() for k, v in self.tensors().items()})


def report_word(device: torch.device, words: int = 1) -> torch.Tensor:
    """The words refused calls' kernels report to (``kernels.common.report_refusal``), one a layer
    group, so that the host can say which group a refusal came from: host memory mapped for the
    device beside a GPU, so the host reads them with no copy and no wait."""
    if device.type == "meta":
        return torch.zeros(words, dtype=torch.int64, device=device)
    word = host_memory.allocate_tier((8 * words,), pin=device.type == "cuda", what="the refusal report")
    return word.view(torch.int64)


@dataclass(eq=False)
class TieredState(_Tensors):
    """All device state of a tiered pool. Row ``g`` of each ``[groups, ...]`` tensor is group ``g``."""

    mapping: torch.Tensor  # int32 [groups, addresses]: see ulakv.address_space
    owner: torch.Tensor  # int32 [groups, G]: address homed in each GPU slot, -1 if free
    ver: torch.Tensor  # int32 [groups, G]: bumped on every touch; stale LRU pairs differ
    q_slot: torch.Tensor  # int32 [groups, 2G]: LRU ring, oldest at gctl[G_HEAD]
    q_ver: torch.Tensor  # int32 [groups, 2G]
    gpu_free: torch.Tensor  # int32 [groups, G]: stack of free GPU slots
    # Free CPU rows (C includes staging): a deque in a ring, ``gctl[G_CPU_BOT]`` its bottom index,
    # ``gctl[G_CPU_FREE]`` its length. Pops take the top; rows freed by a release go on top; the row
    # a swap-in leaves, which still holds the entry's bytes (a *copy*), goes to the bottom, and so
    # does the plain row a write fills with a new entry's copy (``gctl[G_CPU_PLAIN]``: plain rows on
    # top), so plain free rows are handed out first and copies survive longest.
    cpu_free: torch.Tensor  # int32 [groups, max(C, 1)]
    cpu_pos: torch.Tensor  # int32 [groups, max(C, 1)]: index of each free row in cpu_free
    copy_slot: torch.Tensor  # int32 [groups, max(C, 1)]: GPU slot whose entry a free row copies, -1
    copy_row: torch.Tensor  # int32 [groups, G]: free row copying the slot's entry, -1 (both must agree)
    stamp: torch.Tensor  # int32 [groups, G]: PB-LRU, round a slot was last used
    bits: torch.Tensor  # int32 [groups, (buckets + 1) * bucket_words]: PB-LRU bitmaps + summaries
    levels: torch.Tensor  # int64 [levels + 1]: word offset of each summary level in a bucket
    gctl: torch.Tensor  # int64 [groups, GCTL_WORDS]
    ctl: torch.Tensor  # int64 [CTL_WORDS]: call-scoped scratch and the pending error
    stats: torch.Tensor  # int64 [STATS_WORDS]: cumulative counters
    claim: torch.Tensor  # int64 [addresses]: dedup scratch, tagged by epoch
    mark: torch.Tensor  # int64 [G]: protection scratch, tagged by epoch
    gpu_data: torch.Tensor  # uint8 [layers, G + 1, bytes]; row G is the dummy slot
    cpu_data: torch.Tensor  # uint8 [layers, C + 1, bytes]; pinned host memory beside a GPU
    # int64 [groups]: each group's latest refused prepare or write, in host memory the device
    # writes (deferred.py)
    report: torch.Tensor
    # ULAKV_DEBUG: int64 [groups, G + C + 1], the tag of the call that last claimed each GPU slot
    # (then each CPU row) its moves write (``apply._claim_homes``); otherwise a [1, 1] stand-in.
    home_claims: torch.Tensor

    # A buffer of entries homed on other ranks (``ulakv.layouts.striped``) drops its victims and
    # fetches its misses; a tiered pool's own state swaps them with its CPU tier.
    CACHE = False

    # State that says where entries live and what the policy knows: what a failed call must not
    # change, and what a pool with no requests resets to.
    RESIDENCY = (
        "mapping",
        "owner",
        "ver",
        "q_slot",
        "q_ver",
        "gpu_free",
        "cpu_free",
        "cpu_pos",
        "copy_slot",
        "copy_row",
        "stamp",
        "bits",
        "gctl",
    )

    @classmethod
    def allocate(
        cls,
        config: PoolConfig,
        gpu_data: torch.Tensor | None = None,
        addresses: int | None = None,
        claim_homes: bool = False,
    ) -> TieredState:
        """A fresh state for ``config`` (a ``Tiered`` layout). ``gpu_data`` (uint8 ``[layers, G + 1,
        bytes]``, possibly a view into a larger buffer) replaces the GPU rows it would allocate;
        ``addresses`` widens the address space beyond the layout's capacity (a buffer's);
        ``claim_homes`` (ULAKV_DEBUG) makes apply claim every home its moves write."""
        layout, device = config.layout, config.torch_device
        # CPU rows: the admitted tier plus staging rows, all on one free stack.
        G, C, groups = layout.gpu_slots, layout.cpu_slots + layout.cpu_staging, config.num_groups
        N, B, L = addresses or layout.capacity, config.entry.bytes_per_layer, config.num_layers
        if gpu_data is not None and tuple(gpu_data.shape) != (L, G + 1, B):
            raise ValueError(f"gpu_data must be [{L}, {G + 1}, {B}], got {tuple(gpu_data.shape)}")
        if gpu_data is not None:
            operands.as_words(gpu_data)  # the kernels view it as words: raises now, not mid-call
        i32 = dict(dtype=torch.int32, device=device)
        i64 = dict(dtype=torch.int64, device=device)
        pin = device.type == "cuda"
        lru = isinstance(layout.policy, ExactLRU)
        # Each policy's own state; the other policy's arguments get one-word stand-ins.
        ring = 2 * G if lru else 1
        offsets = [0, 1] if lru else level_offsets(G)
        bucket_words = offsets[-1]
        buckets = 0 if lru else layout.policy.num_buckets
        state = cls(
            mapping=torch.empty((groups, N), **i32),
            owner=torch.empty((groups, G), **i32),
            ver=torch.empty((groups, G), **i32),
            q_slot=torch.empty((groups, ring), **i32),
            q_ver=torch.empty((groups, ring), **i32),
            stamp=torch.empty((groups, G if not lru else 1), **i32),
            bits=torch.empty((groups, (buckets + 1) * bucket_words), **i32),
            levels=torch.tensor(offsets, **i64),
            gpu_free=torch.empty((groups, G), **i32),
            cpu_free=torch.empty((groups, max(C, 1)), **i32),
            cpu_pos=torch.empty((groups, max(C, 1)), **i32),
            copy_slot=torch.empty((groups, max(C, 1)), **i32),
            copy_row=torch.empty((groups, G), **i32),
            gctl=torch.empty((groups, K.GCTL_WORDS), **i64),
            ctl=torch.zeros(K.CTL_WORDS, **i64),
            stats=torch.zeros(K.STATS_WORDS, **i64),
            claim=torch.zeros(N, **i64),
            mark=torch.zeros(G, **i64),
            gpu_data=gpu_data
            if gpu_data is not None
            else torch.zeros((L, G + 1, B), dtype=torch.uint8, device=device),
            cpu_data=host_memory.allocate_tier((L, C + 1, B), pin=pin)
            if device.type != "meta"
            else torch.empty((L, C + 1, B), dtype=torch.uint8, device=device),
            report=report_word(device, groups),
            home_claims=torch.zeros((groups, G + C + 1) if claim_homes else (1, 1), **i64),
        )
        state.ctl[int(K.E_EPOCH)] = 1
        state.ctl[int(K.E_MAX_SELECTION)] = layout.max_selection
        state.ctl[int(K.E_WRITE_COPIES)] = int(layout.write_copies)
        state.mapping.fill_(-1)
        state.reset_residency()
        return state

    def reset_residency(self) -> None:
        """Every slot free, the LRU queue empty: what a fresh pool has (mapping is left alone)."""
        self.owner.fill_(-1)
        self.ver.zero_()
        self.q_slot.zero_()
        self.q_ver.zero_()
        self.stamp.zero_()
        self.bits.zero_()
        _fill_stack(self.gpu_free, self.gpu_slots)
        _fill_stack(self.cpu_free, self.cpu_slots, self.cpu_pos)
        self.copy_slot.fill_(-1)
        self.copy_row.fill_(-1)
        self.gctl.zero_()
        self.gctl[:, int(K.G_GPU_FREE)] = self.gpu_slots
        self.gctl[:, int(K.G_CPU_FREE)] = self.cpu_slots
        self.gctl[:, int(K.G_CPU_PLAIN)] = self.cpu_slots  # no row holds a copy yet

    # The tensors one call writes besides its group's rows: control words, counters, the claim and
    # protection scratch its epoch tags, and the refusal report. A call context has its own.
    CALL_TENSORS = ("ctl", "stats", "claim", "mark", "report")

    def new_context(self) -> TieredState:
        """The same pool state with call tensors of its own (``CALL_TENSORS``, fresh: epoch 1, no
        counts, the same selection bound): a call through it shares nothing a call through
        ``self`` writes but its group's rows, so calls of different groups may run at once."""
        ctl = torch.zeros_like(self.ctl)
        ctl[int(K.E_EPOCH)] = 1
        for word in (K.E_MAX_SELECTION, K.E_WRITE_COPIES):  # set at build: the pool's, not the call's
            ctl[int(word)] = self.ctl[int(word)]
        return replace(
            self,
            ctl=ctl,
            stats=torch.zeros_like(self.stats),
            claim=torch.zeros_like(self.claim),
            mark=torch.zeros_like(self.mark),
            report=report_word(self.ctl.device, self.report.numel()),
        )

    @property
    def claims_homes(self) -> bool:
        """Whether apply claims the homes its moves write (``ULAKV_DEBUG``)."""
        return self.home_claims.shape[1] > 1

    @property
    def gpu_slots(self) -> int:
        return self.owner.shape[1]

    @property
    def cpu_slots(self) -> int:
        """Physical CPU rows, staging rows included."""
        return self.cpu_data.shape[1] - 1

    @property
    def cpu_stack_size(self) -> int:
        """Length of the free list's ring."""
        return self.cpu_free.shape[1]

    def free_cpu_rows(self, g: int) -> torch.Tensor:
        """Group ``g``'s free CPU rows, bottom first (host copy; tests and checks only)."""
        count, bot = (int(x) for x in self.gctl[g, [int(K.G_CPU_FREE), int(K.G_CPU_BOT)]].tolist())
        at = (bot + torch.arange(count)) % self.cpu_stack_size
        return self.cpu_free[g].cpu()[at]

    @property
    def num_groups(self) -> int:
        return self.mapping.shape[0]

    @functools.cached_property
    def policy(self) -> int:
        """K.EXACT_LRU or K.PBLRU, as the kernels' POLICY constexpr."""
        return K.EXACT_LRU if self.q_slot.shape[1] > 1 else K.PBLRU

    @property
    def num_buckets(self) -> int:
        """PB-LRU ring size (0 under exact LRU)."""
        return self.bits.shape[1] // self.bucket_words - 1

    @property
    def bucket_words(self) -> int:
        return 1 if self.policy == K.EXACT_LRU else level_offsets(self.gpu_slots)[-1]

    def group_kwargs(self, g: int) -> dict[str, object]:
        """Group ``g``'s state as both the classify and the apply kernel take it, by their parameter
        names: GPU slots, control words, mapping, group words, LRU versions and ring, the CPU free
        list and its copies, counters, and PB-LRU's bitmaps and stamps (stand-ins under exact LRU).
        Built once a group (about twenty views: tens of microseconds of host time a launch)."""
        cache = self.__dict__.setdefault("_group_kwargs", {})
        if g not in cache:
            cache[g] = self._build_group_kwargs(g)
        return cache[g]

    @functools.cached_property
    def group_reports(self) -> list[torch.Tensor]:
        """Each group's report word (a one-word view of ``report``): built once, not a launch."""
        return [self.report[g : g + 1] for g in range(self.report.numel())]

    @functools.cached_property
    def row_words(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The GPU and CPU rows as the kernels move them (``operands.as_words``) and the elements
        of their widest vector (``rows.vector_unit``): fixed for the state's life."""
        gpu, cpu = operands.as_words(self.gpu_data), operands.as_words(self.cpu_data)
        return gpu, cpu, vector_unit(gpu.shape[-1], gpu, cpu)

    def _build_group_kwargs(self, g: int) -> dict[str, object]:
        return {
            "G": self.gpu_slots,
            "ctl_ptr": self.ctl,
            "map_ptr": self.mapping[g],
            "gctl_ptr": self.gctl[g],
            "ver_ptr": self.ver[g],
            "q_slot_ptr": self.q_slot[g],
            "q_ver_ptr": self.q_ver[g],
            "Qcap": self.q_slot.shape[1],
            "cpu_free_ptr": self.cpu_free[g],
            "C": self.cpu_stack_size,
            "cpu_pos_ptr": self.cpu_pos[g],
            "copy_row_ptr": self.copy_row[g],
            "copy_slot_ptr": self.copy_slot[g],
            "stats_ptr": self.stats,
            "bits_ptr": self.bits[g],
            "BW": self.bucket_words,
            "lvl_ptr": self.levels,
            "n_levels": self.levels.numel() - 1,  # summary levels, leaf included
            "stamp_ptr": self.stamp[g],
            "R": self.num_buckets,
        }

    @property
    def num_addresses(self) -> int:
        return self.mapping.shape[1]


@dataclass(eq=False)
class BufferState(TieredState):
    """A striped rank's buffer of entries homed elsewhere: the same state and kernels as a tier,
    but victims are dropped (their home is another rank) and misses come from fetched rows."""

    CACHE = True


def miss_positions(plan: TransferPlan) -> torch.Tensor:
    """Positions (in the plan's addresses) of a buffer's misses, in the order its apply expects
    their fetched rows: chunk by chunk. Reads the per-chunk counts back on the host (a buffer's
    caller sizes its fetch with them)."""
    sc, T = plan.scratch, plan.elements
    need = sc.counts[: K.cdiv(T, K.CHUNK), int(K.C_NEED)].tolist()
    return torch.cat([sc.miss_pos[c * K.CHUNK : c * K.CHUNK + n] for c, n in enumerate(need)]).long()


@dataclass(eq=False)
class CallScratch(_Tensors):
    """Per-call scratch, sized for up to ``capacity`` selection elements (grown, never shrunk)."""

    # What a call leaves as the next one needs it (every other tensor is written before it is read).
    CARRIED: ClassVar[tuple[str, ...]] = ("seg_arrivals",)

    home: torch.Tensor  # int32 [cap]: mapping value at lookup
    flags: torch.Tensor  # int8 [cap]: F_* bits
    first_pos: torch.Tensor  # int32 [cap]: position of the address's first occurrence
    miss_rank: torch.Tensor  # int32 [cap]: a first occurrence's misses before it in its chunk
    hit_rank: torch.Tensor  # int32 [cap]: a first occurrence's hits before it in its chunk
    cpu_rank: torch.Tensor  # int32 [cap]: rank of a miss from the CPU among its chunk's such misses
    miss_pos: torch.Tensor  # int32 [chunks * CHUNK]: each chunk's misses, in order
    counts: torch.Tensor  # int32 [chunks, COUNT_WORDS]
    block_counts: (
        torch.Tensor
    )  # int32 [chunks / COUNT_BLOCK, COUNT_WORDS]: the counts, COUNT_BLOCK chunks a row
    chunk_off: torch.Tensor  # int64 [chunks, OFF_WORDS]: miss, queue and CPU-push offsets
    victims: torch.Tensor  # int32 [cap]: the top of the free GPU-slot stack (the first victims)
    # int32 [2 cap]: the top of the free CPU list (the rows popped; a write also takes its copies'
    # rows from below its pops: at most one a new entry, so 2T rows)
    popped: torch.Tensor
    cand: torch.Tensor  # int64 [lists * CHUNK]: eviction candidates (slot, clean, clean before it)
    seg: (
        torch.Tensor
    )  # int64 [blocks * SEG_BLOCK, SEG_WORDS]: each candidate segment's words (``kernels.segments``)
    seg_blocks: (
        torch.Tensor
    )  # int64 [blocks, BLOCK_WORDS]: each block of segments' totals, and those before it
    seg_arrivals: (
        torch.Tensor
    )  # int32 [listers' blocks]: listers arrived at a block this call (zero between calls)
    copy_depth: torch.Tensor  # int32 [G]: a listed candidate's copy's depth in the CPU free list
    slot_of: torch.Tensor  # int32 [cap]: each element's GPU slot (exact LRU), as apply's evict phase found it
    ring: torch.Tensor  # int64 [ring pairs]: a compacting call's live LRU ring pairs, block by block
    ring_blocks: torch.Tensor  # int64 [lists + 1, 2]: each ring block's live pairs, and those before it
    moves: torch.Tensor  # int32 [MOVE_WORDS, cap]: what the plan decided for each miss (``kernels.decide``)

    @classmethod
    def allocate(
        cls,
        capacity: int,
        device: torch.device,
        ring_lists: int = 1,
        slot_lists: int = 1,
        buckets: int = 0,
        slots: int = 1,
        ring_pairs: int = 1,
    ) -> CallScratch:
        """Scratch for ``capacity`` elements. Eviction candidates come in lists of ``CHUNK``:
        exact LRU's ``ring_lists`` (the ring's length over ``CHUNK``), PB-LRU's ``slot_lists`` (the
        GPU slots over ``CHUNK``) in each of ``buckets`` buckets, each list a segment, in blocks of
        ``SEG_BLOCK`` (exact LRU: the call's chunks' blocks, then the blocks the plan lists itself
        when they fall short); among ``slots`` GPU slots; a compacting call packs up to
        ``ring_pairs`` LRU ring pairs (the ring's length)."""
        chunks = K.cdiv(capacity, K.CHUNK)
        lists = max(chunks, ring_lists, slot_lists)
        blocks = max(
            segments.segment_blocks(chunks) + segments.segment_blocks(ring_lists),
            buckets * segments.segment_blocks(slot_lists),
        )
        listers = max(segments.segment_blocks(chunks), segments.segment_blocks(slot_lists))
        i32 = dict(dtype=torch.int32, device=device)
        return cls(
            home=torch.empty(capacity, **i32),
            flags=torch.empty(capacity, dtype=torch.int8, device=device),
            first_pos=torch.empty(capacity, **i32),
            miss_rank=torch.empty(capacity, **i32),
            hit_rank=torch.empty(capacity, **i32),
            cpu_rank=torch.empty(capacity, **i32),
            miss_pos=torch.empty(chunks * K.CHUNK, **i32),
            counts=torch.empty((chunks, K.COUNT_WORDS), **i32),
            block_counts=torch.empty((K.cdiv(chunks, int(K.COUNT_BLOCK)), K.COUNT_WORDS), **i32),
            chunk_off=torch.empty((chunks, K.OFF_WORDS), dtype=torch.int64, device=device),
            victims=torch.empty(capacity, **i32),
            popped=torch.empty(2 * capacity, **i32),
            cand=torch.empty(lists * K.CHUNK, dtype=torch.int64, device=device),
            seg=torch.empty(
                (blocks * int(segments.SEG_BLOCK), int(segments.SEG_WORDS)), dtype=torch.int64, device=device
            ),
            seg_blocks=torch.empty((blocks, int(segments.BLOCK_WORDS)), dtype=torch.int64, device=device),
            seg_arrivals=torch.zeros(listers, **i32),  # each block's last lister clears its count
            copy_depth=torch.empty(max(slots, 1), **i32),
            slot_of=torch.empty(capacity, **i32),
            ring=torch.empty(max(ring_pairs, 1), dtype=torch.int64, device=device),
            ring_blocks=torch.empty((lists + 1, 2), dtype=torch.int64, device=device),
            moves=torch.empty((K.MOVE_WORDS, capacity), **i32),
        )

    @property
    def capacity(self) -> int:
        return self.home.numel()

    def kernel_kwargs(self) -> dict[str, torch.Tensor]:
        """The scratch the classify kernel takes, by its parameter names."""
        return {
            "home_ptr": self.home,
            "flags_ptr": self.flags,
            "counts_ptr": self.counts,
            "block_counts_ptr": self.block_counts,
            "miss_pos_ptr": self.miss_pos,
            "miss_rank_ptr": self.miss_rank,
            "hit_rank_ptr": self.hit_rank,
            "cpu_rank_ptr": self.cpu_rank,
            "first_pos_ptr": self.first_pos,
            "victims_ptr": self.victims,
            "popped_ptr": self.popped,
            "cand_ptr": self.cand,
            "seg_ptr": self.seg,
            "seg_blocks_ptr": self.seg_blocks,
            "seg_arrivals_ptr": self.seg_arrivals,
            "copy_depth_ptr": self.copy_depth,
            "ring_ptr": self.ring,
            "ring_blocks_ptr": self.ring_blocks,
        }


@dataclass(frozen=True)
class Kernels:
    """The two stages of a call: plan (claim, then classify + plan) and apply. Tests swap either
    for its plain reference (same signature)."""

    plan: Callable
    apply: Callable

    def returning_launches(self) -> Kernels:
        """References return None; count them as the launches of the kernels they mirror."""
        wrap = lambda fn, n: lambda *a, **k: (fn(*a, **k), n)[1]
        return Kernels(wrap(self.plan, 2), wrap(self.apply, 1))


TRITON = Kernels(lookup_mod.lookup_and_plan, apply_mod.apply)
REFERENCE = Kernels(lookup_mod.lookup_and_plan_reference, apply_mod.apply_reference).returning_launches()


class TieredRunner:
    """Runs the kernels of a tiered pool over a ``TieredState``.

    With ``contexts > 1`` the calls of group ``g`` run in call context ``g % contexts``: its own
    control words, counters, claim and protection scratch, refusal report and call scratch
    (``TieredState.new_context``). Two consecutive groups then share nothing a call writes but
    nothing at all of each other's (their state rows are their own), so group ``g + 1``'s plan may
    run while group ``g``'s rows move (``SparseKV``'s streams). Context 0 is ``state`` itself.
    """

    def __init__(self, config: PoolConfig, state: TieredState, contexts: int = 1) -> None:
        self.config = config
        self.state = state
        self.contexts = [state] + [state.new_context() for _ in range(contexts - 1)]
        self._scratch: list[CallScratch | None] = [None] * contexts
        self._reserved = False
        self.kernels = TRITON

    def context(self, group: int) -> TieredState:
        """The state a call of ``group`` runs over: the pool's, with its context's call tensors."""
        return self.contexts[group % len(self.contexts)]

    def scratch(self, elements: int, group: int = 0) -> CallScratch:
        """Call scratch for ``elements`` in ``group``'s context: the layout's own, grown to a power
        of two so a serving loop allocates a handful of times, then never; once reserved
        (``reserve``), it stays put (a captured CUDA graph points at it) and a larger call gets
        scratch of its own."""
        at = group % len(self.contexts)
        held = self._scratch[at]
        if held is not None and held.capacity >= elements:
            return held
        st = self.state
        ring_lists = K.cdiv(st.q_slot.shape[1], K.CHUNK)  # exact LRU: the ring, CHUNK pairs a list
        slot_lists = K.cdiv(st.gpu_slots, K.CHUNK)  # PB-LRU: CHUNK slots a list, every bucket
        fresh = CallScratch.allocate(
            max(K.CHUNK, K.next_pow2(elements)),
            self.config.torch_device,
            ring_lists=ring_lists,
            slot_lists=slot_lists,
            buckets=max(st.num_buckets, 1),
            slots=st.gpu_slots,
            ring_pairs=ring_lists * K.CHUNK if st.policy == K.EXACT_LRU else 1,
        )
        if not self._reserved:
            self._scratch[at] = fresh
        return fresh

    def reserve(self, elements: int) -> None:
        """Size every context's call scratch for ``elements`` and never replace it."""
        self._reserved = False
        for at in range(len(self.contexts)):
            self.scratch(elements, at)
        self._reserved = True

    def call_bytes(self) -> int:
        """Bytes of what calls use beside the state: every context's call scratch, and the call
        tensors of contexts past the first (the first's are the state's own)."""
        scratch = sum(
            t.numel() * t.element_size() for sc in self._scratch if sc for t in sc.tensors().values()
        )
        extra = sum(getattr(st, k).nbytes for st in self.contexts[1:] for k in TieredState.CALL_TENSORS)
        return scratch + extra

    def counters(self) -> torch.Tensor:
        """The cumulative counters (``K.STAT_NAMES``), summed over the contexts."""
        return torch.stack([st.stats for st in self.contexts]).sum(0)

    def pending(self) -> int:
        """The OR of every context's sticky refusal bits (reads them back: a sync; for state
        comparisons only: ``ulakv.deferred`` raises from the reports)."""
        bits = 0
        for st in self.contexts:
            bits |= int(st.ctl[int(K.E_PENDING)])
        return bits

    def plan(
        self,
        group: int,
        selection: torch.Tensor,
        *,
        rows: torch.Tensor | None = None,
        layer: int = 0,
        out: torch.Tensor | None = None,
        new: NewRows | None = None,
    ) -> tuple[TransferPlan, int]:
        """Plan one ``prepare`` (``rows is None``) or ``write`` of the addresses ``selection`` (int32
        or int64, any shape, -1 padding): the lookup and plan kernels, no data moved. ``rows`` (uint8
        ``[n, bytes_per_layer]``) and ``out`` (int32, at least ``n`` elements: a prepare's slots, in
        row-major order) may be any view of any memory (see ``ulakv.kernels.operands``); ``out`` is
        allocated when ``None``. A prepare's ``new`` rows (checked by the pool) are planned with it:
        its elements are the new tokens, then the selection (``TransferPlan.n_new``). Returns the
        plan and the launches. No host sync."""
        st, cfg, kernels = self.context(group), self.config, self.kernels
        write = rows is not None
        n_new = 0 if new is None else new.addresses.numel()
        # The new tokens and the selection are read in place, each through its own pointer (a copy
        # only of a view the kernels cannot read, or of one overlapping ``out``, which apply reads
        # after its evict phase has written the slots there).
        flat = operands.readable_indices(selection)
        new_flat = operands.readable_indices(new.addresses) if n_new else None
        if out is not None:
            flat = operands.detached(flat, out)
            new_flat = operands.detached(new_flat, out) if n_new else None
        if n_new:
            rows, layer = new.rows, new.layer
        T = n_new + flat.numel()
        scratch = self.scratch(T, group)
        if rows is not None:  # rows that view the very rows (or slots) this call may write
            written = (st.gpu_data, st.cpu_data) if out is None else (st.gpu_data, st.cpu_data, out)
            rows = operands.detached(operands.readable_rows(rows), *written)
        layers = cfg.group_layers(group)
        width = cfg.entry.bytes_per_layer
        launches = kernels.plan(st, group, flat, scratch, write, len(layers) * width, width, new_flat)
        slots, fill_later = None, None
        if not write:
            if out is not None and operands.writable_in_place(out):
                slots = out.view(-1)[: T - n_new]
            else:
                slots, fill_later = torch.empty(T - n_new, dtype=torch.int32, device=flat.device), out
        plan = TransferPlan(
            group=group,
            layers=layers,
            addresses=flat,
            new_addresses=new_flat,
            scratch=scratch,
            slots=slots,
            rows=rows,
            write_layer=layer,
            ctl=st.ctl,
            out=fill_later,
            n_new=n_new,
        )
        return plan, launches

    def execute(
        self,
        plan: TransferPlan,
        until: Phase = Phase.COMMIT,
        in_layers: range | None = None,
        fetched: torch.Tensor | None = None,
        fetch_rows: torch.Tensor | None = None,
    ) -> int:
        """Run ``plan``'s phases from where it stopped through ``until``; the ``in`` phase moves
        ``in_layers`` (default: every layer not moved yet), from ``fetched`` for a buffer: miss
        ``j``'s rows are ``fetched[fetch_rows[j]]`` (default: ``fetched[j]``, rows in miss order).
        Returns launches (1)."""
        if plan.finished:
            raise UlakvError("this plan has already been run to the end")
        remaining = plan.layers_to_move()
        in_layers = remaining if in_layers is None else in_layers
        if in_layers and (in_layers.start != remaining.start or in_layers.stop > remaining.stop):
            raise InvalidInputError(
                f"in_layers must continue the layers not moved yet ({remaining}), got {in_layers}"
            )
        # Phase ``in`` runs again while some layers' rows have not come in.
        start = Phase.IN if plan.applied >= Phase.IN and remaining else Phase(plan.applied + 1)
        if until >= Phase.COMMIT and in_layers != remaining and start <= Phase.IN:
            raise InvalidInputError("a plan commits only after every layer's rows are in")
        launches = self.kernels.apply(
            self.context(plan.group),
            plan.group,
            plan.scratch,
            plan.addresses,
            plan.layers,
            plan.rows,
            plan.write_layer,
            plan.slots,
            phases=(int(start), int(until)),
            in_layers=in_layers if start <= Phase.IN <= until else range(0),
            fetched=fetched,
            fetch_rows=fetch_rows
            if fetch_rows is not None or fetched is None
            else torch.arange(fetched.shape[0], device=fetched.device),
            new=plan.new_addresses,
        )
        if start <= Phase.IN <= until:
            plan.layers_in.update(in_layers)
        plan.applied = max(plan.applied, int(until))  # first: the phases ran, whatever follows
        if plan.out is not None and start <= Phase.EVICT <= until:  # the slots exist: hand them over
            operands.fill_out(plan.out, plan.slots)
        return launches

    def run(
        self, group: int, selection: torch.Tensor, *, rows: torch.Tensor | None = None, layer: int = 0
    ) -> tuple[torch.Tensor | None, int]:
        """Plan and run one ``prepare`` or ``write``; returns the slots (prepare only) and the
        number of kernel launches (3)."""
        plan, launches = self.plan(group, selection, rows=rows, layer=layer)
        launches += self.execute(plan)
        return plan.slots, launches

    def release(self, addrs: torch.Tensor, checked_by: torch.Tensor | None = None) -> int:
        """Free ``addrs``' homes in every group (``checked_by``: only if that check passed)."""
        return release_mod.release(addrs, self.state, checked_by)

    def read(self, layer: int, addrs: torch.Tensor) -> torch.Tensor:
        st = self.state
        g = self.config.group_of(layer)
        words = gather_mod.gather(
            addrs,
            st.mapping[g],
            st.gpu_slots,
            operands.as_words(st.gpu_data[layer]),
            operands.as_words(st.cpu_data[layer]),
        )
        return words.view(torch.uint8).reshape(addrs.numel(), self.config.entry.bytes_per_layer)
