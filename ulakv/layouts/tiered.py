"""The pool of a ``Tiered`` layout (and of a ``Replicated`` one, stored as one GPU-only replica):
it validates, keeps the books, and delegates.

Everything an engine calls per step (``prepare``, ``write``) runs without a host synchronisation
unless validation is on (see ``PoolConfig.validate``); admission and release are host bookkeeping
plus one kernel. Device state and the order of kernels over it live in ``tiered_state``; this module
holds no kernel code.
"""

from __future__ import annotations

import itertools

import torch

from .. import host_memory
from ..address_space import UNHOMED, EngineAddresses, LogicalAllocator, Sequence, addresses_on, grow, runs_of
from ..config import PoolConfig, Replicated
from ..deferred import DeferredStatus
from ..errors import InvalidAddressError, InvalidInputError, InvariantError, UlakvError
from ..frame import MemoryReport, NewRows, PoolFrame, Selection, debug_enabled, nbytes, refusal, validates
from ..invariants import PlanSnapshot, check_invariants, check_plan, snapshot_plan
from ..kernels import common as K
from ..kernels import engine_addresses as engine_mod
from ..kernels.operands import readable_indices
from ..transfer import Phase, PlanInterrupted, TransferPlan, interrupt_of
from .tiered_state import TieredRunner, TieredState, report_word

_pool_ids = itertools.count(1)


class TieredPool(PoolFrame):
    """The pool of a ``Tiered`` or ``Replicated`` layout (``ulakv.Pool(config)`` builds it; the
    public contract of every call is in ``docs/design.md``)."""

    def __init__(
        self, config: PoolConfig, *, _gpu_data: torch.Tensor | None = None, _owned: bool = False
    ) -> None:
        if not isinstance(config, PoolConfig):
            raise InvalidInputError(f"Pool needs a PoolConfig, got {type(config).__name__}")
        self.config = config
        self.device = config.torch_device
        self._id = next(_pool_ids)
        self._seq_ids = itertools.count()
        self._debug = debug_enabled()
        self._validate = validates(config, self._debug)
        # A striped rank's slice (``_owned``) neither reads nor raises its refusals: its owner decides
        # every call's status for all ranks on the device before planning, hands it to this pool's
        # plan, and reports it itself (``ulakv.layouts.striped``).
        self._owned = _owned
        if _owned:
            self._validate = False
        # A replica of a Replicated pool is stored as a GPU-only tiered pool; stats() counts the
        # other world - 1 replicas' slots too.
        layout = config.layout
        self._replicas = layout.world if isinstance(layout, Replicated) else 1
        self._storage = config.replace(layout=layout.storage) if isinstance(layout, Replicated) else config
        self._paged: torch.Tensor | None = None  # [layers, pages x page_size, bytes] when paged
        if config.page_size > 1 and _gpu_data is None and self.device.type != "meta":
            G, page = self._storage.layout.gpu_slots, config.page_size
            rows = -(-(G + 1) // page) * page
            self._paged = torch.zeros(
                (config.num_layers, rows, config.entry.bytes_per_layer), dtype=torch.uint8, device=self.device
            )
            _gpu_data = self._paged[:, : G + 1]
        self._state = TieredState.allocate(
            self._storage, gpu_data=_gpu_data, addresses=config.engine_addresses, claim_homes=self._debug
        )
        # Two call contexts: consecutive groups' calls share no call words or scratch (they may run
        # at once on the adapter's streams). One for a one-group pool: it has no neighbour.
        self._runner = TieredRunner(self._storage, self._state, contexts=min(2, config.num_groups))
        # Who hands out addresses: the pool (host runs), or the engine (device books, no read-back).
        self._engine: EngineAddresses | None = None
        if config.engine_addresses is not None:
            self._engine = EngineAddresses(
                config.layout.capacity, self._state.mapping, report_word(self.device)
            )
            self._allocator = self._engine
        else:
            self._allocator = LogicalAllocator(config.layout.capacity)
        self._launches = 0
        # Refusals of non-validating calls, reported by context, and by the engine's own check.
        self._deferred = DeferredStatus(context_reports(self), self.device)
        # The plan planned last and not yet run to the end: the plan kernel has already taken its
        # slots from the free stacks and the policy, so the next call finishes it first.
        self._pending: TransferPlan | None = None
        # ULAKV_DEBUG only: the pending plan and the host snapshot taken right before its plan
        # kernels ran; its decisions are checked against it once it has finished (_after_call).
        self._audit: tuple[TransferPlan, PlanSnapshot] | None = None

    # -- shape of the pool (capacity, free_addresses, num_groups, group_layers: PoolFrame) -------
    @property
    def call_contexts(self) -> int:
        """Call contexts: group ``g``'s calls run in context ``g % call_contexts``, and calls in
        different contexts write no common memory (``TieredRunner``)."""
        return len(self._runner.contexts)

    def gpu_buffer(self, layer: int) -> torch.Tensor:
        """uint8 ``[gpu_slots + 1, bytes_per_layer]``: the rows ``prepare``'s slots index (row
        ``gpu_slots`` is a dummy that absorbs padding writes)."""
        self._check_layer(layer)
        return self._state.gpu_data[layer]

    def paged_buffer(self, layer: int) -> torch.Tensor:
        """uint8 ``[pages, page_size, 1, bytes_per_layer]``: ``gpu_buffer(layer)`` and the rows that
        round it up to whole pages (``PoolConfig.page_size``), as a paged KV cache whose token index is
        the slot (FlashMLA's sparse decode reads ``indices`` = slots, ``-1`` skipped). View the bytes as
        the engine's dtype with ``.view(...)``; rows past ``gpu_slots + 1`` are never written."""
        self._check_layer(layer)
        page = self.config.page_size
        rows = self._paged[layer] if self._paged is not None else self._state.gpu_data[layer]
        if rows.shape[0] % page:
            raise InvalidInputError(f"paged_buffer: {rows.shape[0]} rows are not whole pages of {page}")
        return rows.view(rows.shape[0] // page, page, 1, rows.shape[1])

    def reserve_scratch(self, elements: int) -> None:
        """Size the per-call scratch for selections of up to ``elements`` elements now and keep it
        (for CUDA-graph capture: the captured kernels point at it); larger calls, such as a long
        prefill write, get scratch of their own instead of replacing it."""
        if isinstance(elements, bool) or not isinstance(elements, int) or elements < 1:
            raise InvalidInputError(f"reserve_scratch: elements must be a positive int, got {elements!r}")
        self._runner.reserve(elements)

    @property
    def address_space(self) -> int:
        """Addresses are the ints ``[0, address_space)``: ``capacity`` for a pool that hands them
        out, ``PoolConfig.engine_addresses`` for one whose engine owns them."""
        return self._state.num_addresses

    # -- admission -------------------------------------------------------------------------------
    def admit(self, num_tokens: int) -> Sequence:
        """A new request of ``num_tokens`` tokens; raises CapacityError and changes nothing if the
        pool cannot hold them."""
        self._pool_owned("admit")
        self._finish_pending()
        taken = self._allocator.take(num_tokens)
        seq = Sequence(self._id, next(self._seq_ids), _device=self.device)
        self._home(seq, taken)
        self._after_call()
        return seq

    def extend(self, seq: Sequence, num_tokens: int = 1) -> torch.Tensor:
        """Append ``num_tokens`` tokens to ``seq``; returns their addresses."""
        self._pool_owned("extend")
        self._check_seq(seq)
        self._finish_pending()
        new = self._home(seq, self._allocator.take(num_tokens))
        self._after_call()
        return new

    def _home(self, seq: Sequence, taken: list[range]) -> torch.Tensor:
        new = addresses_on(taken, self.device)
        if taken:
            self._state.mapping[:, new] = UNHOMED
            grow(seq, taken)
        return new

    def release(self, seq: Sequence) -> None:
        """Return every address and slot of ``seq`` in every group."""
        self._pool_owned("release")
        self._check_seq(seq)
        self._release_addresses(seq.runs, seq.addresses)
        seq.released = True  # before the debug check: a failed check must not invite a second release
        self._after_call()

    def _release_addresses(self, addresses: list[range], on_device: torch.Tensor) -> None:
        self._join()
        self._finish_pending()
        if self.device.type != "meta":  # a capacity plan's pool holds no device state to free
            self._launches += self._runner.release(on_device)
        self._allocator.give_back(addresses)
        if self._allocator.free == self._allocator.capacity:
            # No request left: put the policy back in its fresh state (invariant 6, exactly).
            self._state.reset_residency()

    def _pool_owned(self, what: str) -> None:
        if self._engine is not None:
            raise InvalidInputError(
                f"{what}: this pool's addresses belong to the engine (PoolConfig.engine_addresses); "
                "use admit_addresses / release_addresses"
            )

    # -- engine-owned addresses --------------------------------------------------------------------
    def admit_addresses(self, addrs: torch.Tensor) -> None:
        """Make the engine's addresses ``addrs`` (int32/int64 ``[n]`` on the pool's device, ``-1``
        padding) live in every group, with no home until written or selected. Refused, changing
        nothing, if one is out of ``[0, address_space)``, already live, given twice, or if more than
        ``capacity`` would be live. Checked on the device with no host sync: a pool that does not
        validate raises the refusal at a later call (``ulakv.deferred``), like a refused ``prepare``."""
        self._engine_call("admit_addresses", addrs, admit=True)

    def release_addresses(self, addrs: torch.Tensor) -> None:
        """Give back the engine's addresses ``addrs`` (``-1`` padding): their homes are freed in every
        group and they are no longer live. Refused, changing nothing, if one is out of range, not
        live, or given twice. An address shared by several requests (a cached prefix) is one entry:
        the engine gives it back once, when its own allocator frees it."""
        self._engine_call("release_addresses", addrs, admit=False)

    def live_addresses(self) -> torch.Tensor:
        """int64 ``[live]``: the live addresses, ascending (reads the mapping back: a sync; for an
        engine that clears its whole cache, and for tests)."""
        self._need_kernels("live_addresses")
        self._join()
        self._finish_pending()
        return torch.nonzero(self._state.mapping[0] != -1).flatten()

    def _engine_call(self, what: str, addrs: torch.Tensor, admit: bool) -> None:
        if self._engine is None:
            raise InvalidInputError(
                f"{what}: this pool hands out its own addresses; set PoolConfig.engine_addresses to let "
                "the engine own them"
            )
        self._need_kernels(what)
        self._check_addresses(what, addrs)
        if addrs.dim() != 1:
            raise InvalidInputError(f"{what}: addrs must be 1-D, got shape {tuple(addrs.shape)}")
        self._check_device(f"{what}: addrs", addrs)
        self._raise_refused()
        self._join()
        self._finish_pending()
        if addrs.numel() == 0:
            return
        flat = readable_indices(addrs)
        self._launches += engine_mod.engine_addresses(flat, self._state, self._engine, admit)
        if not admit:
            self._launches += self._runner.release(flat, checked_by=self._engine.ctl)
        self._settle(what)
        self._after_call()

    def _settle(self, what: str) -> None:
        """After a call whose kernels wrote its status: raise it now (validating) or let a later call
        raise it (``ulakv.deferred``)."""
        if self._validate:
            status = int(self._engine.ctl[int(K.E_LAST_STATUS)])
            self._deferred.forget()  # raised here, not again from its report
            if status:
                self._engine.ctl[int(K.E_PENDING)] = 0
                raise self._status_error(what, status, None)

    def _take_exact(self, addresses: list[range]) -> None:
        """Admit exactly ``addresses`` (runs), which must be the lowest free ones (a striped pool's
        rank takes the local part of what the global allocator handed out: its lowest free, too)."""
        self._finish_pending()
        want = runs_of(addresses)
        taken = self._allocator.take(sum(len(r) for r in want))
        if runs_of(taken) != want:
            self._allocator.give_back(taken)
            raise UlakvError(f"striped admission out of step: expected {want[:2]}..., got {taken[:2]}...")
        if taken:
            self._state.mapping[:, addresses_on(taken, self.device)] = UNHOMED

    # -- the hot path ----------------------------------------------------------------------------
    def prepare(self, group: int, topk: torch.Tensor, *, new: NewRows | None = None) -> Selection:
        """Make every address of ``topk`` (``[B, K]`` or ``[B, Q, K]``, -1 = padding) GPU-resident
        and return their slots. Starts a new round for ``group``. ``new`` (a layer of the group):
        the step's new tokens' rows, written in the same plan (``write`` and ``prepare`` in one
        call: the new tokens' homes and the selection's misses decided together)."""
        plan = self.plan(group, topk, new=new)  # (new rows with an empty selection: a plan of theirs)
        if plan is not None:
            self.run(plan)
            slots = plan.slots
        else:
            slots = torch.empty(0, dtype=torch.int32, device=self.device)
        return Selection(group, slots.view(topk.shape))

    def plan(
        self,
        group: int,
        topk: torch.Tensor,
        out: torch.Tensor | None = None,
        *,
        new: NewRows | None = None,
    ) -> TransferPlan | None:
        """The first half of ``prepare``: decide every move ``topk`` needs, on the device, and
        move nothing (the lookup and plan kernels). ``out`` (int32, at least ``topk.numel()``
        elements) receives the slots in its first ``topk.numel()`` elements, in row-major order, when
        the plan runs, so a captured step writes to a fixed buffer (a packed ``out`` directly; any
        other view by one copy after the ``evict`` phase). ``None`` for an empty selection. Run the
        plan with :meth:`run`. ``topk``, ``out`` (and a write's ``rows``) may be any view of any
        memory: offsets, strides and alignment are the pool's concern (``ulakv.kernels.operands``).
        ``new``: new tokens' rows planned with the selection (see :meth:`prepare`); their addresses
        must have no home yet and appear once among themselves (the selection may name them),
        else the call is refused like a write's duplicate, changing nothing. With ``new``, an empty
        selection still plans (the new tokens alone)."""
        self._check_group(group)
        self._need_kernels("prepare")
        self._check_selection(topk)
        if out is not None:
            if not isinstance(out, torch.Tensor) or out.dtype != torch.int32 or out.numel() < topk.numel():
                raise InvalidInputError(f"prepare: out must be an int32 tensor of >= {topk.numel()} elements")
            if torch._debug_has_internal_overlap(out) == 1:  # 1: certainly (an expanded tensor)
                raise InvalidInputError("prepare: out's elements share memory (expanded?); a slot needs one")
            self._check_device("prepare: out", out)
        if new is not None:
            self._check_new(group, new)
        self._raise_refused()
        self._finish_pending()
        if new is not None and new.addresses.numel() == 0:
            new = None
        if topk.numel() == 0 and new is None:
            return None
        return self._plan("prepare", group, topk, out=out, new=new)

    def _check_new(self, group: int, new: NewRows) -> None:
        """A prepare's new rows: a ``NewRows`` of one of the group's layers, checked as a write's."""
        if not isinstance(new, NewRows):
            raise InvalidInputError(f"prepare: new must be a NewRows, got {type(new).__name__}")
        self._check_write(new.layer, new.addresses, new.rows, what="prepare: new")
        if self.config.group_of(new.layer) != group:
            raise InvalidInputError(
                f"prepare: new rows are of layer {new.layer}, not a layer of group {group} "
                f"({self.config.group_layers(group)})"
            )

    def _plan(self, what: str, group: int, selection: torch.Tensor, **kwargs) -> TransferPlan:
        """Plan a prepare or (with ``rows``) a write and make it the pending plan. Under
        ``ULAKV_DEBUG=1`` the group's state is snapshotted first; with debug off this costs nothing."""
        snapshot = None
        if self._debug:
            new = kwargs.get("new")
            snapshot = snapshot_plan(
                self._state,
                group,
                selection,
                write=kwargs.get("rows") is not None,
                new=None if new is None else new.addresses,
            )
            # Apply's home claims are tagged with the epoch the plan advances to; when it wraps
            # (once in 2**31 calls of a context), tags of the last cycle would recur: clear them.
            if int(self._runner.context(group).ctl[int(K.E_EPOCH)]) + 1 >= K.EPOCH_LIMIT:
                self._state.home_claims[group].zero_()
        plan, launches = self._runner.plan(group, selection, **kwargs)
        self._launches += launches
        self._raise_if_failed(what, plan)
        self._pending = plan
        self._audit = None if snapshot is None else (plan, snapshot)
        return plan

    def run(self, plan: TransferPlan, until: Phase = Phase.COMMIT, in_layers: range | None = None) -> None:
        """Run ``plan`` (from :meth:`plan`) through phase ``until``; the ``in`` phase moves the
        group's layers ``in_layers`` (default: all not moved yet). An engine runs the first layer
        (``until=Phase.IN, in_layers=range(first, first + 1)``), then the rest on a side stream.
        Only the pool's latest plan runs: any other call in between finishes it first."""
        if plan is not self._pending:
            raise InvalidInputError(
                "run: this plan is not the pool's latest (it was finished, or a later call planned); "
                "plan again"
            )
        stop = interrupt_of(self)
        if stop is not None and stop < until:
            self._launches += self._runner.execute(plan, until=stop, in_layers=in_layers)
            raise PlanInterrupted(
                f"plan for group {plan.group} interrupted after its {stop.name.lower()} phase; every "
                "entry is readable at its old home, and the pool finishes the plan before its next call",
                stop,
            )
        self._launches += self._runner.execute(plan, until=until, in_layers=in_layers)
        self._pending = None if plan.finished else plan
        if plan.finished:
            self._after_call()

    def _finish_pending(self) -> None:
        """Finish the latest plan if it was not run to the end (never run, run in part, or
        interrupted): its remaining phases, before anything else."""
        if self._pending is not None:
            plan, self._pending = self._pending, None
            if not plan.finished:  # a run whose last step failed after its phases
                self._launches += self._runner.execute(plan)
            self._after_call()

    def write(self, layer: int, addrs: torch.Tensor, rows: torch.Tensor) -> None:
        """Store ``rows`` (uint8 ``[n, bytes_per_layer]``) as layer ``layer`` of ``addrs``
        (``[n]``, -1 = padding row). New entries get a home in the layer's group. ``rows`` may be
        any view (a slice of a wider tensor, bf16 or fp8 memory viewed as bytes, at any offset):
        read in place when packed and aligned, else copied once."""
        self._check_write(layer, addrs, rows)
        self._raise_refused()
        self._finish_pending()
        if addrs.numel() == 0:
            return
        plan = self._plan("write", self.config.group_of(layer), addrs, rows=rows, layer=layer)
        self.run(plan)

    # -- slow paths ------------------------------------------------------------------------------
    def read(self, layer: int, addrs: torch.Tensor) -> torch.Tensor:
        """The bytes of ``addrs`` in ``layer``, from whichever tier holds them (synchronises)."""
        self._check_layer(layer)
        self._need_kernels("read")
        self.check()  # (joins the adapter's streams)
        self._check_addresses("read", addrs)
        addrs = readable_indices(addrs.to(self.device))
        self._check_live("read", addrs)
        return self._runner.read(layer, addrs)

    def residency(self, group: int, addrs: torch.Tensor) -> torch.Tensor:
        """GPU slot of each address in ``group``, -1 where it is on the CPU or has no home."""
        self._need_kernels("residency")
        self._check_group(group)
        self._check_addresses("residency", addrs)
        addrs = addrs.reshape(-1).to(self.device)
        self._join()
        self._check_live("residency", addrs)
        home = self._state.mapping[group, addrs]
        return torch.where((home >= 0) & (home < self._state.gpu_slots), home, -1)

    def memory(self) -> MemoryReport:
        """Rows (every layer's), the CPU tier's staging rows apart, and everything else kept:
        mapping, policy state, free stacks, call scratch."""
        st = self._state
        row = st.cpu_data.shape[0] * st.cpu_data.shape[2]  # every layer of one CPU row
        meta = sum(nbytes(t) for k, t in st.tensors().items() if k not in ("gpu_data", "cpu_data"))
        staging = self._storage.layout.cpu_staging * row
        engine = nbytes(self._engine.live) + nbytes(self._engine.ctl) if self._engine else 0
        return MemoryReport(
            gpu_rows=nbytes(st.gpu_data),
            gpu_meta=meta + self._runner.call_bytes() + engine,
            cpu_rows=nbytes(st.cpu_data) - staging,
            cpu_staging=staging,
        )

    def stats(self) -> dict[str, int]:
        """Counters (cumulative) and occupancy; synchronises, and raises a deferred error.

        Occupancy, now (a slot or row counts once *per layer group*: every group has its own):

        - ``live_addresses``: addresses admitted and not released (not per group);
        - ``distinct_entries``: homed (address, group) pairs, summed over the groups;
        - ``gpu_slots_used`` / ``cpu_slots_used``: used GPU slots / CPU rows, summed over the
          groups (at most ``num_groups x gpu_slots`` / ``x cpu_slots``);
        - ``physical_slots_used``: both, times ``replicas`` (a ``Replicated`` pool counts every
          replica's); ``replicas``: 1, or the ``Replicated`` world;
        - ``host_bytes_reserved``: host memory the CPU tier holds (whole pages), every replica's.

        Counters since the pool was built, summed over the groups: ``hits`` and ``misses`` (selected
        entries found on / brought to the GPU, each distinct entry of a call once), ``bytes_in`` /
        ``bytes_out`` (bytes moved CPU to GPU / GPU to CPU), ``victims`` (entries moved off the GPU
        to make room), ``clean_evictions`` (victims whose CPU copy was intact: no bytes moved),
        ``victim_search_reads`` / ``round_upkeep_reads`` (policy words the kernels read), and
        ``launches`` (kernel launches)."""
        self._need_kernels("stats")
        self._join()
        self._finish_pending()
        self.check()
        st = self._state
        G, C = st.gpu_slots, st.cpu_slots
        groups = self.num_groups
        gpu_used = groups * G - int(st.gctl[:, int(K.G_GPU_FREE)].sum())
        cpu_used = groups * C - int(st.gctl[:, int(K.G_CPU_FREE)].sum())
        counters = dict(zip(K.STAT_NAMES, self._runner.counters().tolist(), strict=False))
        return {
            "live_addresses": self.capacity - self.free_addresses,
            "distinct_entries": int((st.mapping >= 0).sum()),
            # every replica's slots (a Replicated pool is one of world equal replicas)
            "physical_slots_used": self._replicas * (gpu_used + cpu_used),
            "replicas": self._replicas,
            "gpu_slots_used": gpu_used,
            "cpu_slots_used": cpu_used,
            # host memory the CPU tier holds: its rows as asked, in whole pages (``host_memory``)
            "host_bytes_reserved": self._replicas * host_memory.reserved_bytes(st.cpu_data.nbytes),
            **counters,
            "launches": self._launches,
        }

    def check(self) -> None:
        """Raise an error that a non-validating call recorded and no call has raised yet. Waits for
        the device (every stream the pool's work was on): every report has landed."""
        self._need_kernels("check")
        if self._owned:  # the owner raised or will raise it, in its own words
            return
        self._join()
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        refusal = self._deferred.take()
        if refusal is not None:
            raise self._status_error(refusal.describe(), refusal.status, None, refusal.call)

    def check_invariants(self) -> None:
        """Check the whole state at rest, after finishing a pending plan. This synchronises and is
        for tests and debugging. ``ulakv.invariants.check_invariants`` does the checking: invariant 1,
        the first half of invariant 6, and a well-formed LRU ring or bucket set. Each plan's decisions
        (invariants 3, 4, 5 and 7) are checked only under ``ULAKV_DEBUG=1``, as the plan finishes
        (``_after_call``). Those checks need a snapshot taken before the plan ran, so this method
        cannot run them.
        """
        self._need_kernels("check_invariants")
        self._join()
        self._finish_pending()
        check_invariants(self._state, self._allocator, self.config.group_layers)
        if self._engine is not None:
            live = self.address_space - sum(len(r) for r in self._engine.free_runs())
            if live != int(self._engine.live[0]):
                raise InvariantError(
                    f"engine addresses: {live} live in the mapping, the count says "
                    f"{int(self._engine.live[0])}"
                )

    def _after_call(self) -> None:
        """Under ``ULAKV_DEBUG=1``, check the whole state first (``PoolFrame._after_call``). Then, if
        a plan has just finished, check its decisions against the snapshot taken before it ran."""
        audit, self._audit = self._audit, None
        if self._debug and self.device.type != "meta":  # first: what the device itself caught
            for st in self._runner.contexts:
                twice = int(st.ctl[int(K.E_HOME_CLAIMS)])
                if twice:
                    st.ctl[int(K.E_HOME_CLAIMS)] = 0
                    raise InvariantError(
                        f"a plan gave one home to two misses: {twice} GPU slots or CPU rows claimed "
                        "twice in one call (apply's claims, ULAKV_DEBUG)"
                    )
        super()._after_call()
        if audit is not None and audit[0].finished:
            check_plan(self._state, *audit)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Copies of every tensor that says where entries live, what they hold and the counters."""
        self._join()
        st = self._state
        out = {name: getattr(st, name).clone() for name in TieredState.RESIDENCY}
        out.update(
            gpu_data=st.gpu_data.clone(),
            cpu_data=st.cpu_data.clone(),
            stats=self._runner.counters(),
            pending=torch.tensor(
                self._runner.pending() | (int(self._engine.ctl[int(K.E_PENDING)]) if self._engine else 0)
            ),
        )
        if self._engine is not None:
            out["engine_live"] = self._engine.live.clone()
        return out

    # -- checks ----------------------------------------------------------------------------------
    def _raise_refused(self) -> None:
        """Without validation: raise the refusal of an earlier ``prepare`` or ``write`` once its
        status has reached the host (``ulakv.deferred``; no sync)."""
        if not self._validate and not self._owned:
            refusal = self._deferred.take()
            if refusal is not None:
                raise self._status_error(refusal.describe(), refusal.status, None, refusal.call)

    def _raise_if_failed(self, what: str, plan: TransferPlan) -> None:
        if not self._validate:
            return
        status = int(plan.ctl[int(K.E_LAST_STATUS)])
        self._deferred.forget()  # raised here, not again from its report
        if status:
            plan.ctl[int(K.E_PENDING)] = 0
            raise self._status_error(what, status, plan)

    def _status_error(
        self, what: str, status: int, plan: TransferPlan | None, call: str | None = None
    ) -> UlakvError:
        """The error of a refused call: ``what`` names it, ``call`` is its kind when known
        (``prepare``, ``write``, ``admit_addresses``, ``release_addresses``; else ``what``)."""
        state = "not live"
        if (call or what) == "admit_addresses":
            state = "live already"
        elif call is None and what.startswith("an earlier") and self._engine is not None:
            state = "not live (admit_addresses: live already)"
        bad_address = f"addresses out of range [0, {self.address_space}) or {state}"
        if status & int(K.ST_BAD_ADDRESS) and plan is not None:  # the call's own: say which is which
            flat = plan.element_addresses()
            bad = ((plan.scratch.flags[: flat.numel()].to(torch.int32) & int(K.F_BAD)) != 0).cpu()
            named = flat.cpu()[bad].tolist()
            outside = [a for a in named if not 0 <= a < self.address_space][:5]
            inside = [a for a in named if 0 <= a < self.address_space][:5]
            parts = [f"out of range [0, {self.address_space}): {outside}"] if outside else []
            parts += [f"{state}: {inside}"] if inside else []
            bad_address = "addresses " + "; ".join(parts) if parts else bad_address
        layout = self._storage.layout
        return refusal(
            what,
            status,
            bad_address=bad_address,
            full=f"more than the {self.capacity} addresses the pool holds would be live",
            too_large=(
                f"the selection has more distinct addresses than the {layout.max_selection} a "
                f"prepare may select (gpu_slots {layout.gpu_slots}, staging_slots {layout.cpu_staging})"
            ),
        )

    def _check_live(self, what: str, addrs: torch.Tensor) -> None:
        in_range = (addrs >= 0) & (addrs < self.address_space)
        if not bool(in_range.all()):
            raise InvalidAddressError(f"{what}: addresses out of range [0, {self.address_space})")
        if bool((self._state.mapping[0, addrs] == -1).any()):
            raise InvalidAddressError(f"{what}: addresses not live (released or never admitted)")


# -- the slice protocol: what a pool built over a tiered pool (a striped rank's slice) does to it ------
def take_exact(pool: TieredPool, addresses: list[range]) -> None:
    """Admit exactly ``addresses`` (runs) into ``pool``, which must be its lowest free ones (a
    striped rank takes the local part of what the global allocator handed out: its lowest free,
    too); otherwise ``UlakvError`` (the ranks are out of step), changing nothing."""
    pool._take_exact(addresses)


def release_runs(pool: TieredPool, addresses: list[range], on_device: torch.Tensor) -> None:
    """Release ``addresses`` (runs; ``on_device`` the same as a tensor) from ``pool``: their homes
    freed in every layer."""
    pool._release_addresses(addresses, on_device)


def context_ctl(pool: TieredPool, group: int) -> torch.Tensor:
    """The control words of the call context ``group`` runs in: a composing pool hands its own
    refusal to the plan about to run there (``ulakv.layouts.census.hand_to``)."""
    return pool._runner.context(group).ctl


def context_reports(pool: TieredPool) -> list[torch.Tensor]:
    """Every call context's report words, one a layer group, and the engine check's word of an
    engine-owned pool (``ulakv.deferred``): what a composing pool reads too."""
    engine = [pool._engine.report] if pool._engine is not None else []
    return [st.report for st in pool._runner.contexts] + engine
