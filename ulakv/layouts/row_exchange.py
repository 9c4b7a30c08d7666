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
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..kernels import common as K
from ..kernels._triton import triton

# The one all-gather of equal parts into one flat tensor, for a fetch and for decode context
# parallelism's partial outputs: ``all_gather_single`` where torch has it (2.13 deprecates the older
# name).
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class RowExchange:
    """The send and gather buffers of one striped rank, allocated once (a captured step points at
    them): ``width`` rows to send and ``world x width`` gathered, each row ``layers_per_group``
    layers of ``row_bytes``."""

    def __init__(
        self, world: int, rank: int, width: int, layers_per_group: int, row_bytes: int, device: torch.device
    ) -> None:
        self.world, self.rank, self.width = world, rank, width
        self.layers_per_group, self.row_bytes = layers_per_group, row_bytes
        group_row = layers_per_group * row_bytes
        self.send = torch.zeros(width * group_row, dtype=torch.uint8, device=device)
        self.gathered = torch.zeros(world * width * group_row, dtype=torch.uint8, device=device)

    def wire_bytes(self, layers: int) -> int:
        """Bytes one call receives from the other ranks, padding included."""
        return (self.world - 1) * self.width * layers * self.row_bytes

    def plan(
        self, flat: torch.Tensor, scratch, inner_slots: torch.Tensor, dummy_slot: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For a buffer plan's misses (``scratch``: its call scratch, chunk by chunk) over the
        selection ``flat``: the slice slots whose rows this rank sends (``[width]``; ``dummy_slot``
        for padding), where each miss's rows land in the gathered rows (``fetch_rows``, by miss
        index), and how many misses are homed on other ranks (int64 ``[1]``). Fixed shapes, no
        read-back."""
        T, world, width = flat.numel(), self.world, self.width
        chunks = triton.cdiv(T, K.CHUNK)
        lane = torch.arange(K.CHUNK, device=flat.device, dtype=torch.int32)
        need = scratch.counts[:chunks, int(K.C_NEED)]
        valid = (lane[None, :] < need[:, None]).flatten()  # [chunks x CHUNK]: the misses, in order
        pos = torch.where(valid, scratch.miss_pos[: chunks * K.CHUNK].long(), 0)
        home = torch.where(valid, flat[pos] % world, 0)
        of_home = (home[:, None] == torch.arange(world, device=flat.device)[None, :]) & valid[:, None]
        index_in_home = of_home.int().cumsum(0).gather(1, home[:, None]).flatten().long() - 1
        fits = valid & (index_in_home < width)  # a refused call may have more; it moves nothing
        # Miss j (0, 1, ... over the valid entries) reads gathered row home x width + its index.
        j = torch.where(valid, valid.long().cumsum(0) - 1, valid.numel())
        fetch_rows = torch.zeros(valid.numel() + 1, dtype=torch.int64, device=flat.device)
        fetch_rows.scatter_(0, j, torch.where(fits, home * width + index_in_home, 0))
        sent_here = fits & (home == self.rank)
        slot = inner_slots.long()[pos]
        send_slots = torch.full((width + 1,), dummy_slot, dtype=torch.int64, device=flat.device)
        send_slots.scatter_(
            0,
            torch.where(sent_here, index_in_home, width),
            torch.where(sent_here & (slot >= 0), slot, dummy_slot),
        )
        remote = (valid & (home != self.rank)).long().sum().view(1)
        return send_slots[:width], fetch_rows, remote

    def views(self, layers: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The send rows ``[width, layers, row_bytes]`` and the gathered ``[world x width, layers,
        row_bytes]`` of a group of ``layers`` layers (the last group may be shorter)."""
        shape = (layers, self.row_bytes)
        send = self.send[: self.width * layers * self.row_bytes].view(self.width, *shape)
        gathered = self.gathered[: self.world * self.width * layers * self.row_bytes]
        return send, gathered.view(self.world * self.width, *shape)
