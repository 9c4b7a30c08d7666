"""One rank of a tensor-parallel pool: every entry's one home is on rank ``address mod world``.

Each rank holds its slice of history: an inner tiered pool over its local addresses
(``address // world``), GPU only or with a CPU tier, exactly as a data-parallel rank would. What a
``prepare`` returns depends on where the engine attends (``Striped.attention``):

- ``"local"`` (decode context parallelism): the slots of the selected entries homed on this rank,
  -1 for the others. Only the slice's plan runs: no collective, no buffer, nothing held twice. The
  engine attends over its part and merges the ranks' partial outputs by their log-sum-exp.
- ``"fetch"``: slots for every selected entry. A buffer of ``buffer_slots`` GPU rows, a
  ``BufferState`` run by the same kernels as a tier except that victims are dropped (their home
  keeps them) and misses are filled with rows fetched from their homes. All ranks run the same
  batch, so their buffers take the same decisions and every rank knows every other rank's misses
  without asking: one all-gather of a fixed size (``ulakv.layouts.row_exchange``) brings them.
  Locally homed entries are read in place: the slots index this rank's ``gpu_buffer(layer)``, which
  holds the slice's GPU slots (rows ``[0, S)``, dummy row ``S``) and then the buffer (rows
  ``S + 1 + b``, dummy last). The buffer holds every selected entry, this rank's own included
  (their rows are filled but never returned): a ``1/world`` share spent so that the decisions need
  no communication.

No host syncs on the hot path: every rank decides whether to refuse a call on the device, alike
(``ulakv.layouts.census``), hands the decision to its plans, whose kernels then change nothing, and
raises it as a tiered pool does: at once when validating (one read-back), else from a pinned copy
of the pending word at a later call (``ulakv.deferred``).
"""

from __future__ import annotations

import datetime
import itertools
from types import SimpleNamespace

import torch
import torch.distributed as dist

from ..address_space import FREE, UNHOMED, LogicalAllocator, Sequence, addresses_on, grow
from ..config import PoolConfig, Striped, Tiered
from ..deferred import DeferredStatus
from ..errors import CollectiveError, InvalidAddressError, InvalidInputError, InvariantError, UlakvError
from ..frame import MemoryReport, NewRows, PoolFrame, Selection, debug_enabled, nbytes, refusal, validates
from ..invariants import check_invariants
from ..kernels import common as K
from ..kernels import engine_addresses as engine_mod
from ..kernels import release as release_mod
from ..kernels.operands import detached, readable_indices
from ..transfer import Phase, TransferPlan
from .census import Census, CensusState, hand_to
from .row_exchange import RowExchange, all_gather
from .tiered import TieredPool, context_ctl, context_reports, release_runs, take_exact
from .tiered_state import BufferState, TieredRunner, report_word

_ids = itertools.count(1 << 20)


class StripedPool(PoolFrame):
    """A rank's part of a ``Striped`` pool; every rank calls the same methods with the same
    arguments in the same order (``docs/design.md``, section 5). Built by ``Pool(config)``."""

    def __init__(self, config: PoolConfig) -> None:
        lay: Striped = config.layout
        # On the meta device (a capacity plan: no data, no collectives) no process group is needed,
        # nor in local mode, whose calls never communicate (only ``read`` gathers, and checks then):
        # an engine's DCP group is a subgroup of its tensor-parallel world (SGLang: --dcp-size
        # dividing --tp-size), so the default group's world need not be ``Striped.world``.
        if config.torch_device.type != "meta" and not lay.local:
            self._check_process_group(lay, "a fetch-mode Striped pool")
        self.config = config
        self.device = config.torch_device
        self.world, self.rank = lay.world, lay.rank
        self.local = lay.local
        S, B, L = lay.inner.gpu_slots, lay.buffer_slots, config.num_layers
        width = config.entry.bytes_per_layer
        self._offset = S + 1  # buffer slot b is row S + 1 + b of gpu_buffer(layer)
        rows = S + 1 if self.local else S + 1 + B + 1
        self._unpaged_rows = rows
        page = config.page_size  # > 1 in local mode only: the slice's rows rounded up to whole pages
        rows = -(-rows // page) * page
        self._rows = torch.zeros((L, rows, width), dtype=torch.uint8, device=self.device)
        # Engine-owned addresses (local mode only): ``[0, N)`` over the ranks; this rank's slice
        # owns the local addresses ``a // world`` of those homed here, as an engine-owned pool too.
        self._engine_n = config.engine_addresses
        engine = self._engine_n is not None
        self._addresses = self._engine_n if engine else lay.capacity  # the global address range
        inner_engine = -(-self._engine_n // lay.world) if engine else None
        self.inner = TieredPool(
            config.replace(layout=lay.inner, engine_addresses=inner_engine, page_size=1),
            _gpu_data=self._rows[:, : S + 1],
            _owned=True,
        )
        self._buffer: BufferState | None = None
        self._exchange: RowExchange | None = None
        if not self.local:
            buffer_cfg = config.replace(layout=Tiered(gpu_slots=B, cpu_slots=0, policy=lay.policy))
            self._buffer = BufferState.allocate(
                buffer_cfg, gpu_data=self._rows[:, S + 1 :], addresses=lay.capacity
            )
            self._buffer.ctl[int(K.E_MAX_SELECTION)] = lay.max_selection
            self._buffer_runner = TieredRunner(buffer_cfg, self._buffer)
            self._exchange = RowExchange(
                lay.world, lay.rank, lay.fetch_width, config.max_group_layers, width, self.device
            )
        # Admitted addresses, and one dummy flag past them (an engine admit marks a refused or padded
        # address there, so that marking needs no host decision).
        self._live_flags = torch.zeros(self._addresses + 1, dtype=torch.bool, device=self.device)
        self._live = self._live_flags[: self._addresses]
        self._census_state = CensusState(lay.world, lay.rank, self._addresses, self.device)
        self._allocator = LogicalAllocator(lay.capacity)
        self._id = next(_ids)
        self._debug = debug_enabled()
        self._validate = validates(config, self._debug)
        # This pool's own control words: only E_PENDING is used, the refusals not raised yet.
        self._ctl = torch.zeros(K.CTL_WORDS, dtype=torch.int64, device=self.device)
        # The books of engine-owned addresses, the same on every rank: which global addresses are
        # live (an int32 word each, FREE or not), the check's stamps (int64 each) and its count. An
        # admit or release is checked against them whole, so every rank refuses it alike, before
        # its slice takes the part homed here.
        self._books: SimpleNamespace | None = None
        reports = context_reports(self.inner)
        if engine and self.device.type != "meta":
            n = self._engine_n
            # One word past the addresses: a release frees its addresses there without a host
            # decision (what it refused, or padding, frees the dummy).
            self._book_words = torch.full((n + 1,), FREE, dtype=torch.int32, device=self.device)
            self._books = SimpleNamespace(
                mapping=self._book_words[:n].view(1, n),
                claim=torch.zeros(n, dtype=torch.int64, device=self.device),
                live=torch.zeros(1, dtype=torch.int64, device=self.device),
                capacity=self._addresses,
                ctl=self._ctl,
                report=report_word(self.device),
                num_addresses=n,
                num_groups=1,
            )
            reports.append(self._books.report)
        # A refused call's inner plan reports it (census bits included), and so does a refused
        # engine admit or release: this pool reads those words.
        self._deferred = DeferredStatus(reports, self.device)
        self._seq_ids = itertools.count()
        self.bytes_received = 0  # bytes the fetches' all-gathers brought from other ranks, padding included
        self._bytes_needed = torch.zeros(1, dtype=torch.int64, device=self.device)  # ... that carried a miss
        self.collectives = 0
        self._broken: str | None = None  # why a prepare stopped half-way, if one did

    # -- engine-owned addresses ------------------------------------------------------------------
    def admit_addresses(self, addrs: torch.Tensor) -> None:
        """Make the engine's addresses ``addrs`` (int32/int64 ``[n]``, ``-1`` padding; the same on
        every rank) live: each rank checks them all against its books (out of ``[0, N)``, already
        live, given twice: refused on every rank alike, changing nothing) and its slice takes those
        homed on it (local addresses ``a // world``), with no home until written or selected. No
        collective, no host sync: a non-validating pool raises a refusal at a later call."""
        self._engine_call("admit_addresses", addrs, admit=True)

    def release_addresses(self, addrs: torch.Tensor) -> None:
        """Give back the engine's addresses ``addrs`` (``-1`` padding; the same on every rank): their
        homes on this rank are freed and they are no longer live. Refused alike on every rank if one
        is out of range, not live, or given twice."""
        self._engine_call("release_addresses", addrs, admit=False)

    def live_addresses(self) -> torch.Tensor:
        """int64 ``[live]``: the engine's live addresses, ascending, the same on every rank (reads
        the flags back: a sync; for an engine that clears its whole cache, and for tests)."""
        if self._engine_n is None:
            raise InvalidInputError("live_addresses: this pool hands out its own addresses (sequences)")
        self._join()
        return torch.nonzero(self._live).flatten()

    def _engine_call(self, what: str, addrs: torch.Tensor, admit: bool) -> None:
        if self._engine_n is None:
            raise InvalidInputError(
                f"{what}: this pool hands out its own addresses; set PoolConfig.engine_addresses to let "
                "the engine own them"
            )
        self._need_kernels(what)
        self._check_usable()
        self._check_addresses(what, addrs)
        if addrs.dim() != 1:
            raise InvalidInputError(f"{what}: addrs must be 1-D, got shape {tuple(addrs.shape)}")
        self._check_device(f"{what}: addrs", addrs)
        # No deferred refusal is raised here: on a GPU each rank learns of one when its report
        # lands, and a rank that raised here would skip the admit the others make, so the books
        # would part for good. The next prepare or write raises it (books stay alike).
        if addrs.numel() == 0:
            return
        self._join()
        flat = readable_indices(addrs)
        books = self._books
        engine_mod.engine_addresses(flat, books, books, admit=admit)
        if self._validate:
            status = int(books.ctl[int(K.E_LAST_STATUS)])
            if status:
                self._ctl[int(K.E_PENDING)] = 0
                self._deferred.take()  # raised here: not again later
                raise self._status_error(what, status, None)
        # What passed the check, on the device: the rest (padding, or all of a refused call) is
        # -1 for the slice and marks the dummy flag.
        passed = (books.ctl[int(K.E_LAST_STATUS)] == 0) & (flat >= 0)
        a = flat.long()
        marked = torch.where(passed, a, self._addresses)
        self._live_flags.index_fill_(0, marked, admit)
        self._live_flags[self._addresses] = False
        if not admit:  # the check's kernel counted them out; an admit's marked them live
            self._book_words.index_fill_(0, marked, FREE)
        mine = passed & (a % self.world == self.rank)
        local = torch.where(mine, a // self.world, -1).to(torch.int32)
        if admit:
            self.inner.admit_addresses(local)
        else:
            self.inner.release_addresses(local)
        self._after_call()

    # -- shape (capacity, free_addresses, num_groups: PoolFrame) --------------------------------
    def group_layers(self, group: int) -> range:
        return self.inner.group_layers(group)

    def gpu_buffer(self, layer: int) -> torch.Tensor:
        """uint8 rows ``prepare``'s slots index: this rank's GPU slice ``[S + 1, bytes]`` (local
        mode), then its buffer (fetch mode: ``[S + 1 + buffer_slots + 1, bytes]``)."""
        self._check_layer(layer)
        return self._rows[layer, : self._unpaged_rows]

    def paged_buffer(self, layer: int) -> torch.Tensor:
        """uint8 ``[pages, page_size, 1, bytes_per_layer]``: ``gpu_buffer(layer)`` and the rows that
        round it up to whole pages (``PoolConfig.page_size``), whose token index is the slot: the
        paged KV cache SGLang's DCP attention views (``kv_cache.view(-1, 1, page_size, dim)``)."""
        self._check_layer(layer)
        page = self.config.page_size
        return self._rows[layer].view(-1, page, 1, self._rows.shape[-1])

    # -- admission -------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Addresses live at once: every rank's slice together, or the engine's address range."""
        return self._addresses

    @property
    def free_addresses(self) -> int:
        if self._books is not None:
            return self._addresses - int(self._books.live[0])  # a read-back: stats only
        if self._engine_n is not None:
            return self._addresses  # a meta pool holds no books
        return self._allocator.free

    def _pool_owned(self, what: str) -> None:
        if self._engine_n is not None:
            raise InvalidInputError(
                f"{what}: this pool's addresses belong to the engine (PoolConfig.engine_addresses); "
                "use admit_addresses / release_addresses"
            )

    def admit(self, num_tokens: int) -> Sequence:
        self._pool_owned("admit")
        self._check_usable()
        seq = Sequence(self._id, next(self._seq_ids), _device=self.device)
        self._home(seq, self._allocator.take(num_tokens))
        self._after_call()
        return seq

    def extend(self, seq: Sequence, num_tokens: int = 1) -> torch.Tensor:
        self._pool_owned("extend")
        self._check_seq(seq)
        self._check_usable()
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
            take_exact(self.inner, self._local(taken))
        except BaseException:
            self._allocator.give_back(taken)
            raise
        new = addresses_on(taken, self.device)
        if taken:
            self._live[new] = True
            if self._buffer is not None:
                self._buffer.mapping[:, new] = UNHOMED
            grow(seq, taken)
        return new

    def release(self, seq: Sequence) -> None:
        self._pool_owned("release")
        self._check_seq(seq)
        self._check_usable()
        self._join()
        local = self._local(seq.runs)
        release_runs(self.inner, local, addresses_on(local, self.device))
        if seq.runs:
            self._live[seq.addresses] = False
            if self._buffer is not None and self.device.type != "meta":  # a plan holds no state
                release_mod.release(seq.addresses, self._buffer)
        self._allocator.give_back(seq.runs)
        seq.released = True
        if self._buffer is not None and self._allocator.free == self._allocator.capacity:
            self._buffer.reset_residency()
        self._after_call()

    # -- the hot path ----------------------------------------------------------------------------
    def write(self, layer: int, addrs: torch.Tensor, rows: torch.Tensor) -> None:
        """Every rank passes the full rows; each keeps those homed on it and, in fetch mode,
        refreshes its buffer's copies of any written entry (no communication)."""
        self._check_write(layer, addrs, rows)
        self._check_usable()
        self._raise_refused()
        if addrs.numel() == 0:
            return
        flat = readable_indices(addrs)
        census = self._census(flat, unique=True)
        self._settle("write", census, [context_ctl(self.inner, self.config.group_of(layer))])
        rows = detached(rows, self._rows)  # index_copy_ below refuses an overlap, after inner's write
        self.inner.write(layer, census.local, rows)
        if self._buffer is not None:
            flat = flat.long()
            g = self.config.group_of(layer)
            held = self._buffer.mapping[g, flat.clamp(min=0)]
            cached = (flat >= 0) & (held >= 0) & (held < self._buffer.gpu_slots) & (census.status == 0)
            dummy = self._rows.shape[1] - 1  # a refused write changes no copy either
            self._rows[layer].index_copy_(0, torch.where(cached, self._offset + held.long(), dummy), rows)
        self._finish_call()

    def prepare(self, group: int, topk: torch.Tensor) -> Selection:
        """Every rank passes the same ``topk`` and gets slots into its own ``gpu_buffer(layer)``:
        of every selected entry (fetch mode, collective: misses come from their homes in one
        all-gather), or of those homed on it, -1 for the others (local mode)."""
        flat = self._selection(group, topk)
        if flat.numel() == 0:
            return Selection(group, torch.empty(topk.shape, dtype=torch.int32, device=self.device))
        if self.local:
            census = self._census(flat)
            self._settle("prepare", census, [context_ctl(self.inner, group)])
            slots = self.inner.prepare(group, census.local.view(1, -1)).slots
        else:
            census = self._census(flat, group=group)
            self._settle("prepare", census, [self._buffer.ctl, context_ctl(self.inner, group)])
            try:
                slots = self._fetch_and_apply(group, flat, census)
            except BaseException as exc:
                # The buffer's plan has taken slots and moved its policy, and the ranks may be out of
                # step: nothing further on this pool can be trusted.
                self._broken = f"{type(exc).__name__}: {exc}"
                raise
        self._finish_call()
        return Selection(group, slots.view(topk.shape))

    def _selection(self, group: int, topk: torch.Tensor) -> torch.Tensor:
        """A prepare's checks (raising an earlier refusal first); ``topk`` flattened, read in place
        when packed (int32 or int64)."""
        self._need_kernels("prepare")
        self._check_usable()
        self._check_group(group)
        self._check_selection(topk)
        self._raise_refused()
        return readable_indices(topk)

    # -- a local-mode prepare in two halves, for an engine's side stream (SparseKV) -------------------
    @property
    def call_contexts(self) -> int:
        """1: the census and the pending word are the pool's, not a call context's, so an engine's
        side stream runs this pool's calls in order (``SparseKV`` makes one stream). What overlaps
        is what matters in a step: a group's later layers come in while its first is read."""
        return 1

    def reserve_scratch(self, elements: int) -> None:
        """Size the census's local addresses and the slice's per-call scratch (in fetch mode the
        buffer's and the all-gather's too) for selections of up to ``elements`` now, and keep them
        (for CUDA-graph capture)."""
        self.inner.reserve_scratch(elements)
        self._census_state.local_for(elements)
        if self._buffer is not None:
            self._buffer_runner.reserve(elements)
            self._exchange.buffer_slots_for(elements)

    def plan(
        self,
        group: int,
        topk: torch.Tensor,
        out: torch.Tensor | None = None,
        *,
        new: NewRows | None = None,
    ) -> TransferPlan | None:
        """Local mode: the first half of ``prepare`` (the census, then the slice's plan), moving
        nothing; ``run`` runs it, a layer at a time if asked (``TieredPool.plan``, ``run``). ``out``
        receives the slots, -1 for entries homed elsewhere. ``None`` for an empty selection. Fetch
        mode prepares in one collective call (``prepare``); new rows are written with ``write``."""
        if not self.local:
            raise InvalidInputError(
                "plan: a fetch-mode striped pool prepares in one collective call (prepare)"
            )
        if new is not None:
            raise InvalidInputError("plan: a striped pool takes new rows through write(), not with a plan")
        flat = self._selection(group, topk)
        if flat.numel() == 0:
            return None
        census = self._census(flat)
        self._settle("prepare", census, [context_ctl(self.inner, group)])
        return self.inner.plan(group, census.local.view(1, -1), out=out)

    def run(self, plan: TransferPlan, until: Phase = Phase.COMMIT, in_layers: range | None = None) -> None:
        """Run a local-mode ``plan`` through ``until`` (``TieredPool.run``)."""
        self.inner.run(plan, until=until, in_layers=in_layers)
        if plan.finished:
            self._finish_call()

    def _census(self, flat: torch.Tensor, *, unique: bool = False, group: int | None = None) -> Census:
        """The call's census (``ulakv.layouts.census``): the same on every rank. With ``group``, a
        fetch-mode prepare's: its buffer's limits too."""
        lay: Striped = self.config.layout
        fetch = group is not None
        return self._census_state.take(
            flat,
            live=self._live,
            per_home=None if unique else lay.per_home_selection,  # a write brings nothing in
            most=lay.buffer_slots if fetch else None,
            unique=unique,
            buffer_map=self._buffer.mapping[group] if fetch else None,
            buffer_slots=self._buffer.gpu_slots if fetch else 0,
            fetch_width=lay.fetch_width,
        )

    def _settle(self, what: str, census: Census, plans: list[torch.Tensor]) -> None:
        """Validating: read the census and raise before anything changes. Otherwise hand it to
        the control words of the plans about to run (they refuse together) and to the pending
        word this pool raises from later."""
        if self._validate:
            status = int(census.status)
            if status:
                raise self._status_error(what, status, census)
            return
        for ctl in plans:
            hand_to(ctl, census)
        pending = int(K.E_PENDING)
        self._ctl[pending : pending + 1].bitwise_or_(census.status)

    def _finish_call(self) -> None:
        self._after_call()

    def _fetch_and_apply(self, group: int, flat: torch.Tensor, census: Census) -> torch.Tensor:
        """The buffer's plan, the slice's prepare, the fetch, the buffer's apply: the slots (int32
        ``[T]``, the one tensor of the selection's size this allocates), the slice's where homed
        here, else the buffer's. 11 launches under exact LRU (buffer plan 3, slice 4, fetch plan 2,
        buffer apply, merge) beside the census, and the all-gather."""
        T, layers, status = flat.numel(), self.config.group_layers(group), census.status
        exchange = self._exchange
        plan, _ = self._buffer_runner.plan(group, flat, out=exchange.buffer_slots_for(T))
        slots = torch.empty(T, dtype=torch.int32, device=self.device)
        self.inner.run(self.inner.plan(group, census.local.view(1, T), out=slots))
        send_slots, fetch_rows, remote = exchange.route(flat, plan.scratch, slots, self._offset - 1)
        send, gathered = exchange.views(len(layers))
        # The rows of this home's misses, every layer of the group, gathered straight into send.
        torch.index_select(self._rows[layers.start : layers.stop].transpose(0, 1), 0, send_slots, out=send)
        self._collective("the all-gather of missed rows", all_gather, gathered, send)
        self.bytes_received += exchange.wire_bytes(len(layers))
        # A refused call (``status`` nonzero) gathers padding only: it needed nothing.
        self._bytes_needed += torch.where(status == 0, remote, 0) * (
            len(layers) * self.config.entry.bytes_per_layer
        )
        self._buffer_runner.execute(plan, fetched=gathered, fetch_rows=fetch_rows)
        exchange.merge_slots(census.local, slots, self._offset)
        return slots

    # -- slow paths ------------------------------------------------------------------------------
    @staticmethod
    def _check_process_group(lay: Striped, what: str) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise UlakvError(f"{what} needs torch.distributed initialised first")
        if dist.get_world_size() != lay.world or dist.get_rank() != lay.rank:
            raise UlakvError(
                f"Striped(world={lay.world}, rank={lay.rank}) but torch.distributed has world "
                f"{dist.get_world_size()}, rank {dist.get_rank()}"
            )

    def read(self, layer: int, addrs: torch.Tensor) -> torch.Tensor:
        """Collective: the bytes of ``addrs`` from their homes, on every rank (synchronises). Needs
        ``torch.distributed`` with the pool's world and rank, in local mode too."""
        self._need_kernels("read")
        if self.local:
            self._check_process_group(self.config.layout, "read (a gather from every rank)")
        self._check_usable()
        self.check()
        self._check_layer(layer)
        self._check_addresses("read", addrs)
        flat = readable_indices(addrs.to(self.device)).to(torch.int64)  # packed: the census reads it
        if bool((flat < 0).any()):
            raise InvalidAddressError(f"read: addresses out of range [0, {self.capacity})")
        census = self._census(flat)
        status = int(census.status) & int(K.ST_BAD_ADDRESS)  # a slow path: it may sync
        if status:
            raise self._status_error("read", status, None)
        local = census.local.long()
        mine = local >= 0
        out = torch.zeros(
            (flat.numel(), self.config.entry.bytes_per_layer), dtype=torch.uint8, device=self.device
        )
        if bool(mine.any()):
            out[mine] = self.inner.read(layer, local[mine])
        words = out.view(torch.int32) if out.shape[1] % 4 == 0 else out.to(torch.int32)
        self._collective("read", dist.all_reduce, words)  # one rank holds each row; the others add zeros
        return words.view(torch.uint8) if out.shape[1] % 4 == 0 else words.to(torch.uint8)

    def memory(self) -> MemoryReport:
        """This rank's: its slice (rows, CPU tier, state), the liveness flags, control words and
        census (4 B an address), and in fetch mode the buffer's rows and state and the fetch's
        all-gather scratch."""
        b = self.inner.memory()  # its GPU rows are the first rows of the rank's row tensor
        b.gpu_meta += nbytes(self._live) + nbytes(self._ctl) + nbytes(self._bytes_needed)
        b.gpu_meta += sum(nbytes(t) for t in self._census_state.tensors().values())
        if self._buffer is not None:
            buffer_meta = sum(nbytes(t) for k, t in self._buffer.tensors().items() if k != "gpu_data")
            b.gpu_buffers = nbytes(self._rows) - b.gpu_rows
            exchange = sum(nbytes(t) for t in self._exchange.tensors().values())  # rows and scratch
            b.gpu_meta += buffer_meta + self._buffer_runner.call_bytes() + exchange
        return b

    def stats(self) -> dict[str, int]:
        """This rank's counters (synchronises, and raises a refusal not raised yet): its slice
        (``distinct_entries``, tier traffic), ``physical_slots_used`` (the slice's homes and, in
        fetch mode, the buffer's copies: ``buffer_slots_used``), its buffer in fetch mode
        (``hits``/``misses`` of every selection, rows fetched), and the wire: ``bytes_communicated``
        received by the fetches' all-gathers, padding included, of which ``bytes_needed`` carried a
        miss homed elsewhere."""
        self._need_kernels("stats")
        self.check()
        inner = self.inner.stats()
        out = {
            **inner,
            "live_addresses": self.capacity - self.free_addresses,
            "buffer_slots_used": 0,
            "buffer_victims": 0,
            "bytes_communicated": self.bytes_received,
            "bytes_needed": int(self._bytes_needed),
            "collectives": self.collectives,
        }
        if self._buffer is not None:
            buffer = dict(zip(K.STAT_NAMES, self._buffer.stats.tolist(), strict=False))
            used = self.num_groups * self._buffer.gpu_slots - int(
                self._buffer.gctl[:, int(K.G_GPU_FREE)].sum()
            )
            out.update(
                hits=buffer["hits"],
                misses=buffer["misses"],
                buffer_slots_used=used,
                physical_slots_used=inner["physical_slots_used"] + used,
                buffer_victims=buffer["victims"],
                bytes_in=inner["bytes_in"] + self.bytes_received,
            )
        return out

    def check(self) -> None:
        """Raise (and clear) a refusal that a non-validating ``prepare`` or ``write`` recorded."""
        self._need_kernels("check")
        self._join()
        pending = int(self._ctl[int(K.E_PENDING)])  # a sync: every report has landed
        refusal = self._deferred.take()
        if self._buffer is not None:
            self._buffer.ctl[int(K.E_PENDING)] = 0
        if pending or refusal is not None:
            self._ctl[int(K.E_PENDING)] = 0
            what = "an earlier call"
            if refusal is not None:
                what, pending = refusal.describe(), pending | refusal.status
            raise self._status_error(what, pending, None)

    def check_invariants(self) -> None:
        """The inner slice's invariants, and in fetch mode the buffer's (one slot per buffered
        entry, free stack and policy order consistent)."""
        self._join()
        self.inner.check_invariants()
        if self._buffer is not None:
            check_invariants(self._buffer, self._allocator)
        if self._books is not None:
            self._check_books()

    def _check_books(self) -> None:
        """Engine-owned addresses: the census's liveness flags, the books' words and count, and the
        slice's live local addresses all name the same addresses."""
        live = self._books.mapping[0] != FREE
        if not torch.equal(live, self._live) or bool(self._live_flags[self._addresses]):
            raise InvariantError(f"rank {self.rank}: the liveness flags disagree with the books")
        if int(self._books.live[0]) != int(live.sum()):
            counted = int(self._books.live[0])
            raise InvariantError(f"rank {self.rank}: the books count {counted} live addresses")
        homed = torch.nonzero(live).flatten()
        homed = homed[homed % self.world == self.rank] // self.world
        if not torch.equal(self.inner.live_addresses().cpu(), homed.cpu()):
            raise InvariantError(f"rank {self.rank}: the slice's live addresses are not those homed here")

    # -- refusals --------------------------------------------------------------------------------
    def _raise_refused(self) -> None:
        """Without validation: raise the refusal of an earlier call once its status has reached
        the host (``ulakv.deferred``; no sync)."""
        if not self._validate:
            refusal = self._deferred.take()
            if refusal is not None:
                self._ctl[int(K.E_PENDING)] = 0  # raised now (this pool's calls share one stream)
                raise self._status_error(refusal.describe(), refusal.status, None)

    def _status_error(self, what: str, status: int, census: Census | None) -> UlakvError:
        lay: Striped = self.config.layout
        return refusal(
            what,
            status,
            bad_address=f"addresses out of range [0, {self.capacity}) or not live",
            too_large=(
                f"more distinct addresses than the {lay.max_selection} a striped prepare may select "
                "(buffer_slots)"
            ),
            home_limit=self._home_limit_words(census) if status & int(K.ST_HOME_LIMIT) else "",
        )

    def _home_limit_words(self, census: Census | None) -> str:
        """Why a call went over a home's share: the rank and count when the census is at hand."""
        lay: Striped = self.config.layout
        if census is None:
            carries = f", or more of them missing the buffer than a fetch carries ({lay.fetch_width})"
            fetch = "" if self.local else carries
            return (
                "more distinct addresses homed on one rank than its slice may bring in at once "
                f"({lay.per_home_selection}){fetch}"
            )
        distinct, missing = census.distinct.tolist(), census.missing.tolist()
        worst = max(range(self.world), key=lambda r: distinct[r])
        if distinct[worst] > lay.per_home_selection:
            return (
                f"{distinct[worst]} distinct addresses homed on rank {worst}, more than the "
                f"{lay.per_home_selection} its slice may bring in at once (inner max_selection)"
            )
        worst = max(range(self.world), key=lambda r: missing[r])
        return (
            f"{missing[worst]} addresses homed on rank {worst} miss the buffer, more than the "
            f"{lay.fetch_width} rows a fetch carries from one rank (fetch_rows)"
        )

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise UlakvError(
                f"this striped pool (rank {self.rank}) stopped in the middle of a prepare ({self._broken}); "
                "its ranks are no longer in step: rebuild the group and the pool"
            )

    def _collective(self, what: str, op, *args) -> None:
        """Run ``op``; on gloo (CPU tensors) wait for it at most ``timeout_s``, so that a dead or
        stalled rank becomes a ``CollectiveError`` here, never a silent hang. On a GPU the wait
        only orders the stream (a host-side timeout would block the host, and a captured step
        cannot wait on it): the process group's own timeout watches it."""
        timeout = self.config.layout.timeout_s
        try:
            work = op(*args, async_op=True)
            if self.device.type == "cpu":
                work.wait(timeout=datetime.timedelta(seconds=timeout))
            else:
                work.wait()
        except Exception as exc:  # gloo and NCCL raise RuntimeError subclasses
            raise CollectiveError(
                f"rank {self.rank} of {self.world}: {what} did not complete within {timeout:g} s "
                f"(a rank died, stalled, or called something else): {exc}"
            ) from exc
        self.collectives += 1
