"""The fetch of a fetch-mode striped ``prepare``: one all-gather of a fixed size.

Every rank knows every other rank's buffer misses without asking (the buffers take the same
decisions). Home ``h`` sends the rows of its misses in the buffer's miss order, padded to
``width`` rows, every layer of the group; an all-gather of ``world x width`` rows hands every
rank all of them, home by home. Miss ``j`` homed on ``h`` as the ``i``-th of that home's misses is
row ``h x width + i`` of the gathered rows, which is what the buffer's apply is told to read
(``fetch_rows``): no copy puts them in miss order.

The width is fixed at construction (``Striped.fetch_width``), so the collective's size never
depends on data: no host read-back sizes it and a step can be captured. The price is padding:
every call moves ``world x width`` rows whatever its misses; ``bytes_needed`` counts the rows
that carried a miss homed elsewhere, beside the wire's bytes.

Which gathered row each miss reads must be the same on every rank, so its index within its home is
a count in miss order, never the order atomics land in: a histogram of homes a chunk, a prefix over
the chunks, a per-home prefix within each (``ulakv.kernels.exchange``, two launches); a third
merges the slice's and the buffer's slots into what ``prepare`` returns.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..kernels import common as K
from ..kernels import exchange as exchange_mod
from ..kernels.census import lanes

# The one all-gather of equal parts into one flat tensor, for a fetch and for decode context
# parallelism's partial outputs: ``all_gather_single`` where torch has it (2.13 deprecates the older
# name).
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class RowExchange:
    """The send and gather buffers of one striped rank, allocated once (a captured step points at
    them): ``width`` rows to send and ``world x width`` gathered, each row ``layers_per_group``
    layers of ``row_bytes``; and the plan's scratch (``ulakv.kernels.exchange``), grown with the
    selection to a power of two and never shrunk. ``kernels`` is ``TRITON`` or its twins (tests
    swap them)."""

    def __init__(
        self, world: int, rank: int, width: int, layers_per_group: int, row_bytes: int, device: torch.device
    ) -> None:
        self.world, self.rank, self.width = world, rank, width
        self.layers_per_group, self.row_bytes = layers_per_group, row_bytes
        group_row = layers_per_group * row_bytes
        self.send = torch.zeros(width * group_row, dtype=torch.uint8, device=device)
        self.gathered = torch.zeros(world * width * group_row, dtype=torch.uint8, device=device)
        self.send_slots = torch.zeros(max(width, 1), dtype=torch.int64, device=device)
        self.words = torch.zeros(exchange_mod.X_WORDS, dtype=torch.int64, device=device)
        self.kernels = TRITON
        self._grow(K.CHUNK, device)

    def _grow(self, elements: int, device: torch.device) -> None:
        cap = K.next_pow2(max(elements, K.CHUNK))
        per_chunk = K.cdiv(cap, K.CHUNK) * lanes(self.world)
        self.fetch_rows = torch.empty(cap, dtype=torch.int32, device=device)
        self.buffer_slots = torch.empty(cap, dtype=torch.int32, device=device)
        self.home_counts = torch.empty(per_chunk, dtype=torch.int32, device=device)
        self.home_before = torch.empty(per_chunk, dtype=torch.int32, device=device)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor it holds: the rows, and the plan's scratch."""
        names = ("send", "gathered", "send_slots", "words", "fetch_rows", "buffer_slots")
        return {n: getattr(self, n) for n in (*names, "home_counts", "home_before")}

    def wire_bytes(self, layers: int) -> int:
        """Bytes one call receives from the other ranks, padding included."""
        return (self.world - 1) * self.width * layers * self.row_bytes

    def buffer_slots_for(self, elements: int) -> torch.Tensor:
        """Where the buffer's plan writes its slots (int32 ``[elements]``), growing the scratch."""
        if self.fetch_rows.numel() < elements:
            self._grow(elements, self.fetch_rows.device)
        return self.buffer_slots[:elements]

    def route(
        self, flat: torch.Tensor, scratch, inner_slots: torch.Tensor, dummy_slot: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For a buffer plan's misses (``scratch``: its call scratch, chunk by chunk) over the
        selection ``flat`` (int32 or int64 ``[T]``, packed): the slice slots whose rows this rank
        sends (int64 ``[width]``; ``dummy_slot`` for padding), where each miss's rows land in the
        gathered rows (``fetch_rows``, int32, by miss index; entries past the misses are stale),
        and how many misses are homed on other ranks (int64 ``[1]``). ``inner_slots``: int32
        ``[T]``, the slice's slots by position. Two launches, fixed shapes, no read-back."""
        if self.fetch_rows.numel() < flat.numel():
            self._grow(flat.numel(), flat.device)
        self.kernels.plan_fetch(
            flat,
            scratch,
            inner_slots,
            world=self.world,
            rank=self.rank,
            width=self.width,
            dummy=dummy_slot,
            home_counts=self.home_counts,
            home_before=self.home_before,
            words=self.words,
            fetch_rows=self.fetch_rows,
            send_slots=self.send_slots,
        )
        remote = int(exchange_mod.X_REMOTE)
        return self.send_slots[: self.width], self.fetch_rows, self.words[remote : remote + 1]

    def merge_slots(self, local: torch.Tensor, out: torch.Tensor, offset: int) -> None:
        """A fetch-mode prepare's slots in ``out`` (int32 ``[T]``, holding the slice's): the slice's
        where ``local`` (int32) is homed here, else the buffer's (``buffer_slots_for``) past
        ``offset``, -1 where it gave none. One launch."""
        self.kernels.merge_slots(local, self.buffer_slots, out, offset)

    def views(self, layers: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The send rows ``[width, layers, row_bytes]`` and the gathered ``[world x width, layers,
        row_bytes]`` of a group of ``layers`` layers (the last group may be shorter)."""
        shape = (layers, self.row_bytes)
        send = self.send[: self.width * layers * self.row_bytes].view(self.width, *shape)
        gathered = self.gathered[: self.world * self.width * layers * self.row_bytes]
        return send, gathered.view(self.world * self.width, *shape)


@dataclass(frozen=True)
class ExchangeKernels:
    """The exchange's two steps: the fetch's plan (two launches) and the slots' merge (one)."""

    plan_fetch: Callable
    merge_slots: Callable


TRITON = ExchangeKernels(exchange_mod.plan_fetch, exchange_mod.merge_slots)
REFERENCE = ExchangeKernels(exchange_mod.plan_fetch_reference, exchange_mod.merge_slots_reference)
