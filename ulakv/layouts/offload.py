"""The CPU-offload baseline (what SGLang's HiSparse does), as a layout beside ulakv's own.

- The full history lives in CPU rows: address ``a`` is CPU row ``a``, every layer, from admission
  to release. A write goes there at once (the eager backup), so the CPU copy is always complete.
- Each request owns a fixed GPU buffer of ``slots_per_request`` rows a layer group with its own
  exact LRU, a ``BufferState`` run by the same kernels as a striped rank's buffer: a miss copies
  the row in from the CPU, a victim is dropped (its CPU row is still there), a written token
  enters as the most recent entry. GPU rows are copies, so distinct entries / physical slots stays
  below 1, and an idle request's quota cannot be lent.

Selections are split by request on the host: every request present in a ``prepare`` runs its own
buffer's plan and apply (3 launches) on its own elements, plus one gather per layer of its misses'
rows from the CPU. The baseline reads back on the host every call (validation, the split, the miss
order) and copies a write's rows to host memory at once; it is a comparison point for capacity,
hit rate and bytes moved, not for launch counts or host syncs.

Written tokens enter their request's buffer as its most recent entries (the last
``slots_per_request`` of a prefill), as HiSparse writes new KV on the GPU; so the next steps find
the local window there.
"""

from __future__ import annotations

import itertools

import torch

from .. import host_memory
from ..address_space import UNHOMED, LogicalAllocator, Sequence, addresses_on, grow
from ..config import CPUOffloadBaseline, ExactLRU, PoolConfig, Tiered
from ..errors import CapacityError, InvalidAddressError, InvariantError
from ..frame import MemoryReport, PoolFrame, Selection, debug_enabled, nbytes
from ..invariants import check_invariants
from ..kernels import common as K
from ..kernels import gather as gather_mod
from ..kernels import release as release_mod
from ..kernels.operands import as_words, detached
from .tiered_state import BufferState, TieredRunner, miss_positions

_ids = itertools.count(1 << 21)


class _OnlyLive:
    """An allocator's view for ``check_invariants``: only ``runs`` are live (one request's)."""

    def __init__(self, capacity: int, runs: list[range]) -> None:
        self.capacity, self.runs = capacity, runs

    def free_runs(self) -> list[range]:
        out, at = [], 0
        for r in sorted(self.runs, key=lambda r: r.start):
            if r.start > at:
                out.append(range(at, r.start))
            at = max(at, r.stop)
        if at < self.capacity:
            out.append(range(at, self.capacity))
        return out


class OffloadPool(PoolFrame):
    """A ``CPUOffloadBaseline`` pool, with the calls and counters of :class:`ulakv.Pool`."""

    def __init__(self, config: PoolConfig) -> None:
        lay: CPUOffloadBaseline = config.layout
        self.config = config
        self.device = config.torch_device
        N, R, Q = lay.cpu_slots, lay.max_requests, lay.slots_per_request
        L, W = config.num_layers, config.entry.bytes_per_layer
        meta = self.device.type == "meta"
        self._debug = debug_enabled()
        # History row N is a zero row that padding gathers point at (the map sends N nowhere).
        self._history = (
            torch.empty((L, N + 1, W), dtype=torch.uint8, device=self.device)
            if meta
            else host_memory.allocate_tier(
                (L, N + 1, W), pin=self.device.type == "cuda", what="the baseline's CPU history"
            )
        )
        history_map = torch.arange(N + 1, dtype=torch.int32, device=self.device)
        history_map[N] = UNHOMED
        self._history_map = history_map  # the gather kernel's mapping: every home a CPU row
        self._request_of = torch.full((N,), -1, dtype=torch.int32, device=self.device)
        # Entries that hold data, per group (written or selected), counted as Pool counts them.
        self._homed = torch.zeros((config.num_groups, N), dtype=torch.bool, device=self.device)
        # Buffer r is rows [r (Q + 1), (r + 1)(Q + 1)) of every layer (its last row its dummy);
        # the final row absorbs writes of rows that are not buffered.
        self._rows = torch.zeros((L, R * (Q + 1) + 1, W), dtype=torch.uint8, device=self.device)
        buffer_cfg = config.replace(layout=Tiered(gpu_slots=Q, cpu_slots=0, policy=ExactLRU()))
        self._buffers = []
        for r in range(R):
            rows = self._rows[:, r * (Q + 1) : (r + 1) * (Q + 1)]
            state = BufferState.allocate(buffer_cfg, gpu_data=rows, addresses=N)
            self._buffers.append(TieredRunner(buffer_cfg, state))
        self._allocator = LogicalAllocator(N)
        self._idle = list(range(R - 1, -1, -1))  # idle buffers, lowest on top
        self._seqs: dict[int, Sequence] = {}  # buffer index -> the request that owns it
        self._buffer_of: dict[int, int] = {}  # sequence id -> its buffer index
        self._id = next(_ids)
        self._seq_ids = itertools.count()
        self._launches = 0
        self._bytes_backed_up = 0

    # -- shape (capacity, free_addresses, num_groups, group_layers: PoolFrame) ----------------
    def gpu_buffer(self, layer: int) -> torch.Tensor:
        """uint8 ``[max_requests x (slots_per_request + 1) + 1, bytes]``: every request's buffer."""
        self._check_layer(layer)
        return self._rows[layer]

    # -- admission -------------------------------------------------------------------------------
    def admit(self, num_tokens: int) -> Sequence:
        """A new request: its tokens get CPU rows and the request a GPU buffer; CapacityError
        (nothing changed) if either is short."""
        if not self._idle:
            raise CapacityError(
                f"cannot admit: all {self.config.layout.max_requests} per-request GPU buffers are in use"
            )
        taken = self._allocator.take(num_tokens)
        r = self._idle.pop()
        seq = Sequence(self._id, next(self._seq_ids), _device=self.device)
        self._seqs[r] = seq
        self._buffer_of[seq.seq_id] = r
        self._home(seq, taken)
        self._after_call()
        return seq

    def extend(self, seq: Sequence, num_tokens: int = 1) -> torch.Tensor:
        self._check_seq(seq)
        new = self._home(seq, self._allocator.take(num_tokens))
        self._after_call()
        return new

    def _home(self, seq: Sequence, taken: list[range]) -> torch.Tensor:
        new = addresses_on(taken, self.device)
        if taken:
            r = self._buffer_of[seq.seq_id]
            self._request_of[new] = r
            self._buffers[r].state.mapping[:, new] = UNHOMED
            grow(seq, taken)
        return new

    def release(self, seq: Sequence) -> None:
        """Free the request's CPU rows (zeroed: a later request reads zeros until it writes) and
        empty its GPU buffer."""
        self._check_seq(seq)
        self._join()
        r = self._buffer_of.pop(seq.seq_id)
        addrs = seq.addresses
        if len(seq) and self.device.type != "meta":
            self._launches += release_mod.release(addrs, self._buffers[r].state)
            self._request_of[addrs] = -1
            self._homed[:, addrs] = False
            self._history[:, addrs.to(self._history.device)] = 0
        self._buffers[r].state.reset_residency()
        self._allocator.give_back(seq.runs)
        del self._seqs[r]
        self._idle.append(r)
        self._idle.sort(reverse=True)
        seq.released = True
        self._after_call()

    # -- the hot path ----------------------------------------------------------------------------
    def prepare(self, group: int, topk: torch.Tensor) -> Selection:
        """Bring every selected address into its request's GPU buffer; slots index
        ``gpu_buffer(layer)``. Each request's buffer decides alone (its own LRU and quota)."""
        self._check_group(group)
        self._check_selection(topk)
        self._need_kernels("prepare")
        flat = topk.reshape(-1).to(torch.int64)
        slots = torch.full((flat.numel(),), -1, dtype=torch.int32, device=self.device)
        if flat.numel() == 0:
            return Selection(group, slots.view(topk.shape))
        self._check_live("prepare", flat, padding=True)
        lay: CPUOffloadBaseline = self.config.layout
        Q = lay.slots_per_request
        # Distinct selected addresses per request, checked against the quota before any change.
        used = flat[flat >= 0]
        ordered = used.sort().values
        first = torch.ones_like(ordered, dtype=torch.bool)
        first[1:] = ordered[1:] != ordered[:-1]
        per_request = torch.bincount(self._request_of[ordered[first]].long(), minlength=lay.max_requests)
        per_request = per_request.tolist()
        if max(per_request) > Q:
            raise CapacityError(
                f"prepare: a request selects {max(per_request)} distinct addresses, more than its GPU "
                f"buffer of {Q} (slots_per_request); nothing changed"
            )
        owner = torch.where(flat >= 0, self._request_of[flat.clamp(min=0)], -1)
        self._homed[group, used] = True
        layers = self.config.group_layers(group)
        for r, n in enumerate(per_request):
            if n == 0:
                continue  # not scheduled this step: its LRU does not tick
            at = torch.nonzero(owner == r).flatten()  # this request's elements, in order
            layout = self._buffers[r]
            plan, launches = layout.plan(group, flat[at])
            self._launches += launches
            self._launches += layout.execute(plan, fetched=self._fetch(plan, layers))
            slots[at] = plan.slots + r * (Q + 1)
        self._after_call()
        return Selection(group, slots.view(topk.shape))

    def _fetch(self, plan, layers: range) -> torch.Tensor:  # a read-back: the baseline syncs
        """The rows of ``plan``'s misses from the CPU history, every layer of the group, in the
        buffer's miss order (words ``[misses, layers, W]``)."""
        order = miss_positions(plan)
        if order.numel() == 0:
            return plan.scratch.victims  # nothing to fetch; the kernel needs some tensor
        missed = plan.addresses[order]
        self._launches += len(layers)
        return torch.stack(
            [
                gather_mod.gather(
                    missed,
                    self._history_map,
                    0,
                    as_words(self._rows[layer]),
                    as_words(self._history[layer]),
                )
                for layer in layers
            ],
            dim=1,
        )

    def write(self, layer: int, addrs: torch.Tensor, rows: torch.Tensor) -> None:
        """Store ``rows`` in the CPU history at once (the eager backup; counted in ``bytes_out``)
        and refresh any buffered GPU copy. ``-1`` addresses are padding rows."""
        self._check_write(layer, addrs, rows)
        W = self.config.entry.bytes_per_layer
        flat = addrs.to(torch.int64)
        self._check_live("write", flat, padding=True, unique=True)
        rows = detached(rows, self._rows, self._history)  # index_copy_ refuses overlaps, half-way
        Q = self.config.layout.slots_per_request
        valid = flat >= 0
        kept = flat[valid]  # padding rows are dropped
        history = self._history[layer]
        history.index_copy_(0, kept.to(history.device), rows[valid].to(history.device))
        self._bytes_backed_up += kept.numel() * W
        g = self.config.group_of(layer)
        self._homed[g, kept] = True
        if layer == self.config.group_layers(g).start and kept.numel():
            self._insert(g, kept)
        owner = torch.where(valid, self._request_of[flat.clamp(min=0)], -1)
        dummy = self._rows.shape[1] - 1
        for r in self._seqs:
            held = self._buffers[r].state.mapping[g, flat.clamp(min=0)]
            cached = (owner == r) & (held >= 0) & (held < Q)
            self._rows[layer].index_copy_(0, torch.where(cached, r * (Q + 1) + held.long(), dummy), rows)
        self._after_call()

    def _insert(self, group: int, addrs: torch.Tensor) -> None:
        """Written tokens enter their request's GPU buffer as its most recent entries (HiSparse
        writes a new token's KV on the GPU): the last ``slots_per_request`` of each request's
        addresses, as one round of its LRU (victims dropped). A write is not a selection: the
        round's hit, miss and bytes-in counters are taken back (the rows come from the history
        here only because this model has no attention kernel writing them on the GPU)."""
        Q = self.config.layout.slots_per_request
        owner = self._request_of[addrs].long()
        counted = [int(K.S_HITS), int(K.S_MISSES), int(K.S_BYTES_IN)]
        layers = self.config.group_layers(group)
        for r, n in enumerate(torch.bincount(owner, minlength=len(self._buffers)).tolist()):
            if n == 0:
                continue
            layout = self._buffers[r]
            before = layout.state.stats[counted].clone()
            plan, launches = layout.plan(group, addrs[owner == r][-Q:].contiguous())
            self._launches += launches
            self._launches += layout.execute(plan, fetched=self._fetch(plan, layers))
            layout.state.stats[counted] = before

    # -- slow paths ------------------------------------------------------------------------------
    def residency(self, group: int, addrs: torch.Tensor) -> torch.Tensor:
        """Row of ``gpu_buffer(layer)`` holding each address's copy in ``group`` (its request's
        buffer), -1 where only the CPU history holds it."""
        self._need_kernels("residency")
        self._check_group(group)
        self._check_addresses("residency", addrs)
        flat = addrs.reshape(-1).to(torch.int64).to(self.device)
        self._check_live("residency", flat)
        Q = self.config.layout.slots_per_request
        out = torch.full(flat.shape, -1, dtype=torch.int32, device=self.device)
        owner = self._request_of[flat]
        for r in self._seqs:
            held = self._buffers[r].state.mapping[group, flat]
            mine = (owner == r) & (held >= 0) & (held < Q)
            out = torch.where(mine, (r * (Q + 1) + held).to(torch.int32), out)
        return out

    def read(self, layer: int, addrs: torch.Tensor) -> torch.Tensor:
        """The bytes of ``addrs`` in ``layer``: the CPU history always holds the latest."""
        self._check_layer(layer)
        self._need_kernels("read")
        self._join()
        self._check_addresses("read", addrs)
        flat = addrs.reshape(-1).to(torch.int64).to(self.device)
        self._check_live("read", flat)
        return self._history[layer][flat.to(self._history.device)].to(self.device)

    def memory(self) -> MemoryReport:
        """The per-request GPU buffers (copies), their states, the history's mapping, and the full
        history on the CPU."""
        meta = sum(nbytes(t) for s in self._buffers for k, t in s.state.tensors().items() if k != "gpu_data")
        meta += nbytes(self._history_map) + nbytes(self._request_of)
        return MemoryReport(gpu_buffers=nbytes(self._rows), gpu_meta=meta, cpu_rows=nbytes(self._history))

    def stats(self) -> dict[str, int]:
        """Counters summed over the request buffers; ``bytes_out`` is the eager backup of writes.
        An entry counts once it holds data in its group (written or selected, as ``Pool`` counts);
        its CPU row is its one copy that counts as a home, buffered GPU rows are further copies."""
        self._need_kernels("stats")
        self._join()
        totals = torch.stack([b.state.stats for b in self._buffers]).sum(0).tolist()
        counters = dict(zip(K.STAT_NAMES, totals, strict=False))
        groups = self.num_groups
        buffered = sum(
            groups * b.state.gpu_slots - int(b.state.gctl[:, int(K.G_GPU_FREE)].sum()) for b in self._buffers
        )
        live = self.capacity - self.free_addresses
        homed = int(self._homed.sum())
        return {
            "live_addresses": live,
            "distinct_entries": homed,
            "physical_slots_used": homed + buffered,
            "gpu_slots_used": buffered,
            "cpu_slots_used": homed,
            "host_bytes_reserved": host_memory.reserved_bytes(self._history.nbytes),
            **counters,
            "bytes_out": counters["bytes_out"] + self._bytes_backed_up,
            "launches": self._launches,
        }

    def check(self) -> None:
        """Nothing is deferred: the baseline validates every call on the host."""

    def check_invariants(self) -> None:
        """Each buffer's invariants over its own request's addresses (an idle buffer: none)."""
        self._need_kernels("check_invariants")
        self._join()
        for r, layout in enumerate(self._buffers):
            seq = self._seqs.get(r)
            check_invariants(layout.state, _OnlyLive(self.capacity, seq.runs if seq else []))
        free = torch.zeros(self.capacity, dtype=torch.bool)
        for run in self._allocator.free_runs():
            free[run.start : run.stop] = True
        if bool(((self._request_of.cpu() >= 0) == free).any()):
            raise InvariantError("an address's request disagrees with the allocator")

    # -- checks ----------------------------------------------------------------------------------
    def _check_live(self, what: str, flat: torch.Tensor, padding: bool = False, unique: bool = False) -> None:
        N = self.capacity
        out = (flat >= N) | (flat < (-1 if padding else 0))
        dead = (flat >= 0) & ~out & (self._request_of[flat.clamp(0, N - 1)] < 0)
        if bool((out | dead).any()):
            offenders = flat[out | dead][:5].tolist()
            raise InvalidAddressError(
                f"{what}: addresses out of range [0, {N}) or not live: {offenders}; nothing changed"
            )
        if unique:
            used = flat[flat >= 0].sort().values
            if bool((used[1:] == used[:-1]).any()):
                raise InvalidAddressError(f"{what}: an address appears more than once; nothing changed")
