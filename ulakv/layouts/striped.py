"""One rank of a tensor-parallel pool: every entry's one home is on rank ``address mod world``.

Each rank holds

- its slice of history: an inner tiered pool over its local addresses (``address // world``), GPU
  only or with a CPU tier, exactly as a data-parallel rank would;
- a buffer of ``buffer_slots`` GPU rows for recently selected entries, a ``BufferState`` run by the
  same kernels as a tier except that victims are dropped (their home keeps them) and misses are
  filled with rows fetched from their homes.

All ranks run the same batch, so they pass the same selections to the buffer, whose kernels are
deterministic: every rank takes the same buffer decisions and knows every other rank's misses
without asking. A ``prepare`` therefore needs one collective: each home contributes the rows of the
misses it holds (read from its own GPU slots, where its inner ``prepare`` has just brought them) and
an all-gather hands every rank all of them. Locally homed entries are read in place: the slots
``prepare`` returns index this rank's ``gpu_buffer(layer)``, which holds the inner GPU slots (rows
``[0, S)``, dummy row ``S``) and then the buffer (rows ``S + 1 + b``, dummy last).

The buffer holds every selected entry, this rank's own included (their buffer rows are filled but
never returned here): a ``1/world`` share of the buffer spent so that the decisions need no
communication.

Host syncs: sizing the collective needs the number of misses per home (one small read-back per
group-step), and validation reads the status. Striped pools are for correctness and capacity first;
a fixed-size variant for CUDA graphs is left to later work.
"""

from __future__ import annotations

import datetime
import itertools

import torch
import torch.distributed as dist

from ..address_space import UNHOMED, LogicalAllocator, Sequence, addresses_on
from ..config import PoolConfig, Striped, Tiered
from ..errors import CapacityError, CollectiveError, InvalidAddressError, InvalidInputError, UlakvError
from ..frame import PoolFrame, Selection, debug_enabled
from ..invariants import check_invariants
from ..kernels import common as K
from ..kernels import release as release_mod
from ..kernels.operands import detached, readable_indices, readable_rows
from .tiered import TieredPool
from .tiered_state import BufferState, TieredLayout, miss_positions

_ids = itertools.count(1 << 20)


def fetch_scratch_bytes(config: PoolConfig, misses_per_home: int) -> int:
    """GPU bytes one ``prepare`` allocates to fetch up to ``misses_per_home`` rows from each home
    (kept beside ``_fetch_and_apply``, which allocates them; the capacity planner charges them):
    the rows this rank sends, every rank's after the all-gather, and the fetched rows in miss order,
    each row every layer of the longest group."""
    world = config.layout.world
    row = config.layers_per_group * config.entry.bytes_per_layer
    return (1 + 2 * world) * misses_per_home * row


class StripedPool(PoolFrame):
    """A rank's part of a ``Striped`` pool; every rank calls the same methods with the same
    arguments in the same order (``docs/design.md``, section 5). Built by ``Pool(config)``."""

    def __init__(self, config: PoolConfig) -> None:
        lay: Striped = config.layout
        # On the meta device (a capacity plan: no data, no collectives) no process group is needed.
        if config.torch_device.type != "meta":
            if not dist.is_available() or not dist.is_initialized():
                raise UlakvError("a Striped pool needs torch.distributed initialised first")
            if dist.get_world_size() != lay.world or dist.get_rank() != lay.rank:
                raise UlakvError(
                    f"Striped(world={lay.world}, rank={lay.rank}) but torch.distributed has world "
                    f"{dist.get_world_size()}, rank {dist.get_rank()}"
                )
        self.config = config
        self.device = config.torch_device
        self.world, self.rank = lay.world, lay.rank
        S, B, L = lay.inner.gpu_slots, lay.buffer_slots, config.num_layers
        width = config.entry.bytes_per_layer
        self._offset = S + 1  # buffer slot b is row S + 1 + b of gpu_buffer(layer)
        self._rows = torch.zeros((L, S + 1 + B + 1, width), dtype=torch.uint8, device=self.device)
        self.inner = TieredPool(config.replace(layout=lay.inner), _gpu_data=self._rows[:, : S + 1])
        buffer_cfg = config.replace(layout=Tiered(gpu_slots=B, cpu_slots=0, policy=lay.policy))
        self._buffer = BufferState.allocate(
            buffer_cfg, gpu_data=self._rows[:, S + 1 :], addresses=lay.capacity
        )
        self._buffer.ctl[int(K.E_MAX_SELECTION)] = lay.max_selection
        self._buffer_layout = TieredLayout(buffer_cfg, self._buffer)
        self._allocator = LogicalAllocator(lay.capacity)
        self._id = next(_ids)
        self._debug = debug_enabled()
        self._seq_ids = itertools.count()
        self.bytes_received = 0  # rows fetched from other ranks, cumulative
        self.collectives = 0
        self._broken: str | None = None  # why a prepare stopped half-way, if one did

    # -- shape (capacity, free_addresses, num_groups: PoolFrame) --------------------------------
    def group_layers(self, group: int) -> range:
        return self.inner.group_layers(group)

    def gpu_buffer(self, layer: int) -> torch.Tensor:
        """uint8 ``[S + 1 + buffer_slots + 1, bytes]``: this rank's GPU slice, then its buffer."""
        self.inner._check_layer(layer)
        return self._rows[layer]

    # -- admission -------------------------------------------------------------------------------
    def admit(self, num_tokens: int) -> Sequence:
        seq = Sequence(self._id, next(self._seq_ids), _device=self.device)
        self._home(seq, self._allocator.take(num_tokens))
        self._after_call()
        return seq

    def extend(self, seq: Sequence, num_tokens: int = 1) -> torch.Tensor:
        self._check_seq(seq)
        new = self._home(seq, self._allocator.take(num_tokens))
        self._after_call()
        return new

    def _local(self, runs: list[range]) -> list[range]:
        """The local addresses (``t // world``) of the runs' addresses homed on this rank."""
        local = []
        for r in runs:
            first = r.start + (self.rank - r.start) % self.world  # first address homed here
            n = len(range(first, r.stop, self.world))
            if n:
                local.append(range(first // self.world, first // self.world + n))
        return local

    def _home(self, seq: Sequence, taken: list[range]) -> torch.Tensor:
        try:
            self.inner._take_exact(self._local(taken))
        except BaseException:
            self._allocator.give_back(taken)
            raise
        new = addresses_on(taken, self.device)
        if taken:
            self._buffer.mapping[:, new] = UNHOMED
            seq._append(taken)
        return new

    def release(self, seq: Sequence) -> None:
        self._check_seq(seq)
        local = self._local(seq._runs)
        self.inner._release_addresses(local, addresses_on(local, self.device))
        if seq._runs and self.device.type != "meta":  # a capacity plan holds no device state
            release_mod.release(seq.addresses, self._buffer)
        self._allocator.give_back(seq._runs)
        seq.released = True
        if self._allocator.free == self._allocator.capacity:
            self._buffer.reset_residency()
        self._after_call()

    # -- the hot path ----------------------------------------------------------------------------
    def _local_of(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mine = (flat >= 0) & (flat % self.world == self.rank)
        return mine, torch.where(mine, flat // self.world, -1)

    def write(self, layer: int, addrs: torch.Tensor, rows: torch.Tensor) -> None:
        """Every rank passes the full rows; each keeps those homed on it, and refreshes its buffer
        copies of any written entry (no communication)."""
        self._check_write(layer, addrs, rows)
        self._check_usable()
        self._check_live("write", addrs, unique=True)  # on every rank, before any rank changes anything
        rows = detached(rows, self._rows)  # index_copy_ below refuses an overlap, after inner's write
        _, local = self._local_of(addrs.to(torch.int64))
        self.inner.write(layer, local, rows)
        g = self.config.group_of(layer)
        held = self._buffer.mapping[g, addrs.clamp(min=0).long()]
        cached = (addrs >= 0) & (held >= 0) & (held < self._buffer.gpu_slots)
        dummy = self._rows.shape[1] - 1
        rows_at = torch.where(cached, self._offset + held.long(), dummy)
        self._rows[layer].index_copy_(0, rows_at, rows)
        self._after_call()

    def prepare(self, group: int, topk: torch.Tensor) -> Selection:
        """Collective: every rank passes the same ``topk`` and gets slots into its own
        ``gpu_buffer(layer)``; misses are fetched from their homes with one all-gather."""
        self._need_kernels("prepare")
        self._check_usable()
        self.inner._check_group(group)
        if not isinstance(topk, torch.Tensor) or topk.dim() not in (2, 3):
            raise InvalidInputError("prepare: topk must be a [batch, k] or [batch, q, k] tensor")
        if topk.dtype not in (torch.int32, torch.int64):
            raise InvalidInputError(f"prepare: topk must be int32 or int64, got {topk.dtype}")
        self.inner._check_device("prepare: topk", topk)
        flat = readable_indices(topk.to(torch.int64))
        T = flat.numel()
        if T == 0:
            return Selection(group, torch.empty(topk.shape, dtype=torch.int32, device=self.device))
        layers = self.config.group_layers(group)
        self._check_live("prepare", flat)  # bad addresses first, on every rank alike
        self._check_per_home(flat)
        plan, _ = self._buffer_layout.plan(group, flat)
        status = int(self._buffer.ctl[int(K.E_LAST_STATUS)])
        if status:
            self._buffer.ctl[int(K.E_PENDING)] = 0
            self._buffer_layout.execute(plan, fetched=plan.scratch.victims)  # refused: moves nothing
            if status & int(K.ST_TOO_LARGE):
                raise CapacityError(
                    f"prepare: more distinct addresses than the {self.config.layout.max_selection} a "
                    "striped prepare may select (buffer_slots); nothing changed"
                )
            raise InvalidAddressError("prepare: addresses out of range or not live; nothing changed")
        try:
            selection = self._fetch_and_apply(group, topk, flat, plan, layers)
        except BaseException as exc:
            # The buffer's plan has taken slots and moved its policy, and the ranks may be out of
            # step: nothing further on this pool can be trusted.
            self._broken = f"{type(exc).__name__}: {exc}"
            raise
        self._after_call()
        return selection

    def _check_per_home(self, flat: torch.Tensor) -> None:
        """Refuse, on every rank alike, a selection with more distinct addresses homed on one rank
        than that rank's slice may bring to its GPU in one prepare (one small read-back)."""
        used = flat[flat >= 0].sort().values
        if used.numel() == 0:
            return
        first = torch.ones_like(used, dtype=torch.bool)
        first[1:] = used[1:] != used[:-1]
        per_home = torch.bincount(used[first] % self.world, minlength=self.world)
        limit = self.config.layout.inner.max_selection
        worst = int(per_home.max())
        if worst > limit:
            raise CapacityError(
                f"prepare: {worst} distinct addresses homed on rank {int(per_home.argmax())}, more than the "
                f"{limit} its slice may bring in at once (inner max_selection); nothing changed"
            )

    def _fetch_and_apply(self, group, topk, flat, plan, layers):
        T = flat.numel()
        mine, local = self._local_of(flat)
        inner_slots = self.inner.prepare(group, local.view(1, T)).slots.view(-1)

        # The misses, in the buffer's victim order (the same on every rank), and their homes.
        sc = plan.scratch
        miss_pos = miss_positions(plan)
        home = flat[miss_pos] % self.world
        onehot = home[:, None] == torch.arange(self.world, device=self.device)[None, :]
        per_home = onehot.sum(0).tolist()
        width = max(per_home) if per_home else 0
        fetched = None
        if width:
            ours = miss_pos[home == self.rank]
            slots_here = inner_slots[ours].long()
            send = torch.zeros(
                (width, len(layers), self._rows.shape[2]), dtype=torch.uint8, device=self.device
            )
            send[: ours.numel()] = self._rows[layers.start : layers.stop][:, slots_here].permute(1, 0, 2)
            # One tensor for every rank's rows (views of it are the all-gather's outputs): no copy
            # to stack them. Peak: send + world x send + the fetched rows (fetch_scratch_bytes).
            gathered = torch.empty((self.world, *send.shape), dtype=send.dtype, device=send.device)
            self._collective("the all-gather of missed rows", dist.all_gather, list(gathered.unbind(0)), send)
            self.bytes_received += (self.world - 1) * send.numel()
            rank_in_home = (onehot.long().cumsum(0) - 1).gather(1, home[:, None]).flatten()
            fetched = gathered[home, rank_in_home]
        fetched = readable_rows(fetched) if fetched is not None else sc.victims
        self._buffer_layout.execute(plan, fetched=fetched)
        slots = torch.where(mine, inner_slots, torch.where(flat >= 0, self._offset + plan.slots, -1))
        return Selection(group, slots.to(torch.int32).view(topk.shape))

    # -- slow paths ------------------------------------------------------------------------------
    def read(self, layer: int, addrs: torch.Tensor) -> torch.Tensor:
        """Collective: the bytes of ``addrs`` from their homes, on every rank."""
        self._need_kernels("read")
        self._check_usable()
        self.inner._check_layer(layer)
        self._check_addresses("read", addrs)
        flat = addrs.reshape(-1).to(torch.int64).to(self.device)
        if bool((flat < 0).any()):
            raise InvalidAddressError(f"read: addresses out of range [0, {self.capacity})")
        self._check_live("read", flat)
        mine, local = self._local_of(flat)
        out = torch.zeros(
            (flat.numel(), self.config.entry.bytes_per_layer), dtype=torch.uint8, device=self.device
        )
        if bool(mine.any()):
            out[mine] = self.inner.read(layer, local[mine])
        words = out.view(torch.int32) if out.shape[1] % 4 == 0 else out.to(torch.int32)
        self._collective("read", dist.all_reduce, words)  # one rank holds each row; the others add zeros
        return words.view(torch.uint8) if out.shape[1] % 4 == 0 else words.to(torch.uint8)

    def stats(self) -> dict[str, int]:
        """This rank's counters: its slice (``distinct_entries``, ``physical_slots_used``, tier
        traffic) and its buffer (``hits``/``misses`` of every selection, rows fetched)."""
        inner = self.inner.stats()
        buffer = dict(zip(K.STAT_NAMES, self._buffer.stats.tolist(), strict=False))
        used = self.num_groups * self._buffer.gpu_slots - int(self._buffer.gctl[:, int(K.G_GPU_FREE)].sum())
        return {
            **inner,
            "live_addresses": self.capacity - self.free_addresses,
            "hits": buffer["hits"],
            "misses": buffer["misses"],
            "buffer_slots_used": used,
            "buffer_victims": buffer["victims"],
            "bytes_in": inner["bytes_in"] + self.bytes_received,
            "bytes_communicated": self.bytes_received,
            "collectives": self.collectives,
        }

    def check(self) -> None:
        self.inner.check()

    def check_invariants(self) -> None:
        """The inner slice's invariants, and the buffer's (one slot per buffered entry, free
        stack and policy order consistent)."""
        self.inner.check_invariants()
        check_invariants(self._buffer, self._allocator)

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise UlakvError(
                f"this striped pool (rank {self.rank}) stopped in the middle of a prepare ({self._broken}); "
                "its ranks are no longer in step: rebuild the group and the pool"
            )

    def _collective(self, what: str, op, *args) -> None:
        """Run ``op`` and wait for it at most ``timeout_s``: a dead or stalled rank becomes a
        ``CollectiveError`` here, never a silent hang."""
        timeout = self.config.layout.timeout_s
        try:
            work = op(*args, async_op=True)
            work.wait(timeout=datetime.timedelta(seconds=timeout))
        except Exception as exc:  # gloo and NCCL raise RuntimeError subclasses
            raise CollectiveError(
                f"rank {self.rank} of {self.world}: {what} did not complete within {timeout:g} s "
                f"(a rank died, stalled, or called something else): {exc}"
            ) from exc
        self.collectives += 1

    def _check_live(self, what: str, addrs: torch.Tensor, unique: bool = False) -> None:
        """Checks every rank can make alike (they all hold the global addresses and the buffer's
        mapping of them), so all ranks refuse the same calls."""
        flat = addrs.reshape(-1).to(torch.int64)
        used = flat[flat >= 0]
        if bool((used >= self.capacity).any()) or bool((flat < -1).any()):
            raise InvalidAddressError(f"{what}: addresses out of range [0, {self.capacity})")
        if bool((self._buffer.mapping[0, used] == -1).any()):
            raise InvalidAddressError(f"{what}: addresses not live (released or never admitted)")
        if unique and used.numel() > 1:
            ordered = used.sort().values
            if bool((ordered[1:] == ordered[:-1]).any()):
                raise InvalidAddressError(f"{what}: an address appears more than once; nothing changed")
