"""The engine adapter: a pool bound to a model's sparse-attention layer groups.

Per step and group the engine calls :meth:`SparseKV.prepare` once, as soon as the group's top-k is
known, and gets a :class:`GroupStep`: the slots every layer of the group attends over (built once,
reused by each layer, as FlashInfer's plan is reused by its runs) and one readiness signal per layer.
Before layer ``l`` reads ``pool.gpu_buffer(l)[slots]`` it calls ``step.wait(l)``.

On CUDA every call of a group runs on the stream of its *call context* (``TieredRunner``: group
``g`` in context ``g % 2``, whose control words and scratch no call of groups ``g - 1`` and ``g + 1``
touches; ``docs/design.md``, section 3). The stream first waits for the current stream (the
selection, the rows to write, every earlier read of the group's rows are enqueued there), then
plans and moves; the current stream waits only for that group's events. So group ``g + 1``'s
claim and classify run while group ``g``'s rows still come in over PCIe, and attention waits for
its own group alone. Within a group of several layers the moves are split: the first layer's ``in``
phase ends with an event of its own, then the other layers' ``in`` and the ``commit`` follow, so
layers after the first wait for those only. A group-step is at most 4 launches whatever the batch
size, and no host sync: nothing here reads a device value. On CPU (kernels under the Triton
interpreter) the same calls run synchronously on the current stream and a ``wait`` returns at once;
``prefetch=True`` there still splits the launches, which is how the tests cover the split.

A refused step is never silent. With validation off (the CUDA default) a ``prepare`` that cannot
be served (an address not live, more distinct addresses than the pool may select at once) or a
refused ``write`` changes nothing and leaves ``-1`` in every slot of its step, which attention reads
as padding, never as a row; its error (``InvalidAddressError``, ``CapacityError``, ...) is raised by
a later :meth:`SparseKV.prepare` or :meth:`SparseKV.write`, the first one made once the refused
call's report has reached host memory (``ulakv.deferred``: a word the kernel stores there, no
copy, no sync): on CPU the very next call, on CUDA usually the next step's. ``pool.check()`` raises
it at once (a sync). ``tests/test_engine_adapter.py`` pins this down.

Buffers are sized at construction for the largest step (``max_batch x max_queries x top_k`` per
group), so a step allocates nothing and can be captured in a CUDA graph once per batch shape.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from ..errors import InvalidInputError
from ..frame import Internals, NewRows
from ..layouts.tiered import TieredPool
from ..transfer import Phase, TransferPlan


@dataclass(eq=False)
class GroupStep:
    """One group's selection for one step: its slots, shared by the group's layers, and when each
    layer's rows are in place."""

    group: int
    layers: range
    slots: torch.Tensor  # int32, the selection's shape: rows of pool.gpu_buffer(layer), -1 padding
    plan: TransferPlan | None
    ready: dict[int, object] = field(default_factory=dict)  # layer -> CUDA event (absent: ready)

    def wait(self, layer: int) -> torch.Tensor:
        """Make the current stream wait until ``layer``'s rows are in place; returns the slots."""
        if layer not in self.layers:
            raise InvalidInputError(f"layer {layer} is not in group {self.group} ({self.layers})")
        event = self.ready.get(layer)
        if event is not None:
            torch.cuda.current_stream(self.slots.device).wait_event(event)
        return self.slots


class SparseKV:
    """Binds ``pool`` to a model: one ``prepare`` per layer group per step, calls of consecutive
    groups on streams of their own.

    ``max_batch``, ``max_queries`` (speculative query positions per request) and ``top_k`` bound a
    step's selection ``[B, Q, K]``; buffers for it are allocated here, once. ``prefetch`` runs each
    call context's calls on a stream of its own and splits a multi-layer group's moves in two
    (first layer, then the rest); default: on CUDA only.
    """

    def __init__(
        self,
        pool: TieredPool,
        *,
        max_batch: int,
        top_k: int,
        max_queries: int = 1,
        prefetch: bool | None = None,
    ) -> None:
        for name, value in (("max_batch", max_batch), ("top_k", top_k), ("max_queries", max_queries)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidInputError(f"SparseKV: {name} must be a positive int, got {value!r}")
        self.pool = pool
        self.max_batch, self.max_queries, self.top_k = max_batch, max_queries, top_k
        self.max_elements = max_batch * max_queries * top_k
        device = pool.device
        self._cuda = device.type == "cuda"
        self._prefetch = self._cuda if prefetch is None else bool(prefetch)
        # One slots buffer per group: a group's slots stay valid while later groups prepare.
        self._slots = torch.full((pool.num_groups, self.max_elements), -1, dtype=torch.int32, device=device)
        # Sized once, for a selection and a new token a query position (``prepare(..., new=)``); a
        # larger call (prefill) gets its own.
        pool.reserve_scratch(self.max_elements + max_batch * max_queries)
        self._contexts = pool.call_contexts
        self._streams = (
            [torch.cuda.Stream(device) for _ in range(self._contexts)]
            if self._prefetch and self._cuda
            else None
        )
        self._done: list[torch.cuda.Event | None] = [None] * self._contexts  # each stream's last event
        # The pool's own pool-wide calls (an engine's admit_addresses / release_addresses, release,
        # read, check ...) then wait for every stream's work first, whoever makes them.
        pool.order_after(self._after_streams)

    def prepare(self, group: int, topk: torch.Tensor, *, new: NewRows | None = None) -> GroupStep:
        """Plan ``group``'s moves for the selection ``topk`` (``[B, K]`` or ``[B, Q, K]``, -1
        padding) and start them; returns the step's slots and per-layer readiness. ``new``: the
        step's new tokens' rows of one of the group's layers (at most ``max_batch x max_queries``),
        planned with the selection (one plan, where :meth:`write` then ``prepare`` plan twice);
        their rows are in place when the layer's are. Like ``topk``, ``new``'s tensors are read
        on the group's stream: reuse them only after the step's layers are ready."""
        shape = tuple(topk.shape) if isinstance(topk, torch.Tensor) else None
        if shape is not None and topk.dim() in (2, 3):
            B, K = shape[0], shape[-1]
            Q = shape[1] if topk.dim() == 3 else 1
            if self.max_batch < B or self.max_queries < Q or self.top_k < K:
                raise InvalidInputError(
                    f"SparseKV.prepare: selection {shape} exceeds the adapter's bounds "
                    f"(batch {self.max_batch}, queries {self.max_queries}, top_k {self.top_k})"
                )
        room = self.max_batch * self.max_queries  # the new tokens the reserved scratch holds
        if (
            isinstance(new, NewRows)
            and isinstance(new.addresses, torch.Tensor)
            and new.addresses.numel() > room
        ):
            raise InvalidInputError(
                f"SparseKV.prepare: {new.addresses.numel()} new tokens exceed the adapter's bound "
                f"(batch {self.max_batch} x queries {self.max_queries})"
            )
        pool = self.pool
        out = self._slots[group] if 0 <= group < pool.num_groups else self._slots[0]
        extra = () if new is None else (new.addresses, new.rows)
        with self._on_stream(group, topk, *extra) as stream:
            plan = pool.plan(group, topk, out=out, new=new)
            layers = pool.group_layers(group)
            step = GroupStep(group, layers, out[: topk.numel()].view(shape), plan)
            if plan is None:
                return step
            if self._prefetch and len(layers) > 1:  # the first layer's rows first, with an event
                pool.run(plan, until=Phase.IN, in_layers=range(layers.start, layers.start + 1))
                if stream is not None:
                    step.ready[layers.start] = self._record(group, stream)
            pool.run(plan)
            if stream is not None:
                done = self._record(group, stream)
                for layer in layers:
                    step.ready.setdefault(layer, done)
        return step

    def write(self, layer: int, addrs: torch.Tensor, rows: torch.Tensor) -> None:
        """``pool.write`` on the stream of the layer's group (new tokens' rows, each step); the
        current stream waits for it (an engine may read the rows at once), not for other groups."""
        group = self.pool.config.group_of(layer) if 0 <= layer < self.pool.config.num_layers else 0
        with self._on_stream(group, addrs, rows) as stream:
            self.pool.write(layer, addrs, rows)
            if stream is not None:
                torch.cuda.current_stream(self.pool.device).wait_event(self._record(group, stream))

    def release(self, seq) -> None:
        """``pool.release`` once every group's moves in flight are done (a finished request)."""
        self._after_streams()
        self.pool.release(seq)

    def internals(self) -> Internals:
        """The testing hook: this adapter's private attributes (``ulakv.frame.Internals``)."""
        return Internals(self)

    def join(self) -> None:
        """Make the current stream wait for every group's stream (end of a captured step; before
        using the pool directly)."""
        self._after_streams()

    @contextlib.contextmanager
    def _on_stream(self, group: int, *inputs: torch.Tensor) -> Iterator[torch.cuda.Stream | None]:
        """Run the block on ``group``'s context stream after the current stream's work so far
        (``None`` and the current stream on CPU or without prefetch). ``inputs`` (the caller's,
        made on the current stream) are kept from reuse until the stream is done with them."""
        if self._streams is None:
            yield None
            return
        stream = self._streams[group % self._contexts]
        stream.wait_stream(torch.cuda.current_stream(self.pool.device))
        if not torch.cuda.is_current_stream_capturing():  # a graph's buffers live as long as it
            for t in inputs:
                if isinstance(t, torch.Tensor) and t.device.type == "cuda":
                    t.record_stream(stream)
        with torch.cuda.stream(stream):
            try:
                yield stream
            finally:  # even when stopped part-way, later pool-wide calls wait for what was launched
                self._record(group, stream)

    def _record(self, group: int, stream: torch.cuda.Stream) -> torch.cuda.Event:
        """An event at ``stream``'s current end: the context's latest."""
        event = torch.cuda.Event()
        event.record(stream)
        self._done[group % self._contexts] = event
        return event

    def _after_streams(self) -> None:
        """Order the next pool-wide call after every context stream's last launch (they write pool
        state and read the call scratch). Stream waits, not host syncs."""
        current = None
        for i, event in enumerate(self._done):
            if event is not None:
                current = current or torch.cuda.current_stream(self.pool.device)
                current.wait_event(event)
                self._done[i] = None
