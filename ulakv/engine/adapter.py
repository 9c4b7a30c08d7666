"""The engine adapter: a pool bound to a model's sparse-attention layer groups.

Per step and group the engine calls :meth:`SparseKV.prepare` once, as soon as the group's top-k is
known, and gets a :class:`GroupStep`: the slots every layer of the group attends over (built once,
reused by each layer, as FlashInfer's plan is reused by its runs) and one readiness signal per layer.
Before layer ``l`` reads ``pool.gpu_buffer(l)[slots]`` it calls ``step.wait(l)``.

On CUDA with more than one layer in the group, the moves are split (``docs/design.md``, section 3):

- current stream: claim, classify + plan, then apply's ``out``, ``evict`` and the first layer's ``in``
  phase (3 launches); the first layer may compute as soon as they finish;
- side stream: the other layers' ``in`` phase and the ``commit`` (1 launch), overlapping the first
  layer's attention; layers after the first wait for its event only.

So a group-step is at most 4 launches whatever the batch size, and no host sync: nothing here reads
a device value. On CPU (kernels under the Triton interpreter) the same calls run synchronously and a
``wait`` returns at once; ``prefetch=True`` there still splits the launches (without streams), which
is how the tests cover the split.

A refused step is never silent. With validation off (the CUDA default) a ``prepare`` that cannot
be served (an address not live, more distinct addresses than the pool may select at once) or a
refused ``write`` changes nothing and leaves ``-1`` in every slot of its step, which attention reads
as padding, never as a row; its error (``InvalidAddressError``, ``CapacityError``, ...) is raised by
a later :meth:`SparseKV.prepare` or :meth:`SparseKV.write`, the first one made once the refused
call's status has reached the host (``ulakv.deferred``: an asynchronous copy, no sync): on CPU the
very next call, on CUDA usually the next step's. ``pool.check()`` raises it at once (a sync).
``tests/test_engine_adapter.py`` pins this down.

Buffers are sized at construction for the largest step (``max_batch x max_queries x top_k`` per
group), so a step allocates nothing and can be captured in a CUDA graph once per batch shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import InvalidInputError
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
    """Binds ``pool`` to a model: one ``prepare`` per layer group per step, cross-layer prefetch.

    ``max_batch``, ``max_queries`` (speculative query positions per request) and ``top_k`` bound a
    step's selection ``[B, Q, K]``; buffers for it are allocated here, once. ``prefetch`` splits a
    multi-layer group's moves in two (first layer, then the rest on a side stream); default: on
    CUDA only.
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
        pool.reserve_scratch(self.max_elements)  # sized once; a larger call (prefill) gets its own
        self._side = torch.cuda.Stream(device) if self._prefetch and self._cuda else None
        self._side_done = None  # the side stream's last event: the next pool call waits for it

    def prepare(self, group: int, topk: torch.Tensor) -> GroupStep:
        """Plan ``group``'s moves for the selection ``topk`` (``[B, K]`` or ``[B, Q, K]``, -1
        padding) and start them; returns the step's slots and per-layer readiness."""
        shape = tuple(topk.shape) if isinstance(topk, torch.Tensor) else None
        if shape is not None and topk.dim() in (2, 3):
            B, K = shape[0], shape[-1]
            Q = shape[1] if topk.dim() == 3 else 1
            if self.max_batch < B or self.max_queries < Q or self.top_k < K:
                raise InvalidInputError(
                    f"SparseKV.prepare: selection {shape} exceeds the adapter's bounds "
                    f"(batch {self.max_batch}, queries {self.max_queries}, top_k {self.top_k})"
                )
        pool = self.pool
        self._after_side()
        out = self._slots[group]
        plan = pool.plan(group, topk, out=out)
        layers = pool.group_layers(group)
        step = GroupStep(group, layers, out[: topk.numel()].view(shape), plan)
        if plan is None:
            return step
        if not self._prefetch or len(layers) == 1:
            pool.run(plan)
            return step
        first = range(layers.start, layers.start + 1)
        pool.run(plan, until=Phase.IN, in_layers=first)
        if self._side is None:  # CPU: the same two launches, one after the other
            pool.run(plan)
            return step
        first_ready = torch.cuda.Event()
        first_ready.record(torch.cuda.current_stream(pool.device))
        step.ready[layers.start] = first_ready
        self._side.wait_event(first_ready)
        # The side launch reads the selection: keep its memory from being reused by the current
        # stream's allocations until the side stream is done with it.
        if not torch.cuda.is_current_stream_capturing():  # a graph's buffers live as long as it
            plan.addresses.record_stream(self._side)
        with torch.cuda.stream(self._side):
            try:
                pool.run(plan)
            finally:  # even when stopped part-way, later calls must wait for what was launched
                rest_ready = torch.cuda.Event()
                rest_ready.record(self._side)
                self._side_done = rest_ready
        for layer in layers[1:]:
            step.ready[layer] = rest_ready
        return step

    def write(self, layer: int, addrs: torch.Tensor, rows: torch.Tensor) -> None:
        """``pool.write`` once the moves in flight are done (new tokens' rows, each step)."""
        self._after_side()
        self.pool.write(layer, addrs, rows)

    def release(self, seq) -> None:
        """``pool.release`` once the moves in flight are done (a finished request)."""
        self._after_side()
        self.pool.release(seq)

    def join(self) -> None:
        """Make the current stream wait for the side stream (end of a captured step; before using
        the pool directly)."""
        self._after_side()

    def _after_side(self) -> None:
        """Order the next pool call after the side stream's last launch: it still reads the call
        scratch and writes pool state. A stream wait, not a host sync."""
        if self._side_done is not None:
            torch.cuda.current_stream(self.pool.device).wait_event(self._side_done)
            self._side_done = None
